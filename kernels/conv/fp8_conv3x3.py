"""FP8 (E4M3) 3x3 convolution (stride 1, padding 1) as an implicit GEMM on the tensor cores, channels_last.

    y[n, h, w, co] = (a_scale * w_scale[co]) * sum_{dy, dx, ci} xq[n, h+dy-1, w+dx-1, ci] * wq[co, dy, dx, ci]
                     + bias[co]                                   (zero outside the image)

The GEMM view: M = N*H*W output pixels, N = Cout, K = 9*Cin ordered (tap, ci), so one K tile of ``BLOCK_K``
channels (``BLOCK_K`` divides Cin) lies inside one tap: its rows are ``BLOCK_K`` contiguous bytes of one input pixel
each (the pixel ``m + dy*W + dx`` of the same image, masked to zero where the tap leaves the image), and its weight
tile is a (Cout, 9*Cin) row-major slice of ``wq`` (the (Cout, 3, 3, Cin) layout of a channels_last weight). The
accumulator is fp32; the epilogue applies the per-tensor activation scale, the per-output-channel weight scale and
the bias, and writes the (M, Cout) output rows: the channels_last (N, Cout, H, W) result. No im2col matrix is
written (the 9x patch matrix of ``kernels.conv.im2col`` would cost more memory traffic than FP8 saves).

Two kernels compute it:

* the pointer kernel (``tma=False``): each K tile's rows are loaded with computed addresses and masks, the
  output pixels taken in flat order (``BLOCK_M`` consecutive pixels);
* the TMA kernel (``tma=True``, sm_90): the output tile is ``BLOCK_M / BW`` rows of ``BW`` pixels of one image, and
  each tap's input tile is one 4-D TMA box of the (N, H, W, Cin) tensor at (n, h0 + dy, w0 + dx, c0), whose parts
  outside the image the copy engine fills with zeros (negative coordinates included): the padding costs no
  instruction; the weight tile is a 2-D box of (Cout, 9*Cin).

Accumulation (``fast_accum``): Hopper's FP8 tensor-core accumulation keeps fewer bits than fp32 (DeepSeek-V3's
report measured about 14 on H800s); with ``fast_accum=False`` each K tile's products are promoted into the fp32
accumulator (Triton's ``max_num_imprecise_acc = BLOCK_K``, DeepSeek-V3's promotion interval), as cuBLASLt's
non-fast FP8 mode does; ``True`` keeps the hardware's accumulation (the static FP8 linears' default too). Only the
pointer kernel promotes: on the H200, Triton 3.6 left the TMA kernel's FP8 dot unpromoted (its error stayed that
of fast accumulation), so the TMA kernel takes ``fast_accum=True`` only (:func:`tma_problem`).

Method: the implicit-GEMM formulation of convolution (Chetlur et al., "cuDNN: Efficient Primitives for Deep
Learning", 2014; CUTLASS's ``Conv2dFprop`` implicit GEMM), on FP8 E4M3 operands (Micikevicius et al., 2022) with
static scales (SmoothQuant's per-tensor static activations, per-channel weights). Triton lowers ``tl.dot`` on FP8
operands to Hopper's wgmma and pipelines the tile loads (``num_stages``, cp.async).

Requirements: Cin a multiple of 32 (the smallest ``BLOCK_K``), Cout a multiple of 16; a CUDA GPU of sm_89+, or the
CPU under Triton's interpreter (CI); elsewhere the reference runs, logged once (``kernels.dispatch``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.dispatch import interpret_mode, launch_autotuned, use_triton
from kernels.gemm._common import autotune_bench, device_index, grouped_tile, smem_limit
from kernels.gemm.w8a8 import check_fp8_supported

FP8 = torch.float8_e4m3fn
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------
def fp8_conv3x3_ref(xq: torch.Tensor, wq: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The plain-PyTorch meaning of :func:`fp8_conv3x3`: dequantize both operands, ``F.conv2d`` (stride 1, padding 1)
    in float64 (no TF32, sums near exact), add the bias, cast. Same arguments; returns (N, Cout, H, W) channels_last
    ``out_dtype``."""
    x = xq.double().permute(0, 3, 1, 2) * a_scale.double()
    w = wq.double().permute(0, 3, 1, 2) * w_scale.double().view(-1, 1, 1, 1)
    y = F.conv2d(x, w, None if bias is None else bias.double(), 1, 1)
    return y.to(out_dtype).contiguous(memory_format=torch.channels_last)


