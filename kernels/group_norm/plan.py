"""Launch planning for the Triton GroupNorm kernels: which path a call takes and how it is tiled.

A pure function of the shapes (:func:`group_norm_plan` -> :class:`GroupNormPlan`), no device queries:

* "onepass" (``kernels.group_norm.triton_groups``): the whole channel tile of ``GPT`` groups x H*W fits in
  registers (up to ``onepass_max_elems``); channels_last too unless ``nhwc_onepass`` is off.
* "nhwc_tiles" (``kernels.group_norm.triton_nhwc``): channels_last inputs on the two-pass route while
  ``nhwc_channel_tiles`` is on: ``BLOCK_C``-channel tiles that ignore the groups, H*W split over ``S``
  programs so that there are about ``target_programs`` statistics programs, always the finalize kernel.
* "twopass" (``kernels.group_norm.triton_groups``): NCHW (and channels_last with ``nhwc_channel_tiles``
  off): group-aligned channel tiles, H*W split as above, partials combined inline in the apply pass unless
  there are more than ``max_inline_partials`` (then a finalize kernel), optional L2 chunking of the channel
  tiles (``l2_chunk_bytes``, off by default).

The knobs are :data:`TUNING`, read at call time (tests lower them to reach every path on small shapes;
``benchmarks.ops.group_norm tune`` times them). The defaults target an H200-class GPU (132 SMs).
"""

from __future__ import annotations

import dataclasses

# Tuning knobs (module constants, read at call time; tests lower them to reach every path on
# small shapes). Element counts are padded tile sizes.
TUNING = {
    "onepass_max_elems": 16384,  # whole channel tile x H*W in registers up to this many elements
    "tile_elems": 4096,  # elements per loop iteration in the two-pass kernels
    "target_programs": 528,  # stats programs to aim for (4 per SM on a 132-SM H200)
    "max_inline_partials": 256,  # above this many partials per apply program, a finalize kernel combines them
    "max_splits": 512,
    "force_splits": None,  # tests: exactly this many H*W splits (capped by the blocks available)
    "apply_programs": 4096,  # above this many apply tiles, one program loops over several (<= 8)
    # Per-chunk input bytes so the apply pass re-reads from L2. Off: 8 to 32 MB chunks measured slower than
    # none on sm_90 at every SD shape (``benchmarks.ops.group_norm tune``); L2 keeps much of the input anyway.
    "l2_chunk_bytes": 1 << 40,
    "groups_per_tile": None,  # force GPT (whole groups per channel tile; must divide G), None: chosen
    "stats_warps": 4,
    "stats_warps_large": 2,  # from 16 MB of input: 2 warps per statistics program (faster on sm_90)
    "large_bytes": 16 << 20,
    "apply_warps": 4,
    # channels_last two-pass route: per-channel statistics in BLOCK_C-channel tiles that ignore the
    # groups ("nhwc_tiles"); False: the group-aligned "twopass" kernels, exactly as before.
    "nhwc_channel_tiles": True,
    "nhwc_block_c": 64,  # channels per "nhwc_tiles" tile (power of two; capped at C rounded up to one)
    "nhwc_onepass": True,  # channels_last shapes small enough for "onepass" use it (False: two-pass route)
    "nhwc_finalize_elems": 1024,  # partials per loop iteration of the "nhwc_tiles" finalize kernel
}


