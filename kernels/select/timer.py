"""The one GPU timer of kernel choices: GPU time per call, the host's launch time excluded."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


def gpu_time_us(candidates: Mapping[str, Callable[[], object]], iters: int = 5, rounds: int = 2,
                sleep_cycles: int = 5_000_000) -> dict[str, float]:
    """GPU time per call of each candidate (µs, the best of ``rounds``), on the current stream.

    Each timed batch of ``iters`` calls is queued behind a ``torch.cuda._sleep`` spin kernel of ``sleep_cycles``
    cycles (the default is about 2.5 ms at 2 GHz, longer than the host takes to enqueue the calls), so the events
    time the GPU's work, not the host's launches: inside the engine's CUDA graphs no host time is spent, and a
    Triton kernel launched from Python costs far more host time than GPU time. Candidates alternate on the same
    (L2-resident) inputs, as in a UNet where an op reads what the one before it wrote. Every candidate is called
    once first (warm-up, compilation). Synchronizes the device. Raises what a candidate raises.
    """
    for fn in candidates.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(sleep_cycles)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / iters)
    return {name: min(t) for name, t in times.items()}


def fastest(times: Mapping[str, float], default: str, margin: float = 1.0) -> str:
    """The winner of measured ``times``: ``default`` unless another candidate's time is below ``margin`` times the
    default's (or the default was not measured); among those, the fastest; ties go to the earlier listed."""
    others = {name: t for name, t in times.items() if name != default}
    if default not in times:
        return min(others, key=lambda name: others[name])
    if not others:
        return default
    best = min(others, key=lambda name: others[name])
    return best if others[best] < margin * times[default] else default
