"""Measured choice between kernels that write the same outputs: GPU time per call, the fastest kept.

Used where no rule predicts the winner well enough (the cluster GroupNorm against the Triton kernels, the
TMA GEGLU GEMM against cuBLAS plus the GEGLU kernel). Callers measure once per call signature, outside CUDA
graph capture and outside a ``kernels.precompile`` dry run, and keep the answer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels import precompile
from kernels.dispatch import has_kernel_choice, log_fallback


def gpu_times_us(candidates: dict[str, Callable[[], object]], iters: int = 5, rounds: int = 2) -> dict[str, float]:
    """GPU time per call of each candidate (µs, the best of ``rounds``), on the current stream.

    Each timed batch of ``iters`` calls is queued behind a ``torch.cuda._sleep`` kernel of about 2.5 ms, longer
    than the host takes to enqueue the calls, so the events time the GPU's work, not the host's launches (inside
    the engine's CUDA graphs no host time is spent). Run 14, call F: with a 1 ms sleep and 10 calls a Triton
    GroupNorm's three Python launches still showed in its time, and the slower kernel was chosen. Candidates
    alternate, on the same (L2-resident) inputs, as in a UNet where an op reads what the one before it wrote.
    Every candidate is called once first (warm-up, compilation). Synchronizes the device.
    """
    for fn in candidates.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(5_000_000)  # about 2.5 ms at the H200's clock: longer than enqueuing the calls
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / iters)
    return {name: min(t) for name, t in times.items()}


def signature(*tensors: torch.Tensor | None) -> tuple:
    """A call signature for a per-call cache of choices: each tensor's shape, strides, dtype, class and device (None
    for an absent one). Alignment (a view's storage offset) is not in it: callers that need it check per call."""
    return tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype, type(t), t.device) for t in tensors)


def fastest(times: dict[str, float]) -> str:
    """The name with the smallest time; on a tie, the first listed (callers list their preferred kernel first)."""
    return min(times, key=lambda name: times[name])


def choose_config(cache: dict, key: tuple, x: torch.Tensor, *, name: str, instead: str,
                  problem: Callable[[], str | None], force, compile_all: Callable[[], None],
                  measure: Callable[[], object]):
    """The per-signature choice of the TMA GEMM choosers (``kernels.gemm.geglu_projection``,
    ``kernels.gemm.linear_projection``): a kernel config, or None for their library path.

    First call of a signature: ``problem()`` (why the kernel cannot run, or None) is logged once and caches None;
    a forced choice (``force``: "cublas" or a config) is cached; in a ``kernels.precompile`` dry run ``compile_all()``
    compiles every candidate and nothing is cached; on the CPU or inside CUDA graph capture nothing is timed or
    cached (a later eager call measures); else ``measure()`` is cached. Returns the choice for this call."""
    if key in cache:
        return cache[key]
    why = problem()
    if why is not None:
        if has_kernel_choice(x):  # on a CPU without the interpreter the library path is the only one: no log
            log_fallback(name, why, instead=instead)
        cache[key] = None
    elif force is not None:
        cache[key] = None if force == "cublas" else force
    elif precompile.active():
        compile_all()
        return None
    elif not x.is_cuda or torch.cuda.is_current_stream_capturing():
        return None
    else:
        cache[key] = measure()
    return cache[key]


__all__ = ["choose_config", "fastest", "gpu_times_us", "signature"]
