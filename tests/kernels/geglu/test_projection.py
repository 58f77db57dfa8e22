"""kernels.geglu.projection's choice between cuBLAS + the GEGLU kernel and the TMA GEMM, on the CPU under
TRITON_INTERPRET=1: forced, measured once per signature, never inside a dry run or torch.compile tracing, and its
logged fallbacks (a misaligned view, an unsupported shape, the policy's cuBLAS pin)."""

import logging

import pytest
import torch

from kernels import precompile
from kernels.geglu import projection as gp
from kernels.select import rules
from kernels.geglu.triton_tma_gemm import TileConfig
from kernels.geglu.ref import geglu_linear_fp8_ref
from kernels.testing import e4m3_far
from tests.kernels.geglu.test_triton_tma_gemm import SMALL, SMALL_FP8, _check, _fp8_inputs, _inputs


@pytest.fixture
def clean_choices(monkeypatch, fresh_choices):
    """No geglu decision before the test; returns a function giving the (winner, source) of each since."""
    monkeypatch.setitem(gp.TUNING, "configs", (SMALL,))
    return lambda: [(d.winner, d.source) for d in fresh_choices("geglu")]


def _measured(monkeypatch, times, timed):
    """geglu_projection as on a GPU (its decision measured on the CPU), the timer answering ``times``; ``timed``
    collects the candidates of each measurement."""
    real = rules.decide
    monkeypatch.setattr(rules, "gpu_time_us", lambda c: timed.append(list(c)) or {n: times[n] for n in c})
    monkeypatch.setattr(gp.select, "decide", lambda *a, **k: real(*a, **k, measure_cpu=True))


