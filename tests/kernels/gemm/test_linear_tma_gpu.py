"""GPU tests (marker ``gpu``, sm_90+): the TMA linear GEMM's tile configs (persistent and per-tile grids) at SD1.5's and
SDXL's small-K linear shapes, with bias and with the residual, against the fp32 reference (flash-attention's rule, kernels.testing, against
cuBLAS fp16); bf16; CUDA graph replay on new inputs and an in-place weight change; and ``linear_projection``'s
measured choice (logged, kept, correct, not taken inside a capture)."""

import logging

import pytest
import torch

from kernels.gemm import linear_projection as lp
from kernels.gemm.linear_tma import CONFIGS, linear_ref, linear_tma
from kernels.testing import assert_close_rule
from kernels.select import rules

pytestmark = pytest.mark.gpu
if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("the TMA linear GEMM needs sm_90", allow_module_level=True)

DEV = "cuda"
# (M, K, N): SD1.5's 320/640-wide projections and QKV, SDXL's level-1 projection, a ragged one
SHAPES = [(8192, 320, 320), (8192, 320, 960), (2048, 640, 640), (2048, 640, 1920), (8192, 640, 640), (1000, 328, 200)]


def _inputs(M, K, N, dtype=torch.float16):
    x = torch.randn(M, K, device=DEV).to(dtype)
    w = (torch.randn(N, K, device=DEV) / K**0.5).to(dtype)
    b = (torch.randn(N, device=DEV) * 0.1).to(dtype)
    r = torch.randn(M, N, device=DEV).to(dtype)
    return x, w, b, r


def _check(ours, x, w, b, r, atol, name):
    ref32 = linear_ref(x.float(), w.float(), b.float(), None if r is None else r.float())
    lowp = torch.nn.functional.linear(x, w, b) + (0 if r is None else r)
    assert_close_rule(ours, ref32, lowp, atol, name)


@pytest.mark.parametrize("residual", [False, True], ids=["bias", "bias+residual"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("M,K,N", SHAPES, ids=lambda v: str(v))
def test_every_config_at_sd_shapes(M, K, N, config, residual):
    x, w, b, r = _inputs(M, K, N)
    r = r if residual else None
    _check(linear_tma(x, w, b, r, config), x, w, b, r, 1e-2, f"M{M} K{K} N{N} {config} residual={residual}")


def test_bf16_and_no_bias():
    x, w, b, r = _inputs(2048, 640, 640, torch.bfloat16)
    _check(linear_tma(x, w, None, r), x, w, torch.zeros_like(b), r, 5e-2, "bf16")


def test_graph_replay_sees_new_inputs_and_weights():
    x, w, b, r = _inputs(8192, 320, 320)
    linear_tma(x, w, b, r, lp.CONFIGS[0])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = linear_tma(x, w, b, r, lp.CONFIGS[0])
    x.copy_(torch.randn_like(x))
    r.copy_(torch.randn_like(r))
    w.mul_(0.5)  # an in-place weight change (a fused LoRA) is seen too
    g.replay()
    _check(y, x, w, b, r, 1e-2, "replay")


@pytest.mark.parametrize("residual", [False, True])
def test_measured_choice_is_logged_kept_and_correct(monkeypatch, fresh_choices, caplog, residual):
    caplog.set_level(logging.INFO, logger="sdfast.kernels")
    x, w, b, r = _inputs(8192, 320, 320)
    r = r if residual else None
    _check(lp.linear_projection(x, w, b, r), x, w, b, r, 1e-2, "first call")
    assert "kernel choice linear" in caplog.text and len(fresh_choices("linear")) == 1
    assert "failed" not in caplog.text  # every candidate config ran and was timed:
    assert set(fresh_choices("linear")[0].times_us) == {"cublas", *map(str, lp.TUNING["configs"])}
    monkeypatch.setattr(rules, "gpu_time_us", lambda *a: pytest.fail("measured twice"))
    _check(lp.linear_projection(x, w, b, r), x, w, b, r, 1e-2, "second call")


def test_capture_without_a_choice_runs_cublas_and_keeps_nothing(monkeypatch, fresh_choices):
    monkeypatch.setattr(rules, "gpu_time_us", lambda *a: pytest.fail("nothing may be timed inside a capture"))
    x, w, b, r = _inputs(2048, 640, 640)
    lp.cublas_linear(x, w, b, r)  # warm cuBLAS and the add kernel outside the capture
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = lp.linear_projection(x, w, b, r)
    g.replay()
    torch.cuda.synchronize()
    assert fresh_choices() == []
    _check(y, x, w, b, r, 1e-2, "captured cuBLAS path")
