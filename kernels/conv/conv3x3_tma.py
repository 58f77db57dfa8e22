"""3x3 convolution (stride 1, padding 1) on Hopper: an implicit GEMM whose tiles the TMA loads from NHWC memory.

SD's UNets spend a third of a step in 3x3 convolutions (SD1.5: 1.79 ms of 5.27, H200 run 15), and at the small
latent sizes cuDNN's kernels reach 370-450 TFLOP/s. Seen as a GEMM, a 3x3 convolution of channels_last
``x`` (N, H, W, Cin) with ``weight`` (Cout, Cin, 3, 3) is ``out[p, co] = sum_{tap, ci} x[p + tap, ci] * w[co, tap,
ci]`` over the 9 taps (kh, kw) and Cin channels, ``p`` an output pixel: M = N*H*W rows, K = 9*Cin, N = Cout.

A program owns an output tile of ``BH x BW`` pixels of one image (``block_m`` = BH*BW rows) and ``block_n`` output
channels. For each tap and each ``block_k`` slice of input channels, the TMA loads the input box
``x[img, h0+kh-1 : +BH, w0+kw-1 : +BW, c0 : +block_k]`` straight from the NHWC tensor (a 4-D descriptor): the box
rows that fall outside the image (the padding) read as zeros, so no im2col buffer and no padded copy exist. In
shared memory the (1, BH, BW, block_k) box has the bytes of a (block_m, block_k) tile, which goes to the
warpgroup MMA with the weight tile ``w[co0 : +block_n, tap, c0 : +block_k]`` (the channels_last weight seen as
(Cout, 9*Cin)). Bias is added in fp32 in the epilogue; the (1, BH, BW, block_n) result is stored by the TMA,
which clips what lies outside the output. Persistent grid: at most one program per SM, tiles ordered with the
output-channel tile fastest, so the programs running at once share their input boxes in L2.

Status: not wired into the engine. On the H200 (run 16, ``benchmarks/sweep_conv.py --tma --extra``, 11 tile configs)
its best config ran 1.02-1.3x cuDNN's time at SD's 64x64 and 128x128 levels (430-620 against 510-640 TFLOP/s) and
1.5-3.8x at 16x16 and 8x8, where its (pixels x channels) tiles leave SMs idle. Kept, tested, as the base for
split-K or warp-specialized versions; ``kernels.conv.conv3x3`` chooses between cuDNN and im2col + cuBLAS instead.

Method: the implicit-GEMM convolution (cuDNN, Chetlur et al. 2014; CUTLASS's implicit GEMM), with TMA tiles as in
CUTLASS 3's Hopper convolutions; Triton tutorial 09 (persistent TMA matmul).

Requirements (else :func:`unsupported` says why and :func:`tma_conv3x3` raises): CUDA sm_90+ (or Triton's interpreter
on CPU), fp16/bf16, ``x`` and ``weight`` channels_last-contiguous, Cin a multiple of ``block_k``, Cout a multiple
of 8, 16-byte aligned pointers. Stride, padding, dilation and groups are the caller's to check (1, 1, 1, 1).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.gemm._common import aligned16, device_index, misaligned, num_sms, tma_operands_problem

@dataclass(frozen=True)
class ConvConfig:
    """One launch shape: ``block_m`` output pixels (a BH x BW patch, BW from the image width) by ``block_n``
    output channels, K in ``block_k`` input-channel steps pipelined ``stages`` deep, ``warps`` warps."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int


# The candidates the measured choice times per shape (each compiles once, during warm-up).
CONFIGS = (
    ConvConfig(128, 128, 64, 4, 8),
    ConvConfig(128, 64, 64, 4, 4),
    ConvConfig(64, 128, 64, 4, 4),
)


