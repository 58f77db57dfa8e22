"""GPU tests of bias_residual_add on the ResNet-block output shapes of the SD1.5 and SDXL UNets and the
SD1.5 VAE (both memory formats, fp16/bf16), with the allocator poisoned with NaN first so an element the
kernel forgets to write shows; plus CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

from kernels.elementwise import bias_residual_add, bias_residual_add_ref
from kernels.testing import assert_close_rule

pytestmark = pytest.mark.gpu

SHAPES = [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 8, 8), (2, 640, 128, 128), (1, 512, 256, 256), (1, 128, 512, 511)]
ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_sd_shapes(shape, channels_last, dtype):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(*shape, device="cuda", dtype=dtype, generator=g).contiguous(memory_format=fmt)
    r = torch.randn(*shape, device="cuda", dtype=dtype, generator=g).contiguous(memory_format=fmt)
    b = torch.randn(shape[1], device="cuda", dtype=dtype, generator=g)
    t = torch.empty(x.numel() * x.element_size(), dtype=torch.uint8, device="cuda").fill_(0xFF)
    del t
    b2 = torch.randn(shape[1], device="cuda", dtype=dtype, generator=g)  # a 1x1 shortcut conv's bias
    y = bias_residual_add(x, b, r, bias2=b2)
    assert y.stride() == x.stride()
    ref, lowp = (bias_residual_add_ref(x, b, r, bias2=b2, upcast=u) for u in (True, False))
    assert_close_rule(y, ref, lowp, atol=ATOL[dtype])


def test_mixed_formats_and_graph_capture():
    x = torch.randn(2, 320, 64, 64, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    r = torch.randn(2, 320, 64, 64, device="cuda", dtype=torch.float16)  # NCHW residual
    b = torch.randn(320, device="cuda", dtype=torch.float16)
    ref = bias_residual_add_ref(x, b, r, out_scale=2.0)
    torch.testing.assert_close(bias_residual_add(x, b, r, out_scale=2.0), ref, atol=2e-3, rtol=1e-3)
    bias_residual_add(x, b, r)  # compile before capture
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            out = bias_residual_add(x, b, r)
    torch.cuda.current_stream().wait_stream(s)
    x.add_(1.0)
    g.replay()
    torch.testing.assert_close(out, bias_residual_add_ref(x, b, r), atol=2e-3, rtol=1e-3)
