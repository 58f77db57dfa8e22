"""Linear layer on Hopper: a TMA-fed Triton GEMM, ``y = x @ W^T + bias (+ residual)``, for SD's small-K projections.

SD1.5's 320-wide projections at 64x64 latents ((8192, 320) x (320, 320), 21 per step) leave cuBLAS's tensor pipe
mostly idle (Nsight Compute, sm_90; ``benchmarks/results/h200-2026-12-01-run18/``): with K = 320 every tile is five K
steps, so a tile's load latency and epilogue, not its MMAs, set the time.
This kernel is the GEGLU TMA GEMM's (:mod:`kernels.geglu.triton_tma_gemm`) main loop with a plain epilogue, launched
either persistent (one program per SM walking tiles in grouped order) or one program per tile, whichever the
caller measured faster; smaller tiles than cuBLAS picks give more programs per SM, so one's loads overlap
another's MMAs and stores. The residual (optional) is read by TMA and added in fp32 before the one rounding, which
folds the ``bias_residual_add`` that follows SD's 1x1 ``proj_out`` into the GEMM.

Requirements (else :func:`unsupported` says why): CUDA sm_90+ (or the CPU under the interpreter), fp16/bf16,
``x`` rows and the weight contiguous in K, K and N multiples of 8, 16-byte aligned bases; the residual (M, N)
contiguous in x's dtype.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.gemm._common import aligned16, device_index, grouped_tile, misaligned, num_sms, tma_operands_problem


@dataclass(frozen=True)
class LinearTile:
    """A launch shape: ``block_m x block_n`` output tiles, K in ``block_k`` steps pipelined ``stages`` deep, ``warps``
    warps; ``persistent``: one program per SM walking the tiles, else one program per tile."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int
    group_m: int = 8
    persistent: bool = True


# The sweep's winners where the kernel beat cuBLAS (`python -m benchmarks.ops.gemm tma` on sm_90: SD1.5's
# 320- and 640-wide projections): per-tile grids of 4 warps, measured per shape by linear_projection; and the
# persistent 128x64 tile (never the fastest there), kept for the tests of the persistent walk.
CONFIGS = (
    LinearTile(128, 64, 64, 3, 4, persistent=False),
    LinearTile(64, 64, 64, 4, 4, persistent=False),
    LinearTile(128, 64, 64, 3, 4),
)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch in fp32: ``x @ weight^T + bias + residual`` rounded once to ``x.dtype``. x (..., K), weight
    (N, K), bias (N,), residual (..., N)."""
    y = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


@triton.jit
def _linear_tile(tile, x_desc, w_desc, out_desc, res_desc, bias_ptr, M, N, k_tiles,
                 HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) output tile: the K loop, bias, residual, the store."""
    pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(k_tiles):
        off_k = kt * BLOCK_K
        acc = tl.dot(x_desc.load([off_m, off_k]), w_desc.load([off_n, off_k]).T, acc)
    if HAS_BIAS:
        cols = off_n + tl.arange(0, BLOCK_N)
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        acc += res_desc.load([off_m, off_n]).to(tl.float32)
    out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


@triton.jit(do_not_specialize=["M", "num_programs"])
def _linear_tma_kernel(
    x_desc,  # (M, K), block (BLOCK_M, BLOCK_K)
    w_desc,  # (N, K), block (BLOCK_N, BLOCK_K)
    out_desc,  # (M, N), block (BLOCK_M, BLOCK_N)
    res_desc,  # (M, N) residual, block (BLOCK_M, BLOCK_N); the output's descriptor when HAS_RESIDUAL is False
    bias_ptr,  # (N,); unused when HAS_BIAS is False
    M,
    N,
    K,
    num_programs,  # the persistent grid: program p runs tiles p, p + num_programs, ...
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    K_TILES: tl.constexpr,  # > 0: one tile per program with this many K steps (interpreter, per-tile grid); 0: persistent
):
    if K_TILES > 0:
        _linear_tile(tl.program_id(0), x_desc, w_desc, out_desc, res_desc, bias_ptr, M, N, K_TILES,
                     HAS_BIAS, HAS_RESIDUAL, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    else:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), num_tiles, num_programs):
            _linear_tile(tile, x_desc, w_desc, out_desc, res_desc, bias_ptr, M, N, k_tiles,
                         HAS_BIAS, HAS_RESIDUAL, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


def shape_problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  residual: torch.Tensor | None = None) -> str | None:
    """Why the operands are not a linear layer's ((..., K), (N, K), (N,) or None, (..., N) or None), or None."""
    if weight.dim() != 2:
        return f"weight must be (N, K), got {tuple(weight.shape)}"
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        return f"x (..., K={weight.shape[1]}) expected, got {tuple(x.shape)}"
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        return f"bias must be ({weight.shape[0]},), got {tuple(bias.shape)}"
    if residual is not None and tuple(residual.shape) != (*x.shape[:-1], weight.shape[0]):
        return f"residual must be {(*x.shape[:-1], weight.shape[0])}, got {tuple(residual.shape)}"
    return None


