"""W8A8 linear: 8-bit weights × 8-bit activations, int8 (SmoothQuant) or FP8 E4M3.

Method: SmoothQuant (Xiao et al. 2022, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models"). Weights are quantized per output channel (symmetric),
activations per token at run time (dynamic, symmetric). Activation outliers are migrated into the
weights by per-input-channel smoothing factors

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)        (alpha = 0.5 by default)

so that ``X W^T = (X diag(1/s)) (W diag(s))^T``. The ``1/s`` multiply is fused into the activation
quantize kernel (``smooth`` argument), so no previous op has to be rewritten.

Two kernels:

* ``quantize_per_token``: one program per block of rows: row absmax of ``x * smooth`` (pass 1), scale =
  absmax / qmax, round-to-nearest-even and saturate (pass 2). qmax = 127 (int8) or 448 (E4M3).
* ``w8a8_gemm``: int8 × int8 → int32 ``tl.dot`` (or fp8 × fp8 → fp32 on sm_89+), K-loop pipelined
  over ``num_stages``, epilogue ``acc * a_scale[m] * w_scale[n] + bias[n]`` in fp32, one store.
  With ``group_size`` (ZeroQuant, Yao et al. 2022: group-wise weights, token-wise activations) the
  weight scale is per (n, K-group): each K tile's int32 partial product is scaled by its group's
  weight scale and accumulated in fp32 (``BLOCK_K`` divides ``group_size``).

FP8 uses ``torch.float8_e4m3fn``; Triton's fp8 ``tl.dot`` needs sm_89+ (Ada/Hopper): on an older GPU
the launcher raises ``NotImplementedError``. Under ``TRITON_INTERPRET=1`` (CPU) the kernel runs in
the interpreter; a CPU tensor without the interpreter runs the reference (logged by the dispatch).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.dispatch import interpret_mode, launch_autotuned, log_fallback, use_triton
from kernels.gemm._common import (
    autotune_bench,
    device_index,
    even_k,
    grouped_tile,
    interp_meta,
    round_half_even,
    smem_limit,
)

INT8_QMAX = 127.0
FP8_QMAX = 448.0  # largest finite float8_e4m3fn
QDTYPES = (torch.int8, torch.float8_e4m3fn)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _qmax(dtype: torch.dtype) -> float:
    if dtype == torch.int8:
        return INT8_QMAX
    if dtype == torch.float8_e4m3fn:
        return FP8_QMAX
    raise TypeError(f"W8A8: quantized dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")


def _to_q(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round (int8: half to even) and saturate fp32 values already divided by their scale."""
    qmax = _qmax(dtype)
    if dtype == torch.int8:
        return torch.round(v).clamp_(-qmax, qmax).to(torch.int8)
    return v.clamp(-qmax, qmax).to(dtype)


