"""A linear layer, ``x @ W^T + bias (+ residual)``, on the faster of cuBLAS and the TMA GEMM, chosen per call signature.

* the TMA GEMM with bias and residual in its epilogue (:mod:`kernels.gemm.linear_tma`; sm_90+, fp16/bf16), in the
  tile config that measured fastest for the shape;
* cuBLAS: ``F.linear(x, W, bias)``; with a residual, ``F.linear(x, W)`` and then one ``bias_residual_add`` pass
  (what the engine ran before this kernel for SD 1.x's 1x1 ``proj_out``).

Where it wins (H200, run 18; ``benchmarks/sweep_linear_tma.py``, call C): SD1.5's 320-wide projections at 64x64
latents, 10.2 -> 6.3 µs in the sweep's graph of repeated calls (10.0 -> 7.7 µs in the engine's warm-up measurement,
call D), and ``proj_out`` with the residual at every SD1.5 level (9.7 -> 7.1 µs at 64x64); cuBLAS stays faster from
K = 1280 and at SDXL's shapes. The choice is measured once per signature (shapes, strides, dtypes, device) as GPU time
(:func:`kernels.choice.gpu_times_us`) and logged, as :mod:`kernels.gemm.geglu_projection` does: nothing is timed or
kept inside CUDA graph capture (cuBLAS runs) or a ``kernels.precompile`` dry run (every candidate compiles);
under ``torch.compile`` the cuBLAS path is traced. ``SDFAST_LINEAR_TMA=0`` (read at import) pins cuBLAS;
``TUNING["force"]`` pins either path (tests).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from kernels import choice
from kernels.dispatch import log_fallback
from kernels.elementwise import bias_residual_add
from kernels.gemm._common import aligned16, misaligned
from kernels.gemm.linear_tma import CONFIGS as TILES
from kernels.gemm.linear_tma import LinearTile, linear_tma, shape_problem, unsupported

log = logging.getLogger("sdfast.kernels")

CONFIGS = TILES[:2]  # the per-tile winners of the sweep (kernels.gemm.linear_tma.CONFIGS)

TUNING = {
    "enabled": os.environ.get("SDFAST_LINEAR_TMA", "1") != "0",
    "configs": CONFIGS,  # the TMA candidates measured per signature
    "force": None,  # None: measure; "cublas" or a LinearTile: always that path (where the TMA kernel can run)
}

_choices: dict[tuple, LinearTile | None] = {}  # signature -> the TMA config, or None for cuBLAS


def cublas_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; with a residual, the bias-free product and then ``bias_residual_add`` over
    the (M, N) rows seen as a channels_last (1, N, M, 1) tensor (one pass, the sum in fp32, one rounding)."""
    if residual is None:
        return F.linear(x, weight, bias)
    y = F.linear(x, weight)
    if residual.shape != y.shape:
        raise ValueError(f"linear_projection: residual must be {tuple(y.shape)}, got {tuple(residual.shape)}")
    if y.numel() == 0:
        return y
    n = y.shape[-1]
    as_nhwc = lambda t: t.reshape(-1, n).t()[None, :, :, None]  # noqa: E731 - (M, N) rows as (1, N, M, 1) NHWC
    out = bias_residual_add(as_nhwc(y), bias, as_nhwc(residual.contiguous()))
    return out[0, :, :, 0].t().reshape(y.shape)


def linear_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias + residual`` on the path measured faster for this signature.

    Args: x (..., K); weight (N, K); bias (N,) or None; residual (..., N) in x's dtype, or None; the dtypes of
    ``F.linear``. Returns (..., N) in ``x.dtype``. Raises what ``F.linear`` raises for bad shapes, ``ValueError`` for a
    residual that is not (..., N). No autograd: callers route only inference through it (``sdfast.passes.linear``).
    """
    if torch.compiler.is_compiling():  # Dynamo cannot trace the choice (data_ptr, timing)
        return cublas_linear(x, weight, bias, residual)
    config = choice.choose_config(
        _choices, choice.signature(x, weight, bias, residual), x, name="linear_projection", instead="cuBLAS",
        problem=lambda: ("SDFAST_LINEAR_TMA=0" if not TUNING["enabled"] else None)
        or shape_problem(x, weight, bias, residual) or unsupported(x, weight, bias, residual),
        force=TUNING["force"], compile_all=lambda: [linear_tma(x, weight, bias, residual, c) for c in TUNING["configs"]],
        measure=lambda: _measure(x, weight, bias, residual))
    if config is not None and (misaligned(x, weight) or (residual is not None and not aligned16(residual))):
        log_fallback("linear_projection", "an operand is not 16-byte aligned", instead="cuBLAS")
        config = None
    return cublas_linear(x, weight, bias, residual) if config is None else linear_tma(x, weight, bias, residual, config)


def _measure(x, weight, bias, residual) -> LinearTile | None:
    """Time cuBLAS and every TMA config that compiles and launches; return the fastest TMA config, or None when
    cuBLAS is fastest (kept on a tie). A config that fails to compile or launch is logged and skipped."""
    candidates = {"cublas": lambda: cublas_linear(x, weight, bias, residual)}
    for config in TUNING["configs"]:
        try:
            linear_tma(x, weight, bias, residual, config)
        except Exception as e:  # noqa: BLE001 - e.g. a tile that does not fit this GPU's shared memory
            log_fallback("linear_tma", f"{config} failed: {type(e).__name__}: {e}", instead="the other configs")
            continue
        candidates[str(config)] = lambda config=config: linear_tma(x, weight, bias, residual, config)
    times = choice.gpu_times_us(candidates)
    best = choice.fastest(times)
    log.info("linear_projection x %s weight %s residual %s %s: cuBLAS %.1f us, best TMA %s -> %s", tuple(x.shape),
             tuple(weight.shape), residual is not None, x.dtype, times["cublas"],
             min(((t, n) for n, t in times.items() if n != "cublas"), default=None), best)
    return None if best == "cublas" else next(c for c in TUNING["configs"] if str(c) == best)


__all__ = ["CONFIGS", "TUNING", "cublas_linear", "linear_projection"]
