"""GEGLU projection on Hopper: a TMA-fed Triton GEMM with ``a * gelu(g)`` in its epilogue.

diffusers' ``GEGLU`` computes ``proj(x)`` (``(M, K) -> (M, 2N)``, rows ``[0, N)`` of the weight give the
value ``a``, rows ``[N, 2N)`` the gate ``g``) and then ``a * gelu(g)``. cuBLAS writes the 2N-wide product
and a second kernel reads it back (SDXL: 60 such projections per step). Here one program computes the matching ``a`` and ``g`` tiles, rows ``n`` and
``n + N`` of the weight, from the same ``x`` tile in two fp32 accumulators, and stores only the N-wide
result.

The tiles are loaded by the Tensor Memory Accelerator (host-side ``TensorDescriptor``s; rows and columns
past the edges read as zeros and are not stored), Triton pipelines the loads ``num_stages`` deep and
issues the products as Hopper warpgroup MMAs (with ``single_dot``, the a and g rows of a tile come in one 3-D
TMA load and go through one (BLOCK_M, 2 BLOCK_N) product, so the x tile is read from shared memory once per K
step). The grid is persistent: at most one program per SM, each walking tiles in the grouped order of the
Triton matmul tutorial (neighbouring tiles share ``x`` rows in L2). Methods: Shazeer 2020, "GLU Variants Improve Transformer"; Triton tutorial 09 (persistent TMA matmul).

Requirements (else :func:`unsupported` says why and the caller runs cuBLAS plus ``kernels.geglu.geglu``):
CUDA, sm_90 or newer, fp16/bf16, ``x`` rows and the weight contiguous in K, K and N multiples of 8 (TMA's
16-byte strides), 16-byte aligned base pointers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.geglu.gelu import gelu_erf
from kernels.gemm._common import (TMA_DTYPES, aligned16, device_index, grouped_tile, misaligned, num_sms, plain_tensor,
                                  tma_operands_problem)
from kernels.gemm.fp8_static import FP8, round_to_e4m3
from kernels.gemm.w8a8 import FP8_QMAX

_FP8_MAX = tl.constexpr(FP8_QMAX)


@dataclass(frozen=True)
class TileConfig:
    """One launch shape: a ``block_m x block_n`` output tile (two such accumulators: ``a`` and ``g``), K in
    ``block_k`` steps pipelined ``stages`` deep, ``warps`` warps (4 = one warpgroup)."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int
    group_m: int = 8
    single_dot: bool = False  # a and g tiles as one (block_m, 2 block_n) product from one (2, block_n, block_k) load
    persistent: bool = True  # one program per SM walking the tiles; False: one program per tile


# The candidates geglu_projection measures per shape (each compiles once, on a cold cache, during warm-up).
# Winners of `python -m benchmarks.ops.geglu tma` on sm_90 (benchmarks/results/h200-2026-11-30-run15/ and
# h200-2026-12-01-run18/): the persistent 128x128 tiles at SDXL's levels 1 and 2; one program per 128x64 tile of
# 4 warps (several per SM, so one's epilogue overlaps another's main loop) at SD1.5's levels 0, 1 and 2. At SD1.5's
# mid block cuBLAS + the GEGLU kernel stays faster.
# Accumulator registers per thread: 2 * block_m * block_n / (32 * warps), 128 here.
CONFIGS = (
    TileConfig(128, 128, 64, 3, 8, group_m=4),
    TileConfig(128, 128, 64, 3, 8, group_m=4, single_dot=True),
    TileConfig(128, 64, 64, 3, 4, single_dot=True, persistent=False),
    TileConfig(128, 64, 64, 3, 4, persistent=False),
)