# --------------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------------
def quantize_per_token_ref(
    x: torch.Tensor, smooth: torch.Tensor | None = None, dtype: torch.dtype = torch.int8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token symmetric quantization.

    x: (M, K) float; smooth: optional (K,) multiplier applied first (SmoothQuant's ``1/s``).
    Returns ``q`` (M, K) ``dtype`` and ``scale`` (M,) fp32 with ``x * smooth ≈ q * scale[:, None]``.
    Rows of zeros get scale ``1e-8 / qmax`` and q = 0.
    """
    qmax = _qmax(dtype)
    xf = x.float()
    if smooth is not None:
        xf = xf * smooth.float()
    scale = xf.abs().amax(dim=-1).clamp_min(1e-8) / qmax
    inv = 1.0 / scale
    return _to_q(xf * inv[:, None], dtype), scale


def quantize_weight_per_channel(
    weight: torch.Tensor, dtype: torch.dtype = torch.int8, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric weight quantization per output channel (``group_size=None``) or per (channel, K-group).

    weight: (N, K) float. Returns ``q`` (N, K) ``dtype`` and ``scale`` fp32, (N,) or (N, ceil(K/group_size));
    the last group may be shorter than ``group_size``.
    """
    qmax = _qmax(dtype)
    w = weight.float()
    N, K = w.shape
    if group_size is None:
        scale = w.abs().amax(dim=1).clamp_min(1e-8) / qmax
        return _to_q(w / scale[:, None], dtype), scale
    G = -(-K // group_size)
    pad = G * group_size - K
    wp = torch.nn.functional.pad(w, (0, pad)).view(N, G, group_size)
    scale = wp.abs().amax(dim=2).clamp_min(1e-8) / qmax
    q = _to_q(wp / scale[:, :, None], dtype).view(N, G * group_size)[:, :K]
    return q.contiguous(), scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize_weight_per_channel`: (N, K) fp32."""
    qf = q.float()
    if group_size is None:
        return qf * scale.float()[:, None]
    N, K = q.shape
    idx = torch.arange(K, device=q.device) // group_size
    return qf * scale.float()[:, idx]


def smoothquant_scales(
    act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float = 0.5, eps: float = 1e-5
) -> torch.Tensor:
    """SmoothQuant factors ``s_j = max|X_j|^alpha / max_n|W_nj|^(1-alpha)`` (K,), fp32.

    act_absmax: (K,) per-input-channel activation absmax from calibration; weight: (N, K).
    Quantize ``weight * s`` and feed ``smooth = 1 / s`` to :func:`quantize_per_token`.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smoothquant_scales: alpha must be in [0, 1], got {alpha}")
    a = act_absmax.float().clamp_min(eps)
    w = weight.float().abs().amax(dim=0).clamp_min(eps)
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    return s.clamp_min(eps)


def w8a8_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    smooth: torch.Tensor | None = None,
    group_size: int | None = None,
) -> torch.Tensor:
    """Dequantize-then-matmul reference: quantize x per token, dequantize both, fp32 matmul, + bias.

    x: (..., K); qweight: (N, K) int8 / float8_e4m3fn; w_scale: (N,) or (N, G). Returns (..., N) in x.dtype.
    """
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    q, s = quantize_per_token_ref(x2, smooth, qweight.dtype)
    xd = q.float() * s[:, None]
    wd = dequantize_weight(qweight, w_scale, group_size)
    y = xd @ wd.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _quantize_per_token_kernel(
    x_ptr,  # (M, K) float activations
    smooth_ptr,  # (K,) fp32 per-input-channel multiplier; unused when HAS_SMOOTH is False
    q_ptr,  # (M, K) int8 / float8_e4m3fn output, contiguous
    scale_ptr,  # (M,) fp32 output: per-token scale
    M,
    stride_xm,
    stride_xk,
    K,
    QMAX: tl.constexpr,
    IS_FP8: tl.constexpr,
    HAS_SMOOTH: tl.constexpr,
    K_TILES: tl.constexpr,  # > 0: K-loop trip count as a constexpr (interpreter); 0: computed at run time
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for kt in range(0, K_TILES if K_TILES > 0 else tl.cdiv(K, BLOCK_K)):
        rk = kt * BLOCK_K + cols
        m2 = rmask[:, None] & (rk[None, :] < K)
        v = tl.load(x_ptr + rows64[:, None] * stride_xm + rk[None, :] * stride_xk, mask=m2, other=0.0).to(tl.float32)
        if HAS_SMOOTH:
            v = v * tl.load(smooth_ptr + rk, mask=rk < K, other=0.0)[None, :]
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=1), 1e-8) / QMAX
    inv = 1.0 / scale
    tl.store(scale_ptr + rows, scale, mask=rmask)
    for kt in range(0, K_TILES if K_TILES > 0 else tl.cdiv(K, BLOCK_K)):
        rk = kt * BLOCK_K + cols
        m2 = rmask[:, None] & (rk[None, :] < K)
        v = tl.load(x_ptr + rows64[:, None] * stride_xm + rk[None, :] * stride_xk, mask=m2, other=0.0).to(tl.float32)
        if HAS_SMOOTH:
            v = v * tl.load(smooth_ptr + rk, mask=rk < K, other=0.0)[None, :]
        v = v * inv[:, None]
        if IS_FP8:
            q = tl.clamp(v, -QMAX, QMAX).to(q_ptr.dtype.element_ty)
        else:
            q = tl.clamp(round_half_even(v), -QMAX, QMAX).to(tl.int8)
        tl.store(q_ptr + rows64[:, None] * K + rk[None, :], q, mask=m2)


@triton.jit
def _w8a8_gemm_kernel(
    a_ptr,  # (M, K) int8 / fp8 quantized activations, contiguous
    b_ptr,  # (N, K) int8 / fp8 quantized weight, contiguous
    a_scale_ptr,  # (M,) fp32 per-token scale
    b_scale_ptr,  # (N,) fp32 per-channel scale, or (N, G) per-group when GROUP_SIZE > 0
    bias_ptr,  # (N,) bias; unused when HAS_BIAS is False
    out_ptr,  # (M, N) output
    M,
    N,
    K,
    stride_sn,  # row stride of b_scale (G when grouped)
    stride_om,
    HAS_BIAS: tl.constexpr,
    IS_FP8: tl.constexpr,
    GROUP_SIZE: tl.constexpr,  # 0: per-channel weight scale; else per (n, K-group), BLOCK_K | GROUP_SIZE
    K_TILES: tl.constexpr,  # > 0: K-loop trip count as a constexpr (interpreter); 0: computed at run time
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.max_contiguous(tl.multiple_of(offs_m % M, BLOCK_M), BLOCK_M)
    rn = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * K + rk[None, :]
    b_ptrs = b_ptr + rn[None, :].to(tl.int64) * K + rk[:, None]  # (BLOCK_K, BLOCK_N) view of W^T

    if GROUP_SIZE == 0 and not IS_FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, K_TILES if K_TILES > 0 else tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        if GROUP_SIZE == 0:
            if IS_FP8:
                acc = tl.dot(a, b, acc)
            else:
                acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        else:
            if IS_FP8:
                part = tl.dot(a, b)
            else:
                part = tl.dot(a, b, out_dtype=tl.int32).to(tl.float32)
            g = (kt * BLOCK_K) // GROUP_SIZE
            bs = tl.load(b_scale_ptr + rn * stride_sn + g)
            acc += part * bs[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    a_s = tl.load(a_scale_ptr + rm)
    y = acc.to(tl.float32) * a_s[:, None]
    if GROUP_SIZE == 0:
        y = y * tl.load(b_scale_ptr + rn)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps) for 1-byte operands.
_GPU_CONFIGS_8BIT = (
    (128, 128, 128, 4, 8),
    (128, 256, 128, 3, 8),
    (64, 128, 128, 4, 4),
    (64, 64, 128, 4, 4),  # small M (cross-attention K/V on 154 tokens) and narrow N
)


def gemm8_configs(device: torch.device, group_size: int = 0) -> list[triton.Config]:
    """Configs for 8-bit operand GEMMs whose pipeline fits the device's shared memory and whose
    ``BLOCK_K`` divides ``group_size`` (when grouped). One small config under the interpreter."""
    if device.type != "cuda":
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}, num_warps=4, num_stages=1)]
    limit = smem_limit(device.index if device.index is not None else torch.cuda.current_device())
    out = []
    for bm, bn, bk, st, nw in _GPU_CONFIGS_8BIT:
        if group_size and group_size % bk:
            continue
        if st * (bm + bn) * bk <= limit:
            out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=nw, num_stages=st))
    if not out and group_size and group_size % 32 == 0:
        out.append(triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=2))
    return out


@functools.lru_cache(maxsize=None)
def _tuned_gemm(device_index: int, group_size: int):
    cfgs = gemm8_configs(torch.device("cuda", device_index), group_size)
    if not cfgs:
        raise ValueError(f"w8a8_gemm: group_size={group_size} has no valid tile config (needs a multiple of 32)")
    return triton.autotune(configs=cfgs, key=["M", "N", "K", "HAS_BIAS", "IS_FP8", "GROUP_SIZE"], do_bench=autotune_bench, cache_results=True)(
        triton.heuristics({"EVEN_K": even_k})(_w8a8_gemm_kernel))


def check_fp8_supported(
    t: torch.Tensor, what: str, advice: str = "Use int8 (W8A8Config(dtype='int8')) instead."
) -> None:
    """Raise ``NotImplementedError`` (ending with ``advice``) for an FP8 kernel on a CUDA device below sm_89."""
    if t.is_cuda and not interpret_mode():
        cap = torch.cuda.get_device_capability(t.device)
        if cap < (8, 9):
            raise NotImplementedError(
                f"{what}: FP8 E4M3 needs sm_89+ (Ada/Hopper); this GPU is sm_{cap[0]}{cap[1]}. {advice}"
            )


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("sdfast::quantize_per_token", mutates_args=())
def _quantize_per_token_op(x: torch.Tensor, smooth: torch.Tensor | None, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.float8_e4m3fn if fp8 else torch.int8
    if not use_triton("quantize_per_token", x, smooth):
        return quantize_per_token_ref(x, smooth, dtype)
    if fp8 and not x.is_cuda:
        # Triton's interpreter rounds fp32 -> e4m3 wrongly across binades (124.3 -> 64): the CPU
        # path quantizes with torch (the GEMM kernel itself does run in the interpreter).
        log_fallback("quantize_per_token", "fp8 on CPU: the interpreter's e4m3 rounding is wrong")
        return quantize_per_token_ref(x, smooth, dtype)
    M, K = x.shape
    q = torch.empty((M, K), device=x.device, dtype=dtype)
    scale = torch.empty((M,), device=x.device, dtype=torch.float32)
    if M == 0:
        return q, scale
    if fp8:
        check_fp8_supported(x, "quantize_per_token")
    if x.is_cuda and not interpret_mode():
        block_k = min(triton.next_power_of_2(K), 2048)
        block_m = max(1, min(32, 4096 // block_k))  # about 4K elements per tile
    else:
        block_k, block_m = min(triton.next_power_of_2(K), 64), 32
    sm = smooth.float().contiguous() if smooth is not None else scale
    _quantize_per_token_kernel[(triton.cdiv(M, block_m),)](
        x, sm, q, scale,
        M, x.stride(0), x.stride(1),
        K, QMAX=_qmax(dtype), IS_FP8=fp8, HAS_SMOOTH=smooth is not None, BLOCK_M=block_m, BLOCK_K=block_k,
        K_TILES=0 if (x.is_cuda and not interpret_mode()) else triton.cdiv(K, block_k),
        num_warps=4,
    )
    return q, scale


@_quantize_per_token_op.register_fake
def _(x, smooth, fp8):
    dtype = torch.float8_e4m3fn if fp8 else torch.int8
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((x.shape[0],), dtype=torch.float32)


def quantize_per_token(
    x: torch.Tensor, smooth: torch.Tensor | None = None, dtype: torch.dtype = torch.int8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused dynamic per-token quantization (op ``sdfast::quantize_per_token``).

    x: (M, K) fp16 / bf16 / fp32 (any strides); smooth: optional (K,) per-channel multiplier (fused);
    dtype: ``torch.int8`` (round half to even, saturate to ±127) or ``torch.float8_e4m3fn`` (±448).
    Returns ``q`` (M, K) ``dtype`` contiguous and ``scale`` (M,) fp32, ``x * smooth ≈ q * scale[:, None]``.

    Raises: ValueError (shape), TypeError (dtype), NotImplementedError (FP8 below sm_89).
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_per_token: x must be (M, K), got {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"quantize_per_token: x dtype {x.dtype} not supported ({_FLOAT_DTYPES})")
    _qmax(dtype)
    if smooth is not None and tuple(smooth.shape) != (x.shape[1],):
        raise ValueError(f"quantize_per_token: smooth must be ({x.shape[1]},), got {tuple(smooth.shape)}")
    return _quantize_per_token_op(x, smooth, dtype == torch.float8_e4m3fn)


@torch.library.custom_op("sdfast::w8a8_gemm", mutates_args=())
def _w8a8_gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    M, K = a.shape
    N = b.shape[0]
    if not use_triton("w8a8_gemm", a, b, a_scale, b_scale, bias):
        y = (a.float() * a_scale[:, None]) @ dequantize_weight(b, b_scale, group_size or None).t()
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype)
    is_fp8 = a.dtype == torch.float8_e4m3fn
    if is_fp8:
        check_fp8_supported(a, "w8a8_gemm")
    out = torch.empty((M, N), device=a.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return out
    a = a.contiguous()
    b = b.contiguous()
    a_scale = a_scale.float().contiguous()
    b_scale = b_scale.float().contiguous()
    args = (a, b, a_scale, b_scale, bias if bias is not None else out, out, M, N, K,
            b_scale.stride(0) if group_size else 1, out.stride(0))
    meta = dict(HAS_BIAS=bias is not None, IS_FP8=is_fp8, GROUP_SIZE=group_size)
    if a.is_cuda and not interpret_mode():
        kernel = _tuned_gemm(device_index(a), group_size)

        def grid(m):
            return (triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"]),)

        launch_autotuned(kernel, grid, *args, **meta, K_TILES=0)
    else:
        cfg = gemm8_configs(a.device, group_size)[0]
        if group_size and group_size % cfg.kwargs["BLOCK_K"]:
            raise ValueError(f"w8a8_gemm: group_size={group_size} must be a multiple of {cfg.kwargs['BLOCK_K']}")
        grid = (triton.cdiv(M, cfg.kwargs["BLOCK_M"]) * triton.cdiv(N, cfg.kwargs["BLOCK_N"]),)
        _w8a8_gemm_kernel[grid](*args, **meta, **interp_meta(K, cfg.kwargs["BLOCK_K"]), **cfg.kwargs,
                                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


@_w8a8_gemm_op.register_fake
def _(a, b, a_scale, b_scale, bias, group_size, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def w8a8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group_size: int | None = None,
    out_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """``(a * a_scale[:, None]) @ (b * b_scale)^T + bias`` on 8-bit operands (op ``sdfast::w8a8_gemm``).

    a: (M, K) int8 or float8_e4m3fn; b: (N, K) same dtype; a_scale: (M,) fp32; b_scale: (N,) fp32, or
    (N, ceil(K/group_size)) with ``group_size`` (a multiple of 32); bias: optional (N,). int8 accumulates
    exactly in int32, fp8 in fp32. Returns (M, N) ``out_dtype``.

    Raises: ValueError (shapes, group_size), TypeError (dtypes), NotImplementedError (FP8 below sm_89).
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"w8a8_gemm: expected a (M, K) and b (N, K), got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in QDTYPES or b.dtype != a.dtype:
        raise TypeError(f"w8a8_gemm: a and b must both be int8 or both float8_e4m3fn, got {a.dtype} and {b.dtype}")
    M, K = a.shape
    N = b.shape[0]
    if tuple(a_scale.shape) != (M,):
        raise ValueError(f"w8a8_gemm: a_scale must be ({M},), got {tuple(a_scale.shape)}")
    gs = int(group_size or 0)
    if gs:
        if gs % 32:
            raise ValueError(f"w8a8_gemm: group_size must be a multiple of 32, got {gs}")
        want = (N, -(-K // gs))
    else:
        want = (N,)
    if tuple(b_scale.shape) != want:
        raise ValueError(f"w8a8_gemm: b_scale must be {want}, got {tuple(b_scale.shape)}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"w8a8_gemm: bias must be ({N},), got {tuple(bias.shape)}")
    if out_dtype not in _FLOAT_DTYPES:
        raise TypeError(f"w8a8_gemm: out_dtype must be one of {_FLOAT_DTYPES}, got {out_dtype}")
    return _w8a8_gemm_op(a, b, a_scale, b_scale, bias, gs, out_dtype)


def w8a8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    smooth: torch.Tensor | None = None,
    group_size: int | None = None,
) -> torch.Tensor:
    """W8A8 linear: fused per-token quantize of ``x * smooth``, then the 8-bit GEMM with dequant epilogue.

    x: (..., K) fp16 / bf16 / fp32; qweight: (N, K) int8 or float8_e4m3fn (from
    :func:`quantize_weight_per_channel`, of ``weight * s`` for SmoothQuant); w_scale: (N,) or
    (N, ceil(K/group_size)) fp32; smooth: optional (K,) = ``1 / s``; bias: optional (N,).
    Returns (..., N) in ``x.dtype``.
    """
    K = x.shape[-1]
    if qweight.dim() != 2 or qweight.shape[1] != K:
        raise ValueError(f"w8a8_linear: x has K={K} but qweight is {tuple(qweight.shape)}")
    x2 = x.reshape(-1, K)
    q, s = quantize_per_token(x2, smooth, qweight.dtype)
    y = w8a8_gemm(q, qweight, s, w_scale, bias, group_size=group_size, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], qweight.shape[0])


__all__ = [
    "quantize_per_token", "quantize_per_token_ref", "quantize_weight_per_channel", "dequantize_weight",
    "smoothquant_scales", "w8a8_gemm", "w8a8_linear", "w8a8_linear_ref", "gemm8_configs", "check_fp8_supported",
]
