"""FP8 (E4M3) linear with static per-tensor scales, the GEMM in cuBLASLt (``torch._scaled_mm``).

    q_x = sat448(x * smooth * inv_a_scale)  -> float8_e4m3fn     (our Triton kernel: one pass)
    y   = (q_x @ q_w^T) * (a_scale * w_scale) + bias             (torch._scaled_mm, fp16/bf16 out)

Method: SmoothQuant's per-tensor static setting ("O3": one activation scale per layer, fixed by
calibration; Xiao et al. 2022) in FP8 E4M3 (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning"), which is the FP8 recipe NVIDIA's TensorRT Model Optimizer applies to SD/SDXL: activation
scale = calibrated absmax / 448, one weight scale per tensor. E4M3 keeps about 4.5 decades of normal
range per scale, so one scale per tensor loses little; the win is the GEMM: with one scalar per operand
cuBLASLt runs its fastest FP8 kernels, and nothing has to be reduced at run time.

Over one SDXL UNet forward's linears (``bench_kernels --only gemm``, sm_90) per-tensor scales measured faster than
per-token x per-channel ones, and fast accumulation faster again (figures: ``benchmarks/results/h200-2026-11-30-run8/``).
Fast accumulation (``use_fast_accum``) lets cuBLASLt keep the FP8 products in the tensor cores' accumulator without
periodic promotion to fp32; at SD's K <= 5120 the relative error against fp32 is unchanged (the quantization
error itself).

Rounding: on the GPU the kernel clamps to ±448 and casts (``cvt.rn.satfinite``: nearest, ties to even),
bit-identical to torch's ``(x * smooth * inv).clamp(-448, 448).to(torch.float8_e4m3fn)``. Triton's
interpreter casts fp32 -> e4m3 wrongly across binades, so there the kernel first rounds to the E4M3 grid
itself (bit arithmetic: exact) and the cast only has exact values to convert; the result is then equal in
value (the interpreter drops the sign of zero and casts NaN to 384; the GPU keeps NaN). Doing that rounding on
the GPU too measured about twice as slow per call in the SDXL UNet, and is not bit-exact.

Requirements (``torch._scaled_mm``): K and N multiples of 16; a CUDA GPU of sm_89+ (Ada, Hopper). On a
CPU tensor the GEMM runs the plain-PyTorch reference (dequantize, matmul), logged once by
``kernels.dispatch``; below sm_89 the launchers raise ``NotImplementedError``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import log_fallback, use_triton
from kernels.gemm._common import round_half_even
from kernels.gemm.w8a8 import FP8_QMAX, check_fp8_supported

FP8 = torch.float8_e4m3fn
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 4096  # elements per program of the quantize kernel


# --------------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------------
def quantize_static_ref(x: torch.Tensor, inv_scale: torch.Tensor, smooth: torch.Tensor | None = None) -> torch.Tensor:
    """``(x * smooth * inv_scale)`` saturated to ±448 and cast to E4M3 (round to nearest, ties to even).

    x: (M, K) float; inv_scale: 0-dim fp32 (``1 / a_scale``); smooth: optional (K,) fp32.
    Returns (M, K) ``float8_e4m3fn``, contiguous.
    """
    v = x.float()
    if smooth is not None:
        v = v * smooth.float()
    return (v * inv_scale.float()).clamp(-FP8_QMAX, FP8_QMAX).to(FP8).contiguous()


def fp8_linear_ref(
    q: torch.Tensor,
    qweight: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(q * a_scale) @ (qweight * w_scale)^T + bias`` in fp32, cast to ``out_dtype``."""
    y = (q.float() * a_scale.float()) @ (qweight.float() * w_scale.float()).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