# The FP8 kernel's candidates (:func:`geglu_linear_fp8`): K steps of 128 one-byte elements (the 128-byte rows
# the TMA swizzle and the FP8 warpgroup MMA, K = 32 per instruction, are built for). Shared memory per stage:
# (block_m + 2 block_n) * 128 bytes. From `python -m benchmarks.ops.geglu fp8 --extra` on sm_90
# (benchmarks/results/h200-2026-12-03-run28/): one program per 128x128 tile with one product per K step was the
# fastest at every SD1.5 and SDXL shape but SD1.5's mid block, where 128x64 tiles of 4 warps win; the persistent
# 128x128 tile with two products stays as the third candidate.
FP8_CONFIGS = (
    TileConfig(128, 128, 128, 3, 8, group_m=8, single_dot=True, persistent=False),
    TileConfig(128, 64, 128, 4, 4, single_dot=True, persistent=False),
    TileConfig(128, 128, 128, 3, 8, group_m=4),
)


# --------------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _geglu_tile(tile, x_desc, wa_desc, wg_desc, w2_desc, out_desc, bias_ptr, a_scale_ptr, w_scale_ptr, out_inv_ptr,
                M, N, k_tiles, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SINGLE_DOT: tl.constexpr, SCALED: tl.constexpr,
                OUT_FP8: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) output tile: the K loop, the FP8 scales, bias, ``a * gelu(g)``, the store (quantized
    to E4M3 with OUT_FP8)."""
    pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    if SINGLE_DOT:  # the x tile is read from shared memory once per K step, not twice
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for kt in range(k_tiles):
            off_k = kt * BLOCK_K
            w = tl.reshape(w2_desc.load([0, off_n, off_k]), (2 * BLOCK_N, BLOCK_K))
            acc = tl.dot(x_desc.load([off_m, off_k]), w.T, acc)
        acc_a, acc_g = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    else:
        acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(k_tiles):
            off_k = kt * BLOCK_K
            xt = x_desc.load([off_m, off_k])
            acc_a = tl.dot(xt, wa_desc.load([off_n, off_k]).T, acc_a)
            acc_g = tl.dot(xt, wg_desc.load([off_n, off_k]).T, acc_g)
    if SCALED:  # FP8 operands: one per-tensor scale each, applied once to the fp32 sums
        s = tl.load(a_scale_ptr) * tl.load(w_scale_ptr)
        acc_a = acc_a * s
        acc_g = acc_g * s
    if HAS_BIAS:
        cols = off_n + tl.arange(0, BLOCK_N)
        in_n = cols < N
        acc_a += tl.load(bias_ptr + cols, mask=in_n, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(bias_ptr + N + cols, mask=in_n, other=0.0).to(tl.float32)[None, :]
    y = acc_a * gelu_erf(acc_g)
    if OUT_FP8:  # the consumer's static input scale: saturate to +-448, then E4M3 (nearest, ties to even)
        y = tl.clamp(y * tl.load(out_inv_ptr), -_FP8_MAX, _FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        if ROUND_FIRST:  # the interpreter's fp32 -> e4m3 cast is wrong across binades (kernels.gemm.fp8_static)
            y = round_to_e4m3(y)
    out_desc.store([off_m, off_n], y.to(out_desc.dtype))


# M and the grid size are not specialized: Triton would compile again when their divisibility by 16 changes, e.g. at a
# second image size whose mid-block grid goes from 40 to 80 programs
@triton.jit(do_not_specialize=["M", "num_programs"])
def _geglu_tma_kernel(
    x_desc,  # (M, K), block (BLOCK_M, BLOCK_K)
    wa_desc,  # weight rows [0, N): (N, K), block (BLOCK_N, BLOCK_K)
    wg_desc,  # weight rows [N, 2N): (N, K), block (BLOCK_N, BLOCK_K)
    w2_desc,  # the weight as (2, N, K), block (2, BLOCK_N, BLOCK_K): a and g rows of one tile in one load
    out_desc,  # (M, N), block (BLOCK_M, BLOCK_N)
    bias_ptr,  # (2N,) bias; unused when HAS_BIAS is False
    a_scale_ptr,  # () fp32 activation scale; unused without SCALED
    w_scale_ptr,  # () fp32 weight scale; unused without SCALED
    out_inv_ptr,  # () fp32 1 / (the output's scale); unused without OUT_FP8
    M,
    N,
    K,
    num_programs,  # the persistent grid: program p runs tiles p, p + num_programs, ...
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SINGLE_DOT: tl.constexpr,  # one (BLOCK_M, 2 BLOCK_N) product per K step instead of two (BLOCK_M, BLOCK_N)
    SCALED: tl.constexpr,  # E4M3 x and weight: the sums times a_scale * w_scale
    OUT_FP8: tl.constexpr,  # store E4M3 (times out_inv), the next FP8 layer's input
    ROUND_FIRST: tl.constexpr,  # the interpreter: round to the E4M3 grid before the cast
    K_TILES: tl.constexpr,  # > 0 (interpreter): one tile per program, this many K steps; 0: the persistent loop
):
    if K_TILES > 0:  # Triton's interpreter cannot loop to a run-time bound under numpy >= 2.4 (_common.interp_meta)
        _geglu_tile(tl.program_id(0), x_desc, wa_desc, wg_desc, w2_desc, out_desc, bias_ptr, a_scale_ptr, w_scale_ptr,
                    out_inv_ptr, M, N, K_TILES, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SINGLE_DOT, SCALED,
                    OUT_FP8, ROUND_FIRST)
    else:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), num_tiles, num_programs):
            _geglu_tile(tile, x_desc, wa_desc, wg_desc, w2_desc, out_desc, bias_ptr, a_scale_ptr, w_scale_ptr,
                        out_inv_ptr, M, N, k_tiles, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SINGLE_DOT, SCALED,
                        OUT_FP8, ROUND_FIRST)


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------
def unsupported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why this kernel cannot run these tensors (None when it can). Shapes are assumed already checked."""
    why = tma_operands_problem(x, weight, bias)
    if why is not None:
        return why
    K, N = x.shape[-1], weight.shape[0] // 2
    if K % 8 or N % 8:
        return f"K={K} and N={N} must be multiples of 8 (16-byte TMA strides)"
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or weight.stride(0) != K:
        return "x rows or the weight are not contiguous in K"
    if x.dim() != 2 and not x.is_contiguous():
        return "x is not contiguous (its leading dimensions must flatten into rows without a copy)"
    if x.dim() == 2 and x.stride(0) % 8:
        return "x's row stride is not a multiple of 8 elements"
    if misaligned(x, weight):
        return "x or the weight is not 16-byte aligned"
    return None


