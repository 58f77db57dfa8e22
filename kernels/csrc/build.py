"""Build (on demand, never at import) and call the CUDA C++ cp.async W4A16 GEMM in ``gemm_cp_async.cu``.

Two ways to load the kernel, tried in this order by :func:`backend`:

1. ``torch.utils.cpp_extension.load`` of ``gemm_cp_async.cu`` + ``gemm_binding.cpp`` (the .cpp is the
   only file that includes torch headers). Needs ninja and a host compiler; the build goes to torch's
   extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), never the work tree.
2. ``nvcc -shared`` of the .cu alone into ``~/.cache/sdfast/csrc/`` (or ``$SDFAST_CACHE_DIR/csrc``),
   called through ``ctypes`` with the tensors' data pointers and torch's current stream. Needs only
   nvcc; used when (1) fails, e.g. without ninja.

Both are compiled for the current GPU's architecture by default (``arch_list`` overrides: e.g.
``["8.0", "9.0"]``), since building two architectures doubles the build time.

Public op (a ``torch.library`` custom op, opaque to torch.compile / CUDA graphs):

* :func:`gemm_w4a16` (``sdfast::csrc_gemm_w4a16``): W4A16 with the packed format of
  ``kernels.gemm.w4a16`` (K and group_size multiples of 32).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from kernels.paths import cache_dir

log = logging.getLogger("sdfast.kernels.csrc")

CSRC = Path(__file__).resolve().parent
CU_SOURCE = CSRC / "gemm_cp_async.cu"
CPP_BINDING = CSRC / "gemm_binding.cpp"
EXT_NAME = "sdfast_gemm_cp_async"
NVCC_FLAGS = ("-O3",)  # cpp_extension adds its own -std; the ctypes build adds -std=c++17


def find_nvcc() -> str | None:
    """Path of nvcc: ``$PATH``, then ``$CUDA_HOME/bin``, then ``/usr/local/cuda/bin``."""
    p = shutil.which("nvcc")
    if p:
        return p
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    return None


def gencode_flags(arch_list: list[str] | tuple[str, ...]) -> list[str]:
    """``["8.0", "9.0"]`` -> ``-gencode arch=compute_80,code=sm_80 ...`` (sm_90 gets plain sm_90, not 90a)."""
    out = []
    for a in arch_list:
        num = a.replace(".", "")
        if int(num) < 80:
            raise ValueError(f"gemm_cp_async needs sm_80+ (cp.async, ldmatrix, m16n8k16); got arch {a}")
        out.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    return out


def _default_arch_list() -> list[str]:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return [f"{major}.{minor}"]
    return ["8.0", "9.0"]


@functools.lru_cache(maxsize=None)
def load_extension(arch_list: tuple[str, ...] | None = None, verbose: bool = False):
    """Build (first call; a minute or so) and import the torch extension. Raises RuntimeError on failure."""
    from torch.utils.cpp_extension import load

    archs = list(arch_list) if arch_list else _default_arch_list()
    return load(
        name=EXT_NAME + "_" + "_".join(a.replace(".", "") for a in archs),
        sources=[str(CU_SOURCE), str(CPP_BINDING)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=[*NVCC_FLAGS, *gencode_flags(archs)],
        verbose=verbose,
    )


def _cache_dir() -> Path:
    return cache_dir() / "csrc"


def compile_shared_library(source: Path, stem: str, arch_list: tuple[str, ...] | None = None,
                           parts: tuple[tuple[str, ...], ...] = ((),)) -> Path:
    """``nvcc`` of one pure-CUDA source into a shared library in ``~/.cache/sdfast/csrc/`` (or
    ``$SDFAST_CACHE_DIR/csrc``), named by the hash of the source and the flags, so an edited source is rebuilt and
    a built one is reused by every process. ``parts``: extra flags per object (e.g. one ``-D`` per dtype); the
    objects compile in parallel, then link into one library. Returns the library's path. Raises RuntimeError when
    nvcc is missing or fails."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError(f"{source.name}: nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")
    archs = list(arch_list) if arch_list else _default_arch_list()
    flags = [*NVCC_FLAGS, "-std=c++17", *gencode_flags(archs)]
    digest = hashlib.sha256(source.read_bytes() + repr((flags, parts)).encode()).hexdigest()[:16]
    out = _cache_dir() / f"lib{stem}_{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    objs = [tmp.with_suffix(f".{i}.o") for i in range(len(parts))]
    procs: list[subprocess.Popen] = []
    try:
        if len(parts) == 1:
            _run([nvcc, "-shared", "-Xcompiler", "-fPIC", *flags, *parts[0], "-o", str(tmp), str(source)], source)
        else:
            procs = [subprocess.Popen([nvcc, "-c", "-Xcompiler", "-fPIC", *flags, *extra, "-o", str(o), str(source)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for extra, o in zip(parts, objs)]
            for proc, extra in zip(procs, parts):
                _, err = proc.communicate()
                if proc.returncode != 0:
                    raise RuntimeError(f"{source.name}: nvcc failed ({' '.join(extra)}):\n{err[-4000:]}")
            _run([nvcc, "-shared", *flags, "-o", str(tmp), *map(str, objs)], source)
        tmp.replace(out)
    finally:
        for proc in procs:  # after a failure, the other compilers are stopped before their outputs go
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for o in objs:
            o.unlink(missing_ok=True)
    return out


def _run(cmd: list[str], source: Path) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{source.name}: nvcc failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}")


@functools.lru_cache(maxsize=None)
def load_ctypes_library(arch_list: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """Compile the .cu alone with ``nvcc -shared`` (cached by source hash) and load it with ctypes."""
    lib = ctypes.CDLL(str(compile_shared_library(CU_SOURCE, "sdfast_gemm", arch_list)))
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.sdfast_gemm_w4a16.argtypes = [vp, vp, vp, vp, vp, vp, i, i, i, i, i, i, vp]
    lib.sdfast_gemm_w4a16.restype = i
    return lib


_RC = {
    -1: "a dimension is <= 0 or a leading dimension is too small",
    -2: "the row stride of a must be a multiple of 8 (16-byte cp.async rows)",
    -3: "base pointers must be 16-byte aligned",
    -4: "W4A16 needs K % 32 == 0 and group_size a positive multiple of 32",
}


class _CtypesBackend:
    """Same calls as the torch extension, through ctypes."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: {_RC.get(rc, f'CUDA error {rc}')}")

    def gemm_w4a16(self, a, qweight, scales, zeros, bias, group_size):
        M, K = a.shape
        N = qweight.shape[0]
        c = torch.empty((M, N), device=a.device, dtype=a.dtype)
        stream = torch.cuda.current_stream(a.device).cuda_stream
        with torch.cuda.device(a.device):
            rc = self.lib.sdfast_gemm_w4a16(a.data_ptr(), qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
                                            bias.data_ptr() if bias is not None else None, c.data_ptr(),
                                            M, N, K, group_size, a.stride(0), N, stream)
        self._check(rc, "gemm_w4a16")
        return c


_backend_choice: dict[str, object] = {}


def backend(prefer: str = "auto"):
    """The loaded kernels: ``"torch"`` (cpp_extension), ``"ctypes"`` (nvcc -shared) or ``"auto"``
    (torch extension, else ctypes; the reason for the switch is logged). Raises RuntimeError with
    both build errors when neither loads."""
    if prefer in _backend_choice:
        return _backend_choice[prefer]
    errors = []
    if prefer in ("auto", "torch"):
        try:
            _backend_choice[prefer] = load_extension()
            return _backend_choice[prefer]
        except Exception as e:  # noqa: BLE001 - reported below / by the caller
            errors.append(f"torch.utils.cpp_extension: {type(e).__name__}: {str(e)[-2000:]}")
            if prefer == "torch":
                raise RuntimeError(errors[0]) from e
            log.warning("gemm_cp_async: torch extension build failed, trying nvcc + ctypes (%s)", errors[0][:300])
    try:
        _backend_choice[prefer] = _CtypesBackend(load_ctypes_library())
        return _backend_choice[prefer]
    except Exception as e:  # noqa: BLE001
        errors.append(f"nvcc + ctypes: {type(e).__name__}: {e}")
        raise RuntimeError("gemm_cp_async could not be built:\n" + "\n".join(errors)) from e


# --------------------------------------------------------------------------------------------
# ops
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("sdfast::csrc_gemm_w4a16", mutates_args=())
def _gemm_w4a16_op(
    a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    return backend().gemm_w4a16(a, qweight, scales, zeros, bias, group_size)


@_gemm_w4a16_op.register_fake
def _(a, qweight, scales, zeros, bias, group_size):
    return a.new_empty((a.shape[0], qweight.shape[0]))


def _check_common(what: str, a: torch.Tensor, bias: torch.Tensor | None, N: int) -> None:
    if not a.is_cuda:
        raise NotImplementedError(f"{what}: the CUDA C++ kernel needs CUDA tensors (got {a.device}); "
                                  "use the Triton op (kernels.gemm) or its reference on CPU")
    if a.dtype != torch.float16 or a.dim() != 2:
        raise TypeError(f"{what}: a must be fp16 (M, K), got {a.dtype} {tuple(a.shape)}")
    if bias is not None and (bias.dtype != torch.float16 or tuple(bias.shape) != (N,)):
        raise ValueError(f"{what}: bias must be fp16 ({N},), got {bias.dtype} {tuple(bias.shape)}")


def gemm_w4a16(
    a: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group_size: int = 128,
) -> torch.Tensor:
    """W4A16 GEMM with the CUDA C++ kernel (op ``sdfast::csrc_gemm_w4a16``); format of ``kernels.gemm.w4a16``.

    a: (M, K) fp16 CUDA with K % 32 == 0; qweight: int32 (N, K/8); scales: fp16 (N, ceil(K/group_size));
    zeros: uint8 (N, ceil(K/group_size)); group_size: multiple of 32; bias: optional fp16 (N,).
    Returns (M, N) fp16. (AWQ's ``smooth`` is not fused here: multiply ``a`` first.)

    Raises: NotImplementedError (CPU), TypeError / ValueError (dtype, shape, alignment), RuntimeError (build).
    """
    N = qweight.shape[0]
    _check_common("csrc.gemm_w4a16", a, bias, N)
    M, K = a.shape
    if K % 32 or group_size <= 0 or group_size % 32:
        raise ValueError(f"csrc.gemm_w4a16: needs K % 32 == 0 and group_size % 32 == 0, got K={K}, group_size={group_size}")
    G = -(-K // group_size)
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (N, K // 8):
        raise ValueError(f"csrc.gemm_w4a16: qweight must be int32 ({N}, {K // 8}), got {qweight.dtype} {tuple(qweight.shape)}")
    if scales.dtype != torch.float16 or tuple(scales.shape) != (N, G):
        raise ValueError(f"csrc.gemm_w4a16: scales must be fp16 ({N}, {G}), got {scales.dtype} {tuple(scales.shape)}")
    if zeros.dtype != torch.uint8 or tuple(zeros.shape) != (N, G):
        raise ValueError(f"csrc.gemm_w4a16: zeros must be uint8 ({N}, {G}), got {zeros.dtype} {tuple(zeros.shape)}")
    if a.stride(1) != 1 or a.stride(0) % 8 or a.data_ptr() % 16:
        a = a.contiguous()
    return _gemm_w4a16_op(a, qweight.contiguous(), scales.contiguous(), zeros.contiguous(),
                          None if bias is None else bias.contiguous(), int(group_size))


__all__ = ["backend", "load_extension", "load_ctypes_library", "compile_shared_library", "find_nvcc", "gencode_flags", "gemm_w4a16"]
