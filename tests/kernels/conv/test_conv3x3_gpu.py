"""GPU tests (marker ``gpu``): the im2col + cuBLAS path of ``kernels.conv.conv3x3`` at SD1.5's 8x8 and 16x16
convolution shapes against the fp32 reference (flash-attention's rule, kernels.testing, against cuDNN fp16), bf16 and a bias, the im2col
kernel bit-identical, the measured choice (logged, kept, not taken inside a capture), and CUDA graph replay of the
chosen path on new inputs and an in-place weight change."""

import logging

import pytest
import torch
import torch.nn.functional as F

from kernels.conv import conv3x3 as cv
from kernels.conv.im2col import im2col3x3, im2col3x3_ref
from kernels.testing import assert_close_rule
from kernels.select import rules

pytestmark = pytest.mark.gpu

DEV = "cuda"
CL = torch.channels_last
# (Cin, Cout, H, W), batch 2: SD1.5's 8x8 (mid block, down 3, up 0 with the skip concatenations) and 16x16 levels
SHAPES = [(1280, 1280, 8, 8), (2560, 1280, 8, 8), (1280, 1280, 16, 16), (640, 1280, 16, 16)]


def _inputs(cin, cout, h, w, dtype=torch.float16):
    x = torch.randn(2, cin, h, w, device=DEV).to(dtype).contiguous(memory_format=CL)
    wt = (torch.randn(cout, cin, 3, 3, device=DEV) / (9 * cin) ** 0.5).to(dtype).contiguous(memory_format=CL)
    b = (torch.randn(cout, device=DEV) * 0.1).to(dtype)
    return x, wt, b


def _check(ours, x, wt, b, atol, name):
    f = lambda t: None if t is None else t.float()  # noqa: E731
    assert ours.is_contiguous(memory_format=CL), f"{name}: output not channels_last"
    assert_close_rule(ours, F.conv2d(x.float(), wt.float(), f(b), 1, 1), F.conv2d(x, wt, b, 1, 1), atol, name)


@pytest.mark.parametrize("cin,cout,h,w", SHAPES, ids=str)
def test_gemm_path_at_sd_shapes(cin, cout, h, w):
    x, wt, _ = _inputs(cin, cout, h, w)
    _check(cv.gemm_conv3x3(x, wt, None), x, wt, None, 1e-2, f"{cin}->{cout} {h}x{w}")


def test_bf16_and_bias():
    x, wt, b = _inputs(1280, 1280, 8, 8, torch.bfloat16)
    _check(cv.gemm_conv3x3(x, wt, b), x, wt, b, 5e-2, "bf16")


def test_im2col_is_bit_identical():
    x = torch.randn(2, 1280, 8, 8, device=DEV).half().contiguous(memory_format=CL)
    assert torch.equal(im2col3x3(x), im2col3x3_ref(x))


def test_measured_choice_is_logged_kept_and_correct(monkeypatch, fresh_choices, caplog):
    caplog.set_level(logging.INFO, logger="sdfast.kernels")
    x, wt, _ = _inputs(1280, 1280, 8, 8)
    _check(cv.conv3x3(x, wt), x, wt, None, 1e-2, "first call")
    assert "kernel choice conv3x3" in caplog.text and len(fresh_choices("conv3x3")) == 1
    assert set(fresh_choices("conv3x3")[0].times_us) == {"cudnn", "gemm"}
    monkeypatch.setattr(rules, "gpu_time_us", lambda *a: pytest.fail("measured twice"))
    _check(cv.conv3x3(x, wt), x, wt, None, 1e-2, "second call")


def test_capture_after_a_gemm_choice_replays_on_new_inputs_and_weights(monkeypatch, fresh_choices):
    monkeypatch.setitem(rules._pins, "conv3x3", "gemm")
    x, wt, b = _inputs(2560, 1280, 8, 8)
    cv.conv3x3(x, wt, b)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = cv.conv3x3(x, wt, b)
    x.copy_(torch.randn_like(x))
    wt.mul_(0.5)  # an in-place weight change (a fused LoRA) is seen
    g.replay()
    torch.cuda.synchronize()
    _check(y, x, wt, b, 1e-2, "replay")


def test_capture_without_a_choice_runs_cudnn_and_keeps_nothing(monkeypatch, fresh_choices):
    monkeypatch.setattr(rules, "gpu_time_us", lambda *a: pytest.fail("nothing may be timed inside a capture"))
    x, wt, _ = _inputs(1280, 1280, 8, 8)
    cv.cudnn_conv3x3(x, wt, None)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = cv.conv3x3(x, wt)
    g.replay()
    torch.cuda.synchronize()
    assert fresh_choices() == []
    _check(y, x, wt, None, 1e-2, "captured cuDNN path")


def test_dry_run_compiles_and_keeps_nothing(monkeypatch, fresh_choices):
    """In a compile-only pass the im2col launch is skipped (the GEMM path would look almost free): nothing is timed
    or kept, and cuDNN's output is returned."""
    from kernels import precompile

    monkeypatch.setattr(precompile, "active", lambda: True)
    monkeypatch.setattr(rules, "gpu_time_us", lambda *a: pytest.fail("nothing may be timed in a dry run"))
    x, wt, _ = _inputs(1280, 1280, 8, 8)
    _check(cv.conv3x3(x, wt), x, wt, None, 1e-2, "dry run")
    assert fresh_choices() == []
