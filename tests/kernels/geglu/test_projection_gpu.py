"""GPU tests (marker ``gpu``, sm_90+): ``kernels.geglu.projection.geglu_projection``'s measured choice between
cuBLAS + the GEGLU kernel and the TMA GEMM (logged, kept, correct), and CUDA graph capture after a TMA choice and
without one (nothing timed inside a capture)."""

import logging

import pytest
import torch

from kernels.geglu import projection as gp
from kernels.geglu.triton_tma_gemm import CONFIGS
from kernels.select import rules
from tests.kernels.geglu.test_triton_tma_gemm_gpu import _check, _inputs

pytestmark = pytest.mark.gpu
if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("the TMA GEGLU GEMM needs sm_90", allow_module_level=True)

DEV = "cuda"


def test_measured_choice_is_logged_kept_and_correct(monkeypatch, fresh_choices, caplog):
    caplog.set_level(logging.INFO, logger="sdfast.kernels")
    x, w, b = _inputs(2048, 1280, 5120)
    _check(gp.geglu_projection(x, w, b), x, w, b, 1e-2, "first call")
    assert "kernel choice geglu" in caplog.text and len(fresh_choices("geglu")) == 1
    assert "failed" not in caplog.text  # every candidate config ran and was timed:
    assert set(fresh_choices("geglu")[0].times_us) == {"cublas", *map(str, gp.TUNING["configs"])}
    monkeypatch.setattr(rules, "gpu_time_us", lambda *a: pytest.fail("measured twice"))
    _check(gp.geglu_projection(x, w, b), x, w, b, 1e-2, "second call")


def test_capture_after_a_tma_choice_replays_on_new_inputs(monkeypatch, fresh_choices):
    """The engine's order: an eager call chooses (here: the TMA kernel, forced), the capture records it, replays
    read the static input and the weight in place."""
    monkeypatch.setitem(rules._pins, "geglu", str(CONFIGS[0]))
    ran = []
    real = gp.geglu_linear
    monkeypatch.setattr(gp, "geglu_linear", lambda *a, **k: ran.append(1) or real(*a, **k))
    x, w, b = _inputs(2048, 640, 2560)
    gp.geglu_projection(x, w, b)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = gp.geglu_projection(x, w, b)
    x.copy_(torch.randn_like(x))
    w.mul_(0.5)
    g.replay()
    torch.cuda.synchronize()
    assert len(ran) == 2
    _check(y, x, w, b, 1e-2, "replay through geglu_projection")


def test_capture_without_a_choice_runs_cublas_and_keeps_nothing(monkeypatch, fresh_choices):
    monkeypatch.setattr(rules, "gpu_time_us", lambda *a: pytest.fail("nothing may be timed inside a capture"))
    x, w, b = _inputs(512, 1280, 5120)
    gp.cublas_geglu(x, w, b)  # warm cuBLAS and the GEGLU kernel outside the capture
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = gp.geglu_projection(x, w, b)
    g.replay()
    torch.cuda.synchronize()
    assert fresh_choices() == []
    _check(y, x, w, b, 1e-2, "captured cuBLAS path")
