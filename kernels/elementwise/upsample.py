"""Nearest-neighbour 2x upsampling of (B, C, H, W) in the input's own memory format.

    y[b, c, oh, ow] = x[b, c, oh // 2, ow // 2],   y: (B, C, 2H, 2W)

This is what diffusers' ``Upsample2D`` does before its conv (``F.interpolate(scale_factor=2, mode="nearest")``)
in every UNet up block and VAE decoder up block. PyTorch's channels_last kernel for it
(``upsample_nearest2d_nhwc_out_frame``) runs at a small fraction of the memory bandwidth
(benchmarks/results/h200-2026-11-30-run9). Here each program copies a (BLOCK_P output pixels x
BLOCK_C channels) tile; in channels_last memory the channels are contiguous, so loads and stores are full
vectors, and the four reads of each input pixel hit the cache. NCHW inputs take the same kernel through
their strides (correct, not tuned).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.checks import is_channels_last as _is_channels_last
from kernels.dispatch import use_triton
from kernels.elementwise._pixels import max_offset, pixel_channel_tile, pixel_tiles

TILE_ELEMS = 4096  # elements per program
INT64_FROM = 2**31 - 1  # element offsets at or above this need 64-bit index math


def upsample_nearest2x_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: ``F.interpolate(x, scale_factor=2, mode="nearest")`` in x's memory format."""
    return F.interpolate(x, scale_factor=2.0, mode="nearest")


@triton.jit
def _upsample_nearest2x_kernel(
    x_ptr,  # (B, C, H, W), strides (sxb, sxc, sxh, sxw)
    y_ptr,  # (B, C, 2H, 2W), strides (syb, syc, syh, syw)
    C,
    OH,
    OW,
    NP,  # output pixels: B * OH * OW
    sxb,
    sxc,
    sxh,
    sxw,
    syb,
    syc,
    syh,
    syw,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INT64: tl.constexpr,
):
    p, c, b, oh, ow = pixel_channel_tile(OH, OW, BLOCK_P, BLOCK_C, INT64)  # output pixels
    src = b * sxb + (oh // 2) * sxh + (ow // 2) * sxw
    dst = b * syb + oh * syh + ow * syw
    mask = (p < NP)[:, None] & (c < C)[None, :]
    v = tl.load(x_ptr + src[:, None] + c[None, :] * sxc, mask=mask)
    tl.store(y_ptr + dst[:, None] + c[None, :] * syc, v, mask=mask)


def _check_input(x) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"upsample_nearest2x: x must be (B, C, H, W), got {shape}")


def _empty_output(x: torch.Tensor) -> torch.Tensor:
    B, C, H, W = x.shape
    fmt = torch.channels_last if _is_channels_last(x) else torch.contiguous_format
    return torch.empty((B, C, 2 * H, 2 * W), dtype=x.dtype, device=x.device, memory_format=fmt)


def _upsample_impl(x: torch.Tensor) -> torch.Tensor:
    _check_input(x)
    y = _empty_output(x)
    if not use_triton("upsample_nearest2x", x):
        return y.copy_(upsample_nearest2x_ref(x))
    if y.numel() == 0:
        return y
    B, C, OH, OW = y.shape
    n_pix = B * OH * OW
    block_p, block_c, grid = pixel_tiles(n_pix, C, TILE_ELEMS)
    _upsample_nearest2x_kernel[grid](
        x, y, C, OH, OW, n_pix, *x.stride(), *y.stride(),
        BLOCK_P=block_p, BLOCK_C=block_c, INT64=max_offset(x, y) >= INT64_FROM,
        num_warps=4,
    )
    return y


@torch.library.custom_op("sdfast::upsample_nearest2x", mutates_args=())
def _upsample_op(x: torch.Tensor) -> torch.Tensor:
    return _upsample_impl(x)


@_upsample_op.register_fake
def _upsample_fake(x):
    _check_input(x)
    return _empty_output(x)


def upsample_nearest2x(x: torch.Tensor) -> torch.Tensor:
    """Nearest-neighbour 2x upsampling: ``F.interpolate(x, scale_factor=2, mode="nearest")``, bit-identical.

    x: (B, C, H, W), any dtype, NCHW-contiguous or channels_last (other strides are read as they are); the
    output (B, C, 2H, 2W) is in x's memory format (channels_last for a channels_last x, else NCHW).
    Raises ValueError for a tensor that is not 4-D. Runs the PyTorch reference where Triton cannot run
    (``kernels.dispatch``). Registered as ``torch.ops.sdfast.upsample_nearest2x`` (inference only: no
    autograd formula).
    """
    return torch.ops.sdfast.upsample_nearest2x(x)


__all__ = ["upsample_nearest2x", "upsample_nearest2x_ref"]