def shape_problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why x, weight and bias are not a GEGLU projection's ((..., K), (2N, K), (2N,) or None), or None."""
    if weight.dim() != 2 or weight.shape[0] % 2:
        return f"weight must be (2N, K), got {tuple(weight.shape)}"
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        return f"x (..., K={weight.shape[1]}) expected, got {tuple(x.shape)}"
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        return f"bias must be ({weight.shape[0]},), got {tuple(bias.shape)}"
    return None


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, c: TileConfig,
            scales: tuple[torch.Tensor, torch.Tensor] | None = None, out_inv: torch.Tensor | None = None) -> None:
    """One launch over (M, K) rows ``x2`` into ``out`` (M, N); ``scales`` (a_scale, w_scale) for FP8 operands,
    ``out_inv`` for an E4M3 ``out``. The arguments are checked by the callers."""
    M, K = x2.shape
    N = weight.shape[0] // 2
    x_desc = TensorDescriptor.from_tensor(x2, [c.block_m, c.block_k])
    wa_desc = TensorDescriptor.from_tensor(weight[:N], [c.block_n, c.block_k])
    wg_desc = TensorDescriptor.from_tensor(weight[N:], [c.block_n, c.block_k])
    w2_desc = TensorDescriptor.from_tensor(weight.view(2, N, K), [2, c.block_n, c.block_k])
    out_desc = TensorDescriptor.from_tensor(out, [c.block_m, c.block_n])
    tiles = triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n)
    per_tile = not x2.is_cuda or not c.persistent  # the interpreter runs one tile per program (the kernel's K_TILES)
    programs = tiles if per_tile else min(tiles, num_sms(device_index(x2)))
    a_scale, w_scale = scales if scales is not None else (out, out)
    with torch.cuda.device(x2.device) if x2.is_cuda else contextlib.nullcontext():  # the launch goes to x's GPU
        _geglu_tma_kernel[(programs,)](
            x_desc, wa_desc, wg_desc, w2_desc, out_desc, bias if bias is not None else out, a_scale, w_scale,
            out_inv if out_inv is not None else out, M, N, K, programs,
            HAS_BIAS=bias is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
            SINGLE_DOT=c.single_dot, SCALED=scales is not None, OUT_FP8=out_inv is not None,
            ROUND_FIRST=out_inv is not None and not x2.is_cuda,
            K_TILES=triton.cdiv(K, c.block_k) if per_tile else 0, num_warps=c.warps, num_stages=c.stages,
        )


