"""Compile the Triton kernels a forward pass needs in parallel, before the pass runs for real.

With a cold Triton cache, the first forward pass at a new shape compiles every kernel specialization it
reaches, one after another, on the launching thread: most of a cold first image is ptxas, LLVM and the launchers'
C builds. ptxas and the C compiler are subprocesses, and much of the rest runs without the GIL, so compilations
overlap when several run at once (the README gives the warm-up before and after;
``benchmarks/results/h200-2026-11-30-run7/``).

``dry_run(fn, args, kwargs)`` calls ``fn`` once in *compile-only* mode: a Triton launch whose kernel is not
compiled yet is skipped and its compilation (``JITFunction.preload`` of the launch's specialization, then its
launcher build) is queued on a thread pool; launches of compiled kernels run. The outputs of skipped launches
are never written, so the values of the pass are garbage and it returns nothing; it only has to reach every
launch with the real shapes, dtypes and strides. It then waits for the compilations; the real pass after it
finds them in Triton's caches. A compilation that fails in the pool is logged and left to the real pass, which
compiles it again and raises (or falls back) where it would have anyway. This is Triton's
``knobs.runtime.jit_cache_hook`` (the pre-compile hook: returning True skips the launch) and ``preload``
(compile from a launch's serialized specialization), the mechanism Triton offers for ahead-of-time warm-up.

Code that measures kernels must not believe timings taken in this mode: it checks ``active()``
(the attention dispatcher, ``launch_autotuned``, ``SparseLinear``'s backend choice).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait

log = logging.getLogger("sdfast.kernels")

_state = threading.local()


def active() -> bool:
    """True inside ``dry_run`` on this thread: Triton launches of uncompiled kernels are being skipped."""
    return getattr(_state, "session", None) is not None


class _Session:
    """The compilations queued by one dry run."""

    def __init__(self, workers: int):
        self.workers = workers
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sdfast-precompile")
        self.futures: dict[tuple, Future] = {}
        self.names: Counter = Counter()  # kernel name -> specializations queued (for the log)
        self.owner = threading.get_ident()

    def hook(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 - Triton's names
        if is_manual_warmup or threading.get_ident() != self.owner:
            return None  # our own preload in the pool, or someone's warmup(): compile as usual
        jit = fn.jit_function
        ident = (id(jit), key)
        if ident not in self.futures:
            self.futures[ident] = self.pool.submit(_compile, jit, compile["specialization_data"], compile["device"])
            self.names[getattr(jit, "__name__", "?")] += 1
        return True  # skip this launch

    def finish(self) -> tuple[int, int]:
        wait(list(self.futures.values()))
        self.pool.shutdown(wait=True)
        failed = 0
        for f in self.futures.values():
            if f.exception() is not None:
                failed += 1
                log.info("sdfast precompile: a kernel failed to compile ahead (the real pass compiles it again): %s",
                         f.exception())
        return len(self.futures), failed


def _compile(jit, specialization_data: str, device: int):
    """In a pool thread: compile one launch's specialization into ``jit``'s kernel cache (or read it from Triton's
    disk cache), then load it: its binary onto the device and its launcher (a C module, built once and cached on
    disk). Triton does that loading lazily, at the kernel's first launch, on the launching thread; here the
    loads of all of a pass's kernels overlap."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(device)  # Triton compiles for the current device's target
    kernel = jit.preload(specialization_data)
    if hasattr(kernel, "_init_handles"):  # a CompiledKernel: what its first ``run`` would do, done now
        kernel._init_handles()
    return kernel


_key_thread: threading.Thread | None = None


def _triton_key():
    """Triton's compiler key function (a digest of its compiler sources and of libtriton, about 400 MB), or None
    where this Triton has none."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        try:
            from triton.compiler.compiler import triton_key
        except ImportError:
            return None
    return triton_key


def prefetch_compiler_key() -> None:
    """Start computing Triton's compiler key on a background thread, once per process. Every Triton compile and
    every disk-cache lookup needs it, so the process's first kernel launch pays for hashing libtriton (about
    400 MB) unless this ran before. ``sdfast.load`` calls it before it reads the weights, which the
    hashing overlaps (hashlib and file reads release the GIL); the result is Triton's own ``lru_cache``."""
    global _key_thread
    key = _triton_key()
    if key is None or _key_thread is not None:
        return
    _key_thread = threading.Thread(target=key, name="sdfast-triton-key", daemon=True)
    _key_thread.start()


def _compiler_key_ready() -> None:
    """Have the compiler key computed before a pool's threads need it (else each would hash libtriton at once)."""
    if _key_thread is not None:
        _key_thread.join()
    key = _triton_key()
    if key is not None:
        key()


def default_workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))


_LOCK = threading.Lock()  # Triton's hook is process-wide: one dry run at a time


def dry_run(fn, args: tuple = (), kwargs: dict | None = None, *, workers: int | None = None,
            label: str = "module") -> None:
    """Run ``fn(*args, **kwargs)`` once in compile-only mode, then wait for the Triton compilations it queued.

    Args: ``fn`` and its arguments: a forward pass on real-shaped inputs (CUDA); ``workers``: compile threads
    (default: the CPU count, at most 16); ``label``: for the log line.
    Never raises for the pass itself: an exception in ``fn`` (garbage values reaching a check, out of memory)
    ends the dry run early, logged; the kernels queued so far are still compiled. While another thread's dry
    run holds Triton's hook, this one does nothing (its real pass compiles as usual). Returns None.
    """
    import triton

    kwargs = kwargs or {}
    if active():
        fn(*args, **kwargs)
        return
    if not _LOCK.acquire(blocking=False):
        log.info("sdfast precompile: another thread's dry run is on; %s compiles in its real pass", label)
        return
    try:
        _run_session(triton, fn, args, kwargs, workers or default_workers(), label)
    finally:
        _LOCK.release()


def _run_session(triton, fn, args, kwargs, workers: int, label: str) -> None:
    _compiler_key_ready()
    session = _Session(workers)
    previous = triton.knobs.runtime.jit_cache_hook
    t0 = time.perf_counter()
    _state.session = session
    triton.knobs.runtime.jit_cache_hook = session.hook
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the real pass after this one meets (and reports) the same problem
        log.info("sdfast precompile: the dry pass of %s stopped early (%s: %s)", label, type(e).__name__, e)
    finally:
        _state.session = None
        n, failed = session.finish()  # before the hook goes: the pool's compiles call it (as manual warm-ups)
        triton.knobs.runtime.jit_cache_hook = previous
    if n:
        log.info("sdfast precompile: %s: %d Triton kernels compiled in %.1f s on %d threads (%d failed): %s",
                 label, n, time.perf_counter() - t0, session.workers, failed,
                 ", ".join(f"{name} x{k}" for name, k in session.names.most_common()))
