"""kernels.conv.conv3x3_tma (the TMA implicit-GEMM 3x3 convolution) against its fp32 reference on the CPU under
TRITON_INTERPRET=1 (each program runs one tile there; the persistent tile walk runs in the GPU file): images whose
height and width are not tile multiples (the zero padding read through out-of-bounds TMA boxes), Cout not a multiple
of the channel tile, bias or none, SD's channel counts with small images, batch 1 and 3; the patch widths; what the
kernel refuses."""

import pytest
import torch
import torch.nn.functional as F

from kernels.conv.conv3x3_tma import ConvConfig, conv3x3_ref, patch_width, tma_conv3x3, unsupported
from kernels.testing import assert_close_rule, poison

CL = torch.channels_last
SMALL = ConvConfig(32, 16, 64, 1, 4)


def _inputs(n, cin, cout, h, w, bias=True, dtype=torch.float16):
    x = torch.randn(n, cin, h, w).to(dtype).contiguous(memory_format=CL)
    wt = (torch.randn(cout, cin, 3, 3) / (9 * cin) ** 0.5).to(dtype).contiguous(memory_format=CL)
    b = (torch.randn(cout) * 0.5).to(dtype) if bias else None
    return x, wt, b


def _check(ours, x, wt, b, name):
    ref32 = conv3x3_ref(x.float(), wt.float(), None if b is None else b.float())
    lowp = F.conv2d(x.float(), wt.float(), None if b is None else b.float(), 1, 1).to(x.dtype)
    assert ours.dtype == x.dtype and ours.is_contiguous(memory_format=CL)
    assert_close_rule(ours, ref32, lowp, 2e-3, name)


@pytest.mark.parametrize("n,cin,cout,h,w", [(1, 64, 16, 5, 7), (3, 128, 24, 9, 8), (1, 64, 40, 16, 16),
                                             (1, 320, 16, 3, 3), (1, 64, 8, 1, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_reference(n, cin, cout, h, w, bias):
    x, wt, b = _inputs(n, cin, cout, h, w, bias)
    out = poison(torch.empty(n, cout, h, w, dtype=x.dtype).contiguous(memory_format=CL))
    _check(tma_conv3x3(x, wt, b, SMALL, out=out), x, wt, b, f"{n}x{cin}->{cout} {h}x{w} bias={bias}")


def test_64_pixel_patch():  # bf16 runs in the GPU file: Triton 3.6's interpreter returns garbage for bf16 TMA tiles
    x, wt, b = _inputs(1, 64, 16, 4, 24)
    _check(tma_conv3x3(x, wt, b, ConvConfig(64, 16, 64, 1, 4)), x, wt, b, "64-pixel patch")


def test_patch_width():
    assert patch_width(64, 128) == 64
    assert patch_width(32, 128) == 32
    assert patch_width(96, 128) == 32
    assert patch_width(8, 128) == 8
    assert patch_width(65, 128) == 8
    assert patch_width(200, 64) == 8  # 64 would leave 56 columns unused, 8 none


def test_refuses_what_it_cannot_run():
    x, wt, b = _inputs(1, 64, 16, 8, 8)
    assert "channels_last" in unsupported(x.contiguous(), wt, b)
    assert "channels_last" in unsupported(x, wt.contiguous(), b)
    assert "multiple" in unsupported(x[:, :40].contiguous(memory_format=CL), wt[:, :40].contiguous(memory_format=CL), b)
    assert "fp16 or bf16" in unsupported(x.float(), wt.float(), None)
    assert "bias" in unsupported(x, wt, b.float())
    with pytest.raises(RuntimeError, match="channels_last"):
        tma_conv3x3(x.contiguous(), wt, b)
    with pytest.raises(ValueError, match="Cout, Cin, 3, 3"):
        tma_conv3x3(x, wt[:, :, :1], b)
    with pytest.raises(ValueError, match="out must be"):
        tma_conv3x3(x, wt, b, SMALL, out=torch.empty(1, 16, 8, 8, dtype=x.dtype))
