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

The kernel list: what dry runs queued (the module and name of each kernel of ours, with the launch's
specialization) is saved to ``<cache dir>/kernels/<gpu>-<digest>.json``, keyed as the saved kernel choices are
(``kernels.select.store.keyed_path``: the GPU, driver, CUDA, cuDNN, torch, Triton and sdfast versions and sources).
:func:`load_saved` loads those kernels into their ``JITFunction``s' caches (from Triton's disk cache: nothing is
compiled when it is warm) and onto the device; ``sdfast.load`` runs it on a thread while it reads the weights, so
the first dry run of a second process finds its kernels loaded and queues nothing. The list also names the passes
(:func:`pass_key`: a module's label, parameter shapes and input signature) whose kernels it holds whole: every kernel
their dry run queued, and every kernel compiled on the pass's thread during their warm-ups (:func:`watch`). Where
:func:`load_saved` loaded every listed kernel, such a pass needs no dry run (:func:`warm_pass`); a kernel it still
compiles in its warm-up is listed then, for the next process.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import tempfile
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
        self.queued: list[tuple[object, str]] = []  # (JITFunction, specialization data), for the kernel list
        self.owner = threading.get_ident()

    def hook(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 - Triton's names
        if is_manual_warmup or threading.get_ident() != self.owner:
            return None  # our own preload in the pool, or someone's warmup(): compile as usual
        jit = fn.jit_function
        ident = (id(jit), key)
        if ident not in self.futures:
            self.futures[ident] = self.pool.submit(_compile, jit, compile["specialization_data"], compile["device"])
            self.names[getattr(jit, "__name__", "?")] += 1
            self.queued.append((jit, compile["specialization_data"]))
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
    remember(session.queued)
    if n:
        log.info("sdfast precompile: %s: %d Triton kernels compiled in %.1f s on %d threads (%d failed): %s",
                 label, n, time.perf_counter() - t0, session.workers, failed,
                 ", ".join(f"{name} x{k}" for name, k in session.names.most_common()))


# ----------------------------------------------------------------------------------------------------------------
# The kernel list: what dry runs compiled, saved for the next process (see the module's docstring)
# ----------------------------------------------------------------------------------------------------------------
PACKAGES = ("kernels", "sdfast")  # only kernels of these packages are listed (and imported when loaded)
MAX_LISTED = 4000  # entries kept in the file (the newest)

_list_lock = threading.Lock()
_listed: dict[tuple[str, str, str], None] | None = None  # (module, qualname, specialization data), read lazily
_passes: dict[str, None] = {}  # pass keys whose kernels the list holds whole (read with _listed)
_loaded_on: set[int] = set()  # devices on which load_saved loaded every listed kernel


def list_path():
    """The kernel list's file for the current CUDA device (``kernels.select.store.keyed_path("kernels")``)."""
    from kernels.select import store

    return store.keyed_path("kernels")


def _entry(jit, specialization_data: str) -> tuple[str, str, str] | None:
    """(module, qualname, specialization data) of a kernel of ours that :func:`_resolve` finds again, else None
    (a kernel made inside a function, or another package's)."""
    module, qualname = getattr(jit, "module", None), getattr(jit, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or module.split(".")[0] not in PACKAGES:
        return None
    try:
        return (module, qualname, specialization_data) if _resolve(module, qualname) is jit else None
    except Exception:  # noqa: BLE001 - not reachable by name: not listed
        return None


def _resolve(module: str, qualname: str):
    """The ``JITFunction`` named ``module:qualname`` (through an autotuner's or heuristics' ``.fn``). Raises
    ImportError, AttributeError or TypeError when there is none."""
    if module.split(".")[0] not in PACKAGES:
        raise ImportError(f"{module}: not a module of {PACKAGES}")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    for _ in range(4):
        if hasattr(obj, "preload"):
            return obj
        obj = getattr(obj, "fn", None)
    raise TypeError(f"{module}:{qualname} is not a Triton kernel")


def _read_list(path) -> None:
    """Read the kernel list's file into ``_listed`` and ``_passes`` (empty for a missing or unreadable file)."""
    global _listed, _passes
    try:
        data = json.loads(path.read_text())
        listed = {(r["module"], r["name"], r["specialization"]): None for r in data["kernels"]}
        passes = dict.fromkeys(str(k) for k in data.get("passes", []))
    except FileNotFoundError:
        listed, passes = {}, {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("sdfast precompile: ignoring the kernel list %s (%s: %s)", path, type(e).__name__, e)
        listed, passes = {}, {}
    _listed, _passes = listed, passes


def pass_key(label: str, module, signature) -> str:
    """A name for one pass that is the same in every process: ``label``, a digest of ``module``'s parameter names,
    shapes and dtypes, and of ``repr(signature)`` (shapes, dtypes, plain values; an object whose repr holds its
    address makes a key no other process has, so that pass always gets its dry run)."""
    import hashlib

    params = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    return f"{label}:{hashlib.sha1(repr((params, signature)).encode()).hexdigest()[:16]}"


def warm_pass(key: str, device: int) -> bool:
    """True when the kernel list names pass ``key`` and :func:`load_saved` loaded every listed kernel onto CUDA
    device ``device`` in this process: that pass's dry run would queue nothing."""
    with _list_lock:
        return device in _loaded_on and key in _passes


def remember(queued: list[tuple[object, str]], passes: tuple[str, ...] = ()) -> int:
    """Add kernels (``(JITFunction, specialization data)``) and pass keys to the kernel list and write it when
    something is new (CUDA, and only while ``kernels.select.store.persisting()``). Returns how many entries were new.
    Never raises: a list that cannot be written is logged."""
    import torch

    from kernels.select import store

    if not (queued or passes) or not store.persisting() or not torch.cuda.is_available():
        return 0
    entries = [e for e in (_entry(jit, spec) for jit, spec in queued) if e is not None]
    with _list_lock:
        try:
            path = list_path()
            if _listed is None:
                _read_list(path)
            new = [e for e in entries if e not in _listed]
            new_passes = [k for k in passes if k not in _passes]
            if not (new or new_passes):
                return 0
            _listed.update(dict.fromkeys(new))
            _passes.update(dict.fromkeys(new_passes))
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"key": store.file_key(), "passes": list(_passes)[-MAX_LISTED:], "kernels": [
                    {"module": m, "name": n, "specialization": sp} for m, n, sp in list(_listed)[-MAX_LISTED:]]}, f)
            os.replace(tmp, path)
            return len(new)
        except OSError as e:
            log.warning("sdfast precompile: could not save the kernel list: %s", e)
            return 0


@contextlib.contextmanager
def watch(label: str = "module"):
    """Within the block, every Triton kernel compiled on this thread is compiled as usual and added to the kernel
    list at the end (the warm-ups of a pass: candidates timed there, a kernel its dry run did not reach). Does
    nothing while a dry run holds Triton's hook on another thread, or inside one here."""
    import triton

    if active() or not _LOCK.acquire(blocking=False):
        yield
        return
    owner, compiled = threading.get_ident(), []
    previous = triton.knobs.runtime.jit_cache_hook

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 - Triton's names
        if not is_manual_warmup and threading.get_ident() == owner:
            compiled.append((fn.jit_function, compile["specialization_data"]))
        return None  # compile as usual

    triton.knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
        _LOCK.release()
        if compiled:
            log.info("sdfast precompile: %s compiled %d Triton kernels outside a dry run: %s", label, len(compiled),
                     ", ".join(sorted({getattr(j, "__name__", "?") for j, _ in compiled})))
        remember(compiled)


def load_saved(device: int, workers: int | None = None) -> tuple[int, int]:
    """Load every kernel of the kernel list (see the module's docstring) into its ``JITFunction``'s cache and onto
    CUDA device ``device``, on ``workers`` threads (default: the CPU count, at most 16). An entry that cannot be
    found or loaded (a renamed kernel, a compile error) is logged and skipped. Returns (loaded, failed). Never
    raises."""
    from kernels.select import store

    if not store.persisting():
        return 0, 0
    try:
        path = list_path()
    except Exception as e:  # noqa: BLE001 - no CUDA device, no Triton: nothing to load
        log.info("sdfast precompile: no kernel list (%s: %s)", type(e).__name__, e)
        return 0, 0
    with _list_lock:
        if _listed is None:
            _read_list(path)
        entries = list(_listed)
    if not entries:
        return 0, 0
    _compiler_key_ready()
    t0 = time.perf_counter()

    def one(entry):
        module, qualname, spec = entry
        return _compile(_resolve(module, qualname), spec, device)

    with ThreadPoolExecutor(max_workers=workers or default_workers(), thread_name_prefix="sdfast-preload") as pool:
        futures = [pool.submit(one, e) for e in entries]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if not failed:
        with _list_lock:
            _loaded_on.add(device)
    for e in failed[:3]:
        log.info("sdfast precompile: a listed kernel was not loaded (%s: %s)", type(e).__name__, e)
    log.info("sdfast precompile: %d listed kernels loaded in %.2f s (%d failed)", len(entries) - len(failed),
             time.perf_counter() - t0, len(failed))
    return len(entries) - len(failed), len(failed)