# --------------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _fp8_conv3x3_kernel(
    x_ptr,  # (NB, H, W, CIN) fp8, contiguous (channels_last activations)
    w_ptr,  # (COUT, 3, 3, CIN) fp8, contiguous: (COUT, 9*CIN) row-major
    a_scale_ptr,  # 0-dim fp32: the activation scale
    w_scale_ptr,  # (COUT,) fp32 per-output-channel weight scales
    bias_ptr,  # (COUT,); unused when HAS_BIAS is False
    out_ptr,  # (M, COUT) rows of the output (NHWC)
    M,  # NB * H * W
    H,
    W,
    CIN,
    COUT,
    HAS_BIAS: tl.constexpr,
    FAST_ACC: tl.constexpr,  # the tensor cores' FP8 accumulation as it is; else promoted to fp32 every K tile
    K_TILES: tl.constexpr,  # > 0: the K-loop trip count 9*CIN/BLOCK_K as a constexpr (interpreter); 0: at run time
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, COUT, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.max_contiguous(tl.multiple_of(offs_n % COUT, BLOCK_N), BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    hw = offs_m % (H * W)
    oh = hw // W
    ow = hw % W
    in_m = offs_m < M
    K = 9 * CIN
    b_ptrs = w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None]  # (BLOCK_K, BLOCK_N) view of the weight^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, K_TILES if K_TILES > 0 else K // BLOCK_K):
        k = kt * BLOCK_K
        tap = k // CIN
        c0 = k - tap * CIN
        dy = tap // 3 - 1
        dx = tap % 3 - 1
        ih = oh + dy
        iw = ow + dx
        valid = in_m & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        pix = (offs_m + dy * W + dx).to(tl.int64)  # the input pixel of this tap in the same image, where valid
        a = tl.load(x_ptr + pix[:, None] * CIN + (c0 + rk)[None, :], mask=valid[:, None], other=0.0)
        b = tl.load(b_ptrs)
        if FAST_ACC:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        b_ptrs += BLOCK_K
    scale = tl.load(a_scale_ptr) * tl.load(w_scale_ptr + rn)
    y = acc * scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    mask = in_m[:, None] & (offs_n[None, :] < COUT)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * COUT + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_conv3x3_tma_kernel(
    x_desc,  # (NB, H, W, CIN) fp8, box (1, BLOCK_M // BW, BW, BLOCK_K)
    w_desc,  # (COUT, 9*CIN) fp8, box (BLOCK_N, BLOCK_K)
    a_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,  # (NB*H*W, COUT) rows of the output (NHWC)
    NB,
    H,
    W,
    CIN,
    COUT,
    HAS_BIAS: tl.constexpr,
    K_TILES: tl.constexpr,  # as in the pointer kernel
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BW: tl.constexpr,  # output pixels per tile row (a power of two <= BLOCK_M)
    GROUP_M: tl.constexpr,
):
    BH: tl.constexpr = BLOCK_M // BW
    tiles_w = tl.cdiv(W, BW)
    tiles_hw = tl.cdiv(H, BH) * tiles_w
    pid_m, pid_n = grouped_tile(tl.program_id(0), NB * tiles_hw * BLOCK_M, COUT, BLOCK_M, BLOCK_N, GROUP_M)
    n = pid_m // tiles_hw
    r = pid_m - n * tiles_hw
    h0 = (r // tiles_w) * BH
    w0 = (r % tiles_w) * BW
    off_n = pid_n * BLOCK_N
    c_tiles = CIN // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, K_TILES if K_TILES > 0 else 9 * c_tiles):
        tap = kt // c_tiles
        c0 = (kt - tap * c_tiles) * BLOCK_K
        a = x_desc.load([n, h0 + tap // 3 - 1, w0 + tap % 3 - 1, c0]).reshape(BLOCK_M, BLOCK_K)
        b = w_desc.load([off_n, tap * CIN + c0])
        acc = tl.dot(a, b.T, acc)  # fast accumulation only (the module docstring)
    rn = off_n + tl.arange(0, BLOCK_N)
    in_n = rn < COUT
    i = tl.arange(0, BLOCK_M)
    hh = h0 + i // BW
    ww = w0 + i % BW
    rows = (n * H + hh).to(tl.int64) * W + ww
    scale = tl.load(a_scale_ptr) * tl.load(w_scale_ptr + rn, mask=in_n, other=0.0)
    y = acc * scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=in_n, other=0.0).to(tl.float32)[None, :]
    mask = ((hh < H) & (ww < W))[:, None] & in_n[None, :]
    tl.store(out_ptr + rows[:, None] * COUT + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)
_GPU_CONFIGS = (
    (128, 128, 128, 4, 8),
    (128, 256, 128, 3, 8),
    (128, 128, 64, 5, 8),
    (128, 256, 64, 4, 8),
    (256, 128, 64, 4, 8),
    (64, 128, 128, 4, 4),
    (128, 64, 128, 4, 4),
    (64, 64, 128, 4, 4),
)
_MIN_BLOCK_K = 32


def _configs(table, device_idx: int, pre_hook=None) -> list[triton.Config]:
    """The tiles of ``table`` ((BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps) rows) whose pipelined operand tiles
    fit the device's shared memory."""
    limit = smem_limit(device_idx)
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=nw, num_stages=st,
                          pre_hook=pre_hook)
            for bm, bn, bk, st, nw in table if st * (bm + bn) * bk <= limit]