def test_forced_tma_path_runs_the_kernel(clean_choices, monkeypatch):
    monkeypatch.setitem(rules._pins, "geglu", str(SMALL))
    calls = []
    real = gp.geglu_linear
    monkeypatch.setattr(gp, "geglu_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w, b = _inputs(20, 64, 48)
    _check(gp.geglu_projection(x, w, b), x, w, b, "forced TMA")
    assert calls and clean_choices() == [(str(SMALL), "pinned")]


def test_cpu_without_force_runs_cublas_path_and_keeps_nothing(clean_choices, monkeypatch):
    monkeypatch.setattr(gp, "geglu_linear", lambda *a, **k: pytest.fail("the TMA kernel must not run"))
    x, w, b = _inputs(20, 64, 48)
    _check(gp.geglu_projection(x, w, b), x, w, b, "cuBLAS path")
    assert clean_choices() == []  # nothing measured on the CPU: a later CUDA call would measure


def test_measured_once_per_signature(clean_choices, monkeypatch):
    measured = []
    _measured(monkeypatch, {"cublas": 1.0, str(SMALL): 2.0}, measured)  # cuBLAS measured faster
    monkeypatch.setattr(gp, "geglu_linear", lambda *a, **k: None)
    monkeypatch.setattr(gp, "unsupported", lambda *a: None)
    x, w, b = _inputs(20, 64, 48)
    for _ in range(3):
        gp.geglu_projection(x, w, b)
    gp.geglu_projection(x[:10], w, b)
    assert measured == [["cublas", str(SMALL)]] * 2 and clean_choices() == [("cublas", "measured")] * 2


def test_dry_run_compiles_every_config_and_keeps_nothing(clean_choices, monkeypatch):
    monkeypatch.setattr(precompile, "active", lambda: True)
    _measured(monkeypatch, {}, [])  # the timer would fail: nothing may be timed in a dry run
    configs = (SMALL, TileConfig(16, 32, 32, 1, 4))
    monkeypatch.setitem(gp.TUNING, "configs", configs)
    monkeypatch.setattr(gp, "unsupported", lambda *a: None)
    launched = []
    monkeypatch.setattr(gp, "geglu_linear", lambda x, w, b, c: launched.append(c))
    x, w, b = _inputs(20, 64, 48)
    _check(gp.geglu_projection(x, w, b), x, w, b, "dry run")
    assert launched == list(configs) and clean_choices() == []


def test_a_misaligned_view_with_a_cached_tma_choice_runs_cublas_logged(clean_choices, monkeypatch, caplog):
    """Two views with one shape and strides share a choice; the one off a 16-byte boundary must not reach TMA."""
    caplog.set_level(logging.INFO, logger="sdfast.kernels")
    monkeypatch.setitem(rules._pins, "geglu", str(SMALL))
    buf = torch.randn(20, 72).half()
    _, w, b = _inputs(20, 64, 48)
    ran = []
    real = gp.geglu_linear
    monkeypatch.setattr(gp, "geglu_linear", lambda *a, **k: ran.append(1) or real(*a, **k))
    aligned, offset = buf[:, :64], buf[:, 4:68]  # offset: 8 bytes past the start
    _check(gp.geglu_projection(aligned, w, b), aligned, w, b, "aligned view")
    _check(gp.geglu_projection(offset, w, b), offset, w, b, "misaligned view")
    assert len(ran) == 1 and len(clean_choices()) == 1 and "not 16-byte aligned" in caplog.text


def test_torch_compile_traces_the_two_kernel_path(clean_choices, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setitem(rules._pins, "geglu", str(SMALL))
    monkeypatch.setattr(gp, "geglu_linear", lambda *a, **k: pytest.fail("not traceable"))
    x, w, b = _inputs(20, 64, 48)
    _check(gp.geglu_projection(x, w, b), x, w, b, "compiling")
    assert clean_choices() == []


def test_unsupported_and_disabled_fall_back_logged(clean_choices, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="sdfast.kernels")
    x, w, b = _inputs(20, 36, 48)  # K = 36
    _check(gp.geglu_projection(x, w, b), x, w, b, "K=36")
    assert "geglu" in caplog.text and "multiples of 8" in caplog.text
    assert clean_choices() == [("cublas", "only")]
    monkeypatch.setitem(rules._pins, "geglu", "cublas")  # the policy's switch (KernelPolicy.geglu)
    monkeypatch.setattr(gp, "geglu_linear", lambda *a, **k: pytest.fail("pinned to cuBLAS"))
    x, w, b = _inputs(20, 64, 48)
    gp.geglu_projection(x, w, b)
    assert clean_choices()[-1] == ("cublas", "pinned")


# --------------------------------------------------------------------------------------------
# geglu_projection_fp8: scaled_mm + GEGLU + quantize, or the FP8 TMA GEMM with both in its epilogue
# --------------------------------------------------------------------------------------------
@pytest.fixture
def fp8_choices(monkeypatch, fresh_choices):
    monkeypatch.setitem(gp.TUNING, "fp8_configs", (SMALL_FP8,))
    return lambda: [(d.winner, d.source) for d in fresh_choices("geglu_fp8")]


@pytest.mark.parametrize("fp8_out", [True, False])
def test_fp8_paths_agree(fp8_choices, monkeypatch, fp8_out):
    """The default (scaled_mm: its CPU reference, logged) and the pinned TMA kernel give the reference's values."""
    q, qw, sa, sw, b = _fp8_inputs(20, 64, 48)
    inv = torch.tensor(60.0) if fp8_out else None
    outs = []
    for pin in (None, str(SMALL_FP8)):
        monkeypatch.setitem(rules._pins, "geglu_fp8", pin)
        out = gp.geglu_projection_fp8(q, qw, sa, sw, b, out_scale_inv=inv)
        assert out.dtype == (torch.float8_e4m3fn if fp8_out else torch.float16) and out.shape == (20, 48)
        outs.append(out)
    ref = geglu_linear_fp8_ref(q, qw, sa, sw, b, out_scale_inv=inv, out_dtype=torch.float32)
    for out in outs:
        if fp8_out:
            assert not e4m3_far(out, ref).any()
        else:
            assert (out.float() - ref).abs().max() <= 2e-3 * ref.abs().max() + 1e-3
    assert fp8_choices() == [(str(SMALL_FP8), "pinned")]


def test_fp8_measured_once_per_signature_and_key_holds_the_output_kind(fp8_choices, monkeypatch):
    measured = []
    real = rules.decide
    monkeypatch.setattr(rules, "gpu_time_us", lambda c: measured.append(list(c)) or {n: {"scaled_mm": 2.0}.get(n, 1.0)
                                                                                       for n in c})
    monkeypatch.setattr(gp.select, "decide", lambda *a, **k: real(*a, **k, measure_cpu=True))
    q, qw, sa, sw, b = _fp8_inputs(20, 64, 48)
    for _ in range(2):
        gp.geglu_projection_fp8(q, qw, sa, sw, b, out_scale_inv=torch.tensor(60.0))
    gp.geglu_projection_fp8(q, qw, sa, sw, b)
    assert measured == [["scaled_mm", str(SMALL_FP8)]] * 2
    assert fp8_choices() == [(str(SMALL_FP8), "measured")] * 2


def test_fp8_tma_refused_logged(fp8_choices, monkeypatch, caplog):
    """fast_accum=False and an fp32 output keep scaled_mm, logged; the policy pin too."""
    from kernels import dispatch

    monkeypatch.setattr(dispatch, "_logged", set())  # logged once per process: another file may have logged it
    caplog.set_level(logging.INFO, logger="sdfast.kernels")
    monkeypatch.setattr(gp, "geglu_linear_fp8", lambda *a, **k: pytest.fail("the TMA kernel must not run"))
    q, qw, sa, sw, b = _fp8_inputs(20, 64, 48)
    gp.geglu_projection_fp8(q, qw, sa, sw, b, fast_accum=False)
    assert "fast accumulation only" in caplog.text
    gp.geglu_projection_fp8(q, qw, sa, sw, b, out_dtype=torch.float32)
    assert "not torch.float32" in caplog.text
    assert fp8_choices() == [("scaled_mm", "only")] * 2
    monkeypatch.setitem(rules._pins, "geglu_fp8", "scaled_mm")  # KernelPolicy.geglu_fp8
    q, qw, sa, sw, b = _fp8_inputs(20, 64, 48)
    gp.geglu_projection_fp8(q, qw, sa, sw, b)
    assert fp8_choices()[-1] == ("scaled_mm", "pinned")
