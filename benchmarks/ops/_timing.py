"""The ops benchmarks' device timer (``benchmarks.ops.*``).

GPU time of one call, from the profiler's CUPTI trace: what the kernels themselves take, without the host
launch latency that event timing of a single short launch adds (a few µs per graph replay: more than a 10 MB copy
takes at the memory bandwidth).

``device_time_us(fn)``: L2 is flushed (``bitwise_not_`` over a 256 MB buffer, the marker kernel) before each
of ``iters`` calls of ``fn``; the GPU activities (kernels, memcpys, memsets) between two markers are one
call's; their durations are summed and the median over calls returned. Gaps between a call's kernels are
not counted (in a CUDA graph they are about 1 µs each). Nothing runs at import.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

MARKER = "bitwise_not"
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def split_by_marker(events: list[tuple[str, float, float]], marker: str = MARKER) -> list[float]:
    """Per-call summed µs: ``events`` are (name, start µs, duration µs) GPU activities in any order; a
    call is every activity after a ``marker`` one up to the next marker (activities before the first
    marker are ignored). Returns one sum per marker that had at least one activity after it."""
    sums: list[float] = []
    current = None
    for name, _, dur in sorted(events, key=lambda e: e[1]):
        if marker in name:
            if current:
                sums.append(current)
            current = 0.0
        elif current is not None:
            current += dur
    if current:
        sums.append(current)
    return sums


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
