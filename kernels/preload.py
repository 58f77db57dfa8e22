"""Warm start: the Triton kernels one process compiled, loaded by the next one while it reads its weights.

A Triton kernel's first launch in a process finds it in Triton's disk cache, loads its binary onto the GPU and
loads its C launcher, on the launching thread, mostly in Python; an SD image launches a hundred or more kernel
specializations. :func:`record` keeps each specialization that a ``kernels.precompile`` dry run compiled (Triton's
serialized ``specialization_data`` and the ``JITFunction`` it belongs to); :func:`save` writes them to
``<cache dir>/kernels/<gpu>-<digest>.json``, the digest over the saved kernel choices' key (GPU, driver, CUDA,
torch, Triton and sdfast versions, source digest) and Triton's cache directory. :func:`start` reads that file on a
background thread and preloads each kernel on a small thread pool (``JITFunction.preload``, then the load its first
launch would do); :func:`wait` joins it. ``sdfast.load`` starts it before reading the weights and waits before
optimizing, so the loading overlaps the weights' (reads and copies that release the GIL).

Before anything, the thread computes Triton's compiler key (a digest of its compiler sources and of libtriton, about
400 MB), which the process's first compile or cache lookup would otherwise pay for.

A kernel no longer in Triton's disk cache compiles in the pool, as its first launch would have compiled it; one
whose function cannot be found (renamed, or made at run time) or that fails to load is logged and left to its first
launch. Tests turn saving and reading off with ``kernels.select.persist(False)``, as for the kernel choices.

Method: Triton's ``JITFunction.preload`` of a launch's ``specialization_data``, as torch's Inductor warm-starts the
kernels of its cache.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kernels.select import store

log = logging.getLogger("sdfast.kernels")

FORMAT = 1

_lock = threading.Lock()
_seen: dict[str, dict] = {}  # digest of the specialization -> {"module", "qualname", "spec"}
_dirty = False
_thread: threading.Thread | None = None
_report: dict = {}


def _jit_function(obj):
    """The ``JITFunction`` under an autotuner / heuristics wrapper (``.fn`` chain), or ``obj``."""
    while not hasattr(obj, "preload") and hasattr(obj, "fn"):
        obj = obj.fn
    return obj


def _resolve(module: str, qualname: str):
    """The ``JITFunction`` named ``module``:``qualname``. Raises ImportError / AttributeError."""
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return _jit_function(obj)


def record(jit, specialization_data: str) -> None:
    """Keep one compiled specialization of ``jit`` (a ``JITFunction``) for :func:`save`. Kernels that cannot be
    found again by name (made inside a function) are not kept."""
    fn = getattr(jit, "fn", None)
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<locals>" in qualname:
        return
    try:
        if _resolve(module, qualname) is not jit:
            return
    except (ImportError, AttributeError):
        return
    ident = hashlib.sha1(f"{module}:{qualname}:{specialization_data}".encode()).hexdigest()
    global _dirty
    with _lock:
        if ident not in _seen:
            _seen[ident] = {"module": module, "qualname": qualname, "spec": specialization_data}
            _dirty = True


def _triton_cache_dir() -> str:
    import triton

    knobs = getattr(triton, "knobs", None)
    cache = getattr(getattr(knobs, "cache", None), "dir", None)
    return str(cache or os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def path(device: torch.device | str = "cuda") -> Path:
    """The warm-start file of ``device`` for this Triton cache directory."""
    return store.keyed_path("kernels", device, triton_cache=_triton_cache_dir())


def _read(target: Path) -> dict[str, dict]:
    data = json.loads(target.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
    return {row["id"]: {k: row[k] for k in ("module", "qualname", "spec")} for row in data["kernels"]}


def save(device: torch.device | str = "cuda") -> Path | None:
    """Write the recorded specializations, merged with the file's, to :func:`path`; returns it, or None when nothing
    new was recorded (or saving is off). Raises OSError when it cannot be written."""
    global _dirty
    with _lock:
        if not _dirty or not store.persisting():
            return None
        target = path(device)
        rows = {}
        if target.exists():
            try:
                rows = _read(target)
            except (OSError, ValueError, KeyError, TypeError):
                rows = {}
        rows.update(_seen)
        store.write_json(target, {"format": FORMAT, "kernels": [dict(id=k, **v) for k, v in rows.items()]})
        _dirty = False
        return target


def _load(entry: dict, device: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    jit = _resolve(entry["module"], entry["qualname"])
    kernel = jit.preload(entry["spec"])
    if hasattr(kernel, "_init_handles"):  # what its first launch would do: binary onto the GPU, launcher loaded
        kernel._init_handles()


def _warm(device: torch.device, workers: int) -> None:
    t0 = time.perf_counter()
    from kernels import precompile

    precompile.compiler_key()
    report = {"kernels": 0, "failed": 0, "key_s": time.perf_counter() - t0}
    if store.persisting():
        target = path(device)
        try:
            entries = list(_read(target).items()) if target.exists() else []
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("sdfast: ignoring the warm-start kernel list %s (%s: %s)", target, type(e).__name__, e)
            entries = []
        index = device.index if device.index is not None else torch.cuda.current_device()
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sdfast-preload") as pool:
            futures = [(ident, entry, pool.submit(_load, entry, index)) for ident, entry in entries]
        for ident, entry, future in futures:
            error = future.exception()
            if error is None:
                with _lock:
                    _seen.setdefault(ident, entry)
                report["kernels"] += 1
            else:
                report["failed"] += 1
                log.info("sdfast: warm start: %s.%s not preloaded (%s: %s); its first launch loads it",
                         entry["module"], entry["qualname"], type(error).__name__, error)
    report["seconds"] = time.perf_counter() - t0
    _report.update(report)
    if report["kernels"] or report["failed"]:
        log.info("sdfast: warm start: %d Triton kernels preloaded in %.2f s (%d failed)", report["kernels"],
                 report["seconds"], report["failed"])


def start(device: torch.device | str = "cuda", workers: int | None = None) -> None:
    """Start the warm start for ``device`` (a CUDA device) on a background thread; once per process. Never raises:
    what goes wrong is logged."""
    global _thread
    device = torch.device(device)
    if device.type != "cuda" or _thread is not None:
        return
    workers = workers or max(1, min(8, os.cpu_count() or 1))

    def run():
        try:
            _warm(device, workers)
        except Exception as e:  # noqa: BLE001 - a warm start is an optimization: never the cause of a failure
            log.warning("sdfast: warm start failed (%s: %s); kernels load at their first launch", type(e).__name__, e)

    _thread = threading.Thread(target=run, name="sdfast-warm-start", daemon=True)
    _thread.start()


def wait() -> dict:
    """Join the warm start (if one was started); returns its report: ``kernels`` preloaded, ``failed``, ``seconds``
    (wall time of the thread), ``key_s`` (of that, Triton's compiler key). Empty when none ran."""
    if _thread is not None:
        _thread.join()
    return dict(_report)
