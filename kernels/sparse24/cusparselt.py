"""The hardware 2:4 backends torch exposes, cuSPARSELt and CUTLASS: probing, cuSPARSELt's algorithm search,
direct calls, and torch's ``SparseSemiStructuredTensor`` of a weight.

Why torch's default 2:4 path (``F.linear`` with a ``SparseSemiStructuredTensor`` weight) is slower than dense,
and what the direct calls here do instead (``python -m benchmarks.ops.sparse24 bench`` measures each point):

1. Host overhead: every ``torch._cslt_sparse_mm`` call rebuilds all cuSPARSELt descriptors and the
   matmul plan (``cusparseLtMatmulPlanInit``) and allocates a workspace; the PyTorch PR that caches
   plans (pytorch/pytorch#179642) reports 50-200 us of CPU per call. ``nn.Linear`` with a
   ``SparseSemiStructuredTensor`` weight adds ``__torch_dispatch__`` and a custom-op hop on top.
   A timer that includes the host measures the CPU, not the GPU; inside a CUDA graph (which sdfast
   uses for the UNet) that cost disappears.
2. Algorithm selection: the default ``alg_id=0`` is not tuned for the shape; :func:`cusparselt_search`
   runs cuSPARSELt's search (``torch._C._cusparselt.mm_search`` / ``torch._cslt_sparse_mm_search``) with
   the layer's real M, bias and layout, and keeps the split-K settings it finds.
3. Operand order and layout: the hardware sparse operand is the LEFT one. For ``y = x W^T`` we
   compute ``y^T = W_s x^T`` with ``x^T`` passed as a transposed view of the contiguous ``x``
   (K-major, no copy) and ask cuSPARSELt for a transposed result so ``y`` comes out ``(M, N)``
   row-major with no extra copy; bias is fused (``_cslt_sparse_mm(..., bias=...)``).
4. Alignment/dtype: fp16/bf16 only; N, K multiples of the backend's minimum (read from torch's
   ``_DTYPE_SHAPE_CONSTRAINTS``); M is padded to a multiple of 8 when needed (SD's text-token rows,
   2 x 77 = 154, are the only such case; those GEMMs are tiny and stay dense anyway).
5. CUTLASS (``SparseSemiStructuredTensorCUTLASS``) runs Ampere-generation ``mma.sp`` kernels, which on
   Hopper compete with cuBLAS's ``wgmma`` dense kernels; torch builds them for sm_8x only.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import warnings

import torch
import torch.nn.functional as F

from kernels.sparse24.format import kept_indices
from kernels.sparse24.prune import check_weight

__all__ = [
    "CusparseltPlan", "cusparselt_available", "cusparselt_runtime_version", "loaded_libraries", "backend_supports",
    "pad_rows", "cusparselt_search", "searched_plan", "cusparselt_linear", "cutlass_linear", "to_semi_structured",
]


@dataclasses.dataclass(frozen=True)
class CusparseltPlan:
    """cuSPARSELt matmul settings found by its search: algorithm id and split-K."""

    alg_id: int = 0
    split_k: int = 1
    split_k_mode: int = -1  # int (torch >= 2.6 style) or bool one-kernel flag stored as 0/1


def cusparselt_available() -> bool:
    """True when torch was built with cuSPARSELt (does not touch the GPU)."""
    return bool(getattr(torch._C, "_has_cusparselt", False))


def loaded_libraries(soname_prefix: str) -> list[str]:
    """Paths of the shared libraries this process has mapped whose file name starts with ``soname_prefix``, in
    the order of /proc/self/maps (empty where there is no such file)."""
    found: list[str] = []
    try:
        with open("/proc/self/maps", errors="surrogateescape") as f:
            for line in f:
                fields = line.rstrip("\n").split(maxsplit=5)
                path = fields[5].removesuffix(" (deleted)") if len(fields) == 6 else ""
                if os.path.basename(path).startswith(soname_prefix) and path not in found:
                    found.append(path)
    except OSError:  # not Linux
        pass
    return found


@functools.lru_cache(maxsize=None)
def cusparselt_runtime_version() -> tuple[int, int, int] | None:
    """(major, minor, patch) of the cuSPARSELt library this process runs, asked of the loaded library itself
    (``cusparseLtGetProperty``); ``torch.backends.cusparselt.version()`` gives the version torch was built with.
    None when torch has no cuSPARSELt or the library is not loaded (e.g. a CPU build); cached, like the library.
    Two copies can be mapped (an ``LD_PRELOAD``: ``loaded_libraries`` lists them); the global scope's answer is the
    one torch's calls bind to (checked with ``LD_DEBUG=bindings``)."""
    if not cusparselt_available():
        return None
    try:  # the definition the process's global scope gives (an LD_PRELOADed copy first): what torch binds to
        get_property = ctypes.CDLL(None).cusparseLtGetProperty
    except (AttributeError, TypeError, OSError):  # loaded locally (not in the global scope), or no dlopen(NULL)
        paths = loaded_libraries("libcusparseLt.so")
        if not paths:
            return None
        try:
            get_property = ctypes.CDLL(paths[0]).cusparseLtGetProperty  # dlopen of a loaded path loads nothing
        except (OSError, AttributeError):
            return None
    out = []
    for prop in (0, 1, 2):  # libraryPropertyType: MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
        v = ctypes.c_int()
        if get_property(prop, ctypes.byref(v)) != 0:
            return None
        out.append(v.value)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _cslt_mm_arg_names() -> frozenset[str]:
    names: set[str] = set()
    for s in torch._C._jit_get_schemas_for_operator("aten::_cslt_sparse_mm"):
        names.update(a.name for a in s.arguments)
    return frozenset(names)


