"""Concatenation of two (B, C, H, W) tensors along the channels, in the first input's memory format.

    y[:, :C1] = a,  y[:, C1:] = b,   y: (B, C1 + C2, H, W)

This is ``torch.cat([hidden_states, res_hidden_states], dim=1)``, the skip connection of every UNet up block
(diffusers' ``UpBlock2D`` and ``CrossAttnUpBlock2D``). In channels_last memory the concatenated axis is the
innermost one, and PyTorch's kernel for it (``CatArrayBatchedCopy``) runs at about half the memory bandwidth
(benchmarks/results/h200-2026-11-30-run12). Here each
program copies a (BLOCK_P pixels x BLOCK_C output channels) tile, taking each channel from ``a`` or ``b``; in
channels_last memory the channels are contiguous, so loads and stores are full vectors. NCHW inputs take the
same kernel through their strides (correct, not tuned).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import is_channels_last as _is_channels_last
from kernels.dispatch import use_triton
from kernels.elementwise._pixels import max_offset, pixel_channel_tile, pixel_tiles

TILE_ELEMS = 4096  # elements per program
INT64_FROM = 2**31 - 1  # element offsets at or above this need 64-bit index math


def cat_channels_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: ``torch.cat([a, b], dim=1)`` in a's memory format."""
    fmt = torch.channels_last if _is_channels_last(a) else torch.contiguous_format
    return torch.cat([a, b], dim=1).contiguous(memory_format=fmt)


@triton.jit
def _cat_channels_kernel(
    a_ptr,  # (B, C1, H, W), strides (sab, sac, sah, saw)
    b_ptr,  # (B, C2, H, W), strides (sbb, sbc, sbh, sbw)
    y_ptr,  # (B, C1 + C2, H, W), strides (syb, syc, syh, syw)
    C1,
    C,  # C1 + C2
    H,
    W,
    NP,  # pixels: B * H * W
    sab,
    sac,
    sah,
    saw,
    sbb,
    sbc,
    sbh,
    sbw,
    syb,
    syc,
    syh,
    syw,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INT64: tl.constexpr,
):
    p, c, bi, h, w = pixel_channel_tile(H, W, BLOCK_P, BLOCK_C, INT64)
    p_ok = (p < NP)[:, None]
    in_a = (c < C1)[None, :]
    in_b = ((c >= C1) & (c < C))[None, :]
    va = tl.load(a_ptr + (bi * sab + h * sah + w * saw)[:, None] + c[None, :] * sac, mask=p_ok & in_a)
    vb = tl.load(b_ptr + (bi * sbb + h * sbh + w * sbw)[:, None] + (c - C1)[None, :] * sbc, mask=p_ok & in_b)
    tl.store(y_ptr + (bi * syb + h * syh + w * syw)[:, None] + c[None, :] * syc, tl.where(in_a, va, vb),
             mask=p_ok & (in_a | in_b))


def _check_inputs(a, b) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"cat_channels: {name} must be (B, C, H, W), got {shape}")
    if a.shape[0] != b.shape[0] or a.shape[2:] != b.shape[2:]:
        raise ValueError(f"cat_channels: a {tuple(a.shape)} and b {tuple(b.shape)} differ outside the channel dim")
    if a.dtype != b.dtype:
        raise TypeError(f"cat_channels: a and b dtypes differ: {a.dtype}, {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"cat_channels: a on {a.device}, b on {b.device}")


def _empty_output(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    B, C1, H, W = a.shape
    fmt = torch.channels_last if _is_channels_last(a) else torch.contiguous_format
    return torch.empty((B, C1 + b.shape[1], H, W), dtype=a.dtype, device=a.device, memory_format=fmt)


def _cat_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check_inputs(a, b)
    y = _empty_output(a, b)
    if not use_triton("cat_channels", a, b):
        return y.copy_(cat_channels_ref(a, b))
    if y.numel() == 0:
        return y
    B, C, H, W = y.shape
    n_pix = B * H * W
    block_p, block_c, grid = pixel_tiles(n_pix, C, TILE_ELEMS)
    _cat_channels_kernel[grid](
        a, b, y, a.shape[1], C, H, W, n_pix, *a.stride(), *b.stride(), *y.stride(),
        BLOCK_P=block_p, BLOCK_C=block_c, INT64=max_offset(a, b, y) >= INT64_FROM,
        num_warps=4,
    )
    return y


@torch.library.custom_op("sdfast::cat_channels", mutates_args=())
def _cat_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _cat_impl(a, b)


@_cat_op.register_fake
def _cat_fake(a, b):
    _check_inputs(a, b)
    return _empty_output(a, b)


def cat_channels(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.cat([a, b], dim=1)`` for two (B, C, H, W) tensors, bit-identical, in a's memory format.

    a: (B, C1, H, W), b: (B, C2, H, W), same dtype and device, any strides; the output (B, C1 + C2, H, W) is
    channels_last when a is, else NCHW-contiguous. Raises ValueError for tensors that are not 4-D or whose batch
    or spatial sizes differ, TypeError for different dtypes. Runs the PyTorch reference where Triton cannot run
    (``kernels.dispatch``). Registered as ``torch.ops.sdfast.cat_channels`` (inference only: no autograd formula).
    """
    return torch.ops.sdfast.cat_channels(a, b)


__all__ = ["cat_channels", "cat_channels_ref"]
