"""GroupNorm with fp32 statistics, fused pre-adds and SiLU, for NCHW and channels_last (NHWC) memory.

    pre = x (+ channel_bias[b, c]) (+ residual)          # rounded to x.dtype, as eager PyTorch does
    y   = (pre - mean[b, g]) * rstd[b, g] * weight[c] + bias[c]
    y   = silu(y)                                         # activation="silu"

This is the ResNet block's pattern in SD: ``norm2(conv1(h) + temb)`` + SiLU (``channel_bias`` is the
time-embedding projection, (B, C)), and ``norm1`` of the next block after the residual add
(``residual``; ``return_sum=True`` also returns ``pre`` so the residual stream is kept). The fusion
list follows the fastest SD engines (TensorRT's GroupNorm plugins, stable-fast, Paddle's
``fused_group_norm``); the channels_last method follows Apex/stable-fast NHWC GroupNorm: keep the
memory order and reduce over channel groups inside each row, never copy to NCHW.

Kernels (all read the input in its own layout through (batch, channel, hw) strides; in the
"onepass" and "twopass" paths a "channel tile" is ``GPT`` whole groups, so no program shares a
group's channels with another in the same row range):

* ``_gn_onepass_kernel`` ("onepass"): small groups (the whole tile of ``GPT`` groups x H*W fits in
  registers): one read, one write, one launch.
* otherwise two passes ("twopass"): ``_gn_stats_kernel`` splits H*W over ``S`` programs per channel
  tile and writes per-(batch, group, split) partial mean and M2 (Welford/Chan combination,
  per-channel shifted sums inside a program, so no catastrophic cancellation); ``_gn_apply_kernel``
  combines the ``S`` partials of its groups (a few hundred bytes) and normalizes a tile. When ``S`` is
  large, a tiny ``_gn_finalize_kernel`` combines the partials once instead. Tensors much larger than
  L2 are processed in channel-tile chunks so the apply pass re-reads its input from L2, not HBM.
* channels_last inputs on the two-pass route ("nhwc_tiles", knob ``nhwc_channel_tiles``): whole-group
  tiles waste lanes there (Cg = 10 fp16: 4 groups = 40 channels = 80-byte row segments in 64-lane
  blocks), so the channel tiles ignore the groups: ``BLOCK_C`` (64 or 128) channels from a multiple of
  ``BLOCK_C``, i.e. aligned 128/256-byte row segments in fp16 when C is a multiple of 64.
  ``_gn_nhwc_stats_kernel`` writes per-(batch, split, channel) partial mean and M2 (shifted by the
  channel's first value in the split); ``_gn_nhwc_finalize_kernel``, one program per (batch, group),
  combines the group's ``S x Cg`` partials (Chan) into per-channel vectors ``mean_c`` and
  ``scale_c = rstd_g * weight[c]``; ``_gn_nhwc_apply_kernel`` normalizes a tile with them, with no
  group logic. Same fusions and the same ``S`` choice as "twopass"; no L2 chunking (a chunk would
  have to hold whole groups; chunking is off by default). Small channels_last shapes keep "onepass"
  (knob ``nhwc_onepass``).
* on an sm_90 GPU, channels_last or contiguous NCHW: the CUDA C++ cluster kernels
  (``kernels.norm.group_norm_cluster``: one read, one launch, statistics through thread-block clusters) run instead
  where they can and where, timed once per call signature, they are faster than the kernels above (run 14: most of
  SD's channels_last UNet shapes up to 5 MB of input).

Method: Wu & He 2018 (GroupNorm); Chan, Golub & LeVeque 1979 (pairwise variance combination).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.checks import check_like
from kernels.checks import is_channels_last as _is_channels_last
from kernels.dispatch import use_triton
from kernels.norm import group_norm_cluster

ACTIVATIONS = (None, "silu")
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Tuning knobs (module constants, read at call time; tests lower them to reach every path on
# small shapes). Element counts are padded tile sizes.
_TUNING = {
    "onepass_max_elems": 16384,  # whole channel tile x H*W in registers up to this many elements
    "tile_elems": 4096,  # elements per loop iteration in the two-pass kernels
    "target_programs": 528,  # stats programs to aim for (4 per SM on a 132-SM H200)
    "max_inline_partials": 256,  # above this many partials per apply program, a finalize kernel combines them
    "max_splits": 512,
    "force_splits": None,  # tests: exactly this many H*W splits (capped by the blocks available)
    "apply_programs": 4096,  # above this many apply tiles, one program loops over several (<= 8)
    # Per-chunk input bytes so the apply pass re-reads from L2. Off: on the H200 (run 4,
    # benchmarks/tune_group_norm.py) 8, 16 and 32 MB chunks were slower than none on every shape
    # (2x640x128x128 NHWC: 121 / 99 / 72 µs against 66 µs); L2 keeps much of the input anyway.
    "l2_chunk_bytes": 1 << 40,
    "groups_per_tile": None,  # force GPT (whole groups per channel tile; must divide G), None: chosen
    "stats_warps": 4,
    "stats_warps_large": 2,  # from 16 MB of input: 2 warps per statistics program (run 4: -5..-15 %)
    "large_bytes": 16 << 20,
    "apply_warps": 4,
    # channels_last two-pass route: per-channel statistics in BLOCK_C-channel tiles that ignore the
    # groups ("nhwc_tiles"); False: the group-aligned "twopass" kernels, exactly as before.
    "nhwc_channel_tiles": True,
    "nhwc_block_c": 64,  # channels per "nhwc_tiles" tile (power of two; capped at C rounded up to one)
    "nhwc_onepass": True,  # channels_last shapes small enough for "onepass" use it (False: two-pass route)
    "nhwc_finalize_elems": 1024,  # partials per loop iteration of the "nhwc_tiles" finalize kernel
}


# --------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------
def _like_layout(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t`` in the memory format of ``x`` (NCHW-contiguous or channels_last)."""
    if _is_channels_last(x):
        return t.contiguous(memory_format=torch.channels_last)
    return t.contiguous()


def _channel_bias_4d(channel_bias: torch.Tensor, B: int, C: int) -> torch.Tensor:
    """A (C,), (B, C), (1, C), (B, C, 1, 1) or (1, C, 1, 1) channel bias as (B or 1, C, 1, 1)."""
    cb = channel_bias
    if cb.dim() == 4:
        cb = cb.flatten(1)
    if cb.dim() == 1:
        cb = cb[None]
    return cb.reshape(cb.shape[0], C, 1, 1)


