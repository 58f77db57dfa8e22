"""A linear layer, ``x @ W^T + bias (+ residual)``, on the faster of cuBLAS and the TMA GEMM, chosen per call signature.

* the TMA GEMM with bias and residual in its epilogue (:mod:`kernels.gemm.linear_tma`; sm_90+, fp16/bf16), in the
  tile config that measured fastest for the shape;
* cuBLAS: ``F.linear(x, W, bias)``; with a residual, ``F.linear(x, W)`` and then one ``bias_residual_add`` pass.

The TMA GEMM pays at small K (SD 1.x's 320- and 640-wide projections, and ``proj_out`` with the residual, whose
separate add pass it removes); cuBLAS is faster at large K. The choice is the kernel-choice service's ``linear``
(:mod:`kernels.select`): candidates "cublas" (the default, kept on a tie) and one per TMA tile config in
``TUNING["configs"]`` (named by the config's ``str``). The kernel policy pins cuBLAS
(``sdfast.KernelPolicy.linear``); under ``torch.compile`` the cuBLAS path is traced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import select
from kernels.dispatch import log_fallback
from kernels.elementwise import bias_residual_add
from kernels.gemm._common import aligned16, misaligned
from kernels.gemm.linear_tma import CONFIGS as TILES
from kernels.gemm.linear_tma import LinearTile, linear_tma, shape_problem, unsupported

CONFIGS = TILES[:2]  # the per-tile winners of benchmarks.ops.gemm's tma sweep (kernels.gemm.linear_tma.CONFIGS)

TUNING = {
    "configs": CONFIGS,  # the TMA candidates measured per signature
}

CHOICE = select.Choice("linear", default="cublas")


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
    """``x @ weight^T + bias + residual`` on the path chosen for this signature.

    Args: x (..., K); weight (N, K); bias (N,) or None; residual (..., N) in x's dtype, or None; the dtypes of
    ``F.linear``. Returns (..., N) in ``x.dtype``. Raises what ``F.linear`` raises for bad shapes, ``ValueError`` for a
    residual that is not (..., N). No autograd: callers route only inference through it (``sdfast.passes.linear``).
    """
    if torch.compiler.is_compiling():  # Dynamo cannot trace the choice (data_ptr, timing)
        return cublas_linear(x, weight, bias, residual)
    configs = {str(c): c for c in TUNING["configs"]}
    tma_problem = []  # computed once per decision, for every TMA candidate

    def problem(name: str) -> str | None:
        if name == "cublas":
            return None
        if not tma_problem:
            tma_problem.append(shape_problem(x, weight, bias, residual) or unsupported(x, weight, bias, residual))
        return tma_problem[0]

    candidates = {"cublas": lambda: cublas_linear(x, weight, bias, residual)}
    candidates.update({name: lambda c=c: linear_tma(x, weight, bias, residual, c) for name, c in configs.items()})
    name = select.decide(
        CHOICE, select.signature(x, weight, bias, residual), device=x.device, candidates=candidates, problem=problem,
        compile_all=lambda: [linear_tma(x, weight, bias, residual, c) for c in configs.values()],
        describe=lambda: f"x {tuple(x.shape)} weight {tuple(weight.shape)} residual {residual is not None} {x.dtype}")
    config: LinearTile | None = configs.get(name)
    if config is not None and (misaligned(x, weight) or (residual is not None and not aligned16(residual))):
        log_fallback("linear_projection", "an operand is not 16-byte aligned", instead="cuBLAS")
        config = None
    return cublas_linear(x, weight, bias, residual) if config is None else linear_tma(x, weight, bias, residual, config)


__all__ = ["CHOICE", "CONFIGS", "TUNING", "cublas_linear", "linear_projection"]
