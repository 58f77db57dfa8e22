"""Flash attention forward: ``softmax(q @ k^T * scale) @ v`` without the (Lq, Lk) score matrix.

Method: FlashAttention-2 (Dao, 2023, https://tridao.me/publications/flash2/flash2.pdf) as laid out in
Triton's ``06-fused-attention.py`` tutorial: one program owns a tile of ``BLOCK_M`` queries of one
(batch, head), streams ``BLOCK_N`` keys/values at a time and keeps a running row max ``m``, row sum
``l`` and output accumulator in fp32 (online softmax). ``log2(e)`` is folded into the softmax scale
so the exponentials are ``exp2``.

What is specific to Stable Diffusion's shapes:

* head_dim 40 / 80 / 160 are not powers of two. The q·k product and the output are split in two
  power-of-two column chunks (40 = 32 + 16 with 8 masked columns, 80 = 64 + 16, 160 = 128 + 32)
  instead of padding to 64 / 128 / 256: that saves 25-37 % of the tensor-core work.
* head_dim 512 (the VAE mid-block: one head of 512) does not fit one program's registers: the
  output columns are split over a third grid axis (``DV0`` columns per program, q·k recomputed per
  column block), with small key tiles.
* query / key lengths that are not tile multiples (77, 154, 4225 = 65x65): the last partial key
  tile runs a copy of the loop body that sends keys past the end to -inf, as a loop of 0 or 1
  iteration after the main loop. Written as an `if`, Triton 3.6 miscompiled it on sm_90 (wrong
  results for some tiles, illegal memory accesses for others, with or without software pipelining).
  K/V loads are row-masked in every tile, also the full ones: a cheap guard,
  added while that fault was hunted; the fault itself was the `if`.
* any strides: q, k, v, out may be strided views, e.g. the (B, L, H, D) output of a fused QKV
  projection seen as (B, H, L, D) through ``transpose(1, 2)``; no copy is made.

Measured and not kept: FlashAttention-4's conditional softmax rescaling (move a row's running max only when a tile
raises it by more than 8 in base 2). Triton can only branch on a value uniform over the program, a max over all rows
that goes through shared memory on every key tile: measured slower at every SD self-attention shape on sm_90
(``benchmarks/results/h200-2026-12-01-run18``, with the Nsight Compute profile: in cuDNN's head-dim-40 kernel as in
this one, the exponentials and the MMAs take turns rather than overlap).

The output is allocated as (B, Lq, H, D) memory and returned as its (B, H, Lq, D) view, so that
``out.transpose(1, 2).reshape(B, Lq, H * D)`` (what attention processors do next) is free.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Optional

import torch

from kernels import precompile
from kernels.attention.buckets import length_bucket
from kernels.dispatch import interpret_mode, launch_autotuned, use_triton

try:  # triton is an optional dependency; the reference path works without it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CI installs triton
    HAS_TRITON = False

log = logging.getLogger("sdfast.kernels")

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 512
LOG2E = 1.4426950408889634

__all__ = [
    "attention_ref",
    "flash_attention",
    "flash_attention_configs",
    "SUPPORTED_DTYPES",
    "MAX_HEAD_DIM",
]


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    upcast: bool = True,
) -> torch.Tensor:
    """Plain-PyTorch attention, the reference of :func:`flash_attention`.

    Args:
        q: (B, H, Lq, D); k, v: (B, H, Lk, D); any strides, fp16 / bf16 / fp32.
        key_padding_mask: optional bool (B, Lk) or (1, Lk), True = keep the key. A padded key
            gets zero probability; a query whose keys are all padded returns zeros (not NaN).
        scale: softmax scale, default ``D ** -0.5``.
        upcast: compute in fp32 (True, the accurate reference) or in the input dtype.

    Returns:
        (B, H, Lq, D) contiguous, in q's dtype.
    """
    out_dtype = q.dtype
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if key_padding_mask is not None:
        keep = key_padding_mask.to(torch.bool)[:, None, None, :]
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)
    if key_padding_mask is not None:
        p = torch.nan_to_num(p, nan=0.0)  # all keys padded -> zeros, as the kernel does
    return torch.matmul(p.to(v.dtype), v).to(out_dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _load_2d(
        ptrs,
        rows_ok,
        cols_ok,
        CHECK_ROWS: tl.constexpr,
        CHECK_COLS: tl.constexpr,
    ):
        """Load a 2D tile, masking only the dimensions that can run out of bounds."""
        if CHECK_ROWS and CHECK_COLS:
            return tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
        elif CHECK_ROWS:
            return tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        elif CHECK_COLS:
            return tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
        else:
            return tl.load(ptrs)

    @triton.jit
    def _attn_fwd_tile(
        acc0,
        acc1,
        m_i,
        l_i,
        q0,
        q1,
        k_base,  # K + batch/head offset: rows of (LK, HEAD_DIM)
        v_base,  # V + batch/head offset: rows of (LK, HEAD_DIM)
        kpm_base,  # KPM + batch offset: (LK,) uint8, 1 = keep
        start_n,
        LK,
        stride_kn,
        stride_kd,
        stride_vn,
        stride_vd,
        stride_mn,
        qk_scale,
        dv_start,
        HEAD_DIM: tl.constexpr,
        D0: tl.constexpr,
        D1: tl.constexpr,
        DV0: tl.constexpr,
        DV1: tl.constexpr,
        BLOCK_N: tl.constexpr,
        EVEN_N: tl.constexpr,
        HAS_MASK: tl.constexpr,
        UPCAST: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        """One key/value tile of the online softmax: returns updated (acc0, acc1, m_i, l_i)."""
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < LK
        # ---- s = q @ k^T over the column chunks [0, D0) and [D0, D0 + D1) ----
        offs_d0 = tl.arange(0, D0)
        k0 = _load_2d(
            k_base + offs_n[:, None] * stride_kn + offs_d0[None, :] * stride_kd,
            n_ok, offs_d0 < HEAD_DIM, True, D0 > HEAD_DIM,
        )
        qk = tl.dot(q0, tl.trans(k0), input_precision=DOT_PREC)
        if D1 > 0:
            offs_d1 = D0 + tl.arange(0, D1)
            k1 = _load_2d(
                k_base + offs_n[:, None] * stride_kn + offs_d1[None, :] * stride_kd,
                n_ok, offs_d1 < HEAD_DIM, True, D0 + D1 > HEAD_DIM,
            )
            qk = tl.dot(q1, tl.trans(k1), qk, input_precision=DOT_PREC)
        # ---- keys that must not enter the softmax: past LK, or padded ----
        if HAS_MASK:
            keep = tl.load(kpm_base + offs_n * stride_mn, mask=n_ok, other=0) != 0
            qk = tl.where(keep[None, :], qk, float("-inf"))
        elif not EVEN_N:
            qk = tl.where(n_ok[None, :], qk, float("-inf"))
        # ---- online softmax in base 2 (qk_scale = scale * log2(e) > 0) ----
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_sub = m_new
        if HAS_MASK:
            # a row whose keys so far are all padded has m_new = -inf: subtract 0 instead, so that
            # p = exp2(-inf) = 0 and alpha = 0 rather than NaN; m_i itself stays the true max
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        # ---- acc = acc * alpha + p @ v ----
        offs_v0 = dv_start + tl.arange(0, DV0)
        v0 = _load_2d(
            v_base + offs_n[:, None] * stride_vn + offs_v0[None, :] * stride_vd,
            n_ok, offs_v0 < HEAD_DIM, True, (DV1 == 0) & (HEAD_DIM % DV0 != 0),
        )
        # P in the input dtype; with UPCAST also its rounding residue, so p_hi + p_lo carries
        # ~2x the mantissa bits (fp32-like P) at the cost of a second tensor-core dot.
        p_hi = p.to(v0.dtype)
        if UPCAST:
            p_lo = (p - p_hi.to(tl.float32)).to(v0.dtype)
        acc0 = tl.dot(p_hi, v0, acc0 * alpha[:, None], input_precision=DOT_PREC)
        if UPCAST:
            acc0 = tl.dot(p_lo, v0, acc0, input_precision=DOT_PREC)
        if DV1 > 0:
            offs_v1 = dv_start + DV0 + tl.arange(0, DV1)
            v1 = _load_2d(
                v_base + offs_n[:, None] * stride_vn + offs_v1[None, :] * stride_vd,
                n_ok, offs_v1 < HEAD_DIM, True, DV0 + DV1 > HEAD_DIM,
            )
            acc1 = tl.dot(p_hi, v1, acc1 * alpha[:, None], input_precision=DOT_PREC)
            if UPCAST:
                acc1 = tl.dot(p_lo, v1, acc1, input_precision=DOT_PREC)
        return acc0, acc1, m_new, l_i

    @triton.jit(do_not_specialize=["LQ", "LK"])
    def _flash_attn_fwd_kernel(
        Q,  # (B, H, LQ, HEAD_DIM) fp16/bf16/fp32, any strides
        K,  # (B, H, LK, HEAD_DIM) same dtype, any strides
        V,  # (B, H, LK, HEAD_DIM) same dtype, any strides
        O,  # (B, H, LQ, HEAD_DIM) output, same dtype, any strides
        KPM,  # (B, LK) uint8 key-padding mask, 1 = keep (read only when HAS_MASK)
        qk_scale,  # softmax scale * log2(e), > 0
        stride_qb,  # strides of Q, K, V, O below are in units of SA elements, except *_d
        stride_qh,
        stride_qm,
        stride_qd,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_kd,
        stride_vb,
        stride_vh,
        stride_vn,
        stride_vd,
        stride_ob,
        stride_oh,
        stride_om,
        stride_od,
        stride_mb,  # strides of KPM in elements
        stride_mn,
        H,
        LQ,
        LK,
        LQ_BUCKET,  # length_bucket(LQ), length_bucket(LK): the autotuning key only, unused in the body
        LK_BUCKET,
        HEAD_DIM: tl.constexpr,
        SA: tl.constexpr,  # common power-of-two factor of the row strides: lets loads vectorize
        HAS_MASK: tl.constexpr,
        UPCAST: tl.constexpr,  # P.V with P split in hi + lo parts (fp32-accurate probabilities)
        DOT_PREC: tl.constexpr,  # precision of fp32 dots ("tf32x3" for fp32 inputs)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        D0: tl.constexpr,  # q.k column chunks: D0 (power of two) + D1 (0 or power of two) >= HEAD_DIM
        D1: tl.constexpr,
        DV0: tl.constexpr,  # output columns owned by one program: DV0 + DV1
        DV1: tl.constexpr,
        INTERPRET: tl.constexpr,  # running in Triton's numpy interpreter
    ):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        pid_dv = tl.program_id(2)
        off_b = (pid_bh // H).to(tl.int64)
        off_h = (pid_bh % H).to(tl.int64)
        q_base = Q + off_b * (stride_qb * SA) + off_h * (stride_qh * SA)
        k_base = K + off_b * (stride_kb * SA) + off_h * (stride_kh * SA)
        v_base = V + off_b * (stride_vb * SA) + off_h * (stride_vh * SA)
        o_base = O + off_b * (stride_ob * SA) + off_h * (stride_oh * SA)
        kpm_base = KPM + off_b * stride_mb
        dv_start = pid_dv * (DV0 + DV1)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < LQ
        # q tile stays on chip for the whole key loop
        offs_d0 = tl.arange(0, D0)
        q0 = _load_2d(
            q_base + offs_m[:, None] * (stride_qm * SA) + offs_d0[None, :] * stride_qd,
            m_ok, offs_d0 < HEAD_DIM, True, D0 > HEAD_DIM,
        )
        q1 = q0  # placeholder when there is no second chunk
        if D1 > 0:
            offs_d1 = D0 + tl.arange(0, D1)
            q1 = _load_2d(
                q_base + offs_m[:, None] * (stride_qm * SA) + offs_d1[None, :] * stride_qd,
                m_ok, offs_d1 < HEAD_DIM, True, D0 + D1 > HEAD_DIM,
            )

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc0 = tl.zeros([BLOCK_M, DV0], dtype=tl.float32)
        if DV1 > 0:
            acc1 = tl.zeros([BLOCK_M, DV1], dtype=tl.float32)
        else:
            acc1 = tl.zeros([BLOCK_M, 1], dtype=tl.float32)  # unused placeholder

        # full key tiles: no -inf masking of scores (the loads stay row-masked: module docstring)
        n_full = (LK // BLOCK_N) * BLOCK_N
        if INTERPRET:
            # Triton 3.6's interpreter cannot take range() of a runtime bound with numpy >= 2.4
            # (it calls int() on a 1-element array); compiled code keeps the pipelined for-loop.
            start_n = 0
            while start_n < n_full:
                acc0, acc1, m_i, l_i = _attn_fwd_tile(
                    acc0, acc1, m_i, l_i, q0, q1, k_base, v_base, kpm_base, start_n, LK,
                    stride_kn * SA, stride_kd, stride_vn * SA, stride_vd, stride_mn, qk_scale, dv_start,
                    HEAD_DIM, D0, D1, DV0, DV1, BLOCK_N, True, HAS_MASK, UPCAST, DOT_PREC,
                )
                start_n += BLOCK_N
        else:
            for start_n in range(0, n_full, BLOCK_N):
                acc0, acc1, m_i, l_i = _attn_fwd_tile(
                    acc0, acc1, m_i, l_i, q0, q1, k_base, v_base, kpm_base, start_n, LK,
                    stride_kn * SA, stride_kd, stride_vn * SA, stride_vd, stride_mn, qk_scale, dv_start,
                    HEAD_DIM, D0, D1, DV0, DV1, BLOCK_N, True, HAS_MASK, UPCAST, DOT_PREC,
                )
        # last partial key tile: a loop of 0 or 1 iteration, not an `if` (with the dots inside an `if`
        # after the loop, Triton 3.6 on sm_90 gave wrong results or illegal accesses for some tiles)
        if INTERPRET:
            if n_full < LK:
                acc0, acc1, m_i, l_i = _attn_fwd_tile(
                    acc0, acc1, m_i, l_i, q0, q1, k_base, v_base, kpm_base, n_full, LK,
                    stride_kn * SA, stride_kd, stride_vn * SA, stride_vd, stride_mn, qk_scale, dv_start,
                    HEAD_DIM, D0, D1, DV0, DV1, BLOCK_N, False, HAS_MASK, UPCAST, DOT_PREC,
                )
        else:
            for start_n in range(n_full, LK, BLOCK_N):
                acc0, acc1, m_i, l_i = _attn_fwd_tile(
                    acc0, acc1, m_i, l_i, q0, q1, k_base, v_base, kpm_base, start_n, LK,
                    stride_kn * SA, stride_kd, stride_vn * SA, stride_vd, stride_mn, qk_scale, dv_start,
                    HEAD_DIM, D0, D1, DV0, DV1, BLOCK_N, False, HAS_MASK, UPCAST, DOT_PREC,
                )

        # epilogue: divide by the row sums; a query with no unpadded key has l = 0 -> zeros
        if HAS_MASK:
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
        inv_l = 1.0 / l_i
        offs_o0 = dv_start + tl.arange(0, DV0)
        o_rows = o_base + offs_m[:, None] * (stride_om * SA)
        tl.store(
            o_rows + offs_o0[None, :] * stride_od,
            (acc0 * inv_l[:, None]).to(O.dtype.element_ty),
            mask=m_ok[:, None] & (offs_o0[None, :] < HEAD_DIM),
        )
        if DV1 > 0:
            offs_o1 = dv_start + DV0 + tl.arange(0, DV1)
            tl.store(
                o_rows + offs_o1[None, :] * stride_od,
                (acc1 * inv_l[:, None]).to(O.dtype.element_ty),
                mask=m_ok[:, None] & (offs_o1[None, :] < HEAD_DIM),
            )


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def head_dim_chunks(head_dim: int) -> tuple[int, int]:
    """Split ``head_dim`` into two power-of-two column chunks (D0, D1) with D0 + D1 >= head_dim.

    D0 is the largest power of two <= head_dim (at least 16, tl.dot's minimum K), D1 is 0 or the
    next power of two >= the remainder (at least 16): 40 -> (32, 16), 64 -> (64, 0),
    80 -> (64, 16), 160 -> (128, 32), 512 -> (512, 0).
    """
    d0 = max(16, 1 << (head_dim.bit_length() - 1))
    rem = head_dim - d0
    d1 = 0 if rem <= 0 else max(16, _next_pow2(rem))
    return d0, d1


@functools.lru_cache(maxsize=None)
def _max_shared_mem(device_index: int) -> int:
    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return int(props["max_shared_mem"])


def _smem_bytes(block_m, block_n, d_qk, d_v, stages, elem) -> int:
    """Upper estimate of shared memory: q tile + `stages` buffered k and v tiles."""
    return elem * (block_m * d_qk + max(1, stages) * block_n * (d_qk + d_v))


def flash_attention_configs(head_dim: int, elem_size: int = 2, device: Optional[torch.device] = None):
    """Autotune candidates for one head_dim, keeping only those that fit ``device``'s shared memory.

    Kept small on purpose (<= 4): every config is compiled and timed the first time a shape is
    seen. ``device=None`` or a CPU device (Triton interpreter) gives one config.
    Returns a list of ``triton.Config`` with kwargs BLOCK_M, BLOCK_N, D0, D1, DV0, DV1.
    """
    d0, d1 = head_dim_chunks(head_dim)

    def cfg(bm, bn, dv, warps, stages):
        dv0, dv1 = (d0, d1) if dv is None else (dv, 0)
        kw = dict(BLOCK_M=bm, BLOCK_N=bn, D0=d0, D1=d1, DV0=dv0, DV1=dv1)
        return triton.Config(kw, num_warps=warps, num_stages=stages)

    split_dv = head_dim > 256
    if device is None or device.type != "cuda":
        # interpreter: one config; the 512 case still exercises the split-columns grid
        return [cfg(32, 32, 256 if split_dv else None, 4, 1)]

    if elem_size >= 4:
        # fp32 inputs (3xTF32 dots): a correctness path, not a tuned one. fp32 tiles are twice the
        # bytes and 3xTF32 keeps hi/lo copies: one small config that fits, no autotuning.
        if head_dim <= 128:
            return [cfg(64, 32, None, 4, 2)]
        if not split_dv:
            return [cfg(64, 16, None, 4, 2)]
        return [cfg(32, 16, 128, 4, 1)]

    if not split_dv:
        if d0 + d1 <= 128:  # 40, 64, 80
            # (128, 64, 4 warps, 2 stages) replaced (128, 128, 8, 3), which was the fastest of these candidates at
            # none of SD1.5/SDXL/SD2.1's attention shapes (``benchmarks.ops.attention sweep``; results in
            # benchmarks/results/h200-2026-11-30-run12).
            cands = [(128, 64, None, 4, 3), (128, 64, None, 4, 2), (64, 64, None, 4, 3), (128, 32, None, 4, 4)]
        else:  # 160, 256: wide accumulators, more warps per row tile
            cands = [(64, 64, None, 4, 3), (128, 64, None, 8, 3), (64, 32, None, 4, 3), (128, 32, None, 8, 3)]
    else:  # 512: split output columns over the grid, small key tiles
        cands = [(64, 32, 256, 8, 2), (64, 32, 512, 8, 2), (64, 64, 128, 4, 2), (128, 32, 256, 8, 2)]

    limit = _max_shared_mem(device.index if device.index is not None else torch.cuda.current_device())
    configs = []
    for bm, bn, dv, w, s in cands:
        d_v = (d0 + d1) if dv is None else dv
        if _smem_bytes(bm, bn, d0 + d1, d_v, s, elem_size) <= limit:
            configs.append(cfg(bm, bn, dv, w, s))
    if not configs:  # small shared memory: smallest tile, no multi-buffering
        configs.append(cfg(64, 32, 128 if split_dv else None, 4, 1))
    return configs


def _prune_configs(configs, named_args, **kwargs):
    """Per call: drop tiles much larger than the sequences (e.g. BLOCK_M=128 for 40 queries), and
    the 512-column accumulator under UPCAST (its second P.V dot spills registers). The bound is the top of the
    length's bucket (``length_bucket`` x 2: the autotuner's key), so a bucket's config does not depend on which of
    its lengths came first."""
    q_top = 2 * length_bucket(named_args["LQ"])
    k_top = 2 * length_bucket(named_args["LK"])
    upcast = kwargs.get("UPCAST", named_args.get("UPCAST", False))
    kept = [
        c for c in configs
        if c.kwargs["BLOCK_M"] <= max(64, q_top)
        and c.kwargs["BLOCK_N"] <= max(32, k_top)
        and not (upcast and c.kwargs["DV0"] >= 512)
    ]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


def _bench_short(fn, quantiles):
    # Short timing: every new length bucket pays this once per config at warm-up. Shorter is not better: at
    # warmup=2, rep=6 SDXL's (1024, 20 heads, 64) self-attention got a slower config and lost to cuDNN
    # (benchmarks/results/h200-2026-11-30-run7).
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


@functools.lru_cache(maxsize=None)
def _tuned_kernel(head_dim: int, elem_size: int, device_type: str, device_index: int):
    device = torch.device(device_type, device_index) if device_type == "cuda" else torch.device("cpu")
    configs = flash_attention_configs(head_dim, elem_size, device)
    import triton.testing  # noqa: F401  (used by _bench_short)

    return triton.autotune(
        configs=configs,
        key=["LQ_BUCKET", "LK_BUCKET", "HAS_MASK", "UPCAST"],
        prune_configs_by={"early_config_prune": _prune_configs},
        do_bench=_bench_short,
        cache_results=True,  # the winners go to Triton's cache: a second process on this machine times nothing
    )(_flash_attn_fwd_kernel)


# (head_dim, dtype, device, LQ bucket, LK bucket, has_mask, upcast) already autotuned: safe to launch in a graph
_tuned_keys: set = set()
_capture_logged: set = set()


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _check_inputs(q, k, v, key_padding_mask, scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"flash_attention: {name} must be 4D (B, H, L, D), got shape {tuple(t.shape)}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"flash_attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"flash_attention: dtype {q.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attention: q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    B, H, Lq, D = q.shape
    if k.shape[:2] != (B, H) or v.shape[:2] != (B, H) or k.shape[3] != D or v.shape[3] != D:
        raise ValueError(
            "flash_attention: expected q (B, H, Lq, D), k and v (B, H, Lk, D); got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"flash_attention: k and v lengths differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise NotImplementedError(f"flash_attention: head_dim {D} is not supported (1..{MAX_HEAD_DIM})")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError(
                "flash_attention: key_padding_mask must be a bool tensor (True = keep), got "
                f"{getattr(key_padding_mask, 'dtype', type(key_padding_mask))}"
            )
        Lk = k.shape[2]
        if key_padding_mask.dim() != 2 or key_padding_mask.shape[1] != Lk or key_padding_mask.shape[0] not in (1, B):
            raise ValueError(
                f"flash_attention: key_padding_mask must be (B, Lk) = ({B}, {Lk}) or (1, {Lk}), "
                f"got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(
                f"flash_attention: key_padding_mask on {key_padding_mask.device}, tensors on {q.device}"
            )
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"flash_attention: scale must be a finite positive float, got {scale}")


def _empty_out(q: torch.Tensor) -> torch.Tensor:
    B, H, Lq, D = q.shape
    return torch.empty((B, Lq, H, D), device=q.device, dtype=q.dtype).transpose(1, 2)


def _stride_align(elem_size: int, *tensors: torch.Tensor) -> int:
    """Largest power of two (<= 16 bytes of elements) dividing every non-last stride."""
    sa = max(1, 16 // elem_size)
    while sa > 1 and any(s % sa for t in tensors for s in t.stride()[:3]):
        sa //= 2
    return sa


def kernel_arguments(q, k, v, out, key_padding_mask, scale, upcast_softmax):
    """``(args, consts, grid)`` for one launch of ``_flash_attn_fwd_kernel``: its runtime arguments, the constexprs
    that are not a config's, and ``grid(meta)`` for a config's meta-parameters (BLOCK_M, DV0, DV1). What ``_launch``
    passes; ``benchmarks.ops.attention sweep`` launches chosen configs with them.

    q: (B, H, Lq, D), k and v: (B, H, Lk, D), out: (B, H, Lq, D), any strides, one of ``SUPPORTED_DTYPES``;
    key_padding_mask: None or a (B or 1, Lk) bool tensor (True = keep); scale: the softmax scale (> 0);
    upcast_softmax: fp32-accurate probabilities in P.V (ignored for fp32). Inputs are not checked here (see
    ``_check_inputs``)."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    elem = q.element_size()
    lq_bucket, lk_bucket = length_bucket(Lq), length_bucket(Lk)  # the autotuner's key
    sa = _stride_align(elem, q, k, v, out)
    if key_padding_mask is not None:
        kpm = key_padding_mask.view(torch.uint8)
        if kpm.shape[0] == 1 and B > 1:
            kpm = kpm.expand(B, Lk)
        mask_arg, smb, smn = kpm, kpm.stride(0), kpm.stride(1)
    else:
        mask_arg, smb, smn = q, 0, 0
    upcast = bool(upcast_softmax) and q.dtype != torch.float32
    # fp32 operands: 3xTF32 tensor-core dots (about fp32 accuracy); fp16/bf16 operands ignore it
    dot_prec = "tf32x3" if q.dtype == torch.float32 else "tf32"
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
    args = (
        q, k, v, out, mask_arg, float(scale) * LOG2E,
        qs[0] // sa, qs[1] // sa, qs[2] // sa, qs[3],
        ks[0] // sa, ks[1] // sa, ks[2] // sa, ks[3],
        vs[0] // sa, vs[1] // sa, vs[2] // sa, vs[3],
        os_[0] // sa, os_[1] // sa, os_[2] // sa, os_[3],
        smb, smn, H, Lq, Lk, lq_bucket, lk_bucket,
    )
    consts = dict(
        HEAD_DIM=D, SA=sa, HAS_MASK=key_padding_mask is not None, UPCAST=upcast, DOT_PREC=dot_prec,
        INTERPRET=interpret_mode(),
    )

    def grid(meta):
        return (triton.cdiv(Lq, meta["BLOCK_M"]), B * H, triton.cdiv(D, meta["DV0"] + meta["DV1"]))

    return args, consts, grid


