"""Launch geometry shared by the per-pixel copy kernels (nearest 2x upsampling, channel concatenation): programs of
BLOCK_P pixels x BLOCK_C channels (host side: their sizes and grid; in the kernels: the tile's indices), and the largest
element offset a launch reaches (for the 64-bit index switch)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def pixel_tiles(n_pix: int, channels: int, tile_elems: int) -> tuple[int, int, tuple[int, int]]:
    """(BLOCK_P, BLOCK_C, grid) for ``n_pix`` pixels of ``channels`` channels, about ``tile_elems`` elements per
    program: BLOCK_C the channels rounded up to a power of two, at most 128."""
    block_c = min(triton.next_power_of_2(channels), 128)
    block_p = tile_elems // block_c
    return block_p, block_c, (triton.cdiv(n_pix, block_p), triton.cdiv(channels, block_c))


def max_offset(*tensors: torch.Tensor) -> int:
    """The largest element offset any of ``tensors`` reaches through its strides (not numel: a strided view reaches
    further)."""
    return max(sum((n - 1) * s for n, s in zip(t.shape, t.stride())) for t in tensors)


@triton.jit
def pixel_channel_tile(H, W, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, INT64: tl.constexpr):
    """This program's tile: pixel indices p (BLOCK_P, over B*H*W flattened as (b, h, w)), channels c (BLOCK_C), and
    p's (b, h, w); in int64 when INT64 (in NCHW the channel offset c * H*W alone can pass 2**31)."""
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if INT64:
        p = p.to(tl.int64)
        c = c.to(tl.int64)
    w = p % W
    t = p // W
    return p, c, t // H, t % H, w