def gpu_configs(device_idx: int) -> list[triton.Config]:
    """The pointer kernel's tile configs that fit the device's shared memory."""
    return _configs(_GPU_CONFIGS, device_idx)


def _prune(configs, named_args, **kwargs):
    """Keep the configs whose BLOCK_K divides Cin (a K tile must not straddle two taps) and whose BLOCK_N is not
    wider than Cout needs."""
    cin, cout = named_args["CIN"], named_args["COUT"]
    kept = [c for c in configs if cin % c.kwargs["BLOCK_K"] == 0 and c.kwargs["BLOCK_N"] <= max(64, cout)]
    # none divides Cin (a multiple of 32 only): one 32-wide K tile, with the configs' pre-hook (the TMA boxes)
    return kept or [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4,
                                  num_stages=3, pre_hook=configs[0].pre_hook)]


@functools.lru_cache(maxsize=None)
def _tuned(device_idx: int):
    return triton.autotune(configs=gpu_configs(device_idx), key=["M", "H", "W", "CIN", "COUT", "HAS_BIAS", "FAST_ACC"],
                           prune_configs_by={"early_config_prune": _prune}, do_bench=autotune_bench,
                           cache_results=True)(_fp8_conv3x3_kernel)


def tile_width(w: int, block_m: int) -> int:
    """The TMA kernel's ``BW``: output pixels per tile row, the smallest power of two >= the image width, at most
    ``block_m``."""
    return min(triton.next_power_of_2(w), block_m)


