"""The one place where a kernel call decides between Triton and the plain-PyTorch reference.

Triton kernels run on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` (CI runs every
kernel that way). Anything else (a CPU tensor without the interpreter, Triton not installed) runs the
op's reference and is logged once per (op, reason), so a fallback is never silent.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

log = logging.getLogger("sdfast.kernels")

_logged: set[tuple[str, str]] = set()


def interpret_mode() -> bool:
    """True when Triton runs kernels in its numpy interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def can_use_triton(*tensors: torch.Tensor | None) -> tuple[bool, str]:
    """Whether a Triton kernel can run on these tensors, and if not, why (for the log)."""
    if not triton_installed():
        return False, "triton is not installed"
    devices = {t.device.type for t in tensors if t is not None}
    if devices <= {"cuda"}:
        return True, ""
    if devices <= {"cpu"} and interpret_mode():
        return True, ""
    return False, f"tensors on {sorted(devices)} and TRITON_INTERPRET is not set"


def has_kernel_choice(x: torch.Tensor) -> bool:
    """Whether a choice between a library path (cuDNN, cuBLAS) and a Triton kernel is made for ``x``: on a GPU, or on
    the CPU in the interpreter (CI). Elsewhere only the library path runs, and there is nothing to log about it."""
    return x.is_cuda or (x.device.type == "cpu" and interpret_mode())


def log_fallback(op: str, reason: str, instead: str = "the PyTorch reference") -> None:
    """Log (once per op and reason) that ``op`` ran ``instead`` (by default its PyTorch reference) because of
    ``reason``."""
    key = (op, reason)
    if key not in _logged:
        _logged.add(key)
        log.info("sdfast kernel %s: using %s (%s)", op, instead, reason)


def use_triton(op: str, *tensors: torch.Tensor | None) -> bool:
    """Decide for one call of ``op``; logs the fallback when the answer is no."""
    ok, reason = can_use_triton(*tensors)
    if not ok:
        log_fallback(op, reason)
    return ok


def launch_autotuned(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` for a ``triton.autotune`` kernel, dropping the autotuner's
    reference to the arguments afterwards. Triton 3.6's ``Autotuner.run`` keeps them in ``nargs`` until
    it returns normally: an exception while it benchmarks configs (e.g. out of memory) would keep the
    call's tensors, the output included, alive for the life of the process (seen on the H200).
    In a ``kernels.precompile`` dry run, every config is launched once (so each compiles) and none is timed
    or cached: timings of skipped launches mean nothing."""
    from kernels import precompile

    try:
        if precompile.active():  # compile every config (in parallel), time none: their launches are skipped
            kernel.nargs = dict(zip(kernel.arg_names, args))
            meta = dict(kwargs, grid=grid, warmup=False)
            for config in (kernel.prune_configs(meta) if len(kernel.configs) > 1 else kernel.configs):
                hook = getattr(config, "pre_hook", None)
                if hook is not None:  # e.g. a TMA descriptor's box for this config (compiled into it)
                    hook({**kernel.nargs, **kwargs, **config.all_kwargs()})
                kernel.fn.run(*args, **meta, **config.all_kwargs())
        else:
            kernel[grid](*args, **kwargs)
    finally:
        if getattr(kernel, "nargs", None) is not None:
            kernel.nargs = None
