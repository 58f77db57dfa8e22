"""GPU: upsample_nearest2x at every Upsample2D shape of the SD1.5 UNet/VAE at 512² and the SDXL UNet/VAE at
1024², both layouts, bit-identical to F.interpolate, every element written, inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.elementwise import upsample_nearest2x

pytestmark = pytest.mark.gpu

# (shape, dtype): SD1.5 UNet (batch 2 with CFG), SDXL UNet, SD1.5 VAE decoder (fp16), SDXL VAE decoder (fp32)
SHAPES = [((2, 1280, 8, 8), torch.float16), ((2, 1280, 16, 16), torch.float16), ((2, 640, 32, 32), torch.float16),
          ((2, 1280, 32, 32), torch.float16), ((2, 640, 64, 64), torch.float16),
          ((1, 512, 64, 64), torch.float16), ((1, 512, 128, 128), torch.float16), ((1, 256, 256, 256), torch.float16),
          ((1, 512, 128, 128), torch.float32), ((1, 512, 256, 256), torch.float32), ((1, 256, 512, 512), torch.float32)]


@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("shape,dtype", SHAPES)
def test_sd_shapes_bit_identical(shape, dtype, channels_last):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
    nan = torch.empty(4 * x.numel(), device="cuda", dtype=dtype).fill_(float("nan"))  # poison the allocator
    del nan
    y = upsample_nearest2x(x)
    assert y.is_contiguous(memory_format=fmt)
    assert torch.equal(y, F.interpolate(x, scale_factor=2.0, mode="nearest"))


@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
def test_output_past_2_31_elements(channels_last):
    """A 4096² VAE decode with channels_last off: (1, 256, 2048, 2048) in, 2**32 elements out. In NCHW the channel
    offset c * H * W alone passes 2**31 (it faulted before c was widened to 64 bits)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randint(0, 255, (1, 256, 2048, 2048), device="cuda", dtype=torch.uint8).contiguous(memory_format=fmt)
    y = upsample_nearest2x(x)
    assert y.shape == (1, 256, 4096, 4096) and y.is_contiguous(memory_format=fmt)
    assert torch.equal(y[:, :, ::2, ::2], x) and torch.equal(y[:, :, 1::2, 1::2], x)
    assert torch.equal(y[:, -3:, -6:, -6:], F.interpolate(x[:, -3:, -3:, -3:].float(), scale_factor=2.0).to(torch.uint8))
    del y
    torch.cuda.empty_cache()


def test_cuda_graph_replays_follow_the_input():
    x = torch.randn(1, 512, 64, 64, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    upsample_nearest2x(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = upsample_nearest2x(x)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(y, F.interpolate(x, scale_factor=2.0, mode="nearest"))