def _set_boxes(nargs: dict) -> None:
    """Autotuner pre-hook: the descriptors' boxes for this config (built before the config is known)."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    bw = tile_width(nargs["W"], bm)  # what the kernel's BW heuristic gives (the hook runs before heuristics)
    nargs["x_desc"].block_shape = [1, bm // bw, bw, bk]
    nargs["w_desc"].block_shape = [bn, bk]


# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps) of the TMA kernel: each one's output checked identical over
# repeated runs on the H200. 128x128x128 with 4 stages and 8 warps is left out: its output changed from run to run
# (a race in the code Triton 3.6 generates for it; some thousand elements of 5 M at SD's shapes).
_TMA_CONFIGS = (
    (256, 128, 128, 3, 8),
    (128, 128, 64, 6, 8),
    (128, 128, 128, 4, 4),
    (64, 128, 128, 5, 4),
    (128, 64, 128, 5, 4),
    (64, 64, 128, 6, 4),
)


@functools.lru_cache(maxsize=None)
def _tuned_tma(device_idx: int):
    heuristics = triton.heuristics({"BW": lambda args: tile_width(args["W"], args["BLOCK_M"])})
    return triton.autotune(configs=_configs(_TMA_CONFIGS, device_idx, _set_boxes),
                           key=["NB", "H", "W", "CIN", "COUT", "HAS_BIAS"],
                           prune_configs_by={"early_config_prune": _prune}, do_bench=autotune_bench,
                           cache_results=True)(heuristics(_fp8_conv3x3_tma_kernel))


def autotuned_tile(tma: bool, device_idx: int) -> str:
    """The tile the autotuner of the TMA (``tma``) or pointer kernel picked at its last launch on that GPU, as
    "BMxBNxBK s<stages> w<warps>" (for benchmark reports)."""
    best = (_tuned_tma if tma else _tuned)(device_idx).best_config
    return (f"{best.kwargs['BLOCK_M']}x{best.kwargs['BLOCK_N']}x{best.kwargs['BLOCK_K']} "
            f"s{best.num_stages} w{best.num_warps}")


def _interp_block_k(cin: int) -> int:
    return 64 if cin % 64 == 0 else _MIN_BLOCK_K


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------
def problem(xq: torch.Tensor, wq: torch.Tensor) -> str | None:
    """Why :func:`fp8_conv3x3` cannot take these operands (None when it can)."""
    if xq.dim() != 4 or wq.dim() != 4 or tuple(wq.shape[1:3]) != (3, 3) or wq.shape[3] != xq.shape[3]:
        return (f"expected xq (N, H, W, Cin) and wq (Cout, 3, 3, Cin), got {tuple(xq.shape)} and "
                f"{tuple(wq.shape)}")
    if xq.dtype != FP8 or wq.dtype != FP8:
        return f"xq and wq must be float8_e4m3fn, got {xq.dtype} and {wq.dtype}"
    cin, cout = xq.shape[3], wq.shape[0]
    if cin % _MIN_BLOCK_K or cout % 16:
        return f"Cin={cin} must be a multiple of {_MIN_BLOCK_K} and Cout={cout} of 16"
    return None


def tma_problem(xq: torch.Tensor, wq: torch.Tensor, fast_accum: bool = True) -> str | None:
    """Why the TMA kernel cannot take these operands (None when it can): :func:`problem`'s rules, fast accumulation
    (see the module docstring), an sm_90+ GPU (or the interpreter), both operands starting on a 16-byte boundary."""
    why = problem(xq, wq)
    if why is not None:
        return why
    if not fast_accum:
        return "promoted accumulation (fast_accum=False) runs on the pointer kernel only"
    if xq.is_cuda and not interpret_mode() and torch.cuda.get_device_capability(xq.device)[0] < 9:
        return "TMA needs sm_90 or newer"
    if xq.data_ptr() % 16 or wq.data_ptr() % 16:
        return "an operand does not start on a 16-byte boundary (TMA needs it)"
    return None


@torch.library.custom_op("sdfast::fp8_conv3x3", mutates_args=())
def _fp8_conv3x3_op(xq: torch.Tensor, wq: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype, fast_accum: bool, tma: bool) -> torch.Tensor:
    cout = wq.shape[0]
    if not use_triton("fp8_conv3x3", xq, wq, a_scale, w_scale, bias):
        return fp8_conv3x3_ref(xq, wq, a_scale, w_scale, bias, out_dtype)
    check_fp8_supported(xq, "fp8_conv3x3")
    nb, h, w, cin = xq.shape
    m = nb * h * w
    out = torch.empty((nb, h, w, cout), device=xq.device, dtype=out_dtype)
    if m == 0:
        return out.permute(0, 3, 1, 2)
    xq, wq = xq.contiguous(), wq.contiguous()
    a_scale = a_scale.float()
    w_scale = w_scale.float().contiguous()
    if tma:
        _launch_tma(xq, wq, a_scale, w_scale, bias, out)
        return out.permute(0, 3, 1, 2)
    args = (xq, wq, a_scale, w_scale, bias if bias is not None else out, out, m, h, w, cin, cout)
    if xq.is_cuda and not interpret_mode():
        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(cout, meta["BLOCK_N"]),)

        launch_autotuned(_tuned(device_index(xq)), grid, *args, HAS_BIAS=bias is not None, FAST_ACC=fast_accum,
                         K_TILES=0)
    else:
        bk = _interp_block_k(cin)
        bm, bn = 32, 32
        grid = (triton.cdiv(m, bm) * triton.cdiv(cout, bn),)
        _fp8_conv3x3_kernel[grid](*args, HAS_BIAS=bias is not None, FAST_ACC=fast_accum, K_TILES=9 * cin // bk,
                                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4, num_warps=4, num_stages=1)
    return out.permute(0, 3, 1, 2)


def _launch_tma(xq, wq, a_scale, w_scale, bias, out) -> None:
    nb, h, w, cin = xq.shape
    cout = wq.shape[0]
    w2d = wq.view(cout, 9 * cin)
    bias_arg = bias if bias is not None else out
    if xq.is_cuda and not interpret_mode():
        x_desc = TensorDescriptor(xq, [nb, h, w, cin], list(xq.stride()), [1, 1, 8, 32])  # boxes set per config
        w_desc = TensorDescriptor(w2d, [cout, 9 * cin], [9 * cin, 1], [16, 32])

        def grid(meta):
            bh = meta["BLOCK_M"] // meta["BW"]
            return (nb * triton.cdiv(h, bh) * triton.cdiv(w, meta["BW"]) * triton.cdiv(cout, meta["BLOCK_N"]),)

        launch_autotuned(_tuned_tma(device_index(xq)), grid, x_desc, w_desc, a_scale, w_scale, bias_arg, out, nb, h, w,
                         cin, cout, HAS_BIAS=bias is not None, K_TILES=0)
        return
    bm, bn, bk = 32, 32, _interp_block_k(cin)
    bw = tile_width(w, bm)
    x_desc = TensorDescriptor(xq, [nb, h, w, cin], list(xq.stride()), [1, bm // bw, bw, bk])
    w_desc = TensorDescriptor(w2d, [cout, 9 * cin], [9 * cin, 1], [bn, bk])
    grid = (nb * triton.cdiv(h, bm // bw) * triton.cdiv(w, bw) * triton.cdiv(cout, bn),)
    _fp8_conv3x3_tma_kernel[grid](x_desc, w_desc, a_scale, w_scale, bias_arg, out, nb, h, w, cin, cout,
                                  HAS_BIAS=bias is not None, K_TILES=9 * cin // bk, BLOCK_M=bm,
                                  BLOCK_N=bn, BLOCK_K=bk, BW=bw, GROUP_M=4, num_warps=4, num_stages=1)


@_fp8_conv3x3_op.register_fake
def _(xq, wq, a_scale, w_scale, bias, out_dtype, fast_accum, tma):
    nb, h, w, _ = xq.shape
    return xq.new_empty((nb, h, w, wq.shape[0]), dtype=out_dtype).permute(0, 3, 1, 2)


def fp8_conv3x3(xq: torch.Tensor, wq: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None, *, out_dtype: torch.dtype = torch.float16, fast_accum: bool = True,
                tma: bool = False) -> torch.Tensor:
    """3x3, stride-1, padding-1 convolution of FP8 operands with static scales (see the module docstring).

    xq: (N, H, W, Cin) float8_e4m3fn activations (NHWC: the memory of a channels_last tensor); wq: (Cout, 3, 3, Cin)
    float8_e4m3fn weight (the memory of a channels_last (Cout, Cin, 3, 3) weight); a_scale: 0-dim fp32 (read by the
    kernel at run time: CUDA graphs see a new value); w_scale: (Cout,) fp32; bias: (Cout,) or None; out_dtype: fp16,
    bf16 or fp32; fast_accum: see the module docstring; tma: the TMA kernel (:func:`tma_problem` says where it runs).
    Returns (N, Cout, H, W) ``out_dtype``, channels_last. On CPU tensors without the interpreter the reference runs
    (logged once).

    Raises: ValueError (shapes: see :func:`problem`), TypeError (dtypes), NotImplementedError (a GPU below sm_89),
    RuntimeError (``tma=True`` where :func:`tma_problem` refuses).
    """
    why = problem(xq, wq)
    if why is not None:
        raise (TypeError if "float8" in why else ValueError)(f"fp8_conv3x3: {why}")
    cout = wq.shape[0]
    if a_scale.dim() != 0 or tuple(w_scale.shape) != (cout,):
        raise ValueError(f"fp8_conv3x3: a_scale must be 0-dim and w_scale ({cout},), got {tuple(a_scale.shape)} and "
                         f"{tuple(w_scale.shape)}")
    if bias is not None and tuple(bias.shape) != (cout,):
        raise ValueError(f"fp8_conv3x3: bias must be ({cout},), got {tuple(bias.shape)}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"fp8_conv3x3: out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    if tma and (why := tma_problem(xq, wq, fast_accum)) is not None:
        raise RuntimeError(f"fp8_conv3x3(tma=True): {why}")
    return _fp8_conv3x3_op(xq, wq, a_scale, w_scale, bias, out_dtype, bool(fast_accum), bool(tma))


__all__ = ["fp8_conv3x3", "fp8_conv3x3_ref", "problem", "tma_problem", "gpu_configs", "tile_width", "autotuned_tile"]
