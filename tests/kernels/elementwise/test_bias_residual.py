"""bias_residual_add against its PyTorch reference in Triton's interpreter: SD channel counts, H*W not a
multiple of the block, both memory formats for x and for the residual, each optional input, fp32/fp16."""

from __future__ import annotations

import pytest
import torch

from kernels.elementwise import bias_residual_add, bias_residual_add_ref
from kernels.testing import assert_close_rule

DTYPES = [(torch.float32, 1e-5), (torch.float16, 2e-3)]


def _t(shape, dtype, channels_last, scale=1.0):
    t = (torch.randn(*shape) * scale).to(dtype)
    return t.contiguous(memory_format=torch.channels_last) if channels_last else t.contiguous()


@pytest.mark.parametrize("dtype,atol", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("x_cl,r_cl", [(False, False), (True, True), (True, False), (False, True)])
@pytest.mark.parametrize("has_bias,has_bias2,has_res,out_scale", [(True, False, True, 1.0), (True, False, False, 1.0),
                                                                  (False, False, True, 2.0), (True, True, True, 1.4142),
                                                                  (False, True, False, 1.0)])
@pytest.mark.parametrize("shape", [(2, 320, 9, 7), (1, 40, 65, 3), (3, 10, 1, 5)])
def test_matches_reference(shape, has_bias, has_bias2, has_res, out_scale, x_cl, r_cl, dtype, atol):
    torch.manual_seed(0)
    x = _t(shape, dtype, x_cl, 3.0)
    bias = torch.randn(shape[1]).to(dtype) if has_bias else None
    bias2 = torch.randn(shape[1]).to(dtype) if has_bias2 else None
    res = _t(shape, dtype, r_cl) if has_res else None
    y = bias_residual_add(x, bias, res, bias2=bias2, out_scale=out_scale)
    ref32 = bias_residual_add_ref(x, bias, res, bias2=bias2, out_scale=out_scale)
    lowp = bias_residual_add_ref(x, bias, res, bias2=bias2, out_scale=out_scale, upcast=False)
    assert y.dtype == dtype and y.shape == x.shape and y.stride() == x.stride()
    assert torch.isfinite(y).all()
    assert_close_rule(y, ref32, lowp, atol=atol)


def test_fp32_bias_with_fp16_input():
    x = _t((2, 16, 4, 4), torch.float16, True)
    b = torch.randn(16)
    y = bias_residual_add(x, b)
    torch.testing.assert_close(y.float(), (x.float() + b.view(1, -1, 1, 1)), atol=2e-3, rtol=1e-3)


def test_input_errors():
    x = torch.randn(2, 8, 4, 4)
    with pytest.raises(ValueError, match="must be \\(B, C, H, W\\)"):
        bias_residual_add(torch.randn(8, 4))
    with pytest.raises(ValueError, match="bias must be"):
        bias_residual_add(x, torch.randn(4))
    with pytest.raises(ValueError, match="bias2 must be"):
        bias_residual_add(x, bias2=torch.randn(8, 1))
    with pytest.raises(ValueError, match="residual shape"):
        bias_residual_add(x, residual=torch.randn(2, 8, 4, 5))
    with pytest.raises(TypeError, match="residual dtype"):
        bias_residual_add(x, residual=x.half())
    with pytest.raises(ValueError, match="out_scale"):
        bias_residual_add(x, out_scale=0.0)
    with pytest.raises(ValueError, match="NCHW-contiguous or channels_last"):
        bias_residual_add(x[:, :, :, :2])
    with pytest.raises(TypeError, match="dtype"):
        bias_residual_add(x.to(torch.int32))


def test_fake_impl_for_compile_and_graphs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 8, 4, 4).contiguous(memory_format=torch.channels_last)
        y = torch.ops.sdfast.bias_residual_add(x, torch.empty(8), x, 1.0)
    assert y.shape == x.shape and y.stride() == x.stride()


def test_int64_offsets_path(monkeypatch):
    import kernels.elementwise.bias_residual as mod

    monkeypatch.setattr(mod, "INT64_FROM", 0)  # every call takes the 64-bit path (a real one needs 2**31 elements)
    x = _t((2, 24, 5, 3), torch.float32, True)
    b, r = torch.randn(24), _t((2, 24, 5, 3), torch.float32, False)
    torch.testing.assert_close(bias_residual_add(x, b, r, out_scale=2.0), bias_residual_add_ref(x, b, r, out_scale=2.0))
