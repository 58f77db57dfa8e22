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
from kernels.gemm._common import aligned16, device_index, grouped_tile, misaligned, num_sms, tma_operands_problem


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


# --------------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _geglu_tile(tile, x_desc, wa_desc, wg_desc, w2_desc, out_desc, bias_ptr, M, N, k_tiles,
                HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, SINGLE_DOT: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) output tile: the K loop, bias, ``a * gelu(g)``, the store."""
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
    if HAS_BIAS:
        cols = off_n + tl.arange(0, BLOCK_N)
        in_n = cols < N
        acc_a += tl.load(bias_ptr + cols, mask=in_n, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(bias_ptr + N + cols, mask=in_n, other=0.0).to(tl.float32)[None, :]
    y = acc_a * gelu_erf(acc_g)
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
    K_TILES: tl.constexpr,  # > 0 (interpreter): one tile per program, this many K steps; 0: the persistent loop
):
    if K_TILES > 0:  # Triton's interpreter cannot loop to a run-time bound under numpy >= 2.4 (_common.interp_meta)
        _geglu_tile(tl.program_id(0), x_desc, wa_desc, wg_desc, w2_desc, out_desc, bias_ptr, M, N, K_TILES,
                    HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SINGLE_DOT)
    else:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), num_tiles, num_programs):
            _geglu_tile(tile, x_desc, wa_desc, wg_desc, w2_desc, out_desc, bias_ptr, M, N, k_tiles,
                        HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SINGLE_DOT)


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
    c = config
    x_desc = TensorDescriptor.from_tensor(x2, [c.block_m, c.block_k])
    wa_desc = TensorDescriptor.from_tensor(weight[:N], [c.block_n, c.block_k])
    wg_desc = TensorDescriptor.from_tensor(weight[N:], [c.block_n, c.block_k])
    w2_desc = TensorDescriptor.from_tensor(weight.view(2, N, K), [2, c.block_n, c.block_k])
    out_desc = TensorDescriptor.from_tensor(out, [c.block_m, c.block_n])
    tiles = triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n)
    per_tile = not x.is_cuda or not c.persistent  # the interpreter runs one tile per program (the kernel's K_TILES)
    programs = tiles if per_tile else min(tiles, num_sms(device_index(x)))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # the launch goes to x's GPU
        _geglu_tma_kernel[(programs,)](
            x_desc, wa_desc, wg_desc, w2_desc, out_desc, bias if bias is not None else out, M, N, K, programs,
            HAS_BIAS=bias is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
            SINGLE_DOT=c.single_dot,
            K_TILES=triton.cdiv(K, c.block_k) if per_tile else 0, num_warps=c.warps, num_stages=c.stages,
        )
    return out.reshape(*x.shape[:-1], N)


__all__ = ["CONFIGS", "TileConfig", "geglu_linear", "misaligned", "shape_problem", "unsupported"]