# --------------------------------------------------------------------------------------------
# quantize kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def round_to_e4m3(v):
    """fp32 values already within ±448 -> the nearest E4M3 value (ties to even), still in fp32.
    E4M3 has 3 mantissa bits: the spacing in the binade [2^e, 2^(e+1)) is 2^(e-3); below 2^-6 the
    subnormals keep the spacing 2^-9."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)  # exact powers of two: no division
    r = round_half_even(tl.abs(v) * inv_ulp) * ulp
    return tl.where(bits < 0, -r, r)  # the sign bit: -0.0 and small negatives round to -0.0, as torch does


@triton.jit
def _quantize_static_kernel(
    x_ptr,  # (M, K) float activations, contiguous
    smooth_ptr,  # (K,) fp32; unused without HAS_SMOOTH
    inv_ptr,  # () fp32: 1 / a_scale
    q_ptr,  # (M, K) float8_e4m3fn output, contiguous
    n_elem,
    K,
    QMAX: tl.constexpr,
    HAS_SMOOTH: tl.constexpr,
    ROUND_FIRST: tl.constexpr,  # the interpreter: round to the E4M3 grid here, its own cast is wrong
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elem
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SMOOTH:
        v = v * tl.load(smooth_ptr + offs % K, mask=mask, other=0.0)
    v = tl.clamp(v * tl.load(inv_ptr), -QMAX, QMAX, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN
    if ROUND_FIRST:
        v = round_to_e4m3(v)
    tl.store(q_ptr + offs, v.to(q_ptr.dtype.element_ty), mask=mask)  # GPU: cvt.rn.satfinite (nearest, ties to even)


@torch.library.custom_op("sdfast::quantize_static_fp8", mutates_args=())
def _quantize_static_op(x: torch.Tensor, inv_scale: torch.Tensor, smooth: torch.Tensor | None) -> torch.Tensor:
    if not use_triton("quantize_static_fp8", x, inv_scale, smooth):
        return quantize_static_ref(x, inv_scale, smooth)
    check_fp8_supported(x, "quantize_static_fp8")
    x = x.contiguous()
    q = torch.empty(x.shape, device=x.device, dtype=FP8)
    n = x.numel()
    if n:
        sm = smooth.float().contiguous() if smooth is not None else inv_scale
        _quantize_static_kernel[(triton.cdiv(n, _BLOCK),)](
            x, sm, inv_scale, q, n, x.shape[-1], QMAX=FP8_QMAX, HAS_SMOOTH=smooth is not None,
            ROUND_FIRST=not x.is_cuda, BLOCK=_BLOCK, num_warps=4,
        )
    return q


@_quantize_static_op.register_fake
def _(x, inv_scale, smooth):
    return torch.empty(x.shape, device=x.device, dtype=FP8)


def quantize_static(x: torch.Tensor, inv_scale: torch.Tensor, smooth: torch.Tensor | None = None) -> torch.Tensor:
    """Static per-tensor E4M3 quantization (op ``sdfast::quantize_static_fp8``), one pass over ``x``.

    x: (M, K) fp16 / bf16 / fp32 (a non-contiguous ``x`` is made contiguous first); inv_scale: 0-dim fp32
    tensor on x's device, ``1 / a_scale`` (read by the kernel at run time, so CUDA graphs see changes);
    smooth: optional (K,) multiplier (SmoothQuant's ``1 / s``). Returns (M, K) ``float8_e4m3fn``, contiguous,
    bit-identical to :func:`quantize_static_ref` on the GPU (see the module docstring for the interpreter).

    Raises: ValueError (shapes), TypeError (dtypes), NotImplementedError (a CUDA GPU below sm_89).
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_static: x must be (M, K), got {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"quantize_static: x dtype {x.dtype} not supported ({_FLOAT_DTYPES})")
    if inv_scale.dim() != 0 or inv_scale.dtype != torch.float32:
        raise TypeError(f"quantize_static: inv_scale must be a 0-dim fp32 tensor, got {inv_scale.dtype} {tuple(inv_scale.shape)}")
    if smooth is not None and tuple(smooth.shape) != (x.shape[1],):
        raise ValueError(f"quantize_static: smooth must be ({x.shape[1]},), got {tuple(smooth.shape)}")
    return _quantize_static_op(x, inv_scale, smooth)


# --------------------------------------------------------------------------------------------
# GEMM
# --------------------------------------------------------------------------------------------
def fp8_linear(
    q: torch.Tensor,
    qweight: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.float16,
    fast_accum: bool = True,
) -> torch.Tensor:
    """``(q * a_scale) @ (qweight * w_scale)^T + bias`` with per-tensor scales, on cuBLASLt FP8.

    q: (M, K) float8_e4m3fn, row-major; qweight: (N, K) float8_e4m3fn, row-major (its transpose is the
    column-major operand cuBLASLt wants: no copy); a_scale, w_scale: 0-dim fp32; bias: optional (N,);
    out_dtype: fp16 / bf16 / fp32. K and N must be multiples of 16. ``fast_accum``: see the module
    docstring. On CPU tensors the reference runs (logged once). Returns (M, N) ``out_dtype``.

    Raises: ValueError (shapes), TypeError (dtypes), NotImplementedError (a CUDA GPU below sm_89).
    """
    if q.dim() != 2 or qweight.dim() != 2 or q.shape[1] != qweight.shape[1]:
        raise ValueError(f"fp8_linear: expected q (M, K) and qweight (N, K), got {tuple(q.shape)} and {tuple(qweight.shape)}")
    if q.dtype != FP8 or qweight.dtype != FP8:
        raise TypeError(f"fp8_linear: q and qweight must be float8_e4m3fn, got {q.dtype} and {qweight.dtype}")
    K, N = q.shape[1], qweight.shape[0]
    if K % 16 or N % 16:
        raise ValueError(f"fp8_linear: K={K} and N={N} must be multiples of 16 (cuBLASLt FP8)")
    if a_scale.dim() != 0 or w_scale.dim() != 0:
        raise ValueError("fp8_linear: a_scale and w_scale must be 0-dim (per-tensor) fp32 tensors")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"fp8_linear: bias must be ({N},), got {tuple(bias.shape)}")
    if out_dtype not in _FLOAT_DTYPES:
        raise TypeError(f"fp8_linear: out_dtype must be one of {_FLOAT_DTYPES}, got {out_dtype}")
    if not q.is_cuda:
        log_fallback("fp8_scaled_mm", f"tensors on {q.device.type}: torch._scaled_mm runs on CUDA only")
        return fp8_linear_ref(q, qweight, a_scale, w_scale, bias, out_dtype)
    check_fp8_supported(q, "fp8_linear")
    fp32 = out_dtype == torch.float32  # torch._scaled_mm takes no bias with an fp32 output: added after
    b = bias.to(out_dtype) if bias is not None and not fp32 else None
    y = torch._scaled_mm(q.contiguous(), qweight.t(), scale_a=a_scale, scale_b=w_scale, bias=b,
                         out_dtype=out_dtype, use_fast_accum=fast_accum)
    return y.add_(bias.float()) if fp32 and bias is not None else y


__all__ = ["FP8", "quantize_static", "quantize_static_ref", "fp8_linear", "fp8_linear_ref"]