def _launch(q, k, v, out, key_padding_mask, scale, upcast_softmax):
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    elem = q.element_size()
    lq_bucket, lk_bucket = length_bucket(Lq), length_bucket(Lk)
    args, consts, grid = kernel_arguments(q, k, v, out, key_padding_mask, scale, upcast_softmax)
    upcast = consts["UPCAST"]
    dev_index = q.device.index if q.device.type == "cuda" else 0
    if q.device.type == "cuda" and dev_index is None:
        dev_index = torch.cuda.current_device()
    kernel = _tuned_kernel(D, elem, q.device.type, dev_index)
    tkey = (D, q.dtype, q.device, lq_bucket, lk_bucket, key_padding_mask is not None, upcast)
    if tkey not in _tuned_keys and q.is_cuda and torch.cuda.is_current_stream_capturing():
        # Autotuning times kernels (synchronizes): impossible inside CUDA-graph capture. Launch the
        # first valid config instead; warm up outside capture to get the tuned one.
        if tkey not in _capture_logged:
            _capture_logged.add(tkey)
            log.warning("flash_attention: shape %s first seen during CUDA graph capture; untuned config", tkey)
        cfg = _prune_configs(kernel.configs, {"LQ": Lq, "LK": Lk}, UPCAST=upcast)[0]
        _flash_attn_fwd_kernel[grid(cfg.kwargs)](
            *args, **consts, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages
        )
        return out
    launch_autotuned(kernel, grid, *args, **consts)
    if not precompile.active():  # a compile-only pass tunes nothing
        _tuned_keys.add(tkey)
    return out