def unsupported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                residual: torch.Tensor | None = None) -> str | None:
    """Why this kernel cannot run these tensors (None when it can). Shapes are assumed already checked."""
    why = tma_operands_problem(x, weight, bias)
    if why is not None:
        return why
    K, N = weight.shape[1], weight.shape[0]
    if K % 8 or N % 8:
        return f"K={K} and N={N} must be multiples of 8 (16-byte TMA strides)"
    if not x.is_contiguous() or weight.stride() != (K, 1):
        return "x or the weight is not contiguous"
    if residual is not None and (residual.dtype != x.dtype or residual.device != x.device
                                 or not residual.is_contiguous() or not aligned16(residual)):
        return "the residual is not a contiguous, 16-byte aligned tensor in x's dtype on x's device"
    if misaligned(x, weight):
        return "x or the weight is not 16-byte aligned"
    return None


def linear_tma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, config: LinearTile = CONFIGS[0]) -> torch.Tensor:
    """``x @ weight^T + bias + residual`` in one TMA GEMM (fp32 accumulation and epilogue, one rounding).

    Args:
        x: (..., K) fp16 or bf16, contiguous. weight: (N, K), same dtype, contiguous. bias: optional (N,),
        contiguous, x's dtype. residual: optional (..., N), contiguous, x's dtype. config: the tile shape (the
        caller picks it per shape by measurement).

    Returns:
        (..., N) in ``x.dtype``, contiguous.

    Raises:
        ValueError: shapes that do not match; RuntimeError naming the reason (:func:`unsupported`) when this kernel
        cannot run the tensors.
    """
    problem = shape_problem(x, weight, bias, residual)
    if problem is not None:
        raise ValueError(f"linear_tma: {problem}")
    why = unsupported(x, weight, bias, residual)
    if why is not None:
        raise RuntimeError(f"linear_tma: {why}")
    K, N = weight.shape[1], weight.shape[0]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return out.reshape(*x.shape[:-1], N)
    c = config
    out_desc = TensorDescriptor.from_tensor(out, [c.block_m, c.block_n])
    res_desc = TensorDescriptor.from_tensor(residual.reshape(M, N), [c.block_m, c.block_n]) if residual is not None \
        else out_desc
    tiles = triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n)
    per_tile = not x.is_cuda or not c.persistent  # the interpreter runs one tile per program
    programs = tiles if per_tile else min(tiles, num_sms(device_index(x)))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # the launch goes to x's GPU
        _linear_tma_kernel[(programs,)](
            TensorDescriptor.from_tensor(x2, [c.block_m, c.block_k]),
            TensorDescriptor.from_tensor(weight, [c.block_n, c.block_k]), out_desc, res_desc,
            bias if bias is not None else out, M, N, K, programs,
            HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
            BLOCK_K=c.block_k, GROUP_M=c.group_m, K_TILES=triton.cdiv(K, c.block_k) if per_tile else 0,
            num_warps=c.warps, num_stages=c.stages,
        )
    return out.reshape(*x.shape[:-1], N)


__all__ = ["CONFIGS", "LinearTile", "linear_ref", "linear_tma", "shape_problem", "unsupported"]
