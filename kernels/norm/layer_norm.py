"""LayerNorm over the last dimension with an optional fused residual add.

    s = x (+ residual)            # rounded to x.dtype, as eager PyTorch's separate add would
    y = (s - mean) * rstd * weight + bias

The transformer block's residual stream in SD (``h = attn(norm1(h)) + h; norm2(h)``) needs both the
normalized tensor and the sum, so ``return_sum=True`` writes ``s`` in the same pass: one read of x and
of the residual, two writes, instead of an add kernel plus a norm kernel.

Kernels: ``_ln_fwd_kernel`` keeps ``ROWS`` whole rows in registers (D up to 8192): one read, exact
two-pass mean/variance in fp32. ``_ln_fwd_looped_kernel`` handles longer rows (one row per program,
statistics by per-lane shifted sums, then a second sweep that usually hits L2).
Anchors: Ba et al. 2016 (LayerNorm); triton-lang tutorial 05-layer-norm; flash-attention's
``ops/triton/layer_norm.py`` (fused residual, returned pre-norm sum).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.checks import check_like
from kernels.dispatch import use_triton
from kernels.gemm.fp8_static import FP8, round_to_e4m3
from kernels.gemm.w8a8 import FP8_QMAX

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8_MAX = tl.constexpr(FP8_QMAX)
_MAX_FUSED_D = 8192  # rows up to this (padded) width stay in registers


# --------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------
def layer_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    residual: torch.Tensor | None = None,
    return_sum: bool = False,
    sum_bias: torch.Tensor | None = None,
    upcast: bool = True,
    out_scale_inv: torch.Tensor | None = None,
):
    """Plain-PyTorch ``layer_norm(x + residual)`` over the last dim D.

    x, residual: (..., D); weight, bias, sum_bias: (D,) or None. With ``upcast`` the math runs in fp32 and
    the outputs are cast to x.dtype; without, in x.dtype. Returns ``y`` or ``(y, s)`` with ``return_sum``;
    with ``sum_bias``, ``s`` is the sum rounded to x.dtype plus ``sum_bias`` (the norm does not see it). With
    ``out_scale_inv`` (0-dim fp32) ``y`` is ``(y * out_scale_inv)`` from the compute dtype, saturated to +-448 and
    cast to ``float8_e4m3fn``.
    """
    dt = x.dtype
    cdt = torch.promote_types(dt, torch.float32) if upcast else dt
    s = x.to(cdt)
    if residual is not None:
        s = s + residual.to(cdt)
    D = x.shape[-1]
    y = F.layer_norm(
        s, (D,), None if weight is None else weight.to(cdt), None if bias is None else bias.to(cdt), eps
    )
    if out_scale_inv is not None:
        y = (y.float() * out_scale_inv.float()).clamp(-FP8_QMAX, FP8_QMAX).to(FP8)
    else:
        y = y.to(dt)
    if return_sum:
        if sum_bias is not None:
            return y, (s.to(dt).to(cdt) + sum_bias.to(cdt)).to(dt)
        return y, s.to(dt)
    return y


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _ln_fwd_kernel(
    x_ptr,  # (M, D) input, row stride sxm, unit column stride
    r_ptr,  # (M, D) residual, row stride srm; unused without HAS_RES
    w_ptr,  # (D,) weight; unused without HAS_W
    b_ptr,  # (D,) bias; unused without HAS_B
    y_ptr,  # (M, D) output, contiguous
    s_ptr,  # (M, D) sum output, contiguous; unused without WRITE_SUM
    sb_ptr,  # (D,) bias added to the stored sum only; unused without HAS_SUM_BIAS
    inv_ptr,  # () fp32 1 / (y's FP8 scale); unused without Y_FP8
    M,
    D,
    eps,
    sxm,
    srm,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,  # >= D
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    WRITE_SUM: tl.constexpr,
    HAS_SUM_BIAS: tl.constexpr,
    Y_FP8: tl.constexpr,  # y stored as E4M3: sat448(y * inv), the static input of the FP8 GEMM that reads it
    ROUND_FIRST: tl.constexpr,  # the interpreter: round to the E4M3 grid before the cast (kernels.gemm.fp8_static)
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    mask = (rows < M)[:, None] & cmask[None, :]
    xv = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :], mask=mask, other=0.0)
    s = xv.to(tl.float32)
    if HAS_RES:
        s = s + tl.load(r_ptr + rows[:, None] * srm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = s.to(xv.dtype).to(tl.float32)
    out_offs = rows[:, None] * D + cols[None, :]
    if WRITE_SUM:
        s_out = s
        if HAS_SUM_BIAS:  # rounded like the eager sum, then the bias added and rounded again
            s_out = s + tl.load(sb_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(s_ptr + out_offs, s_out.to(s_ptr.dtype.element_ty), mask=mask)
    mean = tl.sum(s, axis=1) / D
    d = tl.where(mask, s - mean[:, None], 0.0)
    var = tl.sum(d * d, axis=1) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    y = d * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + out_offs, _ln_out(y, inv_ptr, Y_FP8, ROUND_FIRST).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ln_out(y, inv_ptr, Y_FP8: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """The normalized fp32 values as stored: unchanged, or scaled and saturated for an E4M3 store."""
    if Y_FP8:
        y = tl.clamp(y * tl.load(inv_ptr), -_FP8_MAX, _FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        if ROUND_FIRST:
            y = round_to_e4m3(y)
    return y


@triton.jit
def _ln_row_sum(
    x_row,  # pointer to the row of x
    r_row,  # pointer to the row of the residual
    cols,
    mask,
    HAS_RES: tl.constexpr,
):
    xv = tl.load(x_row + cols, mask=mask, other=0.0)
    s = xv.to(tl.float32)
    if HAS_RES:
        s = s + tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
        s = s.to(xv.dtype).to(tl.float32)
    return s


@triton.jit
def _ln_fwd_looped_kernel(
    x_ptr,  # (M, D) input, row stride sxm
    r_ptr,  # (M, D) residual, row stride srm; unused without HAS_RES
    w_ptr,  # (D,) weight; unused without HAS_W
    b_ptr,  # (D,) bias; unused without HAS_B
    y_ptr,  # (M, D) output, contiguous
    s_ptr,  # (M, D) sum output, contiguous; unused without WRITE_SUM
    sb_ptr,  # (D,) bias added to the stored sum only; unused without HAS_SUM_BIAS
    inv_ptr,  # () fp32 1 / (y's FP8 scale); unused without Y_FP8
    D,
    eps,
    sxm,
    srm,
    N_CHUNKS: tl.constexpr,  # cdiv(D, BLOCK_D)
    BLOCK_D: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    WRITE_SUM: tl.constexpr,
    HAS_SUM_BIAS: tl.constexpr,
    Y_FP8: tl.constexpr,  # y stored as E4M3: sat448(y * inv), the static input of the FP8 GEMM that reads it
    ROUND_FIRST: tl.constexpr,  # the interpreter: round to the E4M3 grid before the cast (kernels.gemm.fp8_static)
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * sxm
    r_row = r_ptr + row * srm
    lane = tl.arange(0, BLOCK_D)
    # Shift by the row's first value so the fp32 sums of (s - shift) do not cancel.
    shift = tl.sum(_ln_row_sum(x_row, r_row, lane, lane < 1, HAS_RES), axis=0)
    acc1 = tl.zeros((BLOCK_D,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in range(N_CHUNKS):
        cols = k * BLOCK_D + lane
        mask = cols < D
        s = _ln_row_sum(x_row, r_row, cols, mask, HAS_RES)
        if WRITE_SUM:
            s_out = s
            if HAS_SUM_BIAS:
                s_out = s + tl.load(sb_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(s_ptr + row * D + cols, s_out.to(s_ptr.dtype.element_ty), mask=mask)
        d = tl.where(mask, s - shift, 0.0)
        acc1 += d
        acc2 += d * d
    s1 = tl.sum(acc1, axis=0)
    mean = shift + s1 / D
    var = tl.maximum(tl.sum(acc2, axis=0) - s1 * s1 / D, 0.0) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    for k in range(N_CHUNKS):
        cols = k * BLOCK_D + lane
        mask = cols < D
        s = _ln_row_sum(x_row, r_row, cols, mask, HAS_RES)
        y = (s - mean) * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * D + cols, _ln_out(y, inv_ptr, Y_FP8, ROUND_FIRST).to(y_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------
def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# Tuning knobs (read at call time; `python -m benchmarks.ops.layer_norm tune` times them on the GPU). At SD's shapes
# these defaults have the lowest total of its configs (sm_90); holding a row as two power-of-two chunks
# (640 = 512 + 128, no idle lanes) measured slower than one padded chunk, and was dropped.
_TUNING = {
    "tile_elems": 4096,  # padded elements per program: ROWS = tile_elems // BLOCK_D
    "warps_per_4k": 4,  # warps per 4096 elements of tile (at least 4, at most 16)
}


def layer_norm_config(M: int, D: int) -> dict:
    """Tiling for (M, D): rows per program and warps for the in-register kernel, or the looped one."""
    T = _TUNING
    block_d = _p2(D)
    if block_d <= _MAX_FUSED_D:
        rows = max(1, min(_p2(M), T["tile_elems"] // block_d))
        warps = min(16, max(4, rows * block_d * T["warps_per_4k"] // 4096))
        return {"looped": False, "ROWS": rows, "BLOCK_D": block_d, "num_warps": warps}
    return {"looped": True, "BLOCK_D": 4096, "N_CHUNKS": -(-D // 4096), "num_warps": 8}


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------
def _rows_view(t: torch.Tensor, name: str) -> torch.Tensor:
    D = t.shape[-1]
    if t.dim() == 0 or t.stride(-1) != 1:
        raise ValueError(f"layer_norm: {name} must have a contiguous last dim, got strides {t.stride()}")
    try:
        return t.view(-1, D)
    except RuntimeError as e:
        raise ValueError(
            f"layer_norm: {name} of shape {tuple(t.shape)} strides {t.stride()} cannot be viewed as rows (M, D)"
        ) from e


def _check_inputs(x, weight, bias, residual, sum_bias=None, return_sum=False, out_scale_inv=None) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"layer_norm: x must be (..., D), got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"layer_norm: x dtype {x.dtype} not supported; use one of {_SUPPORTED_DTYPES}")
    D = x.shape[-1]
    if sum_bias is not None and not return_sum:
        raise ValueError("layer_norm: sum_bias is added to the returned sum; it needs return_sum=True")
    for name, t in (("weight", weight), ("bias", bias), ("sum_bias", sum_bias)):
        if t is None:
            continue
        if tuple(t.shape) != (D,):
            raise ValueError(f"layer_norm: {name} must have shape ({D},), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"layer_norm: {name} must be floating point, got {t.dtype}")
    if residual is not None:
        check_like("layer_norm", "residual", residual, x)
    if out_scale_inv is not None and (out_scale_inv.dim() != 0 or out_scale_inv.dtype != torch.float32):
        raise TypeError(f"layer_norm: out_scale_inv must be a 0-dim fp32 tensor, got {out_scale_inv.dtype} "
                        f"{tuple(out_scale_inv.shape)}")
    devs = {t.device for t in (x, weight, bias, residual, sum_bias, out_scale_inv) if t is not None}
    if len(devs) > 1:
        raise ValueError(f"layer_norm: all tensors must be on one device, got {sorted(map(str, devs))}")


def _layer_norm_impl(x, weight, bias, eps, residual, return_sum, sum_bias=None, out_scale_inv=None):
    _check_inputs(x, weight, bias, residual, sum_bias, return_sum, out_scale_inv)
    if not use_triton("layer_norm", x, weight, bias, residual, sum_bias, out_scale_inv):
        out = layer_norm_ref(x, weight, bias, eps, residual=residual, return_sum=return_sum, sum_bias=sum_bias,
                             out_scale_inv=out_scale_inv)
        if not return_sum:
            return out, x.new_empty(0)
        y, s = out
        return y, (s.clone() if s.data_ptr() == x.data_ptr() else s)
    D = x.shape[-1]
    x2 = _rows_view(x, "x")
    r2 = _rows_view(residual, "residual") if residual is not None else x2
    M = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype if out_scale_inv is None else FP8, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if return_sum else x.new_empty(0)
    if M == 0 or D == 0:
        return y, s
    w = weight.contiguous() if weight is not None else x2
    b = bias.contiguous() if bias is not None else x2
    sb = sum_bias.contiguous() if sum_bias is not None else x2
    inv = out_scale_inv if out_scale_inv is not None else x2
    flags = dict(HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None, WRITE_SUM=return_sum,
                 HAS_SUM_BIAS=sum_bias is not None, Y_FP8=out_scale_inv is not None,
                 ROUND_FIRST=out_scale_inv is not None and not x.is_cuda)
    cfg = layer_norm_config(M, D)
    if cfg["looped"]:
        _ln_fwd_looped_kernel[(M,)](
            x2, r2, w, b, y, s if return_sum else y, sb, inv, D, float(eps), x2.stride(0), r2.stride(0),
            N_CHUNKS=cfg["N_CHUNKS"], BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"], **flags,
        )
    else:
        _ln_fwd_kernel[(triton.cdiv(M, cfg["ROWS"]),)](
            x2, r2, w, b, y, s if return_sum else y, sb, inv, M, D, float(eps), x2.stride(0), r2.stride(0),
            ROWS=cfg["ROWS"], BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"], **flags,
        )
    return y, s


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("sdfast::layer_norm", mutates_args=())
def _layer_norm_op(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    residual: Optional[torch.Tensor],
    return_sum: bool,
    sum_bias: Optional[torch.Tensor] = None,
    out_scale_inv: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _layer_norm_impl(x, weight, bias, eps, residual, return_sum, sum_bias, out_scale_inv)


@_layer_norm_op.register_fake
def _layer_norm_fake(x, weight, bias, eps, residual, return_sum, sum_bias=None, out_scale_inv=None):
    _check_inputs(x, weight, bias, residual, sum_bias, return_sum, out_scale_inv)
    y = torch.empty(x.shape, dtype=x.dtype if out_scale_inv is None else FP8, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if return_sum else x.new_empty(0)
    return y, s


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    residual: torch.Tensor | None = None,
    return_sum: bool = False,
    sum_bias: torch.Tensor | None = None,
    out_scale_inv: torch.Tensor | None = None,
):
    """Fused LayerNorm over the last dim: ``y = LayerNorm(x + residual) * weight + bias``.

    x: (..., D) fp16/bf16/fp32 with a contiguous last dim (rows may be strided); any D. weight, bias:
    (D,) or None. residual: like x, same dtype. fp32 statistics; the sum is rounded to x.dtype first.
    Returns ``y`` (contiguous, x's shape and dtype), or ``(y, s)`` with ``return_sum`` (``s = x +
    residual``, the residual stream; ``s`` is ``x`` itself when there is no residual). ``sum_bias`` (D,)
    (needs ``return_sum``) is added to ``s`` only: the next layer's bias, so that a GEMM can add its
    product to ``s`` in place (``s.addmm_``) with no separate bias or residual pass. ``out_scale_inv`` (0-dim
    fp32 on x's device, ``1 / s_y``) stores ``y`` as ``float8_e4m3fn``: ``sat448(y * out_scale_inv)`` from the fp32
    values (nearest, ties to even), the static-scale input of the FP8 GEMM that reads it
    (``kernels.gemm.fp8_static``), so no quantize pass follows.
    Raises ValueError (shapes, strides, devices) or TypeError (dtypes). Falls back to the PyTorch
    reference where Triton cannot run. Registered as ``torch.ops.sdfast.layer_norm``.
    """
    if return_sum and residual is None and sum_bias is None:
        y, _ = torch.ops.sdfast.layer_norm(x, weight, bias, float(eps), None, False, None, out_scale_inv)
        return y, x
    y, s = torch.ops.sdfast.layer_norm(x, weight, bias, float(eps), residual, bool(return_sum), sum_bias, out_scale_inv)
    return (y, s) if return_sum else y


__all__ = ["layer_norm", "layer_norm_ref", "layer_norm_config"]
