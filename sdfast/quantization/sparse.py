"""``SparseLinear``: a linear layer with a 2:4-sparse weight, run on dense cuBLAS or a 2:4 backend, whichever is
faster for the shape (built by ``sdfast.passes.sparsity.sparsify_``).

The backends (:mod:`kernels.sparse24`): cuSPARSELt (algorithm 0, or the algorithm its search finds), CUTLASS
(torch's sm_8x kernels) and sdfast's Triton kernel (compressed weight, dense tensor cores). Which one runs for an
input is the kernel-choice service's ``"sparse24"`` choice (:mod:`kernels.select`): candidates ``"dense"`` (the
default), ``"cusparselt"``, ``"cusparselt:search"`` (with ``cusparselt_search``), ``"cutlass"`` and ``"triton"``;
the key is the input's, weight's and bias's signature plus the layer's settings, so layers of one shape share a
decision, and ``kernels.select.decisions()`` reports them.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import select
from kernels.dispatch import log_fallback
from kernels.sparse24.cusparselt import (
    CusparseltPlan,
    backend_supports,
    cusparselt_linear,
    cutlass_linear,
    searched_plan,
)
from kernels.sparse24.format import compress_24, to_cutlass_format
from kernels.sparse24.kernel import HAS_TRITON, sparse24_linear
from kernels.sparse24.prune import is_24_sparse, prune_24_magnitude

log = logging.getLogger("sdfast.kernels")

__all__ = ["CHOICE", "SPARSE_BACKENDS", "BACKEND_CHOICES", "TIMING_CHOICES", "SparseLinear"]

SPARSE_BACKENDS = ("cusparselt", "cutlass", "triton")
BACKEND_CHOICES = ("auto", "dense") + SPARSE_BACKENDS
TIMING_CHOICES = ("graph", "eager")
DEFAULT_MIN_SPEEDUP = 1.03

# a 2:4 backend wins only when it is at least min_speedup times faster than dense (layers with another
# min_speedup decide with this declaration's margin replaced, under a key that holds their min_speedup)
CHOICE = select.Choice("sparse24", default="dense", margin=1 / DEFAULT_MIN_SPEEDUP)


class SparseLinear(nn.Module):
    """A linear layer with a 2:4-sparse weight, run by the fastest correct backend.

    ``y = x @ weight.T + bias`` with x: (..., in_features), y: (..., out_features). ``weight`` is the
    pruned dense weight (N, K) (a frozen Parameter; it is what ``state_dict`` saves). Numerics: every
    backend computes with exactly this pruned weight, so they differ only by accumulation order.

    - CPU (or any non-CUDA tensor): ``F.linear`` with the pruned weight (the reference).
    - CUDA, ``backend="auto"``: the ``"sparse24"`` choice of :mod:`kernels.select`, per input signature (M rows,
      dtype): at the first call it measures dense cuBLAS and every 2:4 backend that can run the shape (cuSPARSELt
      with the default algorithm, and with the searched one when ``cusparselt_search``; CUTLASS; our Triton kernel
      only where neither of those runs the shape, and when M <= ``triton_max_m``) on the layer's real input,
      checks each sparse result against fp32 (a wrong backend is dropped and logged), and keeps dense unless a
      sparse backend is at least ``min_speedup`` times faster. Layers of the same shape and settings share the
      decision. ``timing="graph"`` (default) times GPU work only and drops a backend that cannot be captured in a
      CUDA graph (sdfast captures the UNet); ``timing="eager"`` includes the host's per-call time (right for eager
      inference, where cuSPARSELt's per-call plan setup makes it lose).
    - CUDA, a forced backend (``"cusparselt"``, ``"cutlass"``, ``"triton"``, ``"dense"``): pinned, used without
      timing where the shape/dtype allow it, else dense (logged once).

    Run one eager forward before CUDA-graph capture or ``torch.compile``: a layer reaching its first
    call inside a capture or a compile trace cannot measure, so it runs dense for that call (logged).
    The compressed copies live as plain attributes on the weight's device (not in ``state_dict``);
    moving/casting the module (``.to``) drops them and this layer's report.

    Attributes (reports; the decisions themselves are ``kernels.select``'s): ``chosen: dict[int, str]`` backend
    per M this layer ran; ``timings_us: dict[int, dict]`` the measured µs per candidate for that M.
    Raises ValueError for an unknown backend or timing, ``in_features % 4 != 0``, or ``min_speedup`` below 2/3
    (outside the service's margins), TypeError for a ``cusparselt_search`` that is not a bool.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        backend: str = "auto",
        timing: str = "graph",
        min_speedup: float = DEFAULT_MIN_SPEEDUP,
        triton_max_m: int = 256,
        cusparselt_search: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if backend not in BACKEND_CHOICES:
            raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {backend!r}")
        if timing not in TIMING_CHOICES:
            raise ValueError(f"timing must be one of {TIMING_CHOICES}, got {timing!r}")
        if in_features % 4 != 0:
            raise ValueError(f"in_features={in_features} must be a multiple of 4 for 2:4 sparsity")
        if not (isinstance(min_speedup, (int, float)) and math.isfinite(min_speedup) and min_speedup >= 2 / 3):
            raise ValueError(f"min_speedup must be a finite number >= 2/3, got {min_speedup!r}")
        if not isinstance(cusparselt_search, bool):
            raise TypeError(f"cusparselt_search must be True or False, got {cusparselt_search!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.backend = backend
        self.timing = timing
        self.min_speedup = float(min_speedup)
        self.triton_max_m = int(triton_max_m)
        self.cusparselt_search = cusparselt_search
        self.choice = CHOICE if self.min_speedup == DEFAULT_MIN_SPEEDUP else dataclasses.replace(
            CHOICE, margin=1 / self.min_speedup)
        fk = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, **fk), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, **fk), requires_grad=False) if bias else None
        self.dense_weight_cpu: torch.Tensor | None = None  # original dense weight (keep_dense_copy)
        self.method = "given"  # how the weight was pruned (set by sdfast.passes.sparsity)
        self.chosen: dict[int, str] = {}
        self.timings_us: dict[int, dict] = {}
        self._data: dict[str, tuple] = {}

    # -- construction / undo -------------------------------------------------------------------

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        pruned_weight: torch.Tensor | None = None,
        *,
        backend: str = "auto",
        timing: str = "graph",
        min_speedup: float = DEFAULT_MIN_SPEEDUP,
        cusparselt_search: bool = False,
        keep_dense_copy: bool = False,
    ) -> "SparseLinear":
        """Build from an ``nn.Linear``. ``pruned_weight`` (N, K) must be 2:4 (ValueError otherwise);
        None prunes by magnitude. ``keep_dense_copy`` keeps the original weight on CPU for ``to_linear``."""
        w = linear.weight
        if pruned_weight is None:
            pruned_weight, _ = prune_24_magnitude(w)
        if tuple(pruned_weight.shape) != tuple(w.shape):
            raise ValueError(f"pruned_weight shape {tuple(pruned_weight.shape)} != linear weight {tuple(w.shape)}")
        if not is_24_sparse(pruned_weight):
            raise ValueError("pruned_weight is not 2:4 sparse along K (more than two non-zeros in a group of four)")
        mod = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            backend=backend,
            timing=timing,
            min_speedup=min_speedup,
            cusparselt_search=cusparselt_search,
            device=w.device,
            dtype=w.dtype,
        )
        with torch.no_grad():
            mod.weight.copy_(pruned_weight.to(device=w.device, dtype=w.dtype))
            if linear.bias is not None:
                mod.bias.copy_(linear.bias)
        if keep_dense_copy:
            mod.dense_weight_cpu = w.detach().to("cpu", copy=True)
        return mod

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` with the original dense weight when it was kept (``keep_dense_copy``),
        else with the pruned weight; same device and dtype as this module."""
        w = self.weight
        lin = nn.Linear(self.in_features, self.out_features, self.bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            src = self.dense_weight_cpu if self.dense_weight_cpu is not None else w
            lin.weight.copy_(src.to(device=w.device, dtype=w.dtype))
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        lin.weight.requires_grad_(w.requires_grad)
        return lin

    def _apply(self, fn, *args, **kwargs):
        self._data.clear()
        self.chosen.clear()
        self.timings_us.clear()
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"backend={self.backend}, chosen={self.chosen}"
        )

    # -- backend data ---------------------------------------------------------------------------

    def _backend_data(self, backend: str) -> tuple:
        data = self._data.get(backend)
        if data is None:
            w = self.weight.detach()
            if not is_24_sparse(w):  # e.g. a dense state_dict loaded into this module
                raise ValueError("SparseLinear.weight is not 2:4 sparse along K; prune it before running a sparse backend")
            if backend == "cusparselt":
                data = (torch._cslt_compress(w.contiguous()),)
            elif backend == "cutlass":
                data = tuple(to_cutlass_format(w))
            elif backend == "triton":
                data = compress_24(w)
            else:
                raise ValueError(f"no compressed data for backend {backend!r}")
            self._data[backend] = data
        return data

    def _plan(self, name: str, x2d: torch.Tensor, search: bool = True) -> CusparseltPlan | None:
        """The cuSPARSELt settings of candidate ``name`` for this input (None: not searched yet, ``search=False``)."""
        if name != "cusparselt:search":
            return CusparseltPlan()
        (packed,) = self._backend_data("cusparselt")
        return searched_plan(packed, x2d, self.bias, self.out_features, search=search)

    def _run(self, name: str, x2d: torch.Tensor) -> torch.Tensor:
        backend = name.partition(":")[0]
        b = self.bias
        if backend == "dense":
            return F.linear(x2d, self.weight, b)
        if backend == "cusparselt":
            (packed,) = self._backend_data("cusparselt")
            return cusparselt_linear(x2d, packed, b, self._plan(name, x2d))
        if backend == "cutlass":
            packed, meta = self._backend_data("cutlass")
            return cutlass_linear(x2d, packed, meta, b)
        if backend == "triton":
            values, meta = self._backend_data("triton")
            return sparse24_linear(x2d, values, meta, b)
        raise ValueError(f"unknown backend {name!r}")

    def _ready(self, name: str, x2d: torch.Tensor) -> bool:
        """Whether candidate ``name`` runs without preparing anything (compressing, searching): what may happen
        inside a CUDA graph capture."""
        backend = name.partition(":")[0]
        if backend == "dense":
            return True
        return backend in self._data and (name != "cusparselt:search" or self._plan(name, x2d, search=False) is not None)

    # -- the choice -----------------------------------------------------------------------------

    def _key(self, x2d: torch.Tensor) -> tuple:
        return select.signature(x2d, self.weight, self.bias) + (
            self.backend, self.timing, self.min_speedup, self.triton_max_m, self.cusparselt_search)

    def _problem(self, name: str, x2d: torch.Tensor) -> str | None:
        """Why candidate ``name`` cannot run on ``x2d`` (None: it can)."""
        if name == "dense":
            return None
        if x2d.dtype != self.weight.dtype:
            return f"input dtype {x2d.dtype} != weight dtype {self.weight.dtype}"
        backend = name.partition(":")[0]
        if backend == "triton":
            if not HAS_TRITON:
                return "triton is not installed"
            if self.backend == "auto" and x2d.shape[0] > self.triton_max_m:
                # dense tensor cores + in-register decompression cannot beat cuBLAS once the GEMM
                # is compute-bound; skip the candidate (and its per-K compile) above this M
                return f"M={x2d.shape[0]} > triton_max_m={self.triton_max_m}"
            if self.backend == "auto" and any(
                backend_supports(hw, self.out_features, self.in_features, x2d.dtype)[0] for hw in ("cusparselt", "cutlass")
            ):
                # our kernel runs dense tensor cores: it is the fallback where no sparse-tensor-core backend
                # runs the shape (measured slower than dense at every SD shape on sm_90)
                return "a sparse-tensor-core backend runs this shape"
            if x2d.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                return f"dtype {x2d.dtype}"
            return None
        ok, why = backend_supports(backend, self.out_features, self.in_features, x2d.dtype)
        return None if ok else why

    def _decide(self, x2d: torch.Tensor) -> str:
        """The candidate that runs ``x2d`` (see the class docstring); "dense" where nothing may be decided now
        (CUDA graph capture, torch.compile, a ``kernels.precompile`` dry run). Fills ``chosen`` / ``timings_us``
        for a decision this layer had not seen."""
        if self.backend == "auto":
            pin = None
            names = ["dense", "cusparselt", *(["cusparselt:search"] if self.cusparselt_search else []),
                     "cutlass", "triton"]
        else:
            pin = "cusparselt:search" if self.backend == "cusparselt" and self.cusparselt_search else self.backend
            names = list(dict.fromkeys(["dense", pin]))
        key = self._key(x2d)
        measured = []

        def measure(live):
            measured.append(True)
            return self._measure(list(live), x2d)

        name = select.decide(
            self.choice, key, candidates=names, device=x2d.device, pin=pin,
            problem=lambda n: self._problem(n, x2d), measure=measure,
            describe=lambda: f"SparseLinear (N={self.out_features}, K={self.in_features}, M={x2d.shape[0]}, {x2d.dtype})")
        m = x2d.shape[0]
        if m not in self.chosen:
            decision = next((d for d in select.decisions(self.choice.name) if d.key == repr(key)), None)
            if decision is not None:
                self.chosen[m] = decision.winner.partition(":")[0]
                if decision.times_us:
                    self.timings_us[m] = dict(decision.times_us)
        if measured:  # keep only the compressed copies this layer runs
            keep = {name.partition(":")[0], *self.chosen.values()}
            for backend in [b for b in self._data if b not in keep]:
                del self._data[backend]
        return name

    def _measure(self, live: list[str], x2d: torch.Tensor) -> dict[str, float]:
        """µs per call of each live candidate that gives a correct result (``measure`` of ``select.decide``): each
        sparse result is checked against fp32, with ``timing="graph"`` each sparse candidate must capture in a CUDA
        graph, then the service's timer (``timing="eager"``: without its host-hiding spin, so the host's per-call
        time counts). A failing candidate is logged and left out; dense's failure and out-of-memory are raised."""
        x2d = x2d.detach().clone()
        b = self.bias
        fns = {}
        with torch.no_grad():
            ref32 = F.linear(x2d.float(), self.weight.float(), None if b is None else b.float())
            dense_out = F.linear(x2d, self.weight, b)
            base_err = (dense_out.float() - ref32).abs().max().item()
            tol = 2 * base_err + 1e-3 * ref32.abs().max().item() + 1e-6
            for name in live:
                try:
                    if name != "dense":
                        out = self._run(name, x2d)  # prepares the compressed copy (and the searched plan)
                        err = (out.float() - ref32).abs().max().item()
                        if not math.isfinite(err) or err > tol:
                            raise RuntimeError(f"wrong result: max|sparse - ref32| = {err:.3e} > {tol:.3e}")
                        del out
                        if self.timing == "graph" and x2d.is_cuda:
                            _captures(lambda n=name: self._run(n, x2d))
                    fns[name] = lambda n=name: self._run(n, x2d)
                except torch.OutOfMemoryError:
                    raise  # transient: nothing is decided, the next call measures again
                except Exception as e:  # noqa: BLE001 - a backend that cannot run here is measured out, and said so
                    if name == "dense":
                        raise
                    _log_backend_error(name, e)
                    if name.partition(":")[0] not in self.chosen.values():
                        self._data.pop(name.partition(":")[0], None)
            if self.timing == "eager":
                return select.gpu_time_us(fns, sleep_cycles=0)
            return select.gpu_time_us(fns)

    # -- forward --------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda" or torch.compiler.is_compiling():  # Dynamo cannot trace the choice: dense
            return F.linear(x, self.weight, self.bias)
        x2d = x.reshape(-1, self.in_features)
        m = x2d.shape[0]
        if m == 0:
            return F.linear(x, self.weight, self.bias)
        name = self._decide(x2d)
        capturing = torch.cuda.is_current_stream_capturing()
        if m not in self.chosen and capturing:
            log_fallback("SparseLinear", "dense: first call with this M happened inside CUDA-graph capture")
        if capturing and not self._ready(name, x2d):
            return F.linear(x, self.weight, self.bias)  # compressing or searching here would be recorded in the graph
        y = self._run(name, x2d)
        return y.reshape(*x.shape[:-1], self.out_features)


def _captures(fn) -> None:
    """Capture one call of ``fn`` in a CUDA graph (after a warm-up on a side stream); raises what capture raises."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    del graph


_logged_errors: set[tuple[str, str]] = set()


def _log_backend_error(name: str, e: BaseException) -> None:
    key = (name, f"{type(e).__name__}: {e}"[:300])
    if key not in _logged_errors:
        _logged_errors.add(key)
        log.warning("SparseLinear: backend %s dropped from the measurement: %s", name, key[1])
