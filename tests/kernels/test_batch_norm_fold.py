"""BatchNorm folded into the preceding conv equals conv -> bn in eval mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.norm import fold_batch_norm_into_conv


def _bn(C, affine=True, dtype=torch.float32):
    bn = nn.BatchNorm2d(C, affine=affine, eps=1e-3).to(dtype)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(C))
        bn.running_var.copy_(torch.rand(C) + 0.1)
        if affine:
            bn.weight.copy_(torch.randn(C))
            bn.bias.copy_(torch.randn(C))
    return bn.eval()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-10)])
@pytest.mark.parametrize("conv_kwargs", [
    dict(kernel_size=3, padding=1, bias=True),
    dict(kernel_size=3, stride=2, padding=1, bias=False),
    dict(kernel_size=1, bias=True, groups=4),
    dict(kernel_size=3, padding=2, dilation=2, bias=False, padding_mode="reflect"),
], ids=["3x3_bias", "3x3_s2_nobias", "1x1_groups", "dilated_reflect"])
@pytest.mark.parametrize("affine", [True, False])
def test_fold_matches_conv_then_bn(conv_kwargs, affine, dtype, tol):
    conv = nn.Conv2d(8, 12, **conv_kwargs).to(dtype).eval()
    bn = _bn(12, affine, dtype)
    x = torch.randn(2, 8, 9, 7, dtype=dtype)
    fused = fold_batch_norm_into_conv(conv, bn)
    assert isinstance(fused, nn.Conv2d) and fused.bias is not None
    assert fused.weight.dtype == dtype and fused.stride == conv.stride and fused.groups == conv.groups
    with torch.no_grad():
        ref = bn(conv(x))
        out = fused(x)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    # inputs untouched
    assert conv.bias is None or conv.bias is not fused.bias


def test_fold_leaves_originals_unchanged():
    conv = nn.Conv2d(4, 4, 3, padding=1).eval()
    bn = _bn(4)
    w0, b0 = conv.weight.detach().clone(), conv.bias.detach().clone()
    fold_batch_norm_into_conv(conv, bn)
    assert torch.equal(conv.weight, w0) and torch.equal(conv.bias, b0)


def test_bad_inputs_raise():
    with pytest.raises(TypeError, match="nn.Conv2d"):
        fold_batch_norm_into_conv(nn.ConvTranspose2d(4, 4, 3), _bn(4))
    with pytest.raises(TypeError, match="BatchNorm2d"):
        fold_batch_norm_into_conv(nn.Conv2d(4, 4, 3), nn.GroupNorm(2, 4))
    with pytest.raises(ValueError, match="features"):
        fold_batch_norm_into_conv(nn.Conv2d(4, 6, 3), _bn(4))
    with pytest.raises(ValueError, match="running statistics"):
        fold_batch_norm_into_conv(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4, track_running_stats=False))
