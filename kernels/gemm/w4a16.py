"""W4A16 weight-only linear: packed int4 weights, per-group scales and zeros, fp16/bf16 activations.

Weight format (shared by the Triton kernel, the CUDA C++ kernel in ``kernels/csrc`` and the
AWQ / GPTQ / round-to-nearest quantizers in ``sdfast.quantization``):

* ``qweight``: int32 (N, ceil(K/8)). Weight element ``(n, k)`` is the unsigned 4-bit value in bits
  ``[4*(k % 8), 4*(k % 8) + 4)`` of ``qweight[n, k // 8]``: sequential nibble order along K, lowest
  nibble first (not AWQ's interleaved ``[0, 2, 4, 6, 1, 3, 5, 7]`` order). K is zero-padded to a
  multiple of 8.
* ``scales``: float (N, G) and ``zeros``: uint8 (N, G) with ``G = ceil(K / group_size)``: group ``g``
  covers ``k in [g*group_size, (g+1)*group_size)`` (the last group may be shorter when
  ``K % group_size != 0``). Asymmetric dequantization: ``w[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g]``.
* optional ``smooth``: (K,) per-input-channel multiplier on the activations (AWQ's ``1/s``, see
  ``sdfast.quantization.awq``), fused into the kernel's A-tile load.

The Triton kernel loads a (BLOCK_N, BLOCK_K/8) int32 tile per K step (pipelined with ``num_stages``),
unpacks it in registers with shifts, dequantizes with the tile's group scale/zero in fp32 and feeds
the fp16/bf16 tile to ``tl.dot`` (fp32 accumulation). ``BLOCK_K`` divides ``group_size``, so each K
tile lies in one group.

Sources: AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"), GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers").
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.dispatch import interpret_mode, launch_autotuned, use_triton
from kernels.gemm._common import autotune_bench, device_index, even_k, grouped_tile, interp_meta, smem_limit

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# packing and group quantization
# --------------------------------------------------------------------------------------------
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack unsigned 4-bit values (N, K) (any integer dtype, values in [0, 15]) into int32 (N, ceil(K/8)).

    Element k goes to bits ``4*(k % 8)`` of word ``k // 8`` (lowest nibble first); K is zero-padded.
    Raises ValueError for values outside [0, 15].
    """
    if q.dim() != 2:
        raise ValueError(f"pack_int4: expected (N, K), got {tuple(q.shape)}")
    qi = q.to(torch.int64)
    if qi.numel() and (qi.min() < 0 or qi.max() > 15):
        raise ValueError(f"pack_int4: values must be in [0, 15], got [{int(qi.min())}, {int(qi.max())}]")
    N, K = qi.shape
    KW = -(-K // 8)
    qi = torch.nn.functional.pad(qi, (0, KW * 8 - K)).view(N, KW, 8)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    words = (qi << shifts).sum(dim=-1)  # < 2**32
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement into int32
    return words.to(torch.int32).contiguous()


def unpack_int4(packed: torch.Tensor, K: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 (N, ceil(K/8)) -> uint8 (N, K)."""
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[1] != -(-K // 8):
        raise ValueError(f"unpack_int4: expected int32 (N, {-(-K // 8)}), got {packed.dtype} {tuple(packed.shape)}")
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    q = (packed[:, :, None] >> shifts) & 0xF
    return q.reshape(packed.shape[0], -1)[:, :K].to(torch.uint8)


def _groups(K: int, group_size: int) -> int:
    return -(-K // group_size)


def check_group_size(K: int, group_size: int) -> None:
    """Raise ValueError unless ``group_size`` is a positive multiple of 16 (K needs no relation to it)."""
    if group_size <= 0 or group_size % 16:
        raise ValueError(f"W4A16: group_size must be a positive multiple of 16, got {group_size} (K={K})")


def quantize_int4_groups(
    weight: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric int4 per (row, K-group): min/max -> scale = (max-min)/15, zero = round(-min/scale).

    weight: (N, K) float. Returns ``q`` uint8 (N, K) in [0, 15], ``scales`` fp32 (N, G), ``zeros`` uint8 (N, G).
    """
    N, K = weight.shape
    check_group_size(K, group_size)
    G = _groups(K, group_size)
    w = weight.float()
    pad = G * group_size - K
    wp = torch.nn.functional.pad(w, (0, pad)).view(N, G, group_size)
    if pad:  # padded entries must not widen the last group's range: repeat a real value
        last = wp[:, -1, : group_size - pad]
        wp[:, -1, group_size - pad:] = last[:, :1]
    wmin = wp.amin(dim=2).clamp(max=0.0)
    wmax = wp.amax(dim=2).clamp(min=0.0)
    scales = ((wmax - wmin) / 15.0).clamp_min(1e-8)
    zeros = torch.round(-wmin / scales).clamp(0, 15)
    q = torch.round(wp / scales[:, :, None] + zeros[:, :, None]).clamp(0, 15)
    q = q.view(N, G * group_size)[:, :K].to(torch.uint8).contiguous()
    return q, scales, zeros.to(torch.uint8)


def quantize_w4(
    weight: torch.Tensor, group_size: int = 128, scale_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest W4A16 quantization, packed: ``(qweight int32 (N, ceil(K/8)), scales (N, G), zeros uint8 (N, G))``.

    ``scales`` are stored in ``scale_dtype`` (default: ``weight.dtype``).
    """
    q, s, z = quantize_int4_groups(weight, group_size)
    return pack_int4(q), s.to(scale_dtype or weight.dtype), z


def dequantize_w4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, K: int, group_size: int = 128
) -> torch.Tensor:
    """(N, K) fp32 weight from the packed format: ``(q - zeros[:, k // group_size]) * scales[:, k // group_size]``."""
    q = unpack_int4(qweight, K).float()
    g = torch.arange(K, device=qweight.device) // group_size
    return (q - zeros.float()[:, g]) * scales.float()[:, g]


# --------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------
def w4a16_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group_size: int = 128,
    smooth: torch.Tensor | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """Dequantize-then-matmul: ``(x * smooth) @ dequantize_w4(...)^T + bias``.

    x: (..., K). With ``upcast`` the matmul runs in fp32, else in ``x.dtype``. Returns (..., N) in x.dtype.
    """
    K = x.shape[-1]
    w = dequantize_w4(qweight, scales, zeros, K, group_size)
    ct = torch.float32 if upcast else x.dtype
    xx = x.to(ct)
    if smooth is not None:
        xx = (x.float() * smooth.float()).to(x.dtype).to(ct)  # the kernel rounds x*smooth to x.dtype
    y = xx @ w.to(ct).t()
    if bias is not None:
        y = y + bias.to(ct)
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _w4a16_kernel(
    x_ptr,  # (M, K) fp16 / bf16 / fp32 activations
    qw_ptr,  # (N, ceil(K/8)) int32 packed int4 weight, contiguous
    scales_ptr,  # (N, G) float per-group scales, contiguous
    zeros_ptr,  # (N, G) uint8 per-group zero points, contiguous
    smooth_ptr,  # (K,) fp32 per-input-channel multiplier; unused when HAS_SMOOTH is False
    bias_ptr,  # (N,) bias; unused when HAS_BIAS is False
    out_ptr,  # (M, N) output
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    HAS_SMOOTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    K_TILES: tl.constexpr,  # > 0: K-loop trip count as a constexpr (interpreter); 0: computed at run time
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # multiple of 8, divides GROUP_SIZE
    GROUP_M: tl.constexpr,
):
    KW = (K + 7) // 8  # int32 words per packed row
    G = (K + GROUP_SIZE - 1) // GROUP_SIZE  # groups per row
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.max_contiguous(tl.multiple_of(offs_m % M, BLOCK_M), BLOCK_M)
    rn = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4

    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk
    qw_ptrs = qw_ptr + rn[:, None].to(tl.int64) * KW + rw[None, :]  # (BLOCK_N, BLOCK_K // 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, K_TILES if K_TILES > 0 else tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            packed = tl.load(qw_ptrs)
        else:
            a = tl.load(x_ptrs, mask=rk[None, :] < K - kt * BLOCK_K, other=0.0)
            packed = tl.load(qw_ptrs, mask=rw[None, :] < KW - kt * (BLOCK_K // 8), other=0)
        if HAS_SMOOTH:
            sk = kt * BLOCK_K + rk
            sm = tl.load(smooth_ptr + sk, mask=sk < K, other=0.0)
            a = (a.to(tl.float32) * sm[None, :]).to(x_ptr.dtype.element_ty)
        g = (kt * BLOCK_K) // GROUP_SIZE
        s = tl.load(scales_ptr + rn * G + g).to(tl.float32)
        z = tl.load(zeros_ptr + rn * G + g).to(tl.float32)
        q = (packed[:, :, None] >> shifts[None, None, :]) & 0xF  # (BLOCK_N, BLOCK_K // 8, 8)
        q = tl.reshape(q, (BLOCK_N, BLOCK_K))
        w = ((q.to(tl.float32) - z[:, None]) * s[:, None]).to(x_ptr.dtype.element_ty)
        if IEEE:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        x_ptrs += BLOCK_K * stride_xk
        qw_ptrs += BLOCK_K // 8

    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)
_GPU_CONFIGS = (
    (128, 128, 64, 4, 8),
    (64, 128, 64, 4, 4),
    (128, 64, 128, 3, 8),
    (32, 128, 128, 4, 4),  # small M (cross-attention K/V on 154 tokens)
)


def w4a16_configs(device: torch.device, group_size: int, elem_bytes: int = 2) -> list[triton.Config]:
    """Configs whose ``BLOCK_K`` divides ``group_size`` and whose pipelined tiles (A in ``elem_bytes``,
    packed B at half a byte per weight) fit the device's shared memory. One small config under the interpreter."""
    if device.type != "cuda":
        bk = 32 if group_size % 32 == 0 else 16
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": bk, "GROUP_M": 4}, num_warps=4, num_stages=1)]
    limit = smem_limit(device.index if device.index is not None else torch.cuda.current_device())
    out = []
    for bm, bn, bk, st, nw in _GPU_CONFIGS:
        if group_size % bk:
            continue
        if st * (bm * bk * elem_bytes + bn * bk // 2) <= limit:
            out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=nw, num_stages=st))
    if not out:
        bk = max(b for b in (16, 32, 64) if group_size % b == 0)
        out.append(triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=4, num_stages=3))
    return out


@functools.lru_cache(maxsize=None)
def _tuned(device_index: int, group_size: int, elem_bytes: int):
    return triton.autotune(
        configs=w4a16_configs(torch.device("cuda", device_index), group_size, elem_bytes),
        key=["M", "N", "K", "GROUP_SIZE", "HAS_SMOOTH", "HAS_BIAS", "IEEE"],
        do_bench=autotune_bench,
        cache_results=True,
    )(triton.heuristics({"EVEN_K": even_k})(_w4a16_kernel))


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------
def check_w4_args(x, qweight, scales, zeros, bias, group_size, smooth, what="w4a16_linear") -> tuple[int, int]:
    """Validate the packed-int4 argument set; returns (K, N). Raises ValueError / TypeError."""
    K = x.shape[-1]
    check_group_size(K, group_size)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{what}: x dtype {x.dtype} not supported ({_FLOAT_DTYPES})")
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[1] != -(-K // 8):
        raise ValueError(f"{what}: qweight must be int32 (N, {-(-K // 8)}) for K={K}, got {qweight.dtype} {tuple(qweight.shape)}")
    N = qweight.shape[0]
    G = _groups(K, group_size)
    if tuple(scales.shape) != (N, G) or not scales.is_floating_point():
        raise ValueError(f"{what}: scales must be float ({N}, {G}), got {scales.dtype} {tuple(scales.shape)}")
    if tuple(zeros.shape) != (N, G) or zeros.dtype != torch.uint8:
        raise ValueError(f"{what}: zeros must be uint8 ({N}, {G}), got {zeros.dtype} {tuple(zeros.shape)}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{what}: bias must be ({N},), got {tuple(bias.shape)}")
    if smooth is not None and tuple(smooth.shape) != (K,):
        raise ValueError(f"{what}: smooth must be ({K},), got {tuple(smooth.shape)}")
    return K, N


@torch.library.custom_op("sdfast::w4a16_linear", mutates_args=())
def _w4a16_op(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bias: torch.Tensor | None,
    smooth: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    K, N = check_w4_args(x, qweight, scales, zeros, bias, group_size, smooth)
    if not use_triton("w4a16_linear", x, qweight, scales, zeros, bias, smooth):
        return w4a16_linear_ref(x, qweight, scales, zeros, bias, group_size=group_size, smooth=smooth)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return out.reshape(*lead, N)
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    sm = smooth.float().contiguous() if smooth is not None else out
    args = (x2, qweight, scales, zeros, sm, bias if bias is not None else out, out, M, N, K,
            x2.stride(0), x2.stride(1), out.stride(0))
    meta = dict(GROUP_SIZE=group_size, HAS_SMOOTH=smooth is not None, HAS_BIAS=bias is not None,
                IEEE=x.dtype == torch.float32)
    if x.is_cuda and not interpret_mode():
        kernel = _tuned(device_index(x), group_size, x.element_size())

        def grid(m):
            return (triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"]),)

        launch_autotuned(kernel, grid, *args, **meta, K_TILES=0)
    else:
        cfg = w4a16_configs(x.device, group_size)[0]
        grid = (triton.cdiv(M, cfg.kwargs["BLOCK_M"]) * triton.cdiv(N, cfg.kwargs["BLOCK_N"]),)
        _w4a16_kernel[grid](*args, **meta, **interp_meta(K, cfg.kwargs["BLOCK_K"]), **cfg.kwargs,
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.reshape(*lead, N)


@_w4a16_op.register_fake
def _(x, qweight, scales, zeros, bias, smooth, group_size):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group_size: int = 128,
    smooth: torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A16 linear with the int4 weight dequantized in the GEMM main loop (op ``sdfast::w4a16_linear``).

    x: (..., K) fp16 / bf16 / fp32; qweight: int32 (N, ceil(K/8)) (format in the module docstring);
    scales: float (N, ceil(K/group_size)); zeros: uint8 (N, ceil(K/group_size)); bias: optional (N,);
    smooth: optional (K,) activation multiplier (AWQ). Any K (odd K is masked; a last partial group
    is allowed); ``group_size`` a multiple of 16. Returns (..., N) in ``x.dtype``.

    Raises: ValueError (shapes / group_size), TypeError (dtype).
    """
    return _w4a16_op(x, qweight, scales, zeros, bias, smooth, int(group_size))


__all__ = [
    "pack_int4", "unpack_int4", "quantize_int4_groups", "quantize_w4", "dequantize_w4", "check_group_size",
    "w4a16_linear", "w4a16_linear_ref", "w4a16_configs", "check_w4_args",
]