def _flash_attention_impl(q, k, v, key_padding_mask, scale, upcast_softmax):
    out = _empty_out(q)
    if q.shape[2] == 0:
        return out
    if k.shape[2] == 0:  # no key at all: same as every key padded
        return out.zero_()
    if HAS_TRITON and use_triton("flash_attention", q, k, v, key_padding_mask):
        return _launch(q, k, v, out, key_padding_mask, scale, upcast_softmax)
    out.copy_(attention_ref(q, k, v, key_padding_mask=key_padding_mask, scale=scale, upcast=True))
    return out


@torch.library.custom_op("sdfast::flash_attention", mutates_args=())
def _flash_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: Optional[torch.Tensor],
    scale: float,
    upcast_softmax: bool,
) -> torch.Tensor:
    return _flash_attention_impl(q, k, v, key_padding_mask, scale, upcast_softmax)


@_flash_attention_op.register_fake
def _flash_attention_fake(q, k, v, key_padding_mask, scale, upcast_softmax):
    return _empty_out(q)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    upcast_softmax: bool = False,
) -> torch.Tensor:
    """Flash attention forward (Triton), ``softmax(q @ k^T * scale) @ v`` per (batch, head).

    Args:
        q: (B, H, Lq, D); k, v: (B, H, Lk, D). fp16, bf16 or fp32, all the same dtype and device.
            Any strides: a (B, L, H, D) tensor viewed with ``.transpose(1, 2)`` is read in place.
            D (head_dim) in 1..512; SD uses 40, 64, 80, 160 and 512 (VAE). Lq, Lk any length.
        key_padding_mask: optional bool (B, Lk) or (1, Lk), True = keep. A padded key never enters
            the softmax; a query whose keys are all padded returns zeros (not NaN, unlike
            ``torch.softmax`` over all ``-inf``).
        scale: softmax scale (> 0), default ``D ** -0.5``.
        upcast_softmax: the kernel always accumulates q·k and P·V in fp32 and runs the softmax
            (scale, max, exp2, sums) in fp32, so scores never overflow fp16: that is already what
            diffusers' ``upcast_attention`` / ``upcast_softmax`` (SD 2.x) ask for, and products of
            fp16/bf16 numbers are exact in fp32, so casting q and k to fp32 first would not change
            q·k. What the flag changes: the probabilities P, normally rounded to the input dtype
            for the P·V tensor-core dot (as in FlashAttention), are split into P_hi + P_lo (both
            in the input dtype), so P·V sees P with about twice the mantissa bits, i.e. fp32-like
            P. Costs a second P·V dot (~+30 % time). No-op for fp32 inputs, whose dots run as
            3xTF32 (about fp32 accuracy; fp32 is a correctness path, not a tuned one).

    Returns:
        (B, H, Lq, D) in q's dtype; memory is laid out (B, Lq, H, D), so
        ``out.transpose(1, 2).reshape(B, Lq, H * D)`` does not copy.

    Raises:
        TypeError: dtype not fp16/bf16/fp32, dtypes differ, non-bool mask.
        ValueError: not 4D, mismatched shapes/devices, bad mask shape, non-positive scale.
        NotImplementedError: head_dim outside 1..512.

    Runs the Triton kernel on CUDA (or on CPU under ``TRITON_INTERPRET=1``), else the PyTorch
    reference through ``kernels.dispatch.use_triton`` (logged). Registered as the custom op
    ``torch.ops.sdfast.flash_attention``. The first call of a new (Lq, Lk, D, dtype, mask, upcast)
    autotunes (a few configs); do that before CUDA-graph capture.
    """
    _check_inputs(q, k, v, key_padding_mask, scale)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return torch.ops.sdfast.flash_attention(q, k, v, key_padding_mask, float(scale), bool(upcast_softmax))