def geglu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 config: TileConfig = CONFIGS[0], out: torch.Tensor | None = None) -> torch.Tensor:
    """``a * gelu(g)`` of ``x @ weight^T + bias`` (diffusers' ``GEGLU``) in one persistent TMA GEMM.

    Args:
        x: (..., K) fp16 or bf16, rows contiguous in K (leading dims flatten without a copy).
        weight: (2N, K), same dtype, contiguous: rows [0, N) give ``a``, rows [N, 2N) the gate ``g``.
        bias: optional (2N,), contiguous, in x's dtype (added in fp32).
        config: the tile shape (see ``CONFIGS``; the caller picks it per shape by measurement).
        out: optional (M, N) contiguous output in ``x.dtype`` (M = rows of x), written and returned reshaped.

    Returns:
        (..., N) in ``x.dtype``; fp32 accumulation and epilogue (exact erf GELU), one rounding at the store.

    Raises:
        ValueError: shapes that do not match; RuntimeError naming the reason (:func:`unsupported`) when this
        kernel cannot run the tensors.
    """
    problem = shape_problem(x, weight, bias)
    if problem is not None:
        raise ValueError(f"geglu_linear: {problem}")
    why = unsupported(x, weight, bias)
    if why is not None:
        raise RuntimeError(f"geglu_linear: {why}")
    K, N = weight.shape[1], weight.shape[0] // 2
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    elif tuple(out.shape) != (M, N) or out.dtype != x.dtype or not out.is_contiguous() or not aligned16(out):
        raise ValueError(f"geglu_linear: out must be a contiguous, 16-byte aligned ({M}, {N}) {x.dtype} tensor")
    if M == 0 or N == 0:
        return out.reshape(*x.shape[:-1], N)
    _launch(x2, weight, bias, out, config)
    return out.reshape(*x.shape[:-1], N)


