"""Per-channel bias + residual add (+ output scale) in one pass, for NCHW and channels_last (NHWC).

    y = (x + bias[c] + bias2[c] + residual) / out_scale

The end of diffusers' ``ResnetBlock2D``: ``(shortcut + conv2(h)) / output_scale_factor``, where conv2
(``bias``) and a 1x1 ``conv_shortcut`` (``bias2``) carry biases that PyTorch's cuDNN path adds in separate
kernels. Running the convolutions without bias and this kernel after them replaces two to four full-tensor passes
(and the sum of the two bias vectors) by one (same idea as the bias/residual epilogues of TensorRT's and
stable-fast's SD graphs). With only ``bias``, it is a convolution's bias add in one vectorized pass.

x: dense 4D in either memory format; the output has x's memory format. The residual may be in either
format (read through its strides). Math in fp32, one rounding at the end (eager PyTorch rounds after
every add: differences are at the dtype's rounding level).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.checks import check_like
from kernels.checks import is_channels_last as _is_channels_last
from kernels.dispatch import use_triton

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK = 4096  # elements per program: 16 per thread with 8 warps (two 16-byte fp16 vectors)
INT64_FROM = 2**31  # element counts from which offsets are computed in int64 (tests lower it)


# --------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------
def bias_residual_add_ref(
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    bias2: torch.Tensor | None = None,
    out_scale: float = 1.0,
    upcast: bool = True,
) -> torch.Tensor:
    """Plain PyTorch ``(x + bias[None, :, None, None] + bias2[...] + residual) / out_scale`` in x's memory format.

    With ``upcast`` the math runs in fp32 and the result is cast to x.dtype; without, in x.dtype with a
    rounding after each op (what eager diffusers does)."""
    dt = x.dtype
    cdt = torch.promote_types(dt, torch.float32) if upcast else dt
    s = x.to(cdt)
    for b in (bias, bias2):
        if b is not None:
            s = s + b.to(cdt).view(1, -1, 1, 1)
    if residual is not None:
        s = s + residual.to(cdt)
    if out_scale != 1.0:
        s = s / out_scale
    fmt = torch.channels_last if _is_channels_last(x) else torch.contiguous_format
    return s.to(dt).contiguous(memory_format=fmt)


# --------------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _bias_residual_kernel(
    x_ptr,  # dense (B, C, H, W), NCHW or NHWC memory; walked in memory order
    b_ptr,  # (C,) bias; unused without HAS_B
    b2_ptr,  # (C,) second bias; unused without HAS_B2
    r_ptr,  # (B, C, H, W) residual, strides (srb, src, srhw); unused without HAS_R
    y_ptr,  # output, x's strides
    N,  # B * C * H * W
    C,
    HW,
    srb,
    src,
    srhw,
    out_scale,
    CHANNELS_LAST: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_B2: tl.constexpr,
    HAS_R: tl.constexpr,
    R_SAME: tl.constexpr,  # residual has x's strides: read it at the same offsets
    SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    INT64: tl.constexpr,  # N >= 2**31: 64-bit offsets (slower index math, only for huge tensors)
):
    if INT64:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    xv = tl.load(x_ptr + offs, mask=mask, other=0.0)
    s = xv.to(tl.float32)
    if CHANNELS_LAST:
        c = offs % C
    else:
        c = (offs // HW) % C
    if HAS_B:
        s += tl.load(b_ptr + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_B2:
        s += tl.load(b2_ptr + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        if R_SAME:
            r_offs = offs
        else:
            if CHANNELS_LAST:
                hw = (offs // C) % HW
            else:
                hw = offs % HW
            r_offs = (offs // (C * HW)) * srb + c * src + hw * srhw
        s += tl.load(r_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
    if SCALE:
        s = s / out_scale
    tl.store(y_ptr + offs, s.to(y_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------
def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)


def _check_inputs(x, bias, residual, out_scale, bias2=None) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"bias_residual_add: x must be (B, C, H, W), got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"bias_residual_add: x dtype {x.dtype} not supported; use one of {_SUPPORTED_DTYPES}")
    if not _dense(x):
        raise ValueError(f"bias_residual_add: x must be NCHW-contiguous or channels_last, got strides {x.stride()}")
    C = x.shape[1]
    for name, b in (("bias", bias), ("bias2", bias2)):
        if b is not None and (tuple(b.shape) != (C,) or not b.is_floating_point()):
            raise ValueError(f"bias_residual_add: {name} must be a float ({C},) tensor, got {tuple(b.shape)} {b.dtype}")
    if residual is not None:
        check_like("bias_residual_add", "residual", residual, x)
        if not _dense(residual):
            raise ValueError(f"bias_residual_add: residual must be NCHW-contiguous or channels_last, got {residual.stride()}")
    if not out_scale > 0:
        raise ValueError(f"bias_residual_add: out_scale must be > 0, got {out_scale}")
    devs = {t.device for t in (x, bias, bias2, residual) if t is not None}
    if len(devs) > 1:
        raise ValueError(f"bias_residual_add: all tensors must be on one device, got {sorted(map(str, devs))}")


def _hw_stride(t: torch.Tensor) -> int:
    return t.stride(2) if t.shape[3] == 1 else t.stride(3)  # size-1 W: stride(3) is arbitrary


def _bias_residual_impl(x, bias, residual, out_scale, bias2=None):
    _check_inputs(x, bias, residual, out_scale, bias2)
    y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)  # x's strides, as the fake op
    if not use_triton("bias_residual_add", x, bias, bias2, residual):
        return y.copy_(bias_residual_add_ref(x, bias, residual, bias2=bias2, out_scale=out_scale))
    N = x.numel()
    if N == 0:
        return y
    B, C, H, W = x.shape
    cl = _is_channels_last(x)
    r = residual if residual is not None else x
    same = residual is not None and r.stride() == x.stride()  # else read through its own strides
    _bias_residual_kernel[(triton.cdiv(N, BLOCK),)](
        x, bias.contiguous() if bias is not None else x, bias2.contiguous() if bias2 is not None else x, r, y, N, C,
        H * W, r.stride(0), r.stride(1), _hw_stride(r), float(out_scale),
        CHANNELS_LAST=cl, HAS_B=bias is not None, HAS_B2=bias2 is not None, HAS_R=residual is not None, R_SAME=same,
        SCALE=out_scale != 1.0, BLOCK=BLOCK, INT64=N + BLOCK >= INT64_FROM, num_warps=8,
    )
    return y


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("sdfast::bias_residual_add", mutates_args=())
def _bias_residual_op(
    x: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor], out_scale: float,
    bias2: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return _bias_residual_impl(x, bias, residual, out_scale, bias2)


@_bias_residual_op.register_fake
def _bias_residual_fake(x, bias, residual, out_scale, bias2=None):
    _check_inputs(x, bias, residual, out_scale, bias2)
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


def bias_residual_add(
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    bias2: torch.Tensor | None = None,
    out_scale: float = 1.0,
) -> torch.Tensor:
    """``(x + bias[c] + bias2[c] + residual) / out_scale`` in one pass.

    x: (B, C, H, W) fp16/bf16/fp32, NCHW-contiguous or channels_last; bias, bias2: (C,) float (any float dtype,
    read as fp32, summed in fp32) or None; residual: like x (same dtype, either dense memory format) or None; out_scale > 0
    (diffusers' ``output_scale_factor``). Returns a new tensor in x's dtype and memory format.

    Raises ValueError (shapes, layouts, scale, devices) or TypeError (dtypes). Falls back to the PyTorch reference where Triton cannot run (``kernels.dispatch``).
    Registered as ``torch.ops.sdfast.bias_residual_add``.
    """
    return torch.ops.sdfast.bias_residual_add(x, bias, residual, float(out_scale), bias2)


__all__ = ["bias_residual_add", "bias_residual_add_ref", "BLOCK"]
