"""GPU time of one call, from the profiler's CUPTI trace: what the kernels themselves take, without the host
launch latency that event timing of a single short launch adds (about 5 µs per graph replay on the H200,
which a 10 MB copy at the 4.05 TB/s ceiling would need only 2.6 µs for).

``device_time_us(fn)``: L2 is flushed (``bitwise_not_`` over a 256 MB buffer, the marker kernel) before each
of ``iters`` calls of ``fn``; the GPU activities (kernels, memcpys, memsets) between two markers are one
call's; the time the GPU was busy with them (the union of their intervals: their summed durations, unless
kernels overlap, which programmatic dependent launch lets them do, see ``kernels.pdl``) is one call's time,
and the median over calls is returned. Gaps between a call's kernels are not counted (in a CUDA graph they
are about 1 µs each). Nothing runs at import.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

MARKER = "bitwise_not"
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def split_by_marker(events: list[tuple[str, float, float]], marker: str = MARKER) -> list[float]:
    """Per-call busy µs: ``events`` are (name, start µs, duration µs) GPU activities in any order; a call is
    every activity after a ``marker`` one up to the next marker (activities before the first marker are
    ignored). A call's time is the length of the union of its activities' intervals, so two kernels that
    overlap count once where they overlap. Returns one value per marker that had at least one activity
    after it."""
    calls: list[list[tuple[float, float]]] = []
    current = None
    for name, start, dur in sorted(events, key=lambda e: e[1]):
        if marker in name:
            current = []
            calls.append(current)
        elif current is not None:
            current.append((start, start + dur))
    return [_union_length(c) for c in calls if c]


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (sorted by start)."""
    total, end = 0.0, float("-inf")
    for lo, hi in intervals:
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def _gpu_events(prof) -> list[tuple[str, float, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [(e.get("name", "?"), float(e["ts"]), float(e.get("dur", 0.0))) for e in events
            if e.get("ph") == "X" and e.get("cat") in _GPU_CATS]


def device_time_us(fn, *, iters: int = 20, flush_bytes: int = 256 << 20) -> float:
    """Median GPU time (µs) of one call of ``fn`` (see the module docstring). Raises RuntimeError when the
    trace holds no GPU activity for ``fn`` (e.g. it ran on the CPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.bitwise_not_()
            fn()
        torch.cuda.synchronize()
    sums = split_by_marker(_gpu_events(prof))
    if not sums:
        raise RuntimeError("device_time_us: the profiler trace has no GPU activity for the timed function")
    return statistics.median(sums)
