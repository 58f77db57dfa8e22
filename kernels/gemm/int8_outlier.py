"""LLM.int8() linear: int8 vector-wise GEMM plus the outlier input features in 16-bit.

Method: Dettmers et al. 2022, "LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale".
Input feature columns ``k`` where any ``|x[:, k]| > threshold`` (default 6.0) are outliers. The
rest of ``x`` is quantized per token (row absmax over the non-outlier columns, "vector-wise"), the
weight per output channel, and multiplied in int8 with int32 accumulation; the outlier columns are
multiplied in 16-bit against the weight's (dequantized) int8 values, as bitsandbytes does for int8
weights. Both parts share one kernel and one pass over the weight tiles:

    y[m, n] = w_scale[n] * ( x_scale[m] * sum_{k not outlier} xq[m, k] * wq[n, k]
                                      +   sum_{k outlier}     x[m, k]  * wq[n, k] ) + bias[n]

The 16-bit product runs only for K tiles that contain an outlier column (a scalar branch per tile),
so a layer without outliers costs one int8 GEMM. The outlier mask is either computed per call from
the batch (dynamic, as in the paper) or fixed from calibration statistics (``outlier_mask``), which
keeps the op free of data-dependent shapes (CUDA-graph friendly) and skips one reduction.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.dispatch import interpret_mode, launch_autotuned, use_triton
from kernels.gemm._common import autotune_bench, device_index, grouped_tile
from kernels.gemm.w8a8 import gemm8_configs, quantize_per_token, quantize_per_token_ref

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------
def outlier_columns(x: torch.Tensor, threshold: float = 6.0) -> torch.Tensor:
    """(K,) bool: input features where any ``|x[..., k]| > threshold`` (one reduction kernel)."""
    K = x.shape[-1]
    return torch.linalg.vector_norm(x.reshape(-1, K), ord=float("inf"), dim=0) > threshold


def int8_outlier_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    threshold: float = 6.0,
    outlier_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize-then-matmul reference of :func:`int8_outlier_linear` (fp32 math).

    x: (..., K); qweight: int8 (N, K); w_scale: fp32 (N,); outlier_mask: optional (K,) bool
    (computed from ``x`` and ``threshold`` when None). Returns (..., N) in ``x.dtype``.
    """
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    mask = outlier_columns(x2, threshold) if outlier_mask is None else outlier_mask.bool()
    keep = (~mask).float()
    q, s = quantize_per_token_ref(x2, keep, torch.int8)
    wd = qweight.float() * w_scale.float()[:, None]
    x_out = x2.float() * mask.float()
    y = (q.float() * s[:, None]) @ wd.t() + x_out.to(x.dtype).float() @ wd.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])