def p2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def _num_warps(elems: int) -> int:
    return min(16, max(4, elems // 1024))  # about 32 fp32 values per thread


@dataclasses.dataclass(frozen=True)
class GroupNormPlan:
    """How one GroupNorm call is tiled (see the module docstring); from :func:`group_norm_plan`."""

    path: str  # "onepass", "twopass" or "nhwc_tiles"
    channels_last: bool
    BLOCK_C: int  # channels per tile row/column block (power of two)
    GPT: int  # whole groups per channel tile (0 for "nhwc_tiles": its tiles ignore the groups)
    N_CB: int  # BLOCK_C sub-blocks per channel tile (> 1 only when GPT == 1 and Cg > BLOCK_C)
    n_ct: int  # channel tiles
    BLOCK_HW: int  # H*W positions per loop iteration
    S: int = 1  # H*W splits of the statistics pass
    HWS: int = 0  # H*W positions per split
    finalize: bool = False  # combine partials in a separate kernel
    HWP: int = 0  # H*W positions per apply program
    chunk_ct: int = 0  # channel tiles per launch (L2 chunking)
    num_warps: int = 4
    apply_warps: int = 4


def _channel_tile(Cg: int, G: int, channels_last: bool, elem_size: int, bytes_per_channel: int, budget: int):
    """(BLOCK_C, GPT, N_CB): the channel tile is GPT whole groups, GPT a divisor of G (every tile full,
    so the channel mask has a constexpr bound), in a power-of-two BLOCK_C <= 256 (a wider group is
    one tile walked in N_CB sub-blocks). NHWC: the tile's first channel must sit on a 16-byte
    boundary or Triton cannot vectorize the channel-contiguous loads (Cg=10 fp16 -> 4 groups = 40
    channels = 80 bytes, not 6 groups at 120 bytes); then fewest masked lanes, then 64..128 channels
    per row. NCHW (channels are rows, H*W contiguous): fewest masked rows, then about 64 rows.
    Both prefer tiles under half the L2 chunk budget for huge tensors."""
    if Cg > 256:
        return 256, 1, -(-Cg // 256)
    best = None
    for gpt in (d for d in range(1, G + 1) if G % d == 0 and d * Cg <= 256):
        ch = gpt * Cg
        bc = max(p2(ch), 1)
        aligned = (ch * elem_size) % 16 == 0
        fits = ch * bytes_per_channel <= budget // 2
        util = round(ch / bc, 3)
        if channels_last:
            key = (aligned, fits, util, -abs(bc - 96))
        else:
            key = (fits, util, -abs(bc - 64))
        if best is None or key > best[0]:
            best = (key, bc, gpt)
    return best[1], best[2], 1


def group_norm_plan(
    B: int, C: int, HW: int, num_groups: int, channels_last: bool, elem_size: int, has_res: bool
) -> GroupNormPlan:
    """The tiling for one GroupNorm call on an H200-class GPU (pure function of the shapes)."""
    T = TUNING
    G = num_groups
    Cg = C // G
    bytes_per_channel = B * HW * elem_size * (2 if has_res else 1)
    bc, gpt, n_cb = _channel_tile(Cg, G, channels_last, elem_size, bytes_per_channel, T["l2_chunk_bytes"])
    forced = T["groups_per_tile"]
    if forced and n_cb == 1 and G % forced == 0 and forced * Cg <= 256:
        gpt, bc = forced, p2(forced * Cg)
    n_ct = G // gpt
    hw_p2 = p2(HW)
    onepass_ok = T["nhwc_onepass"] or not channels_last
    if onepass_ok and n_cb == 1 and bc * hw_p2 <= T["onepass_max_elems"]:
        return GroupNormPlan("onepass", channels_last, bc, gpt, 1, n_ct, hw_p2, num_warps=_num_warps(bc * hw_p2))
    if channels_last and T["nhwc_channel_tiles"]:
        return _nhwc_tiles_plan(B, C, HW, bytes_per_channel)
    block_hw = max(1, min(hw_p2, T["tile_elems"] // bc))
    # L2 chunking: channel tiles per launch so that a chunk's input stays in L2 for the apply pass.
    tile_bytes = gpt * Cg * bytes_per_channel
    chunk = n_ct if tile_bytes * n_ct <= T["l2_chunk_bytes"] else max(1, T["l2_chunk_bytes"] // tile_bytes)
    chunk = min(chunk, n_ct)
    chunk = -(-n_ct // -(-n_ct // chunk))  # balance the chunks
    nb = -(-HW // block_hw)
    gpt_p2 = p2(gpt)
    max_s = T["max_splits"]
    s = max(1, min(nb, max_s, -(-T["target_programs"] // (B * chunk))))
    if T["force_splits"]:
        s = max(1, min(nb, T["force_splits"]))
    hws = -(-nb // s) * block_hw
    s = -(-HW // hws)
    # The apply pass combines its groups' partials inline unless there are many (then one
    # finalize launch is cheaper than every apply program re-reading them).
    finalize = gpt_p2 * p2(s) > T["max_inline_partials"]
    # Apply: one BLOCK_HW block per program unless that makes a very large grid.
    tiles = B * chunk * nb
    iters = max(1, min(8, tiles // T["apply_programs"]))
    return GroupNormPlan(
        "twopass", channels_last, bc, gpt, n_cb, n_ct, block_hw, S=s, HWS=hws, finalize=finalize,
        HWP=iters * block_hw, chunk_ct=chunk, apply_warps=T["apply_warps"],
        num_warps=T["stats_warps_large"] if C * bytes_per_channel >= T["large_bytes"] else T["stats_warps"],
    )


def _nhwc_tiles_plan(B: int, C: int, HW: int, bytes_per_channel: int) -> GroupNormPlan:
    """The "nhwc_tiles" plan: BLOCK_C-channel tiles at multiples of BLOCK_C (aligned 128/256-byte row
    segments in fp16 when C is a multiple of 64), H*W split as in the "twopass" plan so that there are
    about ``target_programs`` statistics programs, always the finalize kernel, no L2 chunking (the
    chunks would have to hold whole groups; chunking is off by default anyway)."""
    T = TUNING
    bc = min(p2(T["nhwc_block_c"]), max(p2(C), 16))
    n_ct = -(-C // bc)
    block_hw = max(1, min(p2(HW), T["tile_elems"] // bc))
    nb = -(-HW // block_hw)
    s = max(1, min(nb, T["max_splits"], -(-T["target_programs"] // (B * n_ct))))
    if T["force_splits"]:
        s = max(1, min(nb, T["force_splits"]))
    hws = -(-nb // s) * block_hw
    s = -(-HW // hws)
    tiles = B * n_ct * nb
    iters = max(1, min(8, tiles // T["apply_programs"]))
    return GroupNormPlan(
        "nhwc_tiles", True, bc, 0, 1, n_ct, block_hw, S=s, HWS=hws, finalize=True,
        HWP=iters * block_hw, chunk_ct=n_ct, apply_warps=T["apply_warps"],
        num_warps=T["stats_warps_large"] if C * bytes_per_channel >= T["large_bytes"] else T["stats_warps"],
    )


__all__ = ["GroupNormPlan", "group_norm_plan", "TUNING", "p2"]
