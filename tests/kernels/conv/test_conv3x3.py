"""kernels.conv.im2col (the patch matrix of a 3x3 convolution, bit-identical to its PyTorch reference, under
TRITON_INTERPRET=1) and kernels.conv.conv3x3 (cuDNN or im2col + cuBLAS, chosen per signature): both paths give the
convolution, channels_last; what the GEMM path refuses; forced paths; nothing kept in a dry run; autograd runs
cuDNN. The measured choice itself runs in the GPU file."""

import pytest
import torch
import torch.nn.functional as F

from kernels import precompile, select
from kernels.conv import conv3x3 as cv
from kernels.conv.im2col import im2col3x3, im2col3x3_ref
from kernels.testing import assert_close_rule

CL = torch.channels_last


def _x(n, c, h, w, dtype=torch.float16, fmt=CL):
    return torch.randn(n, c, h, w).to(dtype).contiguous(memory_format=fmt)


def _weight(cout, cin, dtype=torch.float16):
    return (torch.randn(cout, cin, 3, 3) / (9 * cin) ** 0.5).to(dtype).contiguous(memory_format=CL)


@pytest.mark.parametrize("n,c,h,w", [(2, 64, 8, 8), (1, 20, 5, 7), (3, 130, 9, 4), (1, 8, 1, 1), (2, 320, 3, 2)])
@pytest.mark.parametrize("fmt", [CL, torch.contiguous_format], ids=["channels_last", "nchw"])
def test_im2col_is_bit_identical(n, c, h, w, fmt):
    x = _x(n, c, h, w, fmt=fmt)
    assert torch.equal(im2col3x3(x), im2col3x3_ref(x))


def test_im2col_of_a_strided_view():
    x = _x(2, 64, 8, 8)[:, 16:48]  # a channel slice: strides of the parent
    assert torch.equal(im2col3x3(x), im2col3x3_ref(x))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n,cin,cout,h,w", [(2, 64, 40, 8, 8), (1, 32, 16, 5, 7), (3, 16, 8, 1, 1)])
def test_gemm_path_is_the_convolution(n, cin, cout, h, w, bias):
    x, wt = _x(n, cin, h, w), _weight(cout, cin)
    b = (torch.randn(cout) * 0.5).half() if bias else None
    y = cv.gemm_conv3x3(x, wt, b)
    assert y.is_contiguous(memory_format=CL) and y.dtype == x.dtype
    f = lambda t: None if t is None else t.float()  # noqa: E731
    ref32 = F.conv2d(x.float(), wt.float(), f(b), 1, 1)
    assert_close_rule(y, ref32, F.conv2d(x, wt, b, 1, 1), 2e-3, f"{n}x{cin}->{cout} {h}x{w}")


def test_gemm_problem_names_what_it_refuses(monkeypatch):
    x, wt = _x(2, 64, 8, 8), _weight(32, 64)
    assert cv.gemm_problem(x, wt, None) is None
    assert "channels_last" in cv.gemm_problem(x.contiguous(), wt, None)
    assert "channels_last" in cv.gemm_problem(x, wt.contiguous(), None)
    assert "fp16 or bf16" in cv.gemm_problem(x.float(), wt.float(), None)
    assert "bias" in cv.gemm_problem(x, wt, torch.zeros(32))
    assert "3x3" in cv.gemm_problem(x, wt[:, :, :1], None)
    assert "output pixels" in cv.gemm_problem(_x(2, 64, 64, 64), wt, None)


def _conv_decisions(decisions):
    return [(d.winner, d.source) for d in decisions("conv3x3")]


@pytest.mark.parametrize("force", ["gemm", "cudnn"])
def test_forced_paths(monkeypatch, fresh_choices, force):
    used = []
    for name in ("gemm_conv3x3", "cudnn_conv3x3"):
        real = getattr(cv, name)
        monkeypatch.setattr(cv, name, lambda *a, real=real, name=name: used.append(name) or real(*a))
    x, wt = _x(2, 64, 8, 8), _weight(32, 64)
    b = torch.randn(32).half()
    with select.pinned({"conv3x3": force}):
        torch.testing.assert_close(cv.conv3x3(x, wt, b).float(),
                                   F.conv2d(x.float(), wt.float(), b.float(), 1, 1), atol=2e-2, rtol=1e-2)
    assert used == [f"{force}_conv3x3"] and _conv_decisions(fresh_choices) == [(force, "pinned")]


