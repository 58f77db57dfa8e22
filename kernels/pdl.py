"""Programmatic Dependent Launch (PDL) for our Triton kernels on Hopper.

With PDL a kernel may be launched while the kernel before it in the stream is still running: its programs
get onto the SMs the previous kernel's tail leaves idle and wait at ``griddepcontrol.wait`` until that
kernel has finished and its writes are visible. What it saves is the launch and ramp-up between two
kernels, about a microsecond each, which matters for the short norm kernels (GroupNorm's statistics,
finalize and apply passes run back to back). CUDA 12 programming guide, "Programmatic Dependent Launch
and Synchronization"; TensorRT-LLM and vLLM launch their kernels this way. CUDA graph capture keeps it
(programmatic edges between the kernel nodes).

How a kernel uses it (each kernel that takes a ``PDL`` constexpr)::

    if PDL:
        tl.extra.cuda.gdc_wait()                # first statement: no global load or store before it
        tl.extra.cuda.gdc_launch_dependents()   # the next PDL kernel may start filling idle SMs

The wait comes before every memory access, so a kernel never reads what the previous one has not written
yet, and never overwrites what it still reads. The wait is transitive: the previous kernel passed its own
wait before it finished. A kernel launched without PDL (cuBLAS, cuDNN) waits for ours as usual.

``launch_options(t)`` gives the launch's keyword arguments: ``PDL=True, launch_pdl=True`` on an sm_90+
CUDA device, ``PDL=False`` elsewhere (older GPUs, the CPU interpreter, which cannot run the PTX) or when
``SDFAST_PDL=0`` (the switch the benchmark uses to measure what PDL saves).
"""

from __future__ import annotations

import functools
import os

import torch

from kernels.dispatch import interpret_mode


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device launch with PDL (see the module docstring)."""
    if t.device.type != "cuda" or interpret_mode() or os.environ.get("SDFAST_PDL", "1") == "0":
        return False
    return _sm90_or_newer(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_options(t: torch.Tensor) -> dict:
    """Keyword arguments for a launch of a kernel with a ``PDL`` constexpr, on ``t``'s device."""
    return {"PDL": True, "launch_pdl": True} if enabled(t) else {"PDL": False}


__all__ = ["enabled", "launch_options"]
