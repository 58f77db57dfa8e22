"""kernels.gemm.linear_tma (TMA GEMM with bias and residual in its epilogue) against its fp32 reference on the CPU
under TRITON_INTERPRET=1 (one tile per program): partial tiles in M, N and K, bias and residual present or not,
SD's real K/N pairs with few rows; what it refuses; and kernels.gemm.linear_projection's choice (forced, measured once,
never inside a dry run or a torch.compile trace, logged fallbacks) and its cuBLAS residual path."""

import logging

import pytest
import torch

from kernels import precompile
from kernels.select import rules
from kernels.gemm import linear_projection as lp
from kernels.gemm.linear_tma import LinearTile, linear_ref, linear_tma, unsupported
from kernels.testing import assert_close_rule

SMALL = LinearTile(32, 32, 32, 1, 4, group_m=2)


def _inputs(M, K, N, dtype=torch.float16):
    x = torch.randn(M, K).to(dtype)
    w = (torch.randn(N, K) / K**0.5).to(dtype)
    b = (torch.randn(N) * 0.5).to(dtype)
    r = torch.randn(M, N).to(dtype)
    return x, w, b, r


@pytest.mark.parametrize("M,K,N", [(37, 40, 24), (64, 64, 32), (5, 320, 320), (3, 640, 1920), (70, 48, 96)])
@pytest.mark.parametrize("bias,residual", [(True, False), (False, False), (True, True), (False, True)])
def test_matches_reference(M, K, N, bias, residual):
    x, w, b, r = _inputs(M, K, N)
    b, r = (b if bias else None), (r if residual else None)
    out = linear_tma(x, w, b, r, config=SMALL)
    assert out.shape == (M, N) and out.dtype == x.dtype
    ref32 = linear_ref(x.float(), w.float(), None if b is None else b.float(), None if r is None else r.float())
    lowp = torch.nn.functional.linear(x, w, b) + (0 if r is None else r)
    assert_close_rule(out, ref32, lowp, 2e-3, f"linear_tma {M}x{K}x{N} bias={bias} residual={residual}")


def test_leading_dims_and_residual_view():
    """(B, L, K) input, and a residual that is the token view of a channels_last (B, C, H, W) tensor."""
    x = torch.randn(2, 16, 64).half()
    w = (torch.randn(32, 64) / 8).half()
    res_nchw = torch.randn(2, 32, 4, 4).half().contiguous(memory_format=torch.channels_last)
    res = res_nchw.permute(0, 2, 3, 1).reshape(2, 16, 32)  # no copy: channels_last memory is the token matrix
    out = linear_tma(x, w, None, res, config=SMALL)
    assert out.shape == (2, 16, 32)
    ref = linear_ref(x, w, None, res)
    assert (out.float() - ref.float()).abs().max() < 2e-2


def test_refusals():
    x, w, b, r = _inputs(8, 40, 24)
    with pytest.raises(ValueError, match="bias"):
        linear_tma(x, w, b[:5])
    with pytest.raises(ValueError, match="residual"):
        linear_tma(x, w, b, r[:, :5])
    assert "multiples of 8" in unsupported(x[:, :36], w[:, :36], b)
    assert "contiguous" in unsupported(x.t().contiguous().t(), w, b)
    assert "residual" in unsupported(x, w, b, r.float())
    assert "fp16 or bf16" in unsupported(x.float(), w.float(), b.float())


# ------------------------------------------------------------------------------------------------
# kernels.gemm.linear_projection: the measured choice between cuBLAS and the TMA GEMM
# ------------------------------------------------------------------------------------------------


def _check_lp(out, x, w, b, r, name):
    f = lambda t: None if t is None else t.float()  # noqa: E731
    lowp = torch.nn.functional.linear(x, w, b) + (0 if r is None else r)
    assert out.shape == lowp.shape and out.dtype == x.dtype
    assert_close_rule(out, linear_ref(x.float(), w.float(), f(b), f(r)), lowp, 2e-3, name)


@pytest.fixture
def clean_choices(monkeypatch, fresh_choices):
    """No linear decision before the test; returns a function giving the (winner, source) of each since."""
    monkeypatch.setitem(lp.TUNING, "configs", (SMALL,))
    return lambda: [(d.winner, d.source) for d in fresh_choices("linear")]


def _measured(monkeypatch, times, timed):
    """linear_projection as on a GPU (its decision measured on the CPU), the timer answering ``times``; ``timed``
    collects the candidates of each measurement."""
    real = rules.decide
    monkeypatch.setattr(rules, "gpu_time_us", lambda c: timed.append(list(c)) or {n: times[n] for n in c})
    monkeypatch.setattr(lp.select, "decide", lambda *a, **k: real(*a, **k, measure_cpu=True))


