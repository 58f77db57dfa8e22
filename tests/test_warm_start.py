"""``sdfast.runtime.warm_start``: started once per process for a CUDA device only, on a background thread, its
library calls run in the engine's dtype, and a failing kind is logged and skipped (the others still run). The calls
themselves need a GPU: ``tests/test_cuda_graphs_gpu.py`` runs them."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from sdfast.runtime import warm_start


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(warm_start, "_threads", [])
    monkeypatch.setattr(warm_start, "_report", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())
    from kernels import precompile

    monkeypatch.setattr(precompile, "prefetch_compiler_key", lambda: None)


def test_kinds_run_on_a_background_thread_and_a_failing_one_is_skipped(fresh, monkeypatch, caplog):
    seen = []

    def ok(dtype, device):
        seen.append((dtype, device, threading.get_ident()))

    def broken(dtype, device):
        raise RuntimeError("no cuDNN (test)")

    monkeypatch.setattr(warm_start, "LIBRARY_CALLS", {"cuBLAS": ok, "cuDNN": broken, "SDPA": ok})
    monkeypatch.setattr(warm_start, "_synchronize", lambda: None)
    with caplog.at_level(logging.INFO, logger="sdfast.runtime"):
        warm_start.start("cuda:0", torch.bfloat16)
        report = warm_start.wait()
    assert set(report) == {"cuBLAS", "SDPA"} and all(t >= 0 for t in report.values())
    assert [(d, str(dev)) for d, dev, _ in seen] == [(torch.bfloat16, "cuda:0")] * 2
    assert all(t != threading.get_ident() for *_, t in seen)
    assert "cuDNN not loaded ahead (RuntimeError: no cuDNN (test))" in caplog.text


def test_once_per_process_and_cuda_only(fresh, monkeypatch):
    runs = []
    monkeypatch.setattr(warm_start, "LIBRARY_CALLS", {"cuBLAS": lambda dtype, device: runs.append(device)})
    monkeypatch.setattr(warm_start, "_synchronize", lambda: None)
    warm_start.start("cpu", torch.float32)
    assert warm_start._threads == [] and warm_start.wait() == {}
    warm_start.start("cuda:0", torch.float16)
    warm_start.start("cuda:0", torch.float16)
    warm_start.wait()
    assert len(runs) == 1
