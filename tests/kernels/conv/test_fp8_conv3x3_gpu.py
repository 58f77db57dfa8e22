"""GPU tests (marker ``gpu``): the FP8 implicit-GEMM 3x3 convolutions (``kernels.conv.fp8_conv3x3``, pointer and TMA
kernels, autotuned) at SD1.5's and SDXL's convolution shapes against their dequantize + F.conv2d reference: within
1e-3 of the output's range with promoted accumulation (the tensor cores' reduced-precision sums inside one K tile),
within 3 % with the hardware's accumulation (``fast_accum``: 1.3 % measured at K = 23040); the whole quantized path of
``W8A8StaticConv2d`` against the fp32 convolution of the unquantized operands (E4M3's error); its measured choice
against cuDNN (logged, kept) and its CUDA-graph replay on new inputs."""

import logging

import pytest
import torch
import torch.nn.functional as F

from kernels.conv import fp8_conv3x3 as fc

pytestmark = pytest.mark.gpu

DEV = "cuda"
FP8 = torch.float8_e4m3fn
CL = torch.channels_last
# (Cin, Cout, H, W), batch 2: every Cin / BLOCK_K case (320 and 960 take only 64 and 32) at the sizes of both models
SHAPES = [(320, 320, 128, 128), (960, 320, 128, 128), (640, 640, 64, 64), (2560, 1280, 32, 32), (1280, 1280, 8, 8),
          (1920, 640, 32, 32), (320, 640, 32, 32)]


def _operands(cin, cout, h, w, bias=True):
    g = torch.Generator(device=DEV).manual_seed(0)
    xq = (torch.randn(2, h, w, cin, device=DEV, generator=g) * 64).clamp(-448, 448).to(FP8)
    wq = (torch.randn(cout, 3, 3, cin, device=DEV, generator=g) * 64).clamp(-448, 448).to(FP8)
    a = torch.tensor(0.02, device=DEV)
    ws = torch.rand(cout, device=DEV, generator=g) * 1e-3 + 1e-4
    b = torch.randn(cout, device=DEV, generator=g) if bias else None
    return xq, wq, a, ws, b


@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("cin,cout,h,w", SHAPES, ids=str)
def test_kernel_matches_the_reference_at_sd_shapes(cin, cout, h, w, tma):
    xq, wq, a, ws, b = _operands(cin, cout, h, w)
    ref = fc.fp8_conv3x3_ref(xq, wq, a, ws, b, torch.float32)
    top = float(ref.abs().max())
    fast = fc.fp8_conv3x3(xq, wq, a, ws, b, out_dtype=torch.float32, fast_accum=True, tma=tma)
    assert fast.is_contiguous(memory_format=CL)
    err = (fast - ref).abs()
    assert float(err.max()) < 0.03 * top and float(err.mean()) < 2e-3 * top, float(err.max()) / top
    again = fc.fp8_conv3x3(xq, wq, a, ws, b, out_dtype=torch.float32, fast_accum=True, tma=tma)
    assert torch.equal(again, fast)  # deterministic
    if not tma:  # promoted accumulation: the pointer kernel only
        y = fc.fp8_conv3x3(xq, wq, a, ws, b, out_dtype=torch.float32, fast_accum=False)
        promoted = (y - ref).abs()
        assert float(promoted.max()) < 1e-3 * top and float(promoted.mean()) < 1e-4 * top, float(promoted.max()) / top
        assert float(err.mean()) > float(promoted.mean())  # the promotion is what makes the difference
    y16 = fc.fp8_conv3x3(xq, wq, a, ws, None, out_dtype=torch.float16, tma=tma)  # the fp16 epilogue: one rounding
    y32 = fc.fp8_conv3x3(xq, wq, a, ws, None, out_dtype=torch.float32, tma=tma)
    torch.testing.assert_close(y16.float(), y32, rtol=1e-3, atol=1e-3 * float(y32.abs().max()))


def _module(cin, cout, amax=3.0):
    from sdfast.quantization import W8A8StaticConv2d

    conv = torch.nn.Conv2d(cin, cout, 3, padding=1, device=DEV, dtype=torch.float16)
    return conv, W8A8StaticConv2d.from_conv(conv, input_amax=amax)


@pytest.mark.parametrize("cin,cout,h,w", [(320, 320, 128, 128), (1280, 1280, 32, 32)], ids=str)
def test_quantized_conv_is_within_e4m3_error(cin, cout, h, w):
    conv, m = _module(cin, cout)
    x = torch.randn(2, cin, h, w, device=DEV).clamp(-3, 3).half().contiguous(memory_format=CL)
    want = F.conv2d(x.float(), conv.weight.float(), conv.bias.float(), 1, 1)
    with torch.no_grad():
        y = m.fp8_forward(x)
    assert y.dtype == torch.float16 and y.is_contiguous(memory_format=CL)
    rel = ((y.float() - want).norm() / want.norm()).item()
    assert rel < 0.05, rel  # E4M3: 3 mantissa bits on both operands


def test_choice_is_measured_logged_kept_and_graph_replays(fresh_choices, caplog):
    caplog.set_level(logging.INFO, logger="sdfast.kernels")
    conv, m = _module(640, 640)
    x = torch.randn(2, 640, 64, 64, device=DEV).half().contiguous(memory_format=CL)
    with torch.no_grad():
        first = m(x)
        decided = fresh_choices("fp8_conv3x3")
        assert len(decided) == 1 and set(decided[0].times_us) == {"fp8", "fp8_tma", "cudnn"}
        assert "kernel choice fp8_conv3x3" in caplog.text
        winner = decided[0].winner
        run = (lambda t: m.cudnn_forward(t)) if winner == "cudnn" else (lambda t: m.fp8_forward(t, winner == "fp8_tma"))
        ref = run(x)
        torch.testing.assert_close(first, ref, rtol=0, atol=0)
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = m(static)
        x2 = torch.randn_like(x)
        static.copy_(x2)
        graph.replay()
        again = run(x2)
        torch.testing.assert_close(out, again, rtol=0, atol=0)
