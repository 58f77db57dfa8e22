"""diffusers' ``GEGLU`` (projection, then ``a * gelu(g)``) on the faster of two paths, chosen per call signature.

* the TMA GEMM with the activation in its epilogue (:mod:`kernels.geglu.triton_tma_gemm`; sm_90+, fp16/bf16), in the
  tile config that measured fastest for the shape;
* cuBLAS (``F.linear``) for the 2N-wide projection, then :func:`kernels.geglu.geglu` (``triton_elementwise``; one
  memory pass).

The choice is the kernel-choice service's ``geglu`` (:mod:`kernels.select`): candidates "cublas" (the default, kept
on a tie) and one per TMA tile config in ``TUNING["configs"]`` (named by the config's ``str``). The kernel policy
pins cuBLAS (``sdfast.KernelPolicy.geglu``); under ``torch.compile`` the two-kernel path is traced.

:func:`geglu_projection_fp8` is the same for an FP8 (E4M3, static per-tensor scales) projection whose output may be
the next FP8 layer's quantized input; its choice ``geglu_fp8`` is between "scaled_mm" (the default: cuBLASLt's FP8
GEMM writing the 2N-wide product, the activation kernel, then the quantize kernel) and the FP8 TMA GEMM with the
activation and the output quantization in its epilogue, one candidate per ``TUNING["fp8_configs"]`` entry
(``sdfast.KernelPolicy.geglu_fp8`` pins "scaled_mm").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import select
from kernels.dispatch import log_fallback
from kernels.gemm.fp8_static import fp8_linear, quantize_static
from kernels.geglu.triton_elementwise import geglu
from kernels.geglu.triton_tma_gemm import (CONFIGS, FP8_CONFIGS, TileConfig, fp8_unsupported, geglu_linear,
                                           geglu_linear_fp8, misaligned, shape_problem, unsupported)

TUNING = {
    "configs": CONFIGS,  # the TMA candidates measured per signature
    "fp8_configs": FP8_CONFIGS,  # the FP8 TMA candidates
}

CHOICE = select.Choice("geglu", default="cublas")
FP8_CHOICE = select.Choice("geglu_fp8", default="scaled_mm")


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
    configs = {str(c): c for c in TUNING["configs"]}
    tma_problem = []  # computed once per decision, for every TMA candidate

    def problem(name: str) -> str | None:
        if name == "cublas":
            return None
        if not tma_problem:
            tma_problem.append(shape_problem(x, weight, bias) or unsupported(x, weight, bias))
        return tma_problem[0]

    candidates = {"cublas": lambda: cublas_geglu(x, weight, bias)}
    candidates.update({name: lambda c=c: geglu_linear(x, weight, bias, c) for name, c in configs.items()})
    name = select.decide(
        CHOICE, select.signature(x, weight, bias), device=x.device, candidates=candidates, problem=problem,
        compile_all=lambda: [geglu_linear(x, weight, bias, c) for c in configs.values()],
        describe=lambda: f"x {tuple(x.shape)} weight {tuple(weight.shape)} {x.dtype}")
    config: TileConfig | None = configs.get(name)
    if config is not None and misaligned(x, weight):  # the one property the key does not hold: a view's offset
        log_fallback("geglu_projection", "x or the weight is not 16-byte aligned", instead="cuBLAS and the GEGLU kernel")
        config = None
    return cublas_geglu(x, weight, bias) if config is None else geglu_linear(x, weight, bias, config)


def scaled_mm_geglu(q: torch.Tensor, qweight: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None, out_scale_inv: torch.Tensor | None, out_dtype: torch.dtype,
                    fast_accum: bool = True) -> torch.Tensor:
    """The three-kernel FP8 path: ``torch._scaled_mm`` for the 2N-wide projection, :func:`kernels.geglu.geglu`, then
    (with ``out_scale_inv``) the static quantize kernel. q: (M, K) E4M3. Returns (M, N)."""
    h = geglu(fp8_linear(q, qweight, a_scale, w_scale, bias, out_dtype=out_dtype, fast_accum=fast_accum))
    return h if out_scale_inv is None else quantize_static(h, out_scale_inv)


def geglu_projection_fp8(q: torch.Tensor, qweight: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None = None, *, out_scale_inv: torch.Tensor | None = None,
                         out_dtype: torch.dtype = torch.float16, fast_accum: bool = True) -> torch.Tensor:
    """diffusers' ``GEGLU`` over an FP8 projection, on the faster of :func:`scaled_mm_geglu` and the FP8 TMA GEMM
    (:func:`kernels.geglu.triton_tma_gemm.geglu_linear_fp8`), measured per call signature (choice ``geglu_fp8``).

    Args: q (M, K) float8_e4m3fn, rows contiguous; qweight (2N, K) float8_e4m3fn; a_scale, w_scale 0-dim fp32;
    bias (2N,) fp16 / bf16 / fp32 or None; out_scale_inv: 0-dim fp32 ``1 / s_out`` for an E4M3 output (the next FP8 layer's
    input), else the output is ``out_dtype``; fast_accum: the FP8 sums' accumulation mode (the TMA GEMM runs fast
    accumulation only, so ``False`` keeps cuBLASLt). Returns (M, N). Raises what
    :func:`kernels.gemm.fp8_static.fp8_linear` raises for bad shapes or dtypes (ValueError, TypeError; K and N must be
    multiples of 16).
    """
    fp8_out = out_scale_inv is not None
    if torch.compiler.is_compiling():
        return scaled_mm_geglu(q, qweight, a_scale, w_scale, bias, out_scale_inv, out_dtype, fast_accum)
    configs = {str(c): c for c in TUNING["fp8_configs"]}
    tma_problem = []

    def problem(name: str) -> str | None:
        if name == "scaled_mm":
            return None
        if not fast_accum:
            return "the FP8 TMA GEMM runs fast accumulation only"
        if not fp8_out and out_dtype not in (torch.float16, torch.bfloat16):
            return f"the FP8 TMA GEMM writes E4M3, fp16 or bf16, not {out_dtype}"
        if not tma_problem:
            tma_problem.append(shape_problem(q, qweight, bias) or fp8_unsupported(q, qweight, bias))
        return tma_problem[0]

    def tma(c: TileConfig) -> torch.Tensor:
        return geglu_linear_fp8(q, qweight, a_scale, w_scale, bias, out_scale_inv=out_scale_inv, out_dtype=out_dtype,
                                config=c)

    candidates = {"scaled_mm": lambda: scaled_mm_geglu(q, qweight, a_scale, w_scale, bias, out_scale_inv, out_dtype,
                                                       fast_accum)}
    candidates.update({name: lambda c=c: tma(c) for name, c in configs.items()})
    name = select.decide(
        FP8_CHOICE, select.signature(q, qweight, bias) + (fp8_out, str(out_dtype), fast_accum), device=q.device,
        candidates=candidates, problem=problem,
        compile_all=lambda: [tma(c) for c in configs.values()] if problem(next(iter(configs))) is None else None,
        describe=lambda: f"q {tuple(q.shape)} weight {tuple(qweight.shape)} fp8_out={fp8_out}")
    config = configs.get(name)
    if config is not None and misaligned(q, qweight):
        log_fallback("geglu_projection_fp8", "q or the weight is not 16-byte aligned", instead="torch._scaled_mm")
        config = None
    if config is None:
        return scaled_mm_geglu(q, qweight, a_scale, w_scale, bias, out_scale_inv, out_dtype, fast_accum)
    return tma(config)


__all__ = ["CHOICE", "FP8_CHOICE", "TUNING", "cublas_geglu", "geglu_projection", "geglu_projection_fp8",
           "scaled_mm_geglu"]
