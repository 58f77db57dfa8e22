"""cat_channels against torch.cat in Triton's interpreter: bit-identical values, the first input's memory format
kept, channel splits inside a tile, mixed layouts, every output element written, clear errors."""

from __future__ import annotations

import pytest
import torch

from kernels.elementwise import cat_channels, cat_channels_ref


def _x(shape, dtype, channels_last):
    x = (torch.randn(*shape) * 3).to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x.contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("c1,c2,hw", [(64, 32, (5, 7)), (40, 88, (3, 3)), (130, 3, (1, 1)), (1, 1, (9, 2))])
def test_matches_torch_cat_bit_for_bit(c1, c2, hw, channels_last, dtype):
    torch.manual_seed(0)
    a, b = _x((2, c1, *hw), dtype, channels_last), _x((2, c2, *hw), dtype, channels_last)
    y = cat_channels(a, b)
    assert y.shape == (2, c1 + c2, *hw) and y.dtype == dtype
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert y.is_contiguous(memory_format=fmt) or c1 == 1  # a one-channel a is in both layouts: NCHW out
    assert torch.equal(y, torch.cat([a, b], dim=1))


def test_mixed_layouts_and_strided_views():
    a = _x((1, 24, 6, 5), torch.float16, True)
    b = _x((1, 40, 6, 5), torch.float16, False)
    assert torch.equal(cat_channels(a, b), torch.cat([a, b], dim=1))
    assert cat_channels(a, b).is_contiguous(memory_format=torch.channels_last)
    v = torch.randn(1, 8, 6, 10)[..., ::2]  # neither layout: read through its strides
    assert torch.equal(cat_channels(v, b.float()[..., :5]), torch.cat([v, b.float()[..., :5]], dim=1))


def test_every_output_element_is_written(monkeypatch):
    """The output comes from torch.empty: poison it, so an element the kernel skips stays NaN."""
    from kernels.elementwise import concat as mod

    real = mod._empty_output
    monkeypatch.setattr(mod, "_empty_output", lambda a, b: real(a, b).fill_(float("nan")))
    a, b = _x((2, 200, 7, 5), torch.float32, True), _x((2, 72, 7, 5), torch.float32, True)  # partial tiles both ways
    assert torch.equal(cat_channels(a, b), cat_channels_ref(a, b))


@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
def test_64bit_index_path(channels_last, monkeypatch):
    """INT64 is chosen from the largest offset of a, b and y; forced on here so the int64 index math runs."""
    from kernels.elementwise import concat as mod

    monkeypatch.setattr(mod, "INT64_FROM", 0)
    a, b = _x((2, 24, 5, 3), torch.float16, channels_last), _x((2, 16, 5, 3), torch.float16, channels_last)
    assert torch.equal(cat_channels(a, b), cat_channels_ref(a, b))


def test_empty_and_errors():
    assert cat_channels(torch.empty(0, 3, 4, 4), torch.empty(0, 2, 4, 4)).shape == (0, 5, 4, 4)
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        cat_channels(torch.randn(3, 4, 4), torch.randn(1, 3, 4, 4))
    with pytest.raises(ValueError, match="differ outside the channel dim"):
        cat_channels(torch.randn(1, 3, 4, 4), torch.randn(1, 3, 4, 5))
    with pytest.raises(TypeError, match="dtypes differ"):
        cat_channels(torch.randn(1, 3, 4, 4), torch.randn(1, 3, 4, 4).half())


def test_registered_op_and_fake_tensor():
    from torch._subclasses.fake_tensor import FakeTensorMode

    a, b = _x((1, 16, 3, 5), torch.float16, True), _x((1, 8, 3, 5), torch.float16, True)
    assert torch.equal(torch.ops.sdfast.cat_channels(a, b), cat_channels_ref(a, b))
    with FakeTensorMode() as mode:
        fy = torch.ops.sdfast.cat_channels(mode.from_tensor(a), mode.from_tensor(b))
    assert fy.shape == (1, 24, 3, 5) and fy.is_contiguous(memory_format=torch.channels_last)
