"""Pieces shared by the GEMM kernels in this package (tile ordering, rounding, device limits, tuning)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def smem_limit(device_index: int) -> int:
    """Opt-in shared memory per block (bytes): 227 KiB on sm_90, 163 KiB on A100, 99 KiB on sm_86/89."""
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (132 on a Hopper SXM part): the size of a persistent grid."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


TMA_DTYPES = (torch.float16, torch.bfloat16)


def aligned16(t: torch.Tensor) -> bool:
    """Whether ``t`` starts on a 16-byte boundary (TMA needs it; a view's storage offset can break it)."""
    return t.data_ptr() % 16 == 0


def misaligned(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x or the weight starts off a 16-byte boundary (TMA needs it; a view's storage offset can break it)."""
    return not (aligned16(x) and aligned16(weight))


def plain_tensor(t: torch.Tensor) -> bool:
    """A dense tensor whose memory is its own (not a wrapper subclass such as a quantized weight: data_ptr 0)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided


def tma_operands_problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why a TMA kernel of ours cannot read these operands (None when it can): plain dense tensors, on an sm_90+ GPU
    (or the CPU under Triton's interpreter), fp16/bf16, one dtype and device, a contiguous bias in x's dtype. The
    kernels check their own shapes, strides and alignment after this."""
    from kernels.dispatch import interpret_mode

    if not all(plain_tensor(t) for t in (x, weight, bias) if t is not None):
        return "a tensor subclass or a non-strided layout (TMA reads plain dense memory)"
    if not (x.is_cuda and weight.is_cuda):
        if not (interpret_mode() and x.device.type == weight.device.type == "cpu"):
            return "tensors are not on a CUDA device (and TRITON_INTERPRET is not set)"
    elif torch.cuda.get_device_capability(x.device)[0] < 9:
        return "TMA needs sm_90 or newer"
    if x.dtype not in TMA_DTYPES or weight.dtype != x.dtype or weight.device != x.device:
        return f"dtype {x.dtype}/{weight.dtype}, devices {x.device}/{weight.device} (fp16 or bf16, one dtype, one device)"
    if bias is not None and (bias.dtype != x.dtype or bias.stride(0) != 1 or bias.device != x.device):
        return "the bias is not contiguous, or not in x's dtype and on x's device"
    return None


def autotune_bench(kernel_call, quantiles):
    """Autotuner timing: short warm-up and repetition (SD shapes run for microseconds; the default 100 ms
    per config makes first calls slow)."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def even_k(args) -> bool:
    """``triton.heuristics`` value: K is a multiple of the chosen BLOCK_K (no K mask in the main loop)."""
    return args["K"] % args["BLOCK_K"] == 0


def interp_meta(K: int, block_k: int) -> dict:
    """Constexprs for a launch without the autotuner (interpreter): the K-tile count is passed as a
    constexpr because Triton's interpreter cannot loop to a runtime bound under numpy >= 2.4."""
    return {"K_TILES": triton.cdiv(K, block_k), "EVEN_K": K % block_k == 0}


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ("super-tile") program order of the Triton matmul tutorial: GROUP_M row-tiles share B in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n
    first_m = (pid // num_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % num_in_group) % group_size_m)
    pid_n = (pid % num_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def round_half_even(v):
    """Round to nearest, ties to even (torch.round), from floor (libdevice.rint is not in the interpreter)."""
    f = tl.floor(v)
    d = v - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    return tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, f + odd))