def _backend_constraints(backend: str, dtype: torch.dtype):
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    cls = SparseSemiStructuredTensorCUSPARSELT if backend == "cusparselt" else SparseSemiStructuredTensorCUTLASS
    return cls._DTYPE_SHAPE_CONSTRAINTS.get(dtype)


def backend_supports(backend: str, n: int, k: int, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether a hardware 2:4 backend ("cusparselt", "cutlass") can run an (N, K) weight of ``dtype``."""
    if dtype not in (torch.float16, torch.bfloat16):
        return False, f"dtype {dtype} (2:4 backends here: float16, bfloat16)"
    if backend == "cusparselt" and not cusparselt_available():
        return False, "torch built without cuSPARSELt"
    if backend == "cutlass" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 8:
        # torch's CUTLASS 2:4 kernels are built for sm_8x only ("Supported only on GPUs with compute
        # capability 8.x" on sm_90)
        major, minor = torch.cuda.get_device_capability()
        return False, f"torch's CUTLASS 2:4 kernels run only on sm_8x GPUs, this one is sm_{major}{minor}"
    c = _backend_constraints(backend, dtype)
    if c is None:
        return False, f"{backend} has no constraints entry for {dtype}"
    if n % c.sparse_min_rows or k % c.sparse_min_cols or n < c.sparse_min_rows or k < c.sparse_min_cols:
        return False, f"(N, K)=({n}, {k}) not multiples of ({c.sparse_min_rows}, {c.sparse_min_cols})"
    return True, ""


def pad_rows(x2d: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x2d.shape[0]) % multiple
    return F.pad(x2d, (0, 0, 0, pad)) if pad else x2d


def _aligned_rows(x2d: torch.Tensor) -> torch.Tensor:
    """Contiguous (M, K) with a 16-byte aligned base pointer (cuSPARSELt/CUTLASS descriptors assume both;
    under torch.compile tracing the pointer is unknown and only contiguity is enforced)."""
    if not x2d.is_contiguous():
        return x2d.contiguous()
    if not torch.compiler.is_compiling() and x2d.data_ptr() % 16:
        return x2d.clone(memory_format=torch.contiguous_format)
    return x2d



def cusparselt_search(packed: torch.Tensor, x2d: torch.Tensor, bias: torch.Tensor | None = None) -> CusparseltPlan:
    """Run cuSPARSELt's algorithm search for ``y = x2d @ W^T (+ bias)`` in our layout (transposed
    result, x^T as a view). packed: ``torch._cslt_compress(W)``; x2d: (M, K) CUDA, M % 8 == 0."""
    xt = _aligned_rows(x2d).t()
    mod = getattr(torch._C, "_cusparselt", None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecated.*")
        if mod is not None and hasattr(mod, "mm_search"):
            alg, split_k, mode, _max_alg = mod.mm_search(packed, xt, bias, None, None, True)
            return CusparseltPlan(int(alg), int(split_k), int(mode))
        alg = torch._cslt_sparse_mm_search(packed, xt, bias=bias, transpose_result=True)
    return CusparseltPlan(int(alg), 1, -1)


_SEARCHED: dict[tuple, CusparseltPlan] = {}  # (device, N, K, M, dtype, has_bias) -> the search's answer


def searched_plan(packed: torch.Tensor, x2d: torch.Tensor, bias: torch.Tensor | None, n: int, *,
                  search: bool = True) -> CusparseltPlan | None:
    """:func:`cusparselt_search` for an (N, K) weight and the M rows of ``x2d`` (padded to a multiple of 8), once per
    (device, N, K, M, dtype, bias present) in a process: the search times cuSPARSELt's algorithms on the GPU, and
    its answer depends on the problem's shape, not on the weight's values, so layers of one shape share it.
    ``search=False``: the plan found before, or None. Raises RuntimeError where it would search inside CUDA graph
    capture or torch.compile tracing (the search cannot run there)."""
    key = (str(x2d.device), n, x2d.shape[1], x2d.shape[0], x2d.dtype, bias is not None)
    plan = _SEARCHED.get(key)
    if plan is None and search:
        if torch.compiler.is_compiling() or (x2d.is_cuda and torch.cuda.is_current_stream_capturing()):
            raise RuntimeError("cuSPARSELt's algorithm search cannot run inside CUDA graph capture or torch.compile")
        plan = _SEARCHED[key] = cusparselt_search(packed, pad_rows(x2d, 8), bias)
    return plan


def cusparselt_linear(
    x2d: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, plan: CusparseltPlan = CusparseltPlan()
) -> torch.Tensor:
    """``(M, K) @ W^T + bias -> (M, N)`` with cuSPARSELt: computes ``W_s @ x^T`` (sparse operand left),
    ``x^T`` as a K-major view (no copy), transposed result written as (M, N) row-major, bias fused.
    packed: ``torch._cslt_compress(W)`` of the fp16/bf16 (N, K) weight. M is padded to a multiple of 8."""
    m = x2d.shape[0]
    xp = _aligned_rows(pad_rows(x2d, 8))
    kwargs = dict(bias=bias, transpose_result=True, alg_id=plan.alg_id)
    if plan.split_k != 1:
        names = _cslt_mm_arg_names()
        kwargs["split_k"] = plan.split_k
        if "split_k_mode" in names:
            kwargs["split_k_mode"] = plan.split_k_mode
        elif "split_k_one_kernel" in names:
            kwargs["split_k_one_kernel"] = bool(plan.split_k_mode)
    y = torch._cslt_sparse_mm(packed, xp.t(), **kwargs)
    return y[:m] if y.shape[0] != m else y


def cutlass_linear(x2d: torch.Tensor, packed: torch.Tensor, meta: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(M, K) @ W^T + bias -> (M, N)`` with torch's CUTLASS 2:4 kernel (``to_cutlass_format`` data).
    Uses ``torch._sparse_semi_structured_linear`` (deprecated but direct: (M, N) out, bias fused);
    where it is gone, ``_sparse_semi_structured_(add)mm`` on x^T plus a transpose copy."""
    m = x2d.shape[0]
    xp = _aligned_rows(pad_rows(x2d, 8))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecated.*")
        if hasattr(torch, "_sparse_semi_structured_linear"):
            y = torch._sparse_semi_structured_linear(xp, packed, meta, bias=bias)
        elif bias is None:
            y = torch._sparse_semi_structured_mm(packed, meta, xp.t()).t().contiguous()
        else:
            y = torch._sparse_semi_structured_addmm(bias, packed, meta, xp.t()).t().contiguous()
    return y[:m] if y.shape[0] != m else y


def to_semi_structured(pruned: torch.Tensor, backend: str = "cusparselt"):
    """torch ``SparseSemiStructuredTensor`` of a 2:4 weight (N, K) on CUDA, for ``backend`` in
    ``{"cusparselt", "cutlass"}``.

    Equivalent to ``torch.sparse.to_sparse_semi_structured`` with ``SparseSemiStructuredTensor._FORCE_CUTLASS``
    False/True, without touching that class-wide flag. Raises ValueError (not 2:4, unknown backend)
    or torch's RuntimeError (CPU tensor, unsupported dtype/shape).
    """
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    check_weight(pruned, "pruned")
    kept_indices(pruned)
    cls = {"cusparselt": SparseSemiStructuredTensorCUSPARSELT, "cutlass": SparseSemiStructuredTensorCUTLASS}.get(backend)
    if cls is None:
        raise ValueError(f"backend must be 'cusparselt' or 'cutlass', got {backend!r}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*prototype stage.*")
        return cls.from_dense(pruned.contiguous())