def group_norm_ref(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    channel_bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    return_sum: bool = False,
    upcast: bool = True,
):
    """Plain-PyTorch GroupNorm with the same fusions as :func:`group_norm`.

    x: (B, C, H, W), NCHW or channels_last; weight, bias: (C,) or None; channel_bias: (C,) or (B, C);
    residual: like x. With ``upcast`` every step runs in fp32 and the outputs are cast back to
    ``x.dtype``; without it the adds and the norm run in ``x.dtype`` (the "torch low precision"
    baseline of the tolerance rule). Outputs are in x's memory format.
    Returns ``y``, or ``(y, pre)`` with ``return_sum``.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    dt = x.dtype
    cdt = torch.promote_types(dt, torch.float32) if upcast else dt  # fp64 stays fp64
    B, C = x.shape[:2]
    pre = x.to(cdt)
    if channel_bias is not None:
        pre = pre + _channel_bias_4d(channel_bias, B, C).to(cdt)
    if residual is not None:
        pre = pre + residual.to(cdt)
    w = None if weight is None else weight.to(cdt)
    b = None if bias is None else bias.to(cdt)
    # NCHW: PyTorch's CPU channels_last GroupNorm uses sum/sum-of-squares statistics, which cancel
    # when |mean| >> std; the reference should be the accurate one.
    y = F.group_norm(pre.contiguous(), num_groups, w, b, eps)
    if activation == "silu":
        y = F.silu(y)
    y = _like_layout(y.to(dt), x)
    if return_sum:
        return y, _like_layout(pre.to(dt), x)
    return y


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------
# Tile orientation: HW_AXIS = 1 for NCHW tiles (BLOCK_C, BLOCK_HW), each row a contiguous H*W run;
# HW_AXIS = 0 for NHWC tiles (BLOCK_HW, BLOCK_C), channels contiguous. Per-channel vectors are
# broadcast with tl.expand_dims(v, HW_AXIS) and reduced with tl.sum(t, axis=HW_AXIS). In the NCHW kernels
# loop trip counts are constexpr. In the "nhwc_tiles" kernels (the engine's path) the loops over H*W blocks
# (ITERS) and split blocks (N_S) have runtime trip counts, excluded from Triton's integer specialization
# along with the split count S (``do_not_specialize``), so that another image size mostly runs the kernels
# compiled for the first (SD1.5 at 640x512 after 512x512 compiled 20 new GroupNorm variants before, none after,
# H200 run 11; a size whose plan changes path or unrolling, 1 or 2 blocks against 3+, still compiles). HW and HWS keep
# their divisibility specialization: without it ptxas serialized the block's eight 16-byte loads (sm_90 SASS),
# and GroupNorm+SiLU took up to 1.5x as long (run 11, call B). They are ``while`` loops because the Triton
# interpreter cannot ``range()`` a runtime bound under numpy 2.
# The two helpers below are inlined by Triton. ``_load_pre`` adds the last term of the residual's address
# (``hw2 * srhw``) after x's load; the callers' base and channel terms are computed before the call. Compiled for
# sm_90, 174 of 216 variants keep their SASS instruction count; the one-pass kernel with a residual has 0-2 %
# fewer instructions. Timed on the H200 against the kernels before the helpers (run 9, call 3): the same.


@triton.jit
def _load_pre(x_ptrs, r_b, r_c, hw2, srhw, mask, cb, HAS_CB: tl.constexpr, HAS_RES: tl.constexpr):
    """fp32 ``pre = x (+ cb) (+ residual)``, rounded to x's dtype when anything was added (eager's separate
    adds round their sum). x is read at ``x_ptrs``, the residual at ``r_b + r_c + hw2 * srhw``; ``cb`` is
    the channel bias already in fp32, broadcastable to the tile."""
    xv = tl.load(x_ptrs, mask=mask, other=0.0)
    pre = xv.to(tl.float32)
    if HAS_CB:
        pre += cb
    if HAS_RES:
        pre += tl.load(r_b + r_c + hw2 * srhw, mask=mask, other=0.0).to(tl.float32)
    if HAS_CB or HAS_RES:
        pre = pre.to(xv.dtype).to(tl.float32)
    return pre


@triton.jit
def _bias_act(y, bias, HAS_B: tl.constexpr, SILU: tl.constexpr):
    """``y (+ bias)``, then SiLU when asked."""
    if HAS_B:
        y += bias
    if SILU:
        y = y * tl.sigmoid(y)
    return y


@triton.jit
def _gn_onepass_kernel(
    x_ptr,  # (B, C, H, W) input, strides (sxb, sxc, sxhw)
    r_ptr,  # (B, C, H, W) residual, strides (srb, src, srhw); unused without HAS_RES
    cb_ptr,  # (B or 1, C) channel bias, strides (scbb, scbc); unused without HAS_CB
    w_ptr,  # (C,) weight; unused without HAS_W
    b_ptr,  # (C,) bias; unused without HAS_B
    y_ptr,  # (B, C, H, W) output, x's strides
    pre_ptr,  # (B, C, H, W) pre-norm sum output, x's strides; unused without WRITE_PRE
    HW,
    eps,
    sxb,
    sxc,
    sxhw,
    srb,
    src,
    srhw,
    scbb,
    scbc,
    Cg: tl.constexpr,  # channels per group
    GPT: tl.constexpr,  # groups per channel tile (divides the group count: every tile is full)
    BLOCK_C: tl.constexpr,  # >= GPT * Cg
    BLOCK_HW: tl.constexpr,  # >= HW
    GPT_P2: tl.constexpr,
    HW_AXIS: tl.constexpr,  # 1: NCHW tile, 0: NHWC tile
    HAS_CB: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    WRITE_PRE: tl.constexpr,
    SILU: tl.constexpr,
):
    ct = tl.program_id(0)
    b = tl.program_id(1)
    b64 = b.to(tl.int64)  # batch offsets in int64 on scalars; in-batch offsets stay int32
    cl = tl.arange(0, BLOCK_C)
    cmask = cl < GPT * Cg  # constexpr bound: keeps NHWC channel loads vectorized
    c = ct * (GPT * Cg) + cl
    c2 = tl.expand_dims(c, HW_AXIS)
    cmask2 = tl.expand_dims(cmask, HW_AXIS)
    hw2 = tl.expand_dims(tl.arange(0, BLOCK_HW), 1 - HW_AXIS)
    mask = cmask2 & (hw2 < HW)
    x_offs = c2 * sxc + hw2 * sxhw
    cb2 = tl.load(cb_ptr + b * scbb + c2 * scbc, mask=cmask2, other=0.0).to(tl.float32) if HAS_CB else 0.0
    pre = _load_pre(x_ptr + b64 * sxb + x_offs, r_ptr + b64 * srb, c2 * src, hw2, srhw, mask, cb2, HAS_CB, HAS_RES)
    if HAS_CB or HAS_RES:
        pre = tl.where(mask, pre, 0.0)
    if WRITE_PRE:
        tl.store(pre_ptr + b64 * sxb + x_offs, pre.to(pre_ptr.dtype.element_ty), mask=mask)

    # (BLOCK_C, GPT_P2) membership of each channel in the tile's local groups.
    onehot = ((cl // Cg)[:, None] == tl.arange(0, GPT_P2)[None, :]) & cmask[:, None]
    n_g = Cg * HW * 1.0
    s1 = tl.sum(pre, axis=HW_AXIS)
    mean_g = tl.sum(tl.where(onehot, s1[:, None], 0.0), axis=0) / n_g
    mean_c = tl.sum(tl.where(onehot, mean_g[None, :], 0.0), axis=1)
    d = tl.where(mask, pre - tl.expand_dims(mean_c, HW_AXIS), 0.0)
    s2 = tl.sum(d * d, axis=HW_AXIS)
    var_g = tl.sum(tl.where(onehot, s2[:, None], 0.0), axis=0) / n_g
    rstd_g = 1.0 / tl.sqrt(var_g + eps)
    a_c = tl.sum(tl.where(onehot, rstd_g[None, :], 0.0), axis=1)
    if HAS_W:
        a_c = a_c * tl.load(w_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    bias2 = tl.load(b_ptr + c2, mask=cmask2, other=0.0).to(tl.float32) if HAS_B else 0.0
    y = _bias_act(d * tl.expand_dims(a_c, HW_AXIS), bias2, HAS_B, SILU)
    tl.store(y_ptr + b64 * sxb + x_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gn_stats_kernel(
    x_ptr,  # (B, C, H, W) input, strides (sxb, sxc, sxhw)
    r_ptr,  # (B, C, H, W) residual; unused without HAS_RES
    cb_ptr,  # (B or 1, C) channel bias; unused without HAS_CB
    pre_ptr,  # (B, C, H, W) pre-norm sum output, x's strides; unused without WRITE_PRE
    mean_ptr,  # (B, G, S) fp32 partial means
    m2_ptr,  # (B, G, S) fp32 partial sums of squared deviations (M2)
    HW,
    G,
    S,  # H*W splits
    HWS,  # H*W positions per split (ITERS * BLOCK_HW)
    ct_base,  # first channel tile of this launch (L2 chunking)
    sxb,
    sxc,
    sxhw,
    srb,
    src,
    srhw,
    scbb,
    scbc,
    Cg: tl.constexpr,
    GPT: tl.constexpr,  # groups per channel tile (1 when a group spans several BLOCK_C sub-blocks)
    N_CB: tl.constexpr,  # channel sub-blocks per tile: cdiv(GPT * Cg, BLOCK_C)
    ITERS: tl.constexpr,  # BLOCK_HW blocks per split
    BLOCK_C: tl.constexpr,
    BLOCK_HW: tl.constexpr,
    GPT_P2: tl.constexpr,
    HW_AXIS: tl.constexpr,
    HAS_CB: tl.constexpr,
    HAS_RES: tl.constexpr,
    WRITE_PRE: tl.constexpr,
):
    ct = ct_base + tl.program_id(0)
    s = tl.program_id(1)
    b = tl.program_id(2)
    x_b = x_ptr + b.to(tl.int64) * sxb
    r_b = r_ptr + b.to(tl.int64) * srb
    pre_b = pre_ptr + b.to(tl.int64) * sxb
    g0 = ct * GPT
    hw_lo = s * HWS
    hw_hi = tl.minimum(hw_lo + HWS, HW)
    n_hw = (hw_hi - hw_lo).to(tl.float32)
    j = tl.arange(0, GPT_P2)
    hw_r = tl.arange(0, BLOCK_HW)

    run_n = tl.zeros((GPT_P2,), dtype=tl.float32)
    run_mean = tl.zeros((GPT_P2,), dtype=tl.float32)
    run_m2 = tl.zeros((GPT_P2,), dtype=tl.float32)
    for cbk in range(N_CB):
        cl = cbk * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cl < GPT * Cg
        c = ct * (GPT * Cg) + cl
        c2 = tl.expand_dims(c, HW_AXIS)
        cmask2 = tl.expand_dims(cmask, HW_AXIS)
        x_c = c2 * sxc
        r_c = c2 * src
        cb2 = tl.load(cb_ptr + b * scbb + c2 * scbc, mask=cmask2, other=0.0).to(tl.float32) if HAS_CB else 0.0
        # Per-channel shift: the channel's first value in this split (sums of x - shift do not cancel).
        shift2 = _load_pre(x_b + x_c + hw_lo * sxhw, r_b, r_c, hw_lo, srhw, cmask2, cb2, HAS_CB, HAS_RES)
        if HW_AXIS == 1:
            acc1 = tl.zeros((BLOCK_C, BLOCK_HW), dtype=tl.float32)
        else:
            acc1 = tl.zeros((BLOCK_HW, BLOCK_C), dtype=tl.float32)
        acc2 = acc1
        for it in range(ITERS):
            hw2 = tl.expand_dims(hw_lo + it * BLOCK_HW + hw_r, 1 - HW_AXIS)
            mask = cmask2 & (hw2 < hw_hi)
            pre = _load_pre(x_b + x_c + hw2 * sxhw, r_b, r_c, hw2, srhw, mask, cb2, HAS_CB, HAS_RES)
            if WRITE_PRE:
                tl.store(pre_b + x_c + hw2 * sxhw, pre.to(pre_ptr.dtype.element_ty), mask=mask)
            d = tl.where(mask, pre - shift2, 0.0)
            acc1 += d
            acc2 += d * d
        s1 = tl.sum(acc1, axis=HW_AXIS)
        s2 = tl.sum(acc2, axis=HW_AXIS)
        mean_c = tl.sum(shift2, axis=HW_AXIS) + s1 / n_hw
        m2_c = tl.maximum(s2 - s1 * s1 / n_hw, 0.0)
        # Channels -> local groups (Chan's combination, equal per-channel counts n_hw).
        onehot = ((cl // Cg)[:, None] == j[None, :]) & cmask[:, None]
        nch = tl.sum(onehot.to(tl.float32), axis=0)
        mean_g = tl.sum(tl.where(onehot, mean_c[:, None], 0.0), axis=0) / tl.maximum(nch, 1.0)
        dev = mean_c[:, None] - mean_g[None, :]
        m2_g = tl.sum(tl.where(onehot, m2_c[:, None] + n_hw * dev * dev, 0.0), axis=0)
        n_g = nch * n_hw
        # Fold this channel sub-block into the running group statistics.
        tot = run_n + n_g
        delta = mean_g - run_mean
        frac = n_g / tl.maximum(tot, 1.0)
        run_m2 = run_m2 + m2_g + delta * delta * run_n * frac
        run_mean = run_mean + delta * frac
        run_n = tot
    offs = (b * G + g0 + j) * S + s
    tl.store(mean_ptr + offs, run_mean, mask=j < GPT)
    tl.store(m2_ptr + offs, run_m2, mask=j < GPT)


@triton.jit
def _gn_finalize_kernel(
    mean_ptr,  # (B, G, S) fp32 partial means
    m2_ptr,  # (B, G, S) fp32 partial M2
    out_mean_ptr,  # (B, G) fp32 group means
    out_m2_ptr,  # (B, G) fp32 group M2
    G,
    Cg,
    HW,
    S,
    HWS,
    g_lo,  # first group of this launch
    n_groups,  # groups in this launch
    BLOCK_R: tl.constexpr,
    S_P2: tl.constexpr,
):
    b = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_groups
    row = b * G + g_lo + r
    sidx = tl.arange(0, S_P2)
    smask = sidx < S
    m = rmask[:, None] & smask[None, :]
    offs = row[:, None] * S + sidx[None, :]
    pmean = tl.load(mean_ptr + offs, mask=m, other=0.0)
    pm2 = tl.load(m2_ptr + offs, mask=m, other=0.0)
    # Split s covers n_s H*W positions of every channel; the group's count factor Cg cancels in
    # the mean and multiplies the between-split M2 term.
    n_s = tl.where(smask, tl.minimum(HWS, HW - sidx * HWS), 0).to(tl.float32)
    mean = tl.sum(pmean * n_s[None, :], axis=1) / (HW * 1.0)
    dev = pmean - mean[:, None]
    m2 = tl.sum(pm2, axis=1) + Cg * tl.sum(n_s[None, :] * dev * dev, axis=1)
    tl.store(out_mean_ptr + row, mean, mask=rmask)
    tl.store(out_m2_ptr + row, m2, mask=rmask)


@triton.jit
def _gn_apply_kernel(
    x_ptr,  # (B, C, H, W) input (or the stored pre-norm sum), strides (sxb, sxc, sxhw)
    r_ptr,  # (B, C, H, W) residual; unused without HAS_RES
    cb_ptr,  # (B or 1, C) channel bias; unused without HAS_CB
    w_ptr,  # (C,) weight; unused without HAS_W
    b_ptr,  # (C,) bias; unused without HAS_B
    y_ptr,  # (B, C, H, W) output, strides (syb, syc, syhw)
    mean_ptr,  # (B, G, S) fp32 partial means (S = 1 after the finalize kernel)
    m2_ptr,  # (B, G, S) fp32 partial M2
    HW,
    G,
    S,
    HWS,
    ct_base,
    eps,
    sxb,
    sxc,
    sxhw,
    srb,
    src,
    srhw,
    scbb,
    scbc,
    syb,
    syc,
    syhw,
    Cg: tl.constexpr,
    GPT: tl.constexpr,
    N_CB: tl.constexpr,
    ITERS: tl.constexpr,  # BLOCK_HW blocks per program
    BLOCK_C: tl.constexpr,
    BLOCK_HW: tl.constexpr,
    GPT_P2: tl.constexpr,
    S_P2: tl.constexpr,
    HW_AXIS: tl.constexpr,
    HAS_CB: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    SILU: tl.constexpr,
):
    ct = ct_base + tl.program_id(0)
    t = tl.program_id(1)
    b = tl.program_id(2)
    x_b = x_ptr + b.to(tl.int64) * sxb
    r_b = r_ptr + b.to(tl.int64) * srb
    y_b = y_ptr + b.to(tl.int64) * syb
    g0 = ct * GPT

    # Group statistics of this tile's groups from their S partials (as in _gn_finalize_kernel).
    j = tl.arange(0, GPT_P2)
    sidx = tl.arange(0, S_P2)
    smask = sidx < S
    pmask = (j < GPT)[:, None] & smask[None, :]
    poffs = (b * G + g0 + j)[:, None] * S + sidx[None, :]
    pmean = tl.load(mean_ptr + poffs, mask=pmask, other=0.0)
    pm2 = tl.load(m2_ptr + poffs, mask=pmask, other=0.0)
    n_s = tl.where(smask, tl.minimum(HWS, HW - sidx * HWS), 0).to(tl.float32)
    mean_g = tl.sum(pmean * n_s[None, :], axis=1) / (HW * 1.0)
    dev = pmean - mean_g[:, None]
    m2_g = tl.sum(pm2, axis=1) + Cg * tl.sum(n_s[None, :] * dev * dev, axis=1)
    rstd_g = 1.0 / tl.sqrt(tl.maximum(m2_g / (Cg * HW * 1.0), 0.0) + eps)

    hw_r = t * (ITERS * BLOCK_HW) + tl.arange(0, BLOCK_HW)
    for cbk in range(N_CB):
        cl = cbk * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cl < GPT * Cg
        c = ct * (GPT * Cg) + cl
        c2 = tl.expand_dims(c, HW_AXIS)
        cmask2 = tl.expand_dims(cmask, HW_AXIS)
        onehot = ((cl // Cg)[:, None] == j[None, :]) & cmask[:, None]
        mean_c = tl.sum(tl.where(onehot, mean_g[None, :], 0.0), axis=1)
        a_c = tl.sum(tl.where(onehot, rstd_g[None, :], 0.0), axis=1)
        if HAS_W:
            a_c = a_c * tl.load(w_ptr + c, mask=cmask, other=0.0).to(tl.float32)
        # y = (pre - mean) * a + bias; not pre * a + (bias - mean * a), which cancels when |mean| >> std.
        mean2 = tl.expand_dims(mean_c, HW_AXIS)
        a2 = tl.expand_dims(a_c, HW_AXIS)
        bias2 = tl.load(b_ptr + c2, mask=cmask2, other=0.0).to(tl.float32) if HAS_B else 0.0
        cb2 = tl.load(cb_ptr + b * scbb + c2 * scbc, mask=cmask2, other=0.0).to(tl.float32) if HAS_CB else 0.0
        x_c = c2 * sxc
        r_c = c2 * src
        y_c = c2 * syc
        for it in range(ITERS):
            hw2 = tl.expand_dims(hw_r + it * BLOCK_HW, 1 - HW_AXIS)
            mask = cmask2 & (hw2 < HW)
            pre = _load_pre(x_b + x_c + hw2 * sxhw, r_b, r_c, hw2, srhw, mask, cb2, HAS_CB, HAS_RES)
            y = _bias_act((pre - mean2) * a2, bias2, HAS_B, SILU)
            tl.store(y_b + y_c + hw2 * syhw, y.to(y_ptr.dtype.element_ty), mask=mask)


# NHWC channel-tile path ("nhwc_tiles"): channel tiles of BLOCK_C channels starting at multiples of
# BLOCK_C, whatever the groups (each tile row is one aligned BLOCK_C-channel segment). Statistics are
# per channel and per H*W split; the finalize kernel turns them into per-channel (mean, scale) vectors,
# so the apply kernel has no group logic. Tiles are (BLOCK_HW, BLOCK_C), channels along axis 1.


@triton.jit
def _nhwc_stats_block(acc1, acc2, hw, x_p, r_b, r_c, pre_p, hw_hi, cmask2, cb2, shift2, sxhw, srhw,
                      HAS_CB: tl.constexpr, HAS_RES: tl.constexpr, WRITE_PRE: tl.constexpr):
    """One (BLOCK_HW, BLOCK_C) block of the statistics pass at H*W positions ``hw``: the shifted sums added."""
    hw2 = hw[:, None]
    mask = (hw2 < hw_hi) & cmask2
    pre = _load_pre(x_p + hw2 * sxhw, r_b, r_c, hw2, srhw, mask, cb2, HAS_CB, HAS_RES)
    if WRITE_PRE:
        tl.store(pre_p + hw2 * sxhw, pre.to(pre_p.dtype.element_ty), mask=mask)
    d = tl.where(mask, pre - shift2, 0.0)
    return acc1 + d, acc2 + d * d


@triton.jit(do_not_specialize=['S', 'ITERS'])
def _gn_nhwc_stats_kernel(
    x_ptr,  # (B, C, H, W) channels_last input, strides (sxb, sxc, sxhw)
    r_ptr,  # (B, C, H, W) residual (either layout), strides (srb, src, srhw); unused without HAS_RES
    cb_ptr,  # (B or 1, C) channel bias, strides (scbb, scbc); unused without HAS_CB
    pre_ptr,  # (B, C, H, W) pre-norm sum output, x's strides; unused without WRITE_PRE
    mean_ptr,  # (B, S, C) fp32 per-channel partial means (contiguous)
    m2_ptr,  # (B, S, C) fp32 per-channel partial M2 (contiguous)
    C,
    HW,
    S,  # H*W splits
    HWS,  # H*W positions per split (ITERS * BLOCK_HW); the last split may be shorter
    sxb,
    sxc,
    sxhw,
    srb,
    src,
    srhw,
    scbb,
    scbc,
    ITERS,  # BLOCK_HW blocks per split (runtime)
    UNROLL: tl.constexpr,  # ITERS when it is 1 or 2 (an unrolled loop), else 0 (a runtime loop)
    BLOCK_C: tl.constexpr,  # channels per tile (power of two)
    BLOCK_HW: tl.constexpr,
    HAS_CB: tl.constexpr,
    HAS_RES: tl.constexpr,
    WRITE_PRE: tl.constexpr,
):
    ct = tl.program_id(0)
    s = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)  # batch offsets in int64 on scalars; in-batch offsets stay int32
    x_b = x_ptr + b64 * sxb
    r_b = r_ptr + b64 * srb
    pre_b = pre_ptr + b64 * sxb
    c = ct * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    c2 = c[None, :]
    cmask2 = cmask[None, :]
    x_c = c2 * sxc
    r_c = c2 * src
    hw_lo = s * HWS
    hw_hi = tl.minimum(hw_lo + HWS, HW)
    n_hw = (hw_hi - hw_lo).to(tl.float32)
    cb = tl.load(cb_ptr + b * scbb + c * scbc, mask=cmask, other=0.0).to(tl.float32) if HAS_CB else 0.0
    # Per-channel shift: the channel's first value in this split (sums of pre - shift do not cancel).
    shift = _load_pre(x_b + c * sxc + hw_lo * sxhw, r_b, c * src, hw_lo, srhw, cmask, cb, HAS_CB, HAS_RES)
    shift2 = shift[None, :]
    cb2 = cb[None, :] if HAS_CB else 0.0
    hw_r = tl.arange(0, BLOCK_HW)
    acc1 = tl.zeros((BLOCK_HW, BLOCK_C), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_HW, BLOCK_C), dtype=tl.float32)
    args = (x_b + x_c, r_b, r_c, pre_b + x_c, hw_hi, cmask2, cb2, shift2, sxhw, srhw)
    if UNROLL > 0:
        for it in tl.static_range(UNROLL):
            acc1, acc2 = _nhwc_stats_block(acc1, acc2, hw_lo + it * BLOCK_HW + hw_r, *args, HAS_CB, HAS_RES, WRITE_PRE)
    else:
        it = 0
        while it < ITERS:
            acc1, acc2 = _nhwc_stats_block(acc1, acc2, hw_lo + it * BLOCK_HW + hw_r, *args, HAS_CB, HAS_RES, WRITE_PRE)
            it += 1
    s1 = tl.sum(acc1, axis=0)
    s2 = tl.sum(acc2, axis=0)
    p = (b64 * S + s) * C + c
    tl.store(mean_ptr + p, shift + s1 / n_hw, mask=cmask)
    tl.store(m2_ptr + p, tl.maximum(s2 - s1 * s1 / n_hw, 0.0), mask=cmask)


@triton.jit(do_not_specialize=['S', 'N_S'])
def _gn_nhwc_finalize_kernel(
    mean_ptr,  # (B, S, C) fp32 per-channel partial means
    m2_ptr,  # (B, S, C) fp32 per-channel partial M2
    w_ptr,  # (C,) weight; unused without HAS_W
    mean_c_ptr,  # (B, C) fp32 output: the mean of channel c's group
    scale_c_ptr,  # (B, C) fp32 output: rstd of channel c's group * weight[c]
    C,
    Cg,  # channels per group
    HW,
    S,
    HWS,
    eps,
    N_S,  # BLOCK_S blocks of splits: cdiv(S, BLOCK_S) (runtime)
    N_CG: tl.constexpr,  # BLOCK_CG blocks of the group's channels: cdiv(Cg, BLOCK_CG)
    BLOCK_S: tl.constexpr,
    BLOCK_CG: tl.constexpr,
    HAS_W: tl.constexpr,
):
    g = tl.program_id(0)
    b = tl.program_id(1)
    b64 = b.to(tl.int64)
    p_b = b64 * S * C + g * Cg  # partial (b, s=0, first channel of the group)
    si = tl.arange(0, BLOCK_S)
    ci = tl.arange(0, BLOCK_CG)
    n_g = Cg * HW * 1.0
    # Chan's combination of S x Cg partials; split s has n_s positions of every channel. Each loop iteration's
    # (BLOCK_S, BLOCK_CG) block of partials is loaded once and reduced exactly in registers: its mean (summed as
    # deviations from one partial mean, m_ref, so a large common offset does not round away), then its M2 about
    # that mean; the blocks are merged pairwise (SD's split counts mostly take one block).
    m_ref = tl.load(mean_ptr + p_b)
    run_n = 0.0
    run_mean = 0.0
    run_m2 = 0.0
    i = 0
    while i < N_S:
        sidx = i * BLOCK_S + si
        n_s = tl.where(sidx < S, tl.minimum(HWS, HW - sidx * HWS), 0).to(tl.float32)
        for j in range(N_CG):  # N_CG == 1 unless a group is wider than 256 channels
            cidx = j * BLOCK_CG + ci
            m = (sidx < S)[:, None] & (cidx < Cg)[None, :]
            offs = p_b + sidx[:, None] * C + cidx[None, :]
            w = tl.where(m, n_s[:, None], 0.0)
            pm = tl.load(mean_ptr + offs, mask=m, other=0.0)
            pm2 = tl.load(m2_ptr + offs, mask=m, other=0.0)
            n_t = tl.sum(tl.sum(w, axis=1), axis=0)
            mean_t = m_ref + tl.sum(tl.sum(w * (pm - m_ref), axis=1), axis=0) / tl.maximum(n_t, 1.0)
            dev = pm - mean_t
            m2_t = tl.sum(tl.sum(tl.where(m, pm2 + w * dev * dev, 0.0), axis=1), axis=0)
            tot = run_n + n_t
            frac = n_t / tl.maximum(tot, 1.0)
            delta = mean_t - run_mean
            run_m2 = run_m2 + m2_t + delta * delta * run_n * frac
            run_mean = run_mean + delta * frac
            run_n = tot
        i += 1
    mean_g = run_mean
    m2_g = run_m2
    rstd_g = 1.0 / tl.sqrt(tl.maximum(m2_g / n_g, 0.0) + eps)
    for j in range(N_CG):
        cidx = j * BLOCK_CG + ci
        cm = cidx < Cg
        c = g * Cg + cidx
        scale = tl.zeros((BLOCK_CG,), dtype=tl.float32) + rstd_g
        if HAS_W:
            scale = scale * tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
        tl.store(mean_c_ptr + b64 * C + c, tl.zeros((BLOCK_CG,), dtype=tl.float32) + mean_g, mask=cm)
        tl.store(scale_c_ptr + b64 * C + c, scale, mask=cm)


@triton.jit
def _nhwc_apply_block(hw, x_p, r_b, r_c, y_p, HW, cmask2, cb2, mean2, a2, bias2, sxhw, srhw, syhw,
                      HAS_CB: tl.constexpr, HAS_RES: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr):
    """Normalize one (BLOCK_HW, BLOCK_C) block at H*W positions ``hw``."""
    hw2 = hw[:, None]
    mask = (hw2 < HW) & cmask2
    pre = _load_pre(x_p + hw2 * sxhw, r_b, r_c, hw2, srhw, mask, cb2, HAS_CB, HAS_RES)
    y = _bias_act((pre - mean2) * a2, bias2, HAS_B, SILU)
    tl.store(y_p + hw2 * syhw, y.to(y_p.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=['ITERS'])
def _gn_nhwc_apply_kernel(
    x_ptr,  # (B, C, H, W) channels_last input (or the stored pre-norm sum), strides (sxb, sxc, sxhw)
    r_ptr,  # (B, C, H, W) residual (either layout), strides (srb, src, srhw); unused without HAS_RES
    cb_ptr,  # (B or 1, C) channel bias, strides (scbb, scbc); unused without HAS_CB
    b_ptr,  # (C,) bias; unused without HAS_B
    y_ptr,  # (B, C, H, W) output, strides (syb, syc, syhw)
    mean_c_ptr,  # (B, C) fp32 per-channel group means (from _gn_nhwc_finalize_kernel)
    scale_c_ptr,  # (B, C) fp32 per-channel rstd * weight
    C,
    HW,
    sxb,
    sxc,
    sxhw,
    srb,
    src,
    srhw,
    scbb,
    scbc,
    syb,
    syc,
    syhw,
    ITERS,  # BLOCK_HW blocks per program (runtime)
    UNROLL: tl.constexpr,  # ITERS when it is 1 or 2 (an unrolled loop), else 0 (a runtime loop)
    BLOCK_C: tl.constexpr,
    BLOCK_HW: tl.constexpr,
    HAS_CB: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_B: tl.constexpr,
    SILU: tl.constexpr,
):
    ct = tl.program_id(0)
    t = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    x_b = x_ptr + b64 * sxb
    r_b = r_ptr + b64 * srb
    y_b = y_ptr + b64 * syb
    c = ct * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    c2 = c[None, :]
    cmask2 = cmask[None, :]
    # y = (pre - mean) * a + bias; not pre * a + (bias - mean * a), which cancels when |mean| >> std.
    mean2 = tl.load(mean_c_ptr + b64 * C + c, mask=cmask, other=0.0)[None, :]
    a2 = tl.load(scale_c_ptr + b64 * C + c, mask=cmask, other=0.0)[None, :]
    bias2 = tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :] if HAS_B else 0.0
    cb2 = tl.load(cb_ptr + b * scbb + c * scbc, mask=cmask, other=0.0).to(tl.float32)[None, :] if HAS_CB else 0.0
    x_c = c2 * sxc
    r_c = c2 * src
    y_c = c2 * syc
    hw_r = t * (ITERS * BLOCK_HW) + tl.arange(0, BLOCK_HW)
    args = (x_b + x_c, r_b, r_c, y_b + y_c, HW, cmask2, cb2, mean2, a2, bias2, sxhw, srhw, syhw)
    if UNROLL > 0:
        for it in tl.static_range(UNROLL):
            _nhwc_apply_block(hw_r + it * BLOCK_HW, *args, HAS_CB, HAS_RES, HAS_B, SILU)
    else:
        it = 0
        while it < ITERS:
            _nhwc_apply_block(hw_r + it * BLOCK_HW, *args, HAS_CB, HAS_RES, HAS_B, SILU)
            it += 1


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------
def _p2(n: int) -> int:
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
        bc = max(_p2(ch), 1)
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
    T = _TUNING
    G = num_groups
    Cg = C // G
    bytes_per_channel = B * HW * elem_size * (2 if has_res else 1)
    bc, gpt, n_cb = _channel_tile(Cg, G, channels_last, elem_size, bytes_per_channel, T["l2_chunk_bytes"])
    forced = T["groups_per_tile"]
    if forced and n_cb == 1 and G % forced == 0 and forced * Cg <= 256:
        gpt, bc = forced, _p2(forced * Cg)
    n_ct = G // gpt
    hw_p2 = _p2(HW)
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
    gpt_p2 = _p2(gpt)
    max_s = T["max_splits"]
    s = max(1, min(nb, max_s, -(-T["target_programs"] // (B * chunk))))
    if T["force_splits"]:
        s = max(1, min(nb, T["force_splits"]))
    hws = -(-nb // s) * block_hw
    s = -(-HW // hws)
    # The apply pass combines its groups' partials inline unless there are many (then one
    # finalize launch is cheaper than every apply program re-reading them).
    finalize = gpt_p2 * _p2(s) > T["max_inline_partials"]
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
    T = _TUNING
    bc = min(_p2(T["nhwc_block_c"]), max(_p2(C), 16))
    n_ct = -(-C // bc)
    block_hw = max(1, min(_p2(HW), T["tile_elems"] // bc))
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


def _unroll(iters: int) -> int:
    """The "nhwc_tiles" kernels' UNROLL: 1 or 2 H*W blocks per program run as an unrolled loop, more as a runtime
    loop. Measured on the H200 (run 11, GPU time, L2 flushed), the statistics kernel at (2, 320, 64, 64), 2
    blocks: 5.9 µs with a constexpr trip count, 8.3 µs as a runtime loop, 6.3 µs unrolled; from 3 blocks
    the runtime loop is within 2 % of a constexpr one (2, 640, 64, 64; the VAE's shapes)."""
    return iters if iters <= 2 else 0


def _finalize_block_s(block_cg: int) -> int:
    """Splits per loop iteration of the "nhwc_tiles" finalize kernel: a function of the group width only, so
    that another image size (another split count S) runs the kernel already compiled, not a new one. About
    ``nhwc_finalize_elems`` partials per iteration: SD's S (8 to 256) mostly takes one iteration."""
    return max(1, min(256, _TUNING["nhwc_finalize_elems"] // block_cg))


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------
def _check_layout(t: torch.Tensor, name: str) -> None:
    if not (t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)):
        raise ValueError(
            f"group_norm: {name} must be NCHW-contiguous or channels_last (NHWC), got shape "
            f"{tuple(t.shape)} with strides {t.stride()}"
        )


def _check_inputs(x, num_groups, weight, bias, channel_bias, residual, activation) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"group_norm: x must be (B, C, H, W), got {shape}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"group_norm: x dtype {x.dtype} not supported; use one of {_SUPPORTED_DTYPES}")
    B, C = x.shape[:2]
    if not isinstance(num_groups, int) or num_groups <= 0 or C % num_groups != 0:
        raise ValueError(f"group_norm: C={C} channels must be divisible by num_groups={num_groups} (a positive int)")
    _check_layout(x, "x")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if tuple(t.shape) != (C,):
            raise ValueError(f"group_norm: {name} must have shape ({C},), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"group_norm: {name} must be floating point, got {t.dtype}")
    if channel_bias is not None:
        s = tuple(channel_bias.shape)
        ok = s in ((C,), (B, C), (1, C), (B, C, 1, 1), (1, C, 1, 1))
        if not ok:
            raise ValueError(f"group_norm: channel_bias must be (C,) or (B, C) = ({C},) or ({B}, {C}), got {s}")
        if channel_bias.dtype != x.dtype:
            raise TypeError(f"group_norm: channel_bias dtype {channel_bias.dtype} must match x dtype {x.dtype}")
    if residual is not None:
        check_like("group_norm", "residual", residual, x)
        _check_layout(residual, "residual")
    if activation not in ACTIVATIONS:
        raise ValueError(f"group_norm: activation must be one of {ACTIVATIONS}, got {activation!r}")
    devs = {t.device for t in (x, weight, bias, channel_bias, residual) if t is not None}
    if len(devs) > 1:
        raise ValueError(f"group_norm: all tensors must be on one device, got {sorted(map(str, devs))}")


def _hw_stride(t: torch.Tensor) -> int:
    """Stride of the flattened (H, W) axis. Both supported layouts have stride(2) == W * stride(3), but
    PyTorch's contiguity checks ignore the strides of size-1 dims: with W == 1 (e.g. a (B, L, C) token
    tensor seen as (B, C, L, 1)) stride(3) can be anything, and the step between positions is stride(2)."""
    return t.stride(2) if t.shape[3] == 1 else t.stride(3)


def _group_norm_impl(x, num_groups, weight, bias, eps, channel_bias, residual, activation, return_sum):
    _check_inputs(x, num_groups, weight, bias, channel_bias, residual, activation)
    has_add = channel_bias is not None or residual is not None
    if not use_triton("group_norm", x, weight, bias, channel_bias, residual):
        out = group_norm_ref(
            x, num_groups, weight, bias, eps, channel_bias=channel_bias, residual=residual,
            activation=activation, return_sum=return_sum,
        )
        if not return_sum:
            return out, x.new_empty(0)
        y, pre = out
        return y, (pre.clone() if pre.data_ptr() == x.data_ptr() else pre)

    B, C, H, W = x.shape
    HW = H * W
    G = num_groups
    y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    pre = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) if return_sum else x.new_empty(0)
    if x.numel() == 0:
        return y, pre
    if return_sum and not has_add:
        pre.copy_(x)
    if C * HW >= 2**31:
        raise NotImplementedError(f"group_norm: C*H*W = {C * HW} per batch item needs 64-bit offsets (max 2**31 - 1)")
    cl = _is_channels_last(x)
    silu = activation == "silu"
    write_pre = return_sum and has_add
    triton_call = functools.partial(_launch_triton, x, G, weight, bias, eps, channel_bias, residual, silu, write_pre,
                                    y, pre)
    if x.is_cuda and group_norm_cluster.run_if_faster(
        x, G, weight, bias, eps, channel_bias, residual, silu, y, pre if write_pre else None, triton_call
    ):
        return y, pre
    triton_call()
    return y, pre


def _launch_triton(x, G, weight, bias, eps, channel_bias, residual, silu, write_pre, y, pre) -> None:
    """The Triton kernels of the plan for this call, writing ``y`` (and ``pre`` when ``write_pre``)."""
    B, C, H, W = x.shape
    HW = H * W
    Cg = C // G
    cl = _is_channels_last(x)
    hw_axis = 0 if cl else 1
    plan = group_norm_plan(B, C, HW, G, cl, x.element_size(), residual is not None)
    w = weight.contiguous() if weight is not None else x
    bs = bias.contiguous() if bias is not None else x
    r = residual if residual is not None else x
    if channel_bias is not None:
        cb2 = channel_bias.reshape(-1, C)
        cb, scbb, scbc = cb2, (cb2.stride(0) if cb2.shape[0] > 1 else 0), cb2.stride(1)
    else:
        cb, scbb, scbc = x, 0, 0
    xs = (x.stride(0), x.stride(1), _hw_stride(x))
    rs = (r.stride(0), r.stride(1), _hw_stride(r))

    if plan.path == "onepass":
        _gn_onepass_kernel[(plan.n_ct, B)](
            x, r, cb, w, bs, y, pre if write_pre else x,
            HW, float(eps), *xs, *rs, scbb, scbc,
            Cg=Cg, GPT=plan.GPT, BLOCK_C=plan.BLOCK_C, BLOCK_HW=plan.BLOCK_HW, GPT_P2=_p2(plan.GPT), HW_AXIS=hw_axis,
            HAS_CB=channel_bias is not None, HAS_RES=residual is not None,
            HAS_W=weight is not None, HAS_B=bias is not None, WRITE_PRE=write_pre, SILU=silu,
            num_warps=plan.num_warps,
        )
        return

    # After the statistics pass with WRITE_PRE, the apply pass reads the stored sum instead.
    src_x, a_cb, a_res = (pre, False, False) if write_pre else (x, channel_bias is not None, residual is not None)
    if plan.path == "nhwc_tiles":
        S, HWS, bc = plan.S, plan.HWS, plan.BLOCK_C
        stats_iters, apply_iters = HWS // plan.BLOCK_HW, plan.HWP // plan.BLOCK_HW  # H*W blocks per program
        part = torch.empty((2, B, S, C), dtype=torch.float32, device=x.device)  # per-channel partial mean, M2
        chan = torch.empty((2, B, C), dtype=torch.float32, device=x.device)  # per-channel group mean, rstd * weight
        _gn_nhwc_stats_kernel[(plan.n_ct, S, B)](
            x, r, cb, pre if write_pre else x, part[0], part[1],
            C, HW, S, HWS, *xs, *rs, scbb, scbc,
            ITERS=stats_iters, UNROLL=_unroll(stats_iters), BLOCK_C=bc, BLOCK_HW=plan.BLOCK_HW,
            HAS_CB=channel_bias is not None, HAS_RES=residual is not None, WRITE_PRE=write_pre,
            num_warps=plan.num_warps,
        )
        block_cg = min(_p2(Cg), 256)
        block_s = _finalize_block_s(block_cg)
        _gn_nhwc_finalize_kernel[(G, B)](
            part[0], part[1], w, chan[0], chan[1],
            C, Cg, HW, S, HWS, float(eps),
            N_S=-(-S // block_s), N_CG=-(-Cg // block_cg), BLOCK_S=block_s, BLOCK_CG=block_cg,
            HAS_W=weight is not None, num_warps=4 if block_s * block_cg >= 512 else 1,
        )
        _gn_nhwc_apply_kernel[(plan.n_ct, -(-HW // plan.HWP), B)](
            src_x, r, cb, bs, y, chan[0], chan[1],
            C, HW, *xs, *rs, scbb, scbc, y.stride(0), y.stride(1), _hw_stride(y),
            ITERS=apply_iters, UNROLL=_unroll(apply_iters), BLOCK_C=bc, BLOCK_HW=plan.BLOCK_HW,
            HAS_CB=a_cb, HAS_RES=a_res, HAS_B=bias is not None, SILU=silu,
            num_warps=plan.apply_warps,
        )
        return

    S, HWS = plan.S, plan.HWS
    gpt_p2 = _p2(plan.GPT)
    pmean = torch.empty((2, B, G, S), dtype=torch.float32, device=x.device)
    fmean = torch.empty((2, B, G), dtype=torch.float32, device=x.device) if plan.finalize else None
    for ct0 in range(0, plan.n_ct, plan.chunk_ct):
        n = min(plan.chunk_ct, plan.n_ct - ct0)
        _gn_stats_kernel[(n, S, B)](
            x, r, cb, pre if write_pre else x, pmean[0], pmean[1],
            HW, G, S, HWS, ct0, *xs, *rs, scbb, scbc,
            Cg=Cg, GPT=plan.GPT, N_CB=plan.N_CB, ITERS=HWS // plan.BLOCK_HW,
            BLOCK_C=plan.BLOCK_C, BLOCK_HW=plan.BLOCK_HW,
            GPT_P2=gpt_p2, HW_AXIS=hw_axis,
            HAS_CB=channel_bias is not None, HAS_RES=residual is not None, WRITE_PRE=write_pre,
            num_warps=plan.num_warps,
        )
        if plan.finalize:
            g_lo = ct0 * plan.GPT
            n_g = n * plan.GPT
            block_r = max(1, min(_p2(n_g), 4096 // _p2(S)))
            _gn_finalize_kernel[(-(-n_g // block_r), B)](
                pmean[0], pmean[1], fmean[0], fmean[1], G, Cg, HW, S, HWS, g_lo, n_g,
                BLOCK_R=block_r, S_P2=_p2(S), num_warps=4,
            )
            stats, s_a, hws_a = fmean, 1, HW
        else:
            stats, s_a, hws_a = pmean, S, HWS
        _gn_apply_kernel[(n, -(-HW // plan.HWP), B)](
            src_x, r, cb, w, bs, y, stats[0], stats[1],
            HW, G, s_a, hws_a, ct0, float(eps),
            *xs, *rs, scbb, scbc, y.stride(0), y.stride(1), _hw_stride(y),
            Cg=Cg, GPT=plan.GPT, N_CB=plan.N_CB, ITERS=plan.HWP // plan.BLOCK_HW,
            BLOCK_C=plan.BLOCK_C, BLOCK_HW=plan.BLOCK_HW,
            GPT_P2=gpt_p2, S_P2=_p2(s_a), HW_AXIS=hw_axis,
            HAS_CB=a_cb, HAS_RES=a_res, HAS_W=weight is not None, HAS_B=bias is not None, SILU=silu,
            num_warps=plan.apply_warps,
        )


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("sdfast::group_norm", mutates_args=())
def _group_norm_op(
    x: torch.Tensor,
    num_groups: int,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    channel_bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    activation: Optional[str],
    return_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _group_norm_impl(x, num_groups, weight, bias, eps, channel_bias, residual, activation, return_sum)


@_group_norm_op.register_fake
def _group_norm_fake(x, num_groups, weight, bias, eps, channel_bias, residual, activation, return_sum):
    _check_inputs(x, num_groups, weight, bias, channel_bias, residual, activation)
    y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    pre = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) if return_sum else x.new_empty(0)
    return y, pre


def group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    channel_bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    return_sum: bool = False,
):
    """Fused GroupNorm: ``y = act(GroupNorm(x + channel_bias + residual) * weight + bias)``.

    x: (B, C, H, W) fp16/bf16/fp32, NCHW-contiguous or channels_last (NHWC); the output has x's
    dtype and memory format (no layout copy in either). num_groups divides C (any channels per
    group, any H*W). weight, bias: (C,) or None (affine=False). channel_bias: (C,) or (B, C) in x's
    dtype (e.g. the ResNet block's time-embedding projection). residual: (B, C, H, W) in x's dtype,
    either layout. activation: None or "silu". Statistics are fp32 (biased variance, as
    ``torch.nn.GroupNorm``); ``pre`` is rounded to x's dtype before normalizing, as eager PyTorch's
    separate add would. Returns ``y``, or ``(y, pre)`` with ``return_sum`` (``pre`` in x's layout).

    Raises ValueError (shape, layout, groups, activation, devices) or TypeError (dtypes). Runs the
    PyTorch reference where Triton cannot run (``kernels.dispatch``). Registered as
    ``torch.ops.sdfast.group_norm`` (one opaque op for torch.compile and CUDA graphs).
    Method: Wu & He 2018; fusions as in TensorRT/stable-fast SD GroupNorm plugins.
    """
    if return_sum and channel_bias is None and residual is None:
        y, _ = torch.ops.sdfast.group_norm(x, num_groups, weight, bias, float(eps), None, None, activation, False)
        return y, x
    y, pre = torch.ops.sdfast.group_norm(
        x, num_groups, weight, bias, float(eps), channel_bias, residual, activation, bool(return_sum)
    )
    return (y, pre) if return_sum else y


def instance_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """InstanceNorm (Ulyanov et al. 2016) as GroupNorm with one channel per group.

    x: (B, C, H, W), NCHW or channels_last; weight, bias: (C,) or None. Same as
    ``torch.nn.functional.instance_norm(x, weight=weight, bias=bias, eps=eps)`` (no running stats).
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"instance_norm: x must be (B, C, H, W), got {getattr(x, 'shape', type(x).__name__)}")
    return group_norm(x, x.shape[1], weight, bias, eps, activation=activation)


__all__ = ["group_norm", "group_norm_ref", "instance_norm", "group_norm_plan", "GroupNormPlan", "ACTIVATIONS"]
