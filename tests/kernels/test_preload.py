"""``kernels.preload``, the warm start: the specializations a dry run compiled are saved per GPU, versions and
Triton cache directory, and the next process preloads them on a background pool; what cannot be found or loaded is
logged and left to its first launch. Triton's side is faked (the CPU has no compiler target);
``test_precompile_gpu.py`` runs the real thing."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch

from kernels import preload
from kernels.select import store

GPU = torch.device("cuda", 0)


class FakeCompiled:
    def __init__(self):
        self.loaded_on = None

    def _init_handles(self):
        self.loaded_on = threading.get_ident()


class FakeJit:
    """Stands for a ``JITFunction`` at module level: ``fn`` is the Python function, found by its qualname."""

    def __init__(self, fn):
        self.fn = fn
        self.preloaded: list[tuple[str, FakeCompiled]] = []

    def preload(self, spec):
        if spec == "broken":
            raise RuntimeError("no such cubin (test)")
        self.preloaded.append((spec, FakeCompiled()))
        return self.preloaded[-1][1]


def norm_kernel():
    """The Python function under the fake JIT (module level, as ``@triton.jit`` leaves it)."""


norm_kernel = FakeJit(norm_kernel)


@pytest.fixture
def cache(tmp_path, monkeypatch, fresh_choices):
    """A process whose cache directory is ``tmp_path``, on a GPU named "Test GPU", with nothing recorded yet."""
    monkeypatch.setenv("SDFAST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(store, "_persist", True)
    monkeypatch.setattr(store, "device_name", lambda device: "Test GPU")
    monkeypatch.setattr(store, "_driver_version", lambda: "555.1")
    monkeypatch.setattr(preload, "_triton_cache_dir", lambda: str(tmp_path / "triton"))
    monkeypatch.setattr(preload, "_seen", {})
    monkeypatch.setattr(preload, "_dirty", False)
    monkeypatch.setattr(preload, "_report", {})
    norm_kernel.preloaded.clear()
    return tmp_path


def _new_process(monkeypatch):
    monkeypatch.setattr(preload, "_seen", {})
    monkeypatch.setattr(preload, "_dirty", False)
    monkeypatch.setattr(preload, "_report", {})
    norm_kernel.preloaded.clear()


def test_recorded_kernels_are_preloaded_and_loaded_by_the_next_process(cache, monkeypatch):
    preload.record(norm_kernel, "spec-a")
    preload.record(norm_kernel, "spec-b")
    preload.record(norm_kernel, "spec-a")  # once
    path = preload.save(GPU)
    assert path.parent == cache / "kernels" and path.name.startswith("test-gpu-")
    assert preload.save(GPU) is None  # nothing new since
    rows = json.loads(path.read_text())["kernels"]
    assert [(r["module"], r["qualname"], r["spec"]) for r in rows] == [
        (__name__, "norm_kernel", "spec-a"), (__name__, "norm_kernel", "spec-b")]

    _new_process(monkeypatch)
    preload._warm(GPU, workers=2)
    assert sorted(spec for spec, _ in norm_kernel.preloaded) == ["spec-a", "spec-b"]
    assert all(k.loaded_on not in (None, threading.get_ident()) for _, k in norm_kernel.preloaded)
    assert preload._report["kernels"] == 2 and preload._report["failed"] == 0
    assert len(preload._seen) == 2 and preload.save(GPU) is None  # what it preloaded is kept, nothing new


def test_kernels_that_cannot_be_found_or_loaded_are_logged_and_skipped(cache, monkeypatch, caplog):
    preload.record(norm_kernel, "spec-a")
    preload.record(norm_kernel, "broken")
    path = preload.save(GPU)
    data = json.loads(path.read_text())
    data["kernels"].append(dict(id="x", module=__name__, qualname="renamed_kernel", spec="s"))
    path.write_text(json.dumps(data))
    _new_process(monkeypatch)
    with caplog.at_level(logging.INFO, logger="sdfast.kernels"):
        preload._warm(GPU, workers=1)
    assert [spec for spec, _ in norm_kernel.preloaded] == ["spec-a"]
    assert preload._report["kernels"] == 1 and preload._report["failed"] == 2
    assert "renamed_kernel not preloaded (AttributeError" in caplog.text
    assert "no such cubin (test)" in caplog.text


def test_kernels_made_at_run_time_are_not_recorded(cache):
    def make():
        def local_kernel():
            pass

        return FakeJit(local_kernel)

    preload.record(make(), "spec")
    other = FakeJit(norm_kernel.fn)  # same name, but not the object the name finds
    preload.record(other, "spec")
    assert preload.save(GPU) is None


def test_another_triton_cache_or_version_reads_another_file(cache, monkeypatch):
    preload.record(norm_kernel, "spec-a")
    first = preload.save(GPU)
    monkeypatch.setattr(preload, "_triton_cache_dir", lambda: str(cache / "elsewhere"))
    assert preload.path(GPU) != first
    monkeypatch.setattr(preload, "_triton_cache_dir", lambda: str(cache / "triton"))
    monkeypatch.setattr(store, "_driver_version", lambda: "556.0")
    assert preload.path(GPU) != first


def test_nothing_is_saved_or_read_when_persisting_is_off(cache, monkeypatch):
    preload.record(norm_kernel, "spec-a")
    path = preload.save(GPU)
    _new_process(monkeypatch)
    monkeypatch.setattr(store, "_persist", False)
    preload.record(norm_kernel, "spec-b")
    assert preload.save(GPU) is None
    preload._warm(GPU, workers=1)
    assert norm_kernel.preloaded == [] and len(json.loads(path.read_text())["kernels"]) == 1


def test_start_runs_once_on_a_background_thread_and_never_raises(cache, monkeypatch, caplog):
    ran = []

    def failing(device, workers):
        ran.append(threading.get_ident())
        raise RuntimeError("driver gone (test)")

    monkeypatch.setattr(preload, "_warm", failing)
    monkeypatch.setattr(preload, "_thread", None)
    preload.start("cpu")
    assert preload._thread is None  # CUDA devices only
    with caplog.at_level(logging.WARNING, logger="sdfast.kernels"):
        preload.start(GPU)
        thread = preload._thread
        preload.start(GPU)
        assert preload._thread is thread
        assert preload.wait() == {}
    assert ran == [thread.ident] and "warm start failed (RuntimeError: driver gone (test))" in caplog.text