# --------------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _int8_outlier_kernel(
    xq_ptr,  # (M, K) int8 activations with the outlier columns zeroed, contiguous
    x_ptr,  # (M, K) fp16 / bf16 / fp32 original activations (outlier columns read from here)
    wq_ptr,  # (N, K) int8 weight, contiguous
    x_scale_ptr,  # (M,) fp32 per-token scale of xq
    w_scale_ptr,  # (N,) fp32 per-channel weight scale
    mask_ptr,  # (K,) int8: 1 for an outlier column
    bias_ptr,  # (N,) bias; unused when HAS_BIAS is False
    out_ptr,  # (M, N) output
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_om,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    K_TILES: tl.constexpr,  # > 0: K-loop trip count as a constexpr (interpreter); 0: computed at run time
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.max_contiguous(tl.multiple_of(offs_m % M, BLOCK_M), BLOCK_M)
    rn = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    rk = tl.arange(0, BLOCK_K)

    acc_i = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    acc_f = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, K_TILES if K_TILES > 0 else tl.cdiv(K, BLOCK_K)):
        k = kt * BLOCK_K + rk
        kmask = k < K
        a = tl.load(xq_ptr + rm[:, None].to(tl.int64) * K + k[None, :], mask=kmask[None, :], other=0.0)
        b = tl.load(wq_ptr + rn[None, :].to(tl.int64) * K + k[:, None], mask=kmask[:, None], other=0.0)
        acc_i = tl.dot(a, b, acc_i, out_dtype=tl.int32)
        om = tl.load(mask_ptr + k, mask=kmask, other=0)
        if tl.max(om.to(tl.int32), axis=0) > 0:
            xo = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :] * stride_xk,
                         mask=kmask[None, :] & (om[None, :] != 0), other=0.0)
            if IEEE:
                acc_f = tl.dot(xo, b.to(x_ptr.dtype.element_ty), acc_f, input_precision="ieee")
            else:
                acc_f = tl.dot(xo, b.to(x_ptr.dtype.element_ty), acc_f)

    xs = tl.load(x_scale_ptr + rm)
    ws = tl.load(w_scale_ptr + rn)
    y = (acc_i.to(tl.float32) * xs[:, None] + acc_f) * ws[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _tuned(device_index: int):
    cfgs = gemm8_configs(torch.device("cuda", device_index))
    # the 16-bit outlier tile doubles the A footprint: drop the largest pipelines
    cfgs = [c for c in cfgs if c.num_stages * (c.kwargs["BLOCK_M"] * 3 + c.kwargs["BLOCK_N"]) * c.kwargs["BLOCK_K"] <= 200 * 1024] or cfgs
    return triton.autotune(configs=cfgs, key=["M", "N", "K", "HAS_BIAS", "IEEE"], do_bench=autotune_bench, cache_results=True)(_int8_outlier_kernel)


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("sdfast::int8_outlier_gemm", mutates_args=())
def _int8_outlier_op(
    xq: torch.Tensor,
    x: torch.Tensor,
    wq: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    mask: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    M, K = x.shape
    N = wq.shape[0]
    if not use_triton("int8_outlier_gemm", xq, x, wq, x_scale, w_scale, mask, bias):
        wd = wq.float() * w_scale.float()[:, None]
        y = (xq.float() * x_scale[:, None]) @ wd.t() + (x.float() * mask.float()).to(x.dtype).float() @ wd.t()
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return out
    args = (xq.contiguous(), x, wq.contiguous(), x_scale.float().contiguous(), w_scale.float().contiguous(),
            mask.to(torch.int8).contiguous(), bias if bias is not None else out, out, M, N, K,
            x.stride(0), x.stride(1), out.stride(0))
    meta = dict(HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32)
    if x.is_cuda and not interpret_mode():
        kernel = _tuned(device_index(x))

        def grid(m):
            return (triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"]),)

        launch_autotuned(kernel, grid, *args, **meta, K_TILES=0)
    else:
        cfg = gemm8_configs(x.device)[0]
        grid = (triton.cdiv(M, cfg.kwargs["BLOCK_M"]) * triton.cdiv(N, cfg.kwargs["BLOCK_N"]),)
        _int8_outlier_kernel[grid](*args, **meta, K_TILES=triton.cdiv(K, cfg.kwargs["BLOCK_K"]), **cfg.kwargs,
                                   num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


@_int8_outlier_op.register_fake
def _(xq, x, wq, x_scale, w_scale, mask, bias):
    return x.new_empty((x.shape[0], wq.shape[0]))


def int8_outlier_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    threshold: float = 6.0,
    outlier_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """LLM.int8() linear (ops ``sdfast::quantize_per_token`` + ``sdfast::int8_outlier_gemm``).

    x: (..., K) fp16 / bf16 / fp32; qweight: int8 (N, K) per-output-channel (from
    ``kernels.gemm.w8a8.quantize_weight_per_channel``); w_scale: fp32 (N,); bias: optional (N,);
    outlier_mask: optional (K,) bool fixed from calibration, else columns with any
    ``|x| > threshold`` in this call. Returns (..., N) in ``x.dtype``.

    Raises: ValueError (shapes), TypeError (dtypes).
    """
    K = x.shape[-1]
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"int8_outlier_linear: x dtype {x.dtype} not supported ({_FLOAT_DTYPES})")
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.shape[1] != K:
        raise ValueError(f"int8_outlier_linear: qweight must be int8 (N, {K}), got {qweight.dtype} {tuple(qweight.shape)}")
    N = qweight.shape[0]
    if tuple(w_scale.shape) != (N,):
        raise ValueError(f"int8_outlier_linear: w_scale must be ({N},), got {tuple(w_scale.shape)}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"int8_outlier_linear: bias must be ({N},), got {tuple(bias.shape)}")
    if outlier_mask is not None and tuple(outlier_mask.shape) != (K,):
        raise ValueError(f"int8_outlier_linear: outlier_mask must be ({K},), got {tuple(outlier_mask.shape)}")
    x2 = x.reshape(-1, K)
    mask = outlier_columns(x2, threshold) if outlier_mask is None else outlier_mask.bool()
    xq, xs = quantize_per_token(x2, (~mask).to(torch.float32), torch.int8)
    y = _int8_outlier_op(xq, x2, qweight, xs, w_scale, mask, bias)
    return y.reshape(*x.shape[:-1], N)


__all__ = ["int8_outlier_linear", "int8_outlier_linear_ref", "outlier_columns"]
