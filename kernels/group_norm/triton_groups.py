"""The group-aligned Triton GroupNorm kernels, for NCHW and channels_last tensors, and their launch.

Every kernel reads the input in its own layout through (batch, channel, hw) strides; a "channel tile" is
``GPT`` whole groups, so no program shares a group's channels with another in the same row range
(``kernels.group_norm.plan`` picks the path and the tiling):

* ``_gn_onepass_kernel`` ("onepass"): small groups (the whole tile of ``GPT`` groups x H*W fits in
  registers): one read, one write, one launch.
* otherwise two passes ("twopass"): ``_gn_stats_kernel`` splits H*W over ``S`` programs per channel
  tile and writes per-(batch, group, split) partial mean and M2 (Welford/Chan combination,
  per-channel shifted sums inside a program, so no catastrophic cancellation); ``_gn_apply_kernel``
  combines the ``S`` partials of its groups (a few hundred bytes) and normalizes a tile. When ``S`` is
  large, a tiny ``_gn_finalize_kernel`` combines the partials once instead. Tensors much larger than
  L2 can be processed in channel-tile chunks so the apply pass re-reads its input from L2, not HBM.

``_load_pre`` and ``_bias_act`` (the fused pre-adds and the bias + SiLU epilogue) and :func:`operands` are shared
with the channel-tile kernels of ``kernels.group_norm.triton_nhwc``.

Method: Wu & He 2018 (GroupNorm); Chan, Golub & LeVeque 1979 (pairwise variance combination).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.group_norm.plan import GroupNormPlan, p2

# Tile orientation: HW_AXIS = 1 for NCHW tiles (BLOCK_C, BLOCK_HW), each row a contiguous H*W run;
# HW_AXIS = 0 for NHWC tiles (BLOCK_HW, BLOCK_C), channels contiguous. Per-channel vectors are
# broadcast with tl.expand_dims(v, HW_AXIS) and reduced with tl.sum(t, axis=HW_AXIS). Loop trip counts
# are constexpr here (the channel-tile kernels of triton_nhwc.py use runtime ones).
# The two helpers below are inlined by Triton. ``_load_pre`` adds the last term of the residual's address
# (``hw2 * srhw``) after x's load; the callers' base and channel terms are computed before the call.


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


# --------------------------------------------------------------------------------------------
# launch
# --------------------------------------------------------------------------------------------
def hw_stride(t: torch.Tensor) -> int:
    """Stride of the flattened (H, W) axis. Both supported layouts have stride(2) == W * stride(3), but
    PyTorch's contiguity checks ignore the strides of size-1 dims: with W == 1 (e.g. a (B, L, C) token
    tensor seen as (B, C, L, 1)) stride(3) can be anything, and the step between positions is stride(2)."""
    return t.stride(2) if t.shape[3] == 1 else t.stride(3)


@dataclasses.dataclass(frozen=True)
class Operands:
    """A call's tensors as the kernels take them: absent ones replaced by ``x`` (never read: their ``HAS_*`` flag
    is off), weight and bias contiguous, the channel bias as (B or 1, C) with its strides (``scbb`` 0 when it is
    shared by the batch), x's and the residual's (batch, channel, hw) strides."""

    w: torch.Tensor
    bs: torch.Tensor
    r: torch.Tensor
    cb: torch.Tensor
    scbb: int
    scbc: int
    xs: tuple[int, int, int]
    rs: tuple[int, int, int]


def operands(x, weight, bias, channel_bias, residual) -> Operands:
    """:class:`Operands` of one call (inputs already checked by ``kernels.group_norm.op``)."""
    C = x.shape[1]
    r = residual if residual is not None else x
    if channel_bias is not None:
        cb2 = channel_bias.reshape(-1, C)
        cb, scbb, scbc = cb2, (cb2.stride(0) if cb2.shape[0] > 1 else 0), cb2.stride(1)
    else:
        cb, scbb, scbc = x, 0, 0
    return Operands(
        w=weight.contiguous() if weight is not None else x,
        bs=bias.contiguous() if bias is not None else x,
        r=r, cb=cb, scbb=scbb, scbc=scbc,
        xs=(x.stride(0), x.stride(1), hw_stride(x)),
        rs=(r.stride(0), r.stride(1), hw_stride(r)),
    )


def launch(plan: GroupNormPlan, x, G, weight, bias, eps, channel_bias, residual, silu, write_pre, y, pre) -> None:
    """Run ``plan`` ("onepass" or "twopass") into ``y`` (and ``pre`` when ``write_pre``: the rounded
    ``x + channel_bias + residual``)."""
    B, C, H, W = x.shape
    HW = H * W
    Cg = C // G
    hw_axis = 0 if plan.channels_last else 1
    o = operands(x, weight, bias, channel_bias, residual)
    w, bs, r, cb, scbb, scbc, xs, rs = o.w, o.bs, o.r, o.cb, o.scbb, o.scbc, o.xs, o.rs

    if plan.path == "onepass":
        _gn_onepass_kernel[(plan.n_ct, B)](
            x, r, cb, w, bs, y, pre if write_pre else x,
            HW, float(eps), *xs, *rs, scbb, scbc,
            Cg=Cg, GPT=plan.GPT, BLOCK_C=plan.BLOCK_C, BLOCK_HW=plan.BLOCK_HW, GPT_P2=p2(plan.GPT), HW_AXIS=hw_axis,
            HAS_CB=channel_bias is not None, HAS_RES=residual is not None,
            HAS_W=weight is not None, HAS_B=bias is not None, WRITE_PRE=write_pre, SILU=silu,
            num_warps=plan.num_warps,
        )
        return
    if plan.path != "twopass":
        raise ValueError(f"triton_groups.launch: plan path {plan.path!r} is not onepass or twopass")

    # After the statistics pass with WRITE_PRE, the apply pass reads the stored sum instead.
    src_x, a_cb, a_res = (pre, False, False) if write_pre else (x, channel_bias is not None, residual is not None)
    S, HWS = plan.S, plan.HWS
    gpt_p2 = p2(plan.GPT)
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
            block_r = max(1, min(p2(n_g), 4096 // p2(S)))
            _gn_finalize_kernel[(-(-n_g // block_r), B)](
                pmean[0], pmean[1], fmean[0], fmean[1], G, Cg, HW, S, HWS, g_lo, n_g,
                BLOCK_R=block_r, S_P2=p2(S), num_warps=4,
            )
            stats, s_a, hws_a = fmean, 1, HW
        else:
            stats, s_a, hws_a = pmean, S, HWS
        _gn_apply_kernel[(n, -(-HW // plan.HWP), B)](
            src_x, r, cb, w, bs, y, stats[0], stats[1],
            HW, G, s_a, hws_a, ct0, float(eps),
            *xs, *rs, scbb, scbc, y.stride(0), y.stride(1), hw_stride(y),
            Cg=Cg, GPT=plan.GPT, N_CB=plan.N_CB, ITERS=plan.HWP // plan.BLOCK_HW,
            BLOCK_C=plan.BLOCK_C, BLOCK_HW=plan.BLOCK_HW,
            GPT_P2=gpt_p2, S_P2=p2(s_a), HW_AXIS=hw_axis,
            HAS_CB=a_cb, HAS_RES=a_res, HAS_W=weight is not None, HAS_B=bias is not None, SILU=silu,
            num_warps=plan.apply_warps,
        )


__all__ = ["launch", "operands", "Operands", "hw_stride"]
