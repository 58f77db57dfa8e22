"""diffusers' ``GEGLU`` (projection, then ``a * gelu(g)``) on the faster of two paths, chosen per call signature.

* the TMA GEMM with the activation in its epilogue (:mod:`kernels.gemm.geglu_tma`; sm_90+, fp16/bf16), in the
  tile config that measured fastest for the shape;
* cuBLAS (``F.linear``) for the 2N-wide projection, then :func:`kernels.norm.geglu` (one memory pass).

The choice is measured once per signature (shapes, strides, dtypes, device) as GPU time
(:func:`kernels.choice.gpu_times_us`) and logged. Where the TMA kernel cannot run, the reason is logged once and
cuBLAS runs. Inside CUDA graph capture or a ``kernels.precompile`` dry run nothing is timed or kept: the capture
runs cuBLAS, the dry run queues the compilation of every candidate config; under ``torch.compile`` the cuBLAS
path is traced. ``SDFAST_GEGLU_TMA=0`` (read at import) pins cuBLAS; ``TUNING["force"]`` pins either path (tests).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from kernels import choice
from kernels.dispatch import log_fallback
from kernels.gemm.geglu_tma import CONFIGS, TileConfig, geglu_linear, misaligned, shape_problem, unsupported
from kernels.norm.geglu import geglu

log = logging.getLogger("sdfast.kernels")

TUNING = {
    "enabled": os.environ.get("SDFAST_GEGLU_TMA", "1") != "0",
    "configs": CONFIGS,  # the TMA candidates measured per signature
    "force": None,  # None: measure; "cublas" or a TileConfig: always that path (where the TMA kernel can run)
}

_choices: dict[tuple, TileConfig | None] = {}  # signature -> the TMA config, or None for cuBLAS


def cublas_geglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``geglu(F.linear(x, weight, bias))``: the 2N-wide projection on cuBLAS, then the activation kernel."""
    return geglu(F.linear(x, weight, bias))


def geglu_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a * gelu(g)`` with ``a, g = (x @ weight^T + bias).chunk(2, -1)``, diffusers' ``GEGLU``.

    Args: x (..., K); weight (2N, K) (rows [0, N) give ``a``, rows [N, 2N) the gate); bias (2N,) or None; the
    dtypes of ``F.linear``. Returns (..., N) in ``x.dtype``. Raises what ``F.linear`` raises for bad shapes.
    """
    if torch.compiler.is_compiling():  # Dynamo cannot trace the choice (data_ptr, timing): the two-kernel path
        return cublas_geglu(x, weight, bias)
    config = choice.choose_config(
        _choices, choice.signature(x, weight, bias), x, name="geglu_projection", instead="cuBLAS and the GEGLU kernel",
        problem=lambda: ("SDFAST_GEGLU_TMA=0" if not TUNING["enabled"] else None) or shape_problem(x, weight, bias)
        or unsupported(x, weight, bias),
        force=TUNING["force"], compile_all=lambda: [geglu_linear(x, weight, bias, c) for c in TUNING["configs"]],
        measure=lambda: _measure(x, weight, bias))
    if config is not None and misaligned(x, weight):  # the one property the key does not hold: a view's offset
        log_fallback("geglu_projection", "x or the weight is not 16-byte aligned", instead="cuBLAS and the GEGLU kernel")
        config = None
    return cublas_geglu(x, weight, bias) if config is None else geglu_linear(x, weight, bias, config)


def _measure(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> TileConfig | None:
    """Time cuBLAS + the GEGLU kernel and every TMA config that compiles and launches; return the fastest TMA config,
    or None when cuBLAS is fastest (kept on a tie). A config that fails to compile or launch is logged and skipped."""
    candidates = {"cublas": lambda: cublas_geglu(x, weight, bias)}
    for config in TUNING["configs"]:
        try:
            geglu_linear(x, weight, bias, config)
        except Exception as e:  # noqa: BLE001 - e.g. a tile that does not fit this GPU's shared memory
            log_fallback("geglu_tma", f"{config} failed: {type(e).__name__}: {e}", instead="the other configs")
            continue
        candidates[str(config)] = lambda config=config: geglu_linear(x, weight, bias, config)
    times = choice.gpu_times_us(candidates)
    best = choice.fastest(times)
    log.info("geglu_projection x %s weight %s %s: cuBLAS + GEGLU kernel %.1f us, best TMA %s -> %s", tuple(x.shape),
             tuple(weight.shape), x.dtype, times["cublas"], min(((t, n) for n, t in times.items() if n != "cublas"), default=None), best)
    return None if best == "cublas" else next(c for c in TUNING["configs"] if str(c) == best)


__all__ = ["TUNING", "cublas_geglu", "geglu_projection"]