# --------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------
def conv3x3_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch, fp32 math: ``conv2d(x, weight, bias, stride=1, padding=1)`` in x's dtype and memory format.

    x: (N, Cin, H, W); weight: (Cout, Cin, 3, 3); bias: (Cout,) or None."""
    y = F.conv2d(x.float(), weight.float(), None if bias is None else bias.float(), stride=1, padding=1)
    return y.to(x.dtype).contiguous(memory_format=torch.channels_last)


# --------------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _conv_tile(tile, x_desc, w_desc, out_desc, bias_ptr, Cin, Cout, tiles_h, tiles_w, tiles_n, k_tiles,
               HAS_BIAS: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """One (BH*BW pixels, BLOCK_N channels) output tile: the 9-tap K loop, bias, the store."""
    pid_n = tile % tiles_n
    rest = tile // tiles_n
    pid_w = rest % tiles_w
    rest = rest // tiles_w
    pid_h = rest % tiles_h
    img = rest // tiles_h
    h0 = pid_h * BH
    w0 = pid_w * BW
    n0 = pid_n * BLOCK_N
    cin_tiles = Cin // BLOCK_K
    acc = tl.zeros((BH * BW, BLOCK_N), dtype=tl.float32)
    for kt in range(k_tiles):
        tap = kt // cin_tiles
        c0 = (kt - tap * cin_tiles) * BLOCK_K
        kh = tap // 3
        kw = tap - kh * 3
        # rows and columns outside the image (the zero padding) read as zeros
        a = tl.reshape(x_desc.load([img, h0 + kh - 1, w0 + kw - 1, c0]), (BH * BW, BLOCK_K))
        b = w_desc.load([n0, tap * Cin + c0])
        acc = tl.dot(a, b.T, acc)
    if HAS_BIAS:
        cols = n0 + tl.arange(0, BLOCK_N)
        acc += tl.load(bias_ptr + cols, mask=cols < Cout, other=0.0).to(tl.float32)[None, :]
    out_desc.store([img, h0, w0, n0], tl.reshape(acc.to(out_desc.dtype), (1, BH, BW, BLOCK_N)))


# The image count and the grid size are not specialized (a second image size must not compile again)
@triton.jit(do_not_specialize=["num_tiles", "tiles_h", "tiles_w", "num_programs"])
def _conv3x3_tma_kernel(
    x_desc,  # (N, H, W, Cin), block (1, BH, BW, BLOCK_K)
    w_desc,  # (Cout, 9 * Cin): the channels_last weight, block (BLOCK_N, BLOCK_K)
    out_desc,  # (N, H, W, Cout), block (1, BH, BW, BLOCK_N)
    bias_ptr,  # (Cout,); unused when HAS_BIAS is False
    Cin,
    Cout,
    num_tiles,
    tiles_h,
    tiles_w,
    tiles_n,
    num_programs,  # the persistent grid: program p runs tiles p, p + num_programs, ...
    HAS_BIAS: tl.constexpr,
    BH: tl.constexpr,
    BW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,  # > 0 (interpreter): one tile per program, this many K steps; 0: the persistent loop
):
    if K_TILES > 0:  # Triton's interpreter cannot loop to a run-time bound under numpy >= 2.4
        _conv_tile(tl.program_id(0), x_desc, w_desc, out_desc, bias_ptr, Cin, Cout, tiles_h, tiles_w, tiles_n,
                   K_TILES, HAS_BIAS, BH, BW, BLOCK_N, BLOCK_K)
    else:
        k_tiles = 9 * (Cin // BLOCK_K)
        for tile in tl.range(tl.program_id(0), num_tiles, num_programs):
            _conv_tile(tile, x_desc, w_desc, out_desc, bias_ptr, Cin, Cout, tiles_h, tiles_w, tiles_n, k_tiles,
                       HAS_BIAS, BH, BW, BLOCK_N, BLOCK_K)


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------
def patch_width(width: int, block_m: int) -> int:
    """BW, the tile's width in pixels (a power of two from 8 to ``block_m``): the one that wastes the fewest
    columns past the image's right edge, the widest on a tie (64 -> 64, 96 -> 32, 65 -> 8 for block_m 128)."""
    options = [bw for bw in (8, 16, 32, 64, 128, 256) if bw <= block_m]
    return min(options, key=lambda bw: (-(-width // bw) * bw - width, -bw))


def _channels_last(t: torch.Tensor) -> bool:
    return t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)


def _nhwc_descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A 4-D descriptor of a channels_last (N, C, H, W) tensor as (N, H, W, C), with the dense strides (a size-1
    dimension's stride in ``t`` can be anything)."""
    n, c, h, w = t.shape
    return TensorDescriptor(t, [n, h, w, c], [h * w * c, w * c, c, 1], block)


def shape_problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why x, weight and bias are not a 3x3 convolution's ((N, Cin, H, W), (Cout, Cin, 3, 3), (Cout,)), or None."""
    if weight.dim() != 4 or tuple(weight.shape[2:]) != (3, 3):
        return f"weight must be (Cout, Cin, 3, 3), got {tuple(weight.shape)}"
    if x.dim() != 4 or x.shape[1] != weight.shape[1]:
        return f"x must be (N, {weight.shape[1]}, H, W), got {tuple(x.shape)}"
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        return f"bias must be ({weight.shape[0]},), got {tuple(bias.shape)}"
    return None


def unsupported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                config: ConvConfig | None = None) -> str | None:
    """Why this kernel cannot run these tensors (None when it can). Shapes are assumed already checked."""
    block_k = (config or CONFIGS[0]).block_k
    why = tma_operands_problem(x, weight, bias)
    if why is not None:
        return why
    cin, cout = weight.shape[1], weight.shape[0]
    if cin % block_k or cout % 8:
        return f"Cin={cin} must be a multiple of {block_k} and Cout={cout} of 8"
    if not (_channels_last(x) and _channels_last(weight)):
        return "x or the weight is not channels_last-contiguous"
    if misaligned(x, weight):
        return "x or the weight is not 16-byte aligned"
    return None


def tma_conv3x3(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            config: ConvConfig = CONFIGS[0], out: torch.Tensor | None = None) -> torch.Tensor:
    """``conv2d(x, weight, bias, stride=1, padding=1)`` as one persistent TMA implicit GEMM.

    Args:
        x: (N, Cin, H, W) fp16 or bf16, channels_last-contiguous (NHWC memory).
        weight: (Cout, Cin, 3, 3), same dtype, channels_last-contiguous (the memory is (Cout, 3, 3, Cin)).
        bias: optional (Cout,), contiguous, in x's dtype (added in fp32).
        config: the tile shape (see ``CONFIGS``; the caller picks it per shape by measurement).
        out: optional (N, Cout, H, W) channels_last output in x's dtype, 16-byte aligned: written and returned.

    Returns:
        (N, Cout, H, W) in x's dtype, channels_last; fp32 accumulation, one rounding at the store.

    Raises:
        ValueError: shapes that are not a 3x3 convolution's; RuntimeError naming the reason (:func:`unsupported`)
        when this kernel cannot run the tensors.
    """
    problem = shape_problem(x, weight, bias)
    if problem is not None:
        raise ValueError(f"tma_conv3x3: {problem}")
    why = unsupported(x, weight, bias, config)
    if why is not None:
        raise RuntimeError(f"tma_conv3x3: {why}")
    n, cin, h, w = x.shape
    cout = weight.shape[0]
    if out is None:
        out = torch.empty((n, h, w, cout), device=x.device, dtype=x.dtype).permute(0, 3, 1, 2)
    elif (tuple(out.shape) != (n, cout, h, w) or out.dtype != x.dtype or not _channels_last(out)
          or not aligned16(out)):
        raise ValueError(f"tma_conv3x3: out must be a channels_last, 16-byte aligned ({n}, {cout}, {h}, {w}) {x.dtype} tensor")
    if out.numel() == 0:
        return out
    c = config
    bw = patch_width(w, c.block_m)
    bh = c.block_m // bw
    x_desc = _nhwc_descriptor(x, [1, bh, bw, c.block_k])
    w_desc = TensorDescriptor(weight, [cout, 9 * cin], [9 * cin, 1], [c.block_n, c.block_k])  # (Cout, 3, 3, Cin)
    out_desc = _nhwc_descriptor(out, [1, bh, bw, c.block_n])
    tiles_h, tiles_w, tiles_n = triton.cdiv(h, bh), triton.cdiv(w, bw), triton.cdiv(cout, c.block_n)
    tiles = n * tiles_h * tiles_w * tiles_n
    interp = not x.is_cuda  # the interpreter: one tile per program (see the kernel's K_TILES)
    programs = tiles if interp else min(tiles, num_sms(device_index(x)))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # the launch goes to x's GPU
        _conv3x3_tma_kernel[(programs,)](
            x_desc, w_desc, out_desc, bias if bias is not None else out, cin, cout, tiles, tiles_h, tiles_w, tiles_n,
            programs, HAS_BIAS=bias is not None, BH=bh, BW=bw, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
            K_TILES=9 * (cin // c.block_k) if interp else 0, num_warps=c.warps, num_stages=c.stages,
        )
    return out


__all__ = ["CONFIGS", "ConvConfig", "conv3x3_ref", "tma_conv3x3", "misaligned", "patch_width", "shape_problem",
           "unsupported"]
