"""Warm start: what every process loads once before its first image, loaded while ``sdfast.load`` reads the weights.

A fresh process pays, at its first image, for loading the CUDA libraries behind the first call of each kind:
cuBLAS's first matmul, cuDNN's first convolution (its engine libraries), the first scaled-dot-product attention,
and the first launch of each torch kernel (CUDA loads a kernel's module at its first launch), plus Triton's
compiler key (a digest of libtriton, about 400 MB). None of it depends on the weights or is kept in any cache on
disk, and most of it runs without the GIL, so :func:`start` runs it on background threads: small calls of those
kinds in the engine's dtype on a private stream of the engine's device (``LIBRARY_CALLS``), and
``kernels.precompile.prefetch_compiler_key``. ``sdfast.load`` starts it before reading the weights and waits for
it (:func:`wait`) after optimizing, before it returns. What is per shape (a convolution's cuDNN plan, kept per
thread) is left to the first image's warm-up.

The thread has exited before ``load`` returns, so torch hands its cuBLAS and cuDNN handles to the next thread that
asks (torch keeps a pool of them per device). Every tensor here is made with ``torch.full``/``torch.ones`` and the
random kernel runs on a private generator: a draw from the global CUDA generator would change the seeded weights
that ``load`` builds at the same time. A failure here is logged and changes nothing: the first image then loads the
library itself.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import torch.nn.functional as F

log = logging.getLogger("sdfast.runtime")


def _t(*shape, dtype, device, channels_last=False):
    """A small tensor of ones (no random draw: see the module's docstring)."""
    t = torch.full(shape, 0.5, device=device, dtype=dtype)
    return t.to(memory_format=torch.channels_last) if channels_last else t


def _matmuls(dtype, device):
    a, w = _t(256, 320, dtype=dtype, device=device), _t(640, 320, dtype=dtype, device=device)
    F.linear(a, w)
    F.linear(a, w, torch.zeros(640, device=device, dtype=dtype))
    torch.bmm(a.view(2, 128, 320), a.view(2, 128, 320).transpose(1, 2))


def _convolutions(dtype, device):
    for channels_last in (True, False):
        x = _t(1, 64, 16, 16, dtype=dtype, device=device, channels_last=channels_last)
        for k, bias in ((3, True), (3, False), (1, True)):
            w = _t(64, 64, k, k, dtype=dtype, device=device, channels_last=channels_last)
            F.conv2d(x, w, torch.zeros(64, device=device, dtype=dtype) if bias else None, padding=k // 2)


def _attention(dtype, device):
    for heads, tokens, head_dim in ((8, 64, 40), (10, 64, 64), (20, 64, 64), (1, 64, 512)):
        q = _t(2, heads, tokens, head_dim, dtype=dtype, device=device)
        F.scaled_dot_product_attention(q, q, q)
    q = _t(2, 12, 77, 64, dtype=dtype, device=device)  # CLIP's: a causal mask as a tensor
    mask = torch.full((77, 77), float("-inf"), device=device, dtype=dtype).triu(1)
    F.scaled_dot_product_attention(q, q, q, attn_mask=mask.expand(2, 1, 77, 77))
    F.scaled_dot_product_attention(q, q, q, is_causal=True)


def _elementwise(dtype, device):
    x = _t(2, 64, 8, 8, dtype=dtype, device=device)
    F.group_norm(x, 32)
    F.layer_norm(x.view(2, 64, 64).transpose(1, 2), (64,))
    ops = (F.silu, F.gelu, lambda t: F.gelu(t, approximate="tanh"), lambda t: torch.softmax(t, -1), torch.sigmoid,
           torch.tanh, lambda t: F.interpolate(t, scale_factor=2.0, mode="nearest"), lambda t: torch.cat([t, t], 1),
           lambda t: t + t, lambda t: t * 0.5, lambda t: t.float().to(dtype), lambda t: t.clamp(-1, 1),
           lambda t: torch.exp(t.float()), lambda t: torch.isfinite(t).all())
    for op in ops:
        op(x)
    private = torch.Generator(device=device).manual_seed(0)  # never the global generator
    torch.randn(1, 4, 8, 8, device=device, dtype=dtype, generator=private)


LIBRARY_CALLS = {"cuBLAS": _matmuls, "cuDNN": _convolutions, "SDPA": _attention, "torch kernels": _elementwise}

_threads: list[threading.Thread] = []
_report: dict[str, float] = {}
_lock = threading.Lock()


def _synchronize() -> None:
    torch.cuda.current_stream().synchronize()


def _warm_libraries(device: torch.device, dtype: torch.dtype) -> None:
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device)
    with torch.no_grad(), torch.cuda.stream(stream):
        for name, calls in LIBRARY_CALLS.items():
            t0 = time.perf_counter()
            try:
                calls(dtype, device)
                _synchronize()
            except Exception as e:  # noqa: BLE001 - a warm start never fails a load; the first image loads it
                log.info("sdfast: warm start: %s not loaded ahead (%s: %s)", name, type(e).__name__, e)
                continue
            with _lock:
                _report[name] = time.perf_counter() - t0


def start(device: torch.device | str, dtype: torch.dtype) -> None:
    """Start the warm start for ``device`` (CUDA; nothing for other devices) and ``dtype`` (the engine's: float16,
    bfloat16 or float32) on background threads; once per process. Never raises."""
    device = torch.device(device)
    if device.type != "cuda" or _threads or not torch.cuda.is_available():
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    from kernels import precompile

    precompile.prefetch_compiler_key()
    thread = threading.Thread(target=_warm_libraries, args=(device, dtype), name="sdfast-warm-start", daemon=True)
    thread.start()
    _threads.append(thread)


def wait() -> dict[str, float]:
    """Join the warm start, if one was started; returns the seconds each kind of library call took there
    (``LIBRARY_CALLS``' names; a kind that failed is missing)."""
    for thread in _threads:
        thread.join()
    with _lock:
        return dict(_report)
