"""Self-resetting arrival counters for "the last program to arrive finishes the reduction" kernels.

A kernel splits a reduction over many programs; each program publishes its partial result, then adds 1 to the
counter of every output it contributed to (an acquire-release atomic at GPU scope, after a CTA barrier). The
program that brings a counter to its expected count has seen every partial of that output: it combines them and
stores 0 back into the counter. So no separate "finalize" launch is needed, and the counters are zero again when
the kernel ends: the next launch reuses them without a memset. This is the threadfence reduction of the CUDA
samples and CUTLASS's serial split-K semaphore.

Two launches that run at the same time must not share counters. Here:
- an eager launch takes the next slice of a ring of counters owned by its (device, stream): launches on one stream
  run one after another, and each leaves its slice zeroed;
- a launch being captured into a CUDA graph takes a slice of a per-device arena that is never handed out again, so
  every captured kernel owns its counters for the life of the process, whatever stream its graph replays on. The
  arena is allocated (zeroed) at the first eager call on the device; inside a capture nothing can be allocated,
  so when the arena is missing or used up, ``counters`` returns None and the caller uses its multi-launch path.
"""

from __future__ import annotations

import threading

import torch

RING = 1 << 16  # counters per (device, stream) ring for eager launches
ARENA = 1 << 20  # counters per device for launches captured into CUDA graphs (4 MiB)

_lock = threading.Lock()
_rings: dict[tuple, list] = {}  # (device, stream id) -> [tensor, next offset]
_arenas: dict[torch.device, list] = {}  # device -> [tensor, next offset]


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _stream_id(device: torch.device) -> int:
    return torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0


def _take(pool: list, n: int, size: int, wrap: bool) -> torch.Tensor | None:
    start = pool[1]
    if start + n > size:
        if not wrap:
            return None
        start = 0
    pool[1] = start + n
    return pool[0][start:start + n]


def counters(device: torch.device, n: int) -> torch.Tensor | None:
    """``n`` int32 counters, all zero, that no other launch in flight uses (see the module docstring); None inside a
    CUDA-graph capture when the device's arena is missing (no eager call before) or used up. Raises ValueError when
    ``n`` is larger than a ring."""
    if not 0 < n <= RING:
        raise ValueError(f"arrival counters: {n} requested, 1..{RING} available per launch")
    device = torch.device(device)
    with _lock:
        if _capturing(device):
            arena = _arenas.get(device)
            return None if arena is None else _take(arena, n, ARENA, wrap=False)
        if device not in _arenas:
            _arenas[device] = [torch.zeros(ARENA, dtype=torch.int32, device=device), 0]
        key = (device, _stream_id(device))
        if key not in _rings:
            _rings[key] = [torch.zeros(RING, dtype=torch.int32, device=device), 0]
        return _take(_rings[key], n, RING, wrap=True)
