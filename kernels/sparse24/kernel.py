"""``sparse24_linear``: ``y = x @ decompress_24(values, meta)^T + bias`` in one Triton kernel, and its reference.

The kernel reads our compressed format (:mod:`kernels.sparse24.format`: half the weight bytes plus 1/8 of
metadata) and decompresses each tile in registers, then multiplies on dense tensor cores (Triton has no
``mma.sp``): it can only pay where the weight read dominates (small M). K is a ``constexpr`` of the kernel (one
compile per K; a runtime loop bound breaks the interpreter under numpy >= 2.4). bf16 is tested on the GPU only:
Triton 3.6's interpreter computes bf16 ``tl.dot`` on raw bits.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.dispatch import log_fallback, use_triton
from kernels.sparse24.format import decompress_24

try:  # triton is installed in CI and on the GPU machine; the reference path works without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

HAS_TRITON = triton is not None  # the reference runs without it

__all__ = ["HAS_TRITON", "sparse24_linear_ref", "sparse24_linear", "sparse24_linear_configs"]


def sparse24_linear_ref(
    x: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    upcast: bool = False,
) -> torch.Tensor:
    """Plain-PyTorch reference: ``x: (..., K)`` @ ``decompress_24(values, meta)^T`` ``(K, N)`` + ``bias (N,)``.

    With ``upcast=True`` computes in float32 and returns float32 (the ``ref32`` of the tests).
    """
    w = decompress_24(values, meta)
    if upcast:
        return F.linear(x.float(), w.float(), None if bias is None else bias.float())
    return F.linear(x, w, bias)


if triton is not None:

    @triton.jit
    def _sparse24_linear_kernel(
        x_ptr,  # (M, K) activations, unit stride along K, row stride stride_xm
        v_ptr,  # (N, K // 2) kept values, unit stride along K // 2, row stride stride_vn
        meta_ptr,  # (N, ceil(K / 8)) uint8 metadata, unit stride, row stride stride_en
        bias_ptr,  # (N,) bias; not read when HAS_BIAS is False
        y_ptr,  # (M, N) output, unit stride along N, row stride stride_ym
        M,
        N,
        K: tl.constexpr,  # constexpr: a runtime loop bound breaks Triton 3.6's interpreter under numpy >= 2.4
        stride_xm,
        stride_vn,
        stride_en,
        stride_ym,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,  # dense K per step; multiple of 16
        GROUP_M: tl.constexpr,
    ):
        # grouped program order for L2 reuse (Triton tutorial 03-matrix-multiplication)
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        HALF: tl.constexpr = BLOCK_K // 2
        GROUPS: tl.constexpr = BLOCK_K // 4
        BYTES: tl.constexpr = BLOCK_K // 8
        offs_k = tl.arange(0, BLOCK_K)
        offs_h = tl.arange(0, HALF)
        offs_b = tl.arange(0, BYTES)
        k_half = K // 2
        k_bytes = (K + 7) // 8

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                mask=mask_m[:, None] & (kk[None, :] < K),
                other=0.0,
            )
            hh = k0 // 2 + offs_h
            vals = tl.load(
                v_ptr + offs_n[:, None] * stride_vn + hh[None, :],
                mask=mask_n[:, None] & (hh[None, :] < k_half),
                other=0.0,
            )  # (BLOCK_N, HALF)
            bb = k0 // 8 + offs_b
            meta = tl.load(
                meta_ptr + offs_n[:, None] * stride_en + bb[None, :],
                mask=mask_n[:, None] & (bb[None, :] < k_bytes),
                other=0,
            ).to(tl.int32)  # (BLOCK_N, BYTES)
            # one 4-bit code per group: even group in the low nibble, odd group in the high nibble
            nib = tl.reshape(tl.join(meta & 15, meta >> 4), (BLOCK_N, GROUPS))
            i0 = nib & 3
            i1 = nib >> 2
            v0, v1 = tl.split(tl.reshape(vals, (BLOCK_N, GROUPS, 2)))
            zero = tl.zeros_like(v0)
            d0 = tl.where(i0 == 0, v0, tl.where(i1 == 0, v1, zero))
            d1 = tl.where(i0 == 1, v0, tl.where(i1 == 1, v1, zero))
            d2 = tl.where(i0 == 2, v0, tl.where(i1 == 2, v1, zero))
            d3 = tl.where(i0 == 3, v0, tl.where(i1 == 3, v1, zero))
            # join(join(d0, d2), join(d1, d3)) flattens to d0, d1, d2, d3 per group
            w = tl.reshape(tl.join(tl.join(d0, d2), tl.join(d1, d3)), (BLOCK_N, BLOCK_K))
            acc = tl.dot(x, tl.trans(w), acc)

        if HAS_BIAS:
            b = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc += b[None, :]
        tl.store(
            y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_n[None, :],
        )


def sparse24_linear_configs(device: torch.device | None = None) -> list[dict]:
    """Launch configs valid on ``device`` (dicts of BLOCK_M/BLOCK_N/BLOCK_K/GROUP_M/num_warps/num_stages),
    in the launcher's order of preference for small, medium and large M.

    Under the interpreter (CPU) a single small config. On CUDA, those whose shared memory
    (x tile + compressed weight tile + metadata, per stage) fits the device's opt-in limit.
    """
    if device is None or torch.device(device).type != "cuda":
        return [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=4, num_warps=1, num_stages=1)]
    return [dict(c) for c in _cuda_configs(torch.device(device).index or 0)]


@functools.lru_cache(maxsize=None)
def _cuda_configs(index: int) -> tuple[dict, ...]:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    # BLOCK_K 64 for the small-M tiles: with BLOCK_K 128 Triton 3.6 failed to compile them on sm_90
    # ("Illegal shared layout")
    cands = [(16, 128, 64, 4, 4), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 2)]
    out = []
    for bm, bn, bk, warps, stages in cands:
        need = stages * (bm * bk * 2 + bn * (bk + bk // 8))
        if need <= smem:
            out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages))
    return tuple(out)


def _launch_sparse24(x2d, values, meta, bias, y, cfg) -> None:
    M, K = x2d.shape
    N = values.shape[0]
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _sparse24_linear_kernel[grid](
        x2d,
        values,
        meta,
        bias if bias is not None else values,
        y,
        M,
        N,
        K,
        x2d.stride(0),
        values.stride(0),
        meta.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def _pick_configs(m: int, device: torch.device) -> list[dict]:
    """Heuristic, no autotuning (K is a constexpr, so each config compiles once per K): BLOCK_M 16
    for M <= 32, 64 for M <= 256, else 128, then the other valid configs (tried in order when one
    does not compile here, see ``_launch_first_compiling``)."""
    cfgs = sparse24_linear_configs(device)
    if not cfgs:
        raise RuntimeError(f"sparse24_linear: no launch config fits the shared memory of {device}")
    want = 16 if m <= 32 else 64 if m <= 256 else 128
    return sorted(cfgs, key=lambda c: c["BLOCK_M"] != want)


_FAILED_CONFIGS: set = set()  # (device index, K, dtype, config) that Triton failed to compile


def _launch_first_compiling(x2d, values, meta, bias, y) -> None:
    """Launch with the preferred config; a config that Triton fails to compile (a compiler error is an
    exception, raised before anything runs) is remembered and the next one is tried, logged once."""
    errors = []
    for cfg in _pick_configs(x2d.shape[0], x2d.device):
        key = (x2d.device.index, x2d.shape[1], x2d.dtype, tuple(sorted(cfg.items())))
        if key in _FAILED_CONFIGS:
            continue
        try:
            _launch_sparse24(x2d, values, meta, bias, y, cfg)
            return
        except torch.OutOfMemoryError:
            raise  # not the config's fault
        except RuntimeError as e:  # Triton's "PassManager::run failed" and kin
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            _FAILED_CONFIGS.add(key)
            errors.append(f"{cfg}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            log_fallback("sparse24_linear", f"config {cfg} did not compile for K={x2d.shape[1]}; trying the next")
    raise RuntimeError("sparse24_linear: no launch config compiled: " + "; ".join(errors))


@torch.library.custom_op("sdfast::sparse24_linear", mutates_args=())
def _sparse24_linear_op(
    x2d: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if not use_triton("sparse24_linear", x2d, values, meta, bias):
        return sparse24_linear_ref(x2d, values, meta, bias)
    M = x2d.shape[0]
    N = values.shape[0]
    y = torch.empty(M, N, dtype=x2d.dtype, device=x2d.device)
    if M == 0:
        return y
    _launch_first_compiling(x2d, values, meta, bias, y)
    return y


@_sparse24_linear_op.register_fake
def _(x2d, values, meta, bias):
    return x2d.new_empty(x2d.shape[0], values.shape[0])


def sparse24_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y = x @ W^T + bias`` with W given compressed 2:4 (``compress_24``), decompressed inside the kernel.

    x: (..., K) float16/bfloat16/float32, last dim contiguous (copied otherwise);
    values: (N, K // 2) same dtype; meta: (N, ceil(K / 8)) uint8; bias: (N,) same dtype or None.
    Returns (..., N) in x's dtype (fp32 accumulation). Runs the Triton kernel on CUDA (or on CPU
    under ``TRITON_INTERPRET=1``), else the reference (logged once by ``kernels.dispatch``).
    The kernel reads half the weight bytes plus 1/8 of metadata but computes on dense tensor cores
    (Triton has no ``mma.sp``), so it can only pay where the weight read dominates (small M).
    Registered as ``torch.ops.sdfast.sparse24_linear`` (x flattened to 2-D). Raises TypeError /
    ValueError on dtype/shape/device mismatches.
    """
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (..., K)")
    if values.dim() != 2 or meta.dim() != 2:
        raise ValueError(f"values (N, K//2) and meta (N, ceil(K/8)) must be 2-D, got {tuple(values.shape)}, {tuple(meta.shape)}")
    N, K = values.shape[0], values.shape[1] * 2
    if x.shape[-1] != K:
        raise ValueError(f"x has K={x.shape[-1]} but values (N, K//2)={tuple(values.shape)} imply K={K}")
    if K % 4 != 0:
        raise ValueError(f"K={K} must be a multiple of 4")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x dtype {x.dtype} not supported (float16, bfloat16, float32)")
    if values.dtype != x.dtype:
        raise TypeError(f"values dtype {values.dtype} must equal x dtype {x.dtype}")
    if meta.dtype != torch.uint8 or tuple(meta.shape) != (N, (K // 4 + 1) // 2):
        raise TypeError(f"meta must be uint8 of shape {(N, (K // 4 + 1) // 2)}, got {meta.dtype} {tuple(meta.shape)}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be ({N},) in {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    devs = {t.device for t in (x, values, meta, bias) if t is not None}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")
    x2d = x.reshape(-1, K)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    values = values if values.stride(-1) == 1 else values.contiguous()
    meta = meta if meta.stride(-1) == 1 else meta.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.ops.sdfast.sparse24_linear(x2d, values, meta, bias)
    return y.reshape(*x.shape[:-1], N)
