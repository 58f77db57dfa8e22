"""im2col for a 3x3, stride-1, padding-1 convolution: the (N*H*W, 9*C) matrix whose GEMM with the channels_last
weight is the convolution.

    A[p, tap * C + c] = x[n, c, h + kh - 1, w + kw - 1]   (0 outside the image),  p = (n, h, w),  tap = 3 kh + kw

so that ``conv2d(x, weight, bias, padding=1)`` in NHWC memory is ``A @ weight.permute(0, 2, 3, 1).reshape(Cout,
9*C).T + bias``, an (N*H*W, Cout) row-major result = the channels_last output. At SD1.5's 8x8 level (M = 128 pixels
with CFG, K = 11520 or 23040, Cout 1280) cuDNN's convolutions run far below the tensor-core peak while the
product is bound by reading the 29-59 MB weight; cuBLAS splits K over the SMs for such a skinny GEMM. A is small
there (2.9-5.9 MB). Each program copies a (BLOCK_P pixels x BLOCK_C channels) tile of one tap; in channels_last
memory the channels are contiguous, so loads and stores are full vectors. Method: im2col (Chellapilla et al. 2006).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from kernels.dispatch import use_triton
from kernels.elementwise._pixels import max_offset, pixel_channel_tile, pixel_tiles

TILE_ELEMS = 4096  # elements per program
INT64_FROM = 2**31 - 1  # element offsets at or above this need 64-bit index math


def im2col3x3_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: the (N*H*W, 9*C) patches of a (N, C, H, W) tensor, columns ordered (kh, kw, c)."""
    n, c, h, w = x.shape
    xp = torch.nn.functional.pad(x, (1, 1, 1, 1)).permute(0, 2, 3, 1)  # (N, H+2, W+2, C)
    taps = [xp[:, kh:kh + h, kw:kw + w, :] for kh in range(3) for kw in range(3)]
    return torch.stack(taps, dim=3).reshape(n * h * w, 9 * c)


@triton.jit
def _im2col3x3_kernel(
    x_ptr,  # (N, C, H, W), strides (sxn, sxc, sxh, sxw)
    a_ptr,  # (N*H*W, 9*C) contiguous
    C,
    H,
    W,
    NP,  # pixels: N * H * W
    sxn,
    sxc,
    sxh,
    sxw,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INT64: tl.constexpr,
):
    p, c, n, h, w = pixel_channel_tile(H, W, BLOCK_P, BLOCK_C, INT64)
    tap = tl.program_id(2)
    kh = tap // 3
    hs = h + kh - 1
    ws = w + (tap - 3 * kh) - 1
    inside = (p < NP) & (hs >= 0) & (hs < H) & (ws >= 0) & (ws < W)
    c_ok = (c < C)[None, :]
    v = tl.load(x_ptr + (n * sxn + hs * sxh + ws * sxw)[:, None] + c[None, :] * sxc, mask=inside[:, None] & c_ok,
                other=0.0)
    tl.store(a_ptr + (p * (9 * C) + tap * C)[:, None] + c[None, :], v, mask=(p < NP)[:, None] & c_ok)


def _check_input(x) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"im2col3x3: x must be (N, C, H, W), got {getattr(x, 'shape', type(x).__name__)}")


def _empty_output(x: torch.Tensor) -> torch.Tensor:
    n, c, h, w = x.shape
    return torch.empty((n * h * w, 9 * c), dtype=x.dtype, device=x.device)


def _im2col_impl(x: torch.Tensor) -> torch.Tensor:
    _check_input(x)
    a = _empty_output(x)
    if not use_triton("im2col3x3", x):
        return a.copy_(im2col3x3_ref(x))
    if a.numel() == 0:
        return a
    n, c, h, w = x.shape
    block_p, block_c, (gp, gc) = pixel_tiles(n * h * w, c, TILE_ELEMS)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # the launch goes to x's GPU
        _im2col3x3_kernel[(gp, gc, 9)](
            x, a, c, h, w, n * h * w, *x.stride(), BLOCK_P=block_p, BLOCK_C=block_c,
            INT64=max(max_offset(x), a.numel()) >= INT64_FROM, num_warps=4,
        )
    return a


@torch.library.custom_op("sdfast::im2col3x3", mutates_args=())
def _im2col_op(x: torch.Tensor) -> torch.Tensor:
    return _im2col_impl(x)


@_im2col_op.register_fake
def _im2col_fake(x):
    _check_input(x)
    return _empty_output(x)


def im2col3x3(x: torch.Tensor) -> torch.Tensor:
    """The (N*H*W, 9*C) im2col matrix of a 3x3, stride-1, padding-1 convolution's input, bit-identical copies.

    x: (N, C, H, W), any dtype and strides (channels_last is the fast case). Rows are the pixels (n, h, w) in
    order, columns (kh, kw, c): the order of a channels_last weight's memory. Raises ValueError for a tensor that is
    not 4-D. Runs the PyTorch reference where Triton cannot run (``kernels.dispatch``). Registered as
    ``torch.ops.sdfast.im2col3x3`` (inference only: no autograd formula).
    """
    return torch.ops.sdfast.im2col3x3(x)


__all__ = ["im2col3x3", "im2col3x3_ref"]
