"""upsample_nearest2x against F.interpolate in Triton's interpreter: bit-identical values, the input's memory
format kept, shapes whose pixel or channel count is not a multiple of the tile, every output element written."""

from __future__ import annotations

import pytest
import torch

from kernels.elementwise import upsample_nearest2x, upsample_nearest2x_ref
from kernels.elementwise._pixels import max_offset


def _x(shape, dtype, channels_last):
    x = (torch.randn(*shape) * 3).to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x.contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("shape", [(1, 320, 5, 7), (2, 40, 9, 3), (3, 130, 1, 1), (1, 4, 8, 8)])
def test_matches_interpolate_bit_for_bit(shape, channels_last, dtype):
    torch.manual_seed(0)
    x = _x(shape, dtype, channels_last)
    y = upsample_nearest2x(x)
    ref = upsample_nearest2x_ref(x)
    B, C, H, W = shape
    assert y.shape == (B, C, 2 * H, 2 * W) and y.dtype == dtype
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert y.is_contiguous(memory_format=fmt) or H * W == 1  # a 1x1 input is in both layouts: NCHW out
    assert torch.equal(y, ref)


def test_every_output_element_is_written(monkeypatch):
    """The output comes from torch.empty: poison it, so an element the kernel skips stays NaN."""
    from kernels.elementwise import upsample as mod

    real = mod._empty_output
    monkeypatch.setattr(mod, "_empty_output", lambda x: real(x).fill_(float("nan")))
    x = _x((2, 200, 7, 5), torch.float32, True)  # 140 output pixels x 200 channels: partial tiles both ways
    assert torch.equal(upsample_nearest2x(x), upsample_nearest2x_ref(x))


@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
def test_64bit_index_path(channels_last, monkeypatch):
    """INT64 is chosen from the largest offset of x and y (not numel: a strided view reaches further); here forced
    on, so the int64 pixel and channel index math runs (the overflow itself needs a >2**31-element tensor, a GPU
    test)."""
    from kernels.elementwise import upsample as mod

    view = torch.empty(2, 3, 4, 5)[..., ::2]  # (2, 3, 4, 3), strides (60, 20, 5, 2): 72 elements
    assert max_offset(view) == 1 * 60 + 2 * 20 + 3 * 5 + 2 * 2 > view.numel()
    monkeypatch.setattr(mod, "INT64_FROM", 0)
    x = _x((2, 24, 5, 3), torch.float16, channels_last)
    assert torch.equal(upsample_nearest2x(x), upsample_nearest2x_ref(x))


def test_strided_view_and_empty_and_errors():
    x = torch.randn(1, 8, 6, 10)[..., ::2]  # neither layout: read through its strides
    assert torch.equal(upsample_nearest2x(x), upsample_nearest2x_ref(x))
    assert upsample_nearest2x(torch.empty(0, 3, 4, 4)).shape == (0, 3, 8, 8)
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        upsample_nearest2x(torch.randn(3, 4, 4))


def test_registered_op_and_fake_tensor():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = _x((1, 16, 3, 5), torch.float16, True)
    assert torch.equal(torch.ops.sdfast.upsample_nearest2x(x), upsample_nearest2x_ref(x))
    with FakeTensorMode() as mode:
        fy = torch.ops.sdfast.upsample_nearest2x(mode.from_tensor(x))
    assert fy.shape == (1, 16, 6, 10) and fy.is_contiguous(memory_format=torch.channels_last)
