"""Pieces shared by the GEMM kernels in this package (tile ordering, rounding, device limits, tuning)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def smem_limit(device_index: int) -> int:
    """Opt-in shared memory per block (bytes): 227 KiB on H100/H200, 163 KiB on A100, 99 KiB on sm_86/89."""
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (132 on the H200): the size of a persistent grid."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


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
