"""The channel-tile Triton GroupNorm kernels for channels_last tensors ("nhwc_tiles") and their launch.

Whole-group tiles waste lanes in channels_last (Cg = 10 fp16: 4 groups = 40 channels = 80-byte row segments in
64-lane blocks), so these tiles ignore the groups: ``BLOCK_C`` (64 or 128) channels from a multiple of
``BLOCK_C``, i.e. aligned 128/256-byte row segments in fp16 when C is a multiple of 64.

* ``_gn_nhwc_stats_kernel`` writes per-(batch, split, channel) partial mean and M2 (shifted by the channel's
  first value in the split);
* ``_gn_nhwc_finalize_kernel``, one program per (batch, group), combines the group's ``S x Cg`` partials (Chan)
  into per-channel vectors ``mean_c`` and ``scale_c = rstd_g * weight[c]``;
* ``_gn_nhwc_apply_kernel`` normalizes a tile with them, with no group logic.

Same fusions as the group-aligned kernels (``kernels.group_norm.triton_groups``, whose ``_load_pre`` and
``_bias_act`` these share) and the same split choice; no L2 chunking (a chunk would have to hold whole groups).

The loops over H*W blocks (``ITERS``) and split blocks (``N_S``) have runtime trip counts, excluded from
Triton's integer specialization along with the split count ``S`` (``do_not_specialize``), so that another image
size mostly runs the kernels compiled for the first (a size whose plan changes path or unrolling, 1 or 2 blocks
against 3+, still compiles). ``HW`` and ``HWS`` keep their divisibility specialization: without it ptxas
serialized the block's 16-byte loads on sm_90. They are ``while`` loops because the Triton interpreter cannot
``range()`` a runtime bound under numpy 2.

Method: Wu & He 2018 (GroupNorm); Chan, Golub & LeVeque 1979 (pairwise variance combination); NHWC GroupNorm
that keeps the memory order as in Apex and stable-fast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.group_norm.plan import TUNING, GroupNormPlan, p2
from kernels.group_norm.triton_groups import _bias_act, _load_pre, hw_stride, operands

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
def _unroll(iters: int) -> int:
    """The kernels' UNROLL: 1 or 2 H*W blocks per program run as an unrolled loop (measured faster than a runtime
    loop on sm_90 at 2 blocks), more as a runtime loop (within 2 % of a constexpr trip count from 3 blocks)."""
    return iters if iters <= 2 else 0


def _finalize_block_s(block_cg: int) -> int:
    """Splits per loop iteration of the finalize kernel: a function of the group width only, so that another
    image size (another split count S) runs the kernel already compiled, not a new one. About
    ``nhwc_finalize_elems`` partials per iteration: SD's S (8 to 256) mostly takes one iteration."""
    return max(1, min(256, TUNING["nhwc_finalize_elems"] // block_cg))


# --------------------------------------------------------------------------------------------
# launch
# --------------------------------------------------------------------------------------------
def launch(plan: GroupNormPlan, x, G, weight, bias, eps, channel_bias, residual, silu, write_pre, y, pre) -> None:
    """Run an "nhwc_tiles" ``plan`` into ``y`` (and ``pre`` when ``write_pre``: the rounded
    ``x + channel_bias + residual``)."""
    if plan.path != "nhwc_tiles":
        raise ValueError(f"triton_nhwc.launch: plan path {plan.path!r} is not nhwc_tiles")
    B, C, H, W = x.shape
    HW = H * W
    Cg = C // G
    o = operands(x, weight, bias, channel_bias, residual)
    w, bs, r, cb, scbb, scbc, xs, rs = o.w, o.bs, o.r, o.cb, o.scbb, o.scbc, o.xs, o.rs
    # After the statistics pass with WRITE_PRE, the apply pass reads the stored sum instead.
    src_x, a_cb, a_res = (pre, False, False) if write_pre else (x, channel_bias is not None, residual is not None)
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
    block_cg = min(p2(Cg), 256)
    block_s = _finalize_block_s(block_cg)
    _gn_nhwc_finalize_kernel[(G, B)](
        part[0], part[1], w, chan[0], chan[1],
        C, Cg, HW, S, HWS, float(eps),
        N_S=-(-S // block_s), N_CG=-(-Cg // block_cg), BLOCK_S=block_s, BLOCK_CG=block_cg,
        HAS_W=weight is not None, num_warps=4 if block_s * block_cg >= 512 else 1,
    )
    _gn_nhwc_apply_kernel[(plan.n_ct, -(-HW // plan.HWP), B)](
        src_x, r, cb, bs, y, chan[0], chan[1],
        C, HW, *xs, *rs, scbb, scbc, y.stride(0), y.stride(1), hw_stride(y),
        ITERS=apply_iters, UNROLL=_unroll(apply_iters), BLOCK_C=bc, BLOCK_HW=plan.BLOCK_HW,
        HAS_CB=a_cb, HAS_RES=a_res, HAS_B=bias is not None, SILU=silu,
        num_warps=plan.apply_warps,
    )


__all__ = ["launch"]