def test_refused_signature_runs_cudnn_and_is_kept(fresh_choices):
    x, wt = _x(2, 64, 8, 8, torch.float32), _weight(32, 64, torch.float32)
    with select.pinned({"conv3x3": "gemm"}):
        torch.testing.assert_close(cv.conv3x3(x, wt), F.conv2d(x, wt, None, 1, 1))
    assert _conv_decisions(fresh_choices) == [("cudnn", "only")]


def test_cpu_keeps_nothing(fresh_choices):
    x, wt = _x(2, 64, 8, 8), _weight(32, 64)
    cv.conv3x3(x, wt)
    assert fresh_choices() == []


def test_dry_run_compiles_im2col_and_keeps_nothing(monkeypatch, fresh_choices):
    monkeypatch.setattr(precompile, "active", lambda: True)
    ran = []
    monkeypatch.setattr(cv, "im2col3x3", lambda x: ran.append(x.shape))
    x, wt = _x(2, 64, 8, 8), _weight(32, 64)
    torch.testing.assert_close(cv.conv3x3(x, wt), F.conv2d(x, wt, None, 1, 1))
    assert ran == [x.shape] and fresh_choices() == []


def test_autograd_runs_cudnn(fresh_choices):
    x, wt = _x(2, 16, 4, 4, torch.float32), _weight(8, 16, torch.float32).requires_grad_()
    with select.pinned({"conv3x3": "gemm"}):
        cv.conv3x3(x.half(), wt.half()).float().sum()  # fp16 copies: not leaves, but they need grad
    assert fresh_choices() == []


def test_im2col_64_bit_index_path(monkeypatch):
    from kernels.conv import im2col as im

    monkeypatch.setattr(im, "INT64_FROM", 0)
    x = _x(2, 64, 5, 7)
    assert torch.equal(im2col3x3(x), im2col3x3_ref(x))


def _measured_conv(monkeypatch, times):
    """conv3x3 as on a GPU (its decision measured), with ``times`` as the timer's answer."""
    import kernels.select.rules as rules

    real = rules.decide
    monkeypatch.setattr(rules, "gpu_time_us", lambda c: {n: times[n] for n in c})
    monkeypatch.setattr(cv.select, "decide", lambda *a, **k: real(*a, **k, measure_cpu=True))


@pytest.mark.parametrize("gemm_us,expect", [(96.0, "gemm"), (98.0, "cudnn"), (120.0, "cudnn")])
def test_measure_keeps_the_gemm_only_by_the_margin(monkeypatch, fresh_choices, gemm_us, expect):
    _measured_conv(monkeypatch, {"cudnn": 100.0, "gemm": gemm_us})
    x, wt = _x(2, 64, 8, 8), _weight(32, 64)
    cv.conv3x3(x, wt)
    assert _conv_decisions(fresh_choices) == [(expect, "measured")]


def test_measure_keeps_cudnn_when_the_gemm_path_fails(monkeypatch, fresh_choices, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="sdfast.kernels")

    def boom(*a):
        raise torch.cuda.OutOfMemoryError("no room for the patch matrix")

    _measured_conv(monkeypatch, {})  # the timer must not be reached: one candidate is left
    monkeypatch.setattr(cv, "gemm_conv3x3", boom)
    x, wt = _x(2, 64, 8, 8), _weight(32, 64)
    torch.testing.assert_close(cv.conv3x3(x, wt), F.conv2d(x, wt, None, 1, 1))
    assert [d.winner for d in fresh_choices("conv3x3")] == ["cudnn"]
    assert "no room for the patch matrix" in caplog.text


def test_bad_pin_value_and_bias_shape(fresh_choices):
    x, wt = _x(2, 64, 8, 8), _weight(32, 64)
    with select.pinned({"conv3x3": "fast"}), pytest.raises(ValueError, match="pinned"):
        cv.conv3x3(x, wt)
    with select.pinned({"conv3x3": "gemm"}):
        cv.conv3x3(x, wt, torch.zeros(32).half())  # a (Cout,) bias: the GEMM path
        with pytest.raises(RuntimeError):  # a (1,) bias is another signature, refused by the GEMM path: cuDNN raises
            cv.conv3x3(x, wt, torch.zeros(1).half())


def test_signature_tells_apart_what_the_paths_depend_on():
    from kernels.select import signature

    x, wt = _x(2, 64, 8, 8), _weight(32, 64)
    base = signature(x, wt, None)
    assert signature(_x(2, 64, 8, 8), _weight(32, 64), None) == base
    assert signature(x.contiguous(), wt, None) != base  # strides
    assert signature(x, wt, torch.zeros(32).half()) != base != signature(x, wt, torch.zeros(1).half())
    assert signature(x.float(), wt, None) != base
