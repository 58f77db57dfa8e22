"""LayerNorm (+ fused residual add, returned sum) against the PyTorch reference in Triton's
interpreter: SD's widths (320/640/1280, CLIP's 768, 2048), non-power-of-two and long rows (looped
kernel), strided rows, input checks, the fallback path and the custom-op fake."""

from __future__ import annotations

import logging

import pytest
import torch

import kernels.dispatch as dispatch
from kernels.norm import layer_norm, layer_norm_ref
from kernels.norm.layer_norm import layer_norm_config
from kernels.testing import assert_close_rule

# bf16 runs in the GPU tests: the interpreter rounds fp32 -> bf16 toward zero, not to nearest.
DTYPES = [(torch.float32, 1e-5), (torch.float16, 2e-3)]


def _f32(t):
    return None if t is None else t.float()


def _check(x, w, b, r, return_sum, atol, eps=1e-5):
    out = layer_norm(x, w, b, eps, residual=r, return_sum=return_sum)
    ref32 = layer_norm_ref(x.float(), _f32(w), _f32(b), eps, residual=_f32(r), return_sum=return_sum)
    lowp = layer_norm_ref(x, w, b, eps, residual=r, return_sum=return_sum, upcast=False)
    if not return_sum:
        out, ref32, lowp = (out,), (ref32,), (lowp,)
    for name, o, r32, lp in zip(("y", "sum"), out, ref32, lowp):
        assert o.dtype == x.dtype and o.shape == x.shape
        assert_close_rule(o, r32, lp, atol=atol, name=name)
    return out


@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("D", [320, 640, 768, 1280, 2048, 40, 9000])
@pytest.mark.parametrize("residual,return_sum", [(False, False), (True, False), (True, True)],
                         ids=["plain", "add", "add_sum"])
def test_layer_norm(D, residual, return_sum, dtype, atol):
    x = (torch.randn(2, 5, D) * 2 + 0.5).to(dtype)
    r = torch.randn(2, 5, D).to(dtype) if residual else None
    w = (torch.rand(D) + 0.5).to(dtype)
    b = torch.randn(D).to(dtype)
    assert layer_norm_config(10, D)["looped"] == (D > 8192)
    _check(x, w, b, r, return_sum, atol)


@pytest.mark.parametrize("D", [320, 9000])
def test_no_affine_and_strided_rows(D):
    base = torch.randn(4, 6, D)
    x = base[:, ::2]  # rows with stride 2 * D, contiguous last dim
    r = torch.randn(8, 3, D).transpose(0, 1)[:, :4].transpose(0, 1)  # another row stride
    assert not x.is_contiguous() and x.stride(-1) == 1
    _check(x, None, None, r, True, 1e-5)


def test_return_sum_without_residual_is_x():
    x = torch.randn(3, 64)
    y, s = layer_norm(x, None, None, return_sum=True)
    assert s is x
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (64,)), atol=1e-5, rtol=1e-5)


def test_large_mean_small_std_long_rows():
    """The looped kernel's shifted sums must not cancel (mean 100, std 0.01, D = 9000)."""
    x = 100 + 0.01 * torch.randn(2, 9000)
    y = layer_norm(x, None, None)
    ref64 = layer_norm_ref(x.double(), None, None)
    assert_close_rule(y, ref64, torch.nn.functional.layer_norm(x, (9000,)), atol=1e-4)


def test_bad_inputs_raise():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight"):
        layer_norm(x, torch.ones(7), None)
    with pytest.raises(ValueError, match="residual"):
        layer_norm(x, None, None, residual=torch.randn(2, 9))
    with pytest.raises(TypeError, match="residual"):
        layer_norm(x, None, None, residual=torch.randn(2, 8, dtype=torch.float16))
    with pytest.raises(TypeError, match="dtype"):
        layer_norm(torch.ones(2, 8, dtype=torch.int64), None, None)
    with pytest.raises(ValueError, match="contiguous last dim"):
        layer_norm(torch.randn(8, 4).t(), None, None)


def test_fallback_without_interpreter_is_the_reference(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "interpret_mode", lambda: False)
    monkeypatch.setattr(dispatch, "_logged", set())
    x = torch.randn(2, 3, 320, dtype=torch.float16)
    r = torch.randn(2, 3, 320, dtype=torch.float16)
    w, b = torch.randn(320, dtype=torch.float16), torch.randn(320, dtype=torch.float16)
    with caplog.at_level(logging.INFO, logger="sdfast.kernels"):
        y, s = layer_norm(x, w, b, residual=r, return_sum=True)
    assert any("layer_norm" in rec.getMessage() for rec in caplog.records)
    ry, rs = layer_norm_ref(x, w, b, residual=r, return_sum=True)
    assert torch.equal(y, ry) and torch.equal(s, rs)