@pytest.mark.parametrize("residual", [False, True])
def test_forced_tma_path_runs_the_kernel(clean_choices, monkeypatch, residual):
    monkeypatch.setitem(rules._pins, "linear", str(SMALL))
    calls = []
    real = lp.linear_tma
    monkeypatch.setattr(lp, "linear_tma", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w, b, r = _inputs(20, 64, 48)
    r = r if residual else None
    _check_lp(lp.linear_projection(x, w, b, r), x, w, b, r, "forced TMA")
    assert calls and clean_choices() == [(str(SMALL), "pinned")]


@pytest.mark.parametrize("bias", [True, False])
def test_cublas_path_with_a_residual(clean_choices, bias):
    """cuBLAS's residual path: the bias-free GEMM, then bias_residual_add over the rows seen as NHWC."""
    x, w, b, r = _inputs(2 * 12, 64, 48)
    b = b if bias else None
    out = lp.cublas_linear(x.view(2, 12, 64), w, b, r.view(2, 12, 48))
    assert out.shape == (2, 12, 48) and out.is_contiguous()
    _check_lp(out.view(24, 48), x, w, b, r, "cuBLAS + bias_residual_add")


def test_cpu_without_force_runs_cublas_path_and_keeps_nothing(clean_choices, monkeypatch):
    monkeypatch.setattr(lp, "linear_tma", lambda *a, **k: pytest.fail("the TMA kernel must not run"))
    x, w, b, r = _inputs(20, 64, 48)
    _check_lp(lp.linear_projection(x, w, b, r), x, w, b, r, "cuBLAS path")
    assert clean_choices() == []  # nothing measured on the CPU: a later CUDA call would measure


def test_measured_once_per_signature(clean_choices, monkeypatch):
    measured = []
    _measured(monkeypatch, {"cublas": 1.0, str(SMALL): 2.0}, measured)  # cuBLAS measured faster
    monkeypatch.setattr(lp, "linear_tma", lambda *a, **k: None)
    monkeypatch.setattr(lp, "unsupported", lambda *a: None)
    x, w, b, _ = _inputs(20, 64, 48)
    for _ in range(3):
        lp.linear_projection(x, w, b)
    lp.linear_projection(x[:10], w, b)
    assert measured == [["cublas", str(SMALL)]] * 2 and clean_choices() == [("cublas", "measured")] * 2


def test_dry_run_compiles_every_config_and_keeps_nothing(clean_choices, monkeypatch):
    monkeypatch.setattr(precompile, "active", lambda: True)
    _measured(monkeypatch, {}, [])  # the timer would fail: nothing may be timed in a dry run
    configs = (SMALL, LinearTile(16, 32, 32, 1, 4, persistent=False))
    monkeypatch.setitem(lp.TUNING, "configs", configs)
    monkeypatch.setattr(lp, "unsupported", lambda *a: None)
    launched = []
    monkeypatch.setattr(lp, "linear_tma", lambda x, w, b, r, c: launched.append(c))
    x, w, b, _ = _inputs(20, 64, 48)
    _check_lp(lp.linear_projection(x, w, b), x, w, b, None, "dry run")
    assert launched == list(configs) and clean_choices() == []


def test_a_misaligned_tensor_with_a_cached_tma_choice_runs_cublas_logged(clean_choices, monkeypatch, caplog):
    """Two contiguous tensors with one shape share a choice; the one off a 16-byte boundary must not reach TMA."""
    caplog.set_level(logging.INFO, logger="sdfast.kernels")
    monkeypatch.setitem(rules._pins, "linear", str(SMALL))
    buf = torch.randn(20 * 64 + 4).half()
    _, w, b, _ = _inputs(20, 64, 48)
    ran = []
    real = lp.linear_tma
    monkeypatch.setattr(lp, "linear_tma", lambda *a, **k: ran.append(1) or real(*a, **k))
    aligned, offset = buf[: 20 * 64].view(20, 64), buf[4:].view(20, 64)  # offset: 8 bytes past the start
    _check_lp(lp.linear_projection(aligned, w, b), aligned, w, b, None, "aligned")
    _check_lp(lp.linear_projection(offset, w, b), offset, w, b, None, "misaligned")
    assert len(ran) == 1 and len(clean_choices()) == 1 and "not 16-byte aligned" in caplog.text


def test_unsupported_and_disabled_fall_back_logged(clean_choices, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="sdfast.kernels")
    x, w, b, r = _inputs(20, 36, 48)  # K = 36
    _check_lp(lp.linear_projection(x, w, b), x, w, b, None, "K=36")
    assert "linear" in caplog.text and "multiples of 8" in caplog.text
    assert clean_choices() == [("cublas", "only")]
    monkeypatch.setitem(rules._pins, "linear", "cublas")  # the policy's switch (KernelPolicy.linear)
    monkeypatch.setattr(lp, "linear_tma", lambda *a, **k: pytest.fail("pinned to cuBLAS"))
    x, w, b, _ = _inputs(20, 64, 48)
    lp.linear_projection(x, w, b)
    assert clean_choices()[-1] == ("cublas", "pinned")


def test_torch_compile_traces_the_cublas_path(clean_choices, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setitem(rules._pins, "linear", str(SMALL))
    monkeypatch.setattr(lp, "linear_tma", lambda *a, **k: pytest.fail("not traceable"))
    x, w, b, r = _inputs(20, 64, 48)
    _check_lp(lp.linear_projection(x, w, b, r), x, w, b, r, "compiling")
    assert clean_choices() == []


def test_cublas_residual_path_checks_shape_and_takes_any_strides():
    x, w, b, r = _inputs(20, 64, 48)
    with pytest.raises(ValueError, match="residual"):
        lp.cublas_linear(x.view(2, 10, 64), w, b, r.view(10, 2, 48))  # same numel, wrong shape
    wide = torch.randn(20, 56).half()
    strided = wide[:, :48]  # rows padded: not dense
    _check_lp(lp.cublas_linear(x, w, b, strided), x, w, b, strided, "strided residual")
    empty = lp.cublas_linear(x, w[:0], b[:0], r[:, :0])
    assert empty.shape == (20, 0)