def fp8_unsupported(q: torch.Tensor, qweight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why :func:`geglu_linear_fp8` cannot run these operands (None when it can). Shapes are assumed checked."""
    from kernels.dispatch import interpret_mode

    if not all(plain_tensor(t) for t in (q, qweight, bias) if t is not None):
        return "a tensor subclass or a non-strided layout (TMA reads plain dense memory)"
    if q.dtype != FP8 or qweight.dtype != FP8:
        return f"q and qweight must be float8_e4m3fn, got {q.dtype} and {qweight.dtype}"
    if q.device != qweight.device or (bias is not None and bias.device != q.device):
        return f"tensors on several devices ({q.device}, {qweight.device})"
    if not q.is_cuda:
        if not (interpret_mode() and q.device.type == "cpu"):
            return "tensors are not on a CUDA device (and TRITON_INTERPRET is not set)"
    elif torch.cuda.get_device_capability(q.device)[0] < 9:
        return "the FP8 TMA GEMM needs sm_90 or newer"
    if bias is not None and (bias.dtype not in (*TMA_DTYPES, torch.float32) or bias.stride(0) != 1):
        return "the bias is not a contiguous fp16 / bf16 / fp32 tensor"
    K, N = q.shape[-1], qweight.shape[0] // 2
    if K % 16 or N % 16:
        return f"K={K} and N={N} must be multiples of 16 (16-byte TMA strides of one-byte elements)"
    if q.stride(-1) != 1 or qweight.stride(-1) != 1 or qweight.stride(0) != K:
        return "q rows or the weight are not contiguous in K"
    if q.dim() != 2 and not q.is_contiguous():
        return "q is not contiguous (its leading dimensions must flatten into rows without a copy)"
    if q.dim() == 2 and q.stride(0) % 16:
        return "q's row stride is not a multiple of 16 elements"
    if misaligned(q, qweight):
        return "q or the weight is not 16-byte aligned"
    return None


def geglu_linear_fp8(q: torch.Tensor, qweight: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, *, out_scale_inv: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.float16, config: TileConfig = FP8_CONFIGS[0],
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers' ``GEGLU`` on FP8 operands in one TMA GEMM: ``a * gelu(g)`` of
    ``(q * a_scale) @ (qweight * w_scale)^T + bias``, optionally quantized for the next FP8 layer.

    Args:
        q: (..., K) float8_e4m3fn activations (static per-tensor scale ``a_scale``), rows contiguous in K.
        qweight: (2N, K) float8_e4m3fn, contiguous (rows [0, N) give ``a``, rows [N, 2N) the gate), one scale
            ``w_scale`` for the tensor.
        a_scale, w_scale: 0-dim fp32 tensors on q's device (read by the kernel: CUDA graphs see changes).
        bias: optional (2N,) fp16 / bf16 / fp32, contiguous (added in fp32).
        out_scale_inv: optional 0-dim fp32, ``1 / s_out``: the output is ``sat448(y * out_scale_inv)`` in
            float8_e4m3fn (nearest, ties to even), the static input of the layer that reads it; without it the
            output is ``out_dtype`` (fp16 / bf16).
        config: the tile shape (``FP8_CONFIGS``; the caller picks it per shape by measurement).
        out: optional (M, N) contiguous, 16-byte aligned output of the output dtype.

    Returns:
        (..., N), E4M3 with ``out_scale_inv``, else ``out_dtype``. The FP8 products are summed by the tensor cores'
        fast accumulation (as ``torch._scaled_mm(use_fast_accum=True)``); scales, bias and the exact erf GELU in fp32.

    Raises:
        ValueError: shapes; TypeError: dtypes; RuntimeError naming the reason (:func:`fp8_unsupported`) when this
        kernel cannot run the tensors.
    """
    problem = shape_problem(q, qweight, bias)
    if problem is not None:
        raise ValueError(f"geglu_linear_fp8: {problem}")
    for name, t in (("a_scale", a_scale), ("w_scale", w_scale), ("out_scale_inv", out_scale_inv)):
        if t is not None and (t.dim() != 0 or t.dtype != torch.float32):
            raise TypeError(f"geglu_linear_fp8: {name} must be a 0-dim fp32 tensor, got {t.dtype} {tuple(t.shape)}")
    if out_scale_inv is None and out_dtype not in TMA_DTYPES:
        raise TypeError(f"geglu_linear_fp8: out_dtype must be fp16 or bf16, got {out_dtype}")
    why = fp8_unsupported(q, qweight, bias)
    if why is not None:
        raise RuntimeError(f"geglu_linear_fp8: {why}")
    K, N = qweight.shape[1], qweight.shape[0] // 2
    q2 = q.reshape(-1, K)
    M = q2.shape[0]
    dtype = FP8 if out_scale_inv is not None else out_dtype
    if out is None:
        out = torch.empty((M, N), device=q.device, dtype=dtype)
    elif tuple(out.shape) != (M, N) or out.dtype != dtype or not out.is_contiguous() or not aligned16(out):
        raise ValueError(f"geglu_linear_fp8: out must be a contiguous, 16-byte aligned ({M}, {N}) {dtype} tensor")
    if M and N:
        _launch(q2, qweight, bias, out, config, scales=(a_scale, w_scale), out_inv=out_scale_inv)
    return out.reshape(*q.shape[:-1], N)


__all__ = ["CONFIGS", "FP8_CONFIGS", "TileConfig", "fp8_unsupported", "geglu_linear", "geglu_linear_fp8", "misaligned",
           "shape_problem", "unsupported"]