def test_custom_op_fake_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 7, 320)
        y, s = torch.ops.sdfast.layer_norm(x, None, None, 1e-5, torch.empty(2, 7, 320), True)
        assert y.shape == x.shape and s.shape == x.shape
    x = torch.randn(3, 48)
    torch.library.opcheck(
        torch.ops.sdfast.layer_norm.default,
        (x, torch.ones(48), torch.zeros(48), 1e-5, torch.randn(3, 48), True),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize("tile_elems,warps", [(2048, 4), (16384, 8)])
@pytest.mark.parametrize("D", [640, 700])
def test_tiling_knobs_agree_with_the_reference(monkeypatch, tile_elems, warps, D):
    import importlib

    ln = importlib.import_module("kernels.norm.layer_norm")  # the module (the package exports the function)
    monkeypatch.setitem(ln._TUNING, "tile_elems", tile_elems)
    monkeypatch.setitem(ln._TUNING, "warps_per_4k", warps)
    cfg = layer_norm_config(9, D)
    assert cfg["ROWS"] == min(16, tile_elems // 1024)  # 9 rows: the last tile is partial
    x, r = torch.randn(9, D).half(), torch.randn(9, D).half()
    w, b = (torch.rand(D) + 0.5).half(), torch.randn(D).half()
    _check(x, w, b, r, True, 2e-3)


@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("D", [640, 9000])
def test_sum_bias_goes_into_the_returned_sum_only(D, dtype, atol):
    x = torch.randn(3, D).to(dtype)
    r = torch.randn(3, D).to(dtype)
    w, b, sb = (torch.rand(D) + 0.5).to(dtype), torch.randn(D).to(dtype), torch.randn(D).to(dtype)
    y, s = layer_norm(x, w, b, residual=r, return_sum=True, sum_bias=sb)
    y0, s0 = layer_norm(x, w, b, residual=r, return_sum=True)
    assert torch.equal(y, y0)  # the norm does not see the bias
    ref32 = (s0.float() + sb.float())
    assert_close_rule(s, ref32, (s0 + sb), atol=atol, name="sum")
    _, s_nores = layer_norm(x, w, b, return_sum=True, sum_bias=sb)  # without a residual: x + sum_bias
    assert_close_rule(s_nores, x.float() + sb.float(), x + sb, atol=atol, name="sum")
    with pytest.raises(ValueError, match="return_sum"):
        layer_norm(x, w, b, residual=r, sum_bias=sb)
    with pytest.raises(ValueError, match="sum_bias must have shape"):
        layer_norm(x, w, b, residual=r, return_sum=True, sum_bias=sb[:-1])


# E4M3 output (out_scale_inv): the static-scale input of the FP8 GEMM that reads y, in place of a quantize pass
@pytest.mark.parametrize("D", [320, 1280, 40, 9000])  # 9000: the looped kernel
@pytest.mark.parametrize("residual", [False, True])
def test_fp8_output_matches_reference(D, residual):
    from kernels.testing import e4m3_far

    g = torch.Generator().manual_seed(D)
    x = torch.randn(6, D, generator=g).half()
    r = torch.randn(6, D, generator=g).half() if residual else None
    w = (1 + 0.5 * torch.randn(D, generator=g)).half()
    b = (0.2 * torch.randn(D, generator=g)).half()
    inv = torch.tensor(448.0 / 2.5)  # |y| > 2.5 saturates
    y, s = layer_norm(x, w, b, 1e-5, residual=r, return_sum=True, out_scale_inv=inv)
    _, ref_s = layer_norm_ref(x, w, b, 1e-5, residual=r, return_sum=True)
    ref_y = layer_norm_ref(ref_s, w, b, 1e-5, out_scale_inv=inv)  # the kernel normalizes the sum rounded to fp16
    assert y.dtype == ref_y.dtype == torch.float8_e4m3fn and y.shape == x.shape
    assert s.dtype == x.dtype and torch.equal(s, ref_s)
    atol = 1e-4 * float(inv)  # the fp32 statistics' error (the looped kernel's shifted sums), in scaled units
    assert not e4m3_far(y, ref_y, atol).any()
    assert float((y.float() != ref_y.float()).float().mean()) < 0.02
    assert float(y.float().abs().max()) == 448.0
    # the 16-bit kernel's output quantized: within one grid step (it rounds once more, to fp16, first)
    y16 = layer_norm(x, w, b, 1e-5, residual=r)
    assert not e4m3_far(y, (y16.float() * inv).clamp(-448, 448).to(torch.float8_e4m3fn), atol).any()


def test_fp8_output_scale_is_checked():
    x = torch.randn(4, 64).half()
    with pytest.raises(TypeError, match="out_scale_inv"):
        layer_norm(x, None, None, out_scale_inv=torch.tensor([2.0]))
    with pytest.raises(TypeError, match="out_scale_inv"):
        layer_norm(x, None, None, out_scale_inv=torch.tensor(2.0, dtype=torch.float16))
