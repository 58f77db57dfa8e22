"""The one cache of kernel choices, and the saved-choices file that lets a second process measure nothing.

In memory: (choice name, device name, key) -> :class:`Decision`, for the life of the process.

On disk: measured decisions of CUDA devices are written to ``<cache dir>/choices/<gpu>-<digest>.json`` (the cache
dir is ``$SDFAST_CACHE_DIR``, else ``~/.cache/sdfast``), where the digest covers what a timing depends on: the GPU's
name, the driver, CUDA, cuDNN, torch and Triton versions, and the sdfast version with a digest of its sources (an
edited kernel measures again). Another GPU or version reads another file, so a changed key measures again. The file
is read once per process, at the first lookup on a CUDA device, and written by :func:`save` (the engine calls it
after a warm-up; at exit it is called for anything measured since), atomically (a temporary file, then a rename).
A file that cannot be read or parsed is logged and ignored (everything is measured again).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path

import torch

from kernels.paths import cache_dir
from kernels.select.declare import Decision

log = logging.getLogger("sdfast.kernels")

FORMAT = 1  # the file's layout version

_lock = threading.RLock()
_memory: dict[tuple[str, str, tuple], Decision] = {}  # (choice, device name, key tuple)
_saved: dict[tuple[str, str, str], Decision] | None = None  # read lazily from the file
_dirty = False
_atexit_registered = False
_persist = True  # read and write the saved-choices file (tests turn it off: persist(False))
_measured = 0  # decisions measured in this process (see measured_count)


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device | str) -> str:
    """The name decisions are filed under: the GPU's name for a CUDA device, else the device type."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device.index if device.index is not None else torch.cuda.current_device())


def _driver_version() -> str:
    try:
        return Path("/proc/driver/nvidia/version").read_text().splitlines()[0].strip()
    except OSError:
        pass
    try:
        import ctypes

        version = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        return str(version.value)
    except (OSError, AttributeError):
        return "unknown"


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    """A digest of the sdfast and kernels Python sources (and the CUDA sources): an edit measures again."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha1()
    for package in ("kernels", "sdfast"):
        for path in sorted((root / package).rglob("*")):
            if path.suffix in (".py", ".cu", ".cpp") and path.is_file():
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def file_key(device: torch.device | str = "cuda") -> dict:
    """What the saved decisions of ``device`` depend on (the file's name is its digest)."""
    import triton

    try:
        from importlib.metadata import version

        sdfast_version = version("sdfast")
    except Exception:  # noqa: BLE001 - a checkout on PYTHONPATH, not installed
        sdfast_version = "unknown"
    return {"format": FORMAT, "gpu": device_name(device), "driver": _driver_version(), "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "torch": torch.__version__, "triton": triton.__version__,
            "sdfast": sdfast_version, "sources": _source_digest()}


def saved_path(device: torch.device | str = "cuda") -> Path:
    """The saved-choices file of ``device`` (see the module's docstring)."""
    key = file_key(device)
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    slug = "".join(c if c.isalnum() else "-" for c in key["gpu"]).strip("-").lower()
    return cache_dir() / "choices" / f"{slug}-{digest}.json"


def load(path: Path | None = None) -> int:
    """Read the saved-choices file (``saved_path()`` by default) into the saved set; returns how many decisions it
    held (0 for a missing or unreadable file, which is logged)."""
    global _saved
    with _lock:
        _saved = {}
        if not _persist and path is None:
            return 0
        path = path or saved_path()
        if not path.exists():
            return 0
        try:
            data = json.loads(path.read_text())
            if data.get("key", {}).get("format") != FORMAT:
                raise ValueError(f"format {data.get('key', {}).get('format')!r}, expected {FORMAT}")
            for row in data["decisions"]:
                d = Decision(choice=row["choice"], key=row["key"], winner=row["winner"],
                             times_us=dict(row.get("times_us", {})), source="saved", device=row["device"])
                _saved[(d.choice, d.device, d.key)] = d
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("sdfast: ignoring the saved kernel choices in %s (%s: %s): measuring again", path,
                        type(e).__name__, e)
            _saved = {}
        else:
            log.info("sdfast: %d saved kernel choices read from %s", len(_saved), path)
        return len(_saved)


def lookup(choice: str, device: str, key: tuple) -> Decision | None:
    """The decision of this choice and key: made in this process, else read from the saved file (CUDA)."""
    found = _memory.get((choice, device, key))
    if found is not None or device in ("cpu", "meta"):
        return found
    with _lock:
        if _saved is None:
            load()
        found = _saved.get((choice, device, repr(key)))
        if found is not None:
            _memory[(choice, device, key)] = found
        return found


def record(decision: Decision, key: tuple, save: bool) -> Decision:
    """Keep ``decision`` (for ``key``) for the process; with ``save`` (and a CUDA device), mark it for the saved
    file."""
    global _dirty, _atexit_registered, _measured
    with _lock:
        _memory[(decision.choice, decision.device, key)] = decision
        _measured += decision.source == "measured"
        if save and decision.source == "measured" and decision.device not in ("cpu", "meta"):
            _dirty = True
            if not _atexit_registered:
                atexit.register(_save_at_exit)
                _atexit_registered = True
    return decision


def measured_count() -> int:
    """How many decisions this process has measured so far (never decreases): a caller that compares it before and
    after a pass knows whether the pass timed candidates (the graph runtime's warm-up does)."""
    return _measured


def decisions(choice: str | None = None) -> list[Decision]:
    """Every decision made or read in this process (of one choice, if named), in the order they were made."""
    with _lock:
        return [d for d in _memory.values() if choice is None or d.choice == choice]


def clear(choice: str | None = None) -> None:
    """Forget the decisions of this process (of one choice, if named), saved ones read from the file too; the file
    itself is kept (use :func:`persist` to stop reading it)."""
    with _lock:
        for k in [k for k in _memory if choice is None or k[0] == choice]:
            del _memory[k]
        if _saved is not None:
            for k in [k for k in _saved if choice is None or k[0] == choice]:
                del _saved[k]


def persist(enabled: bool) -> None:
    """Whether this process reads and writes the saved-choices file (on by default). Off: every choice is
    measured again and nothing is written (tests; benchmarks of a first start)."""
    global _saved, _persist
    with _lock:
        _persist = bool(enabled)
        _saved = None if enabled else {}


def save(path: Path | None = None) -> Path | None:
    """Write the measured and saved decisions of the current CUDA device to its saved-choices file, merged with
    what it holds; returns its path, or None when nothing new was measured since the last save (decisions of
    another GPU model in the process are not saved). Raises OSError when it cannot
    be written."""
    global _dirty
    with _lock:
        if not _dirty or not (_persist or path is not None):
            return None
        current = device_name("cuda")
        rows = {}
        for source in (_saved or {}).values(), _memory.values():
            for d in source:
                if d.device == current and d.source in ("measured", "saved"):
                    rows[(d.choice, d.key)] = d
        target = path or saved_path()
        target.parent.mkdir(parents=True, exist_ok=True)
        data = {"key": file_key(), "decisions": [
            {k: v for k, v in d.as_dict().items() if k not in ("source", "reasons")} for d in rows.values()]}
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, target)
        written = target
        _dirty = False
        return written


def _save_at_exit() -> None:
    try:
        save()
    except OSError as e:
        log.warning("sdfast: could not save the kernel choices: %s", e)
