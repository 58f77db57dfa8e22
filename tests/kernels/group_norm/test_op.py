"""The public GroupNorm entry (``kernels.group_norm.op``): input checks, the reference fallback through the one
logged dispatch point, and the ``torch.ops.sdfast.group_norm`` custom op's fake and schema."""

from __future__ import annotations

import logging

import pytest
import torch

import kernels.dispatch as dispatch
from kernels.group_norm import group_norm, group_norm_ref
from tests.kernels.group_norm.test_triton_groups import _inputs


def test_bad_inputs_raise():
    x = torch.randn(1, 40, 4, 4)
    w = torch.ones(40)
    with pytest.raises(ValueError, match="divisible"):
        group_norm(x, 3, w, w)
    with pytest.raises(ValueError, match="channel_bias"):
        group_norm(x, 4, w, w, channel_bias=torch.zeros(2, 40))
    with pytest.raises(ValueError, match="channel_bias"):
        group_norm(x, 4, w, w, channel_bias=torch.zeros(39))
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        group_norm(torch.randn(1, 40, 16), 4, w, w)
    with pytest.raises(TypeError, match="dtype"):
        group_norm(torch.ones(1, 40, 4, 4, dtype=torch.int32), 4, None, None)
    with pytest.raises(ValueError, match="weight"):
        group_norm(x, 4, torch.ones(20), None)
    with pytest.raises(ValueError, match="activation"):
        group_norm(x, 4, w, w, activation="gelu")
    with pytest.raises(ValueError, match="residual"):
        group_norm(x, 4, w, w, residual=torch.randn(1, 40, 4, 5))
    with pytest.raises(TypeError, match="residual"):
        group_norm(x, 4, w, w, residual=torch.randn(1, 40, 4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="NCHW-contiguous or channels_last"):
        group_norm(torch.randn(1, 40, 8, 8)[..., ::2], 4, w, w)


def test_fallback_without_interpreter_is_the_reference(monkeypatch, caplog):
    """A CPU tensor without TRITON_INTERPRET runs group_norm_ref through the one logged dispatch point."""
    monkeypatch.setattr(dispatch, "interpret_mode", lambda: False)
    monkeypatch.setattr(dispatch, "_logged", set())
    x, w, b, cb, r = _inputs(2, 80, 5, 6, torch.float16, True, cb="BC", res=True)
    with caplog.at_level(logging.INFO, logger="sdfast.kernels"):
        y, pre = group_norm(x, 8, w, b, channel_bias=cb, residual=r, activation="silu", return_sum=True)
    assert any("group_norm" in rec.getMessage() and "reference" in rec.getMessage() for rec in caplog.records)
    ref_y, ref_pre = group_norm_ref(x, 8, w, b, channel_bias=cb, residual=r, activation="silu", return_sum=True)
    assert torch.equal(y, ref_y) and torch.equal(pre, ref_pre)
    assert y.is_contiguous(memory_format=torch.channels_last)
    # fp32 and no adds: the reference's sum would alias x; the op must hand back a fresh tensor
    x32 = torch.randn(1, 8, 3, 3)
    y2, pre2 = torch.ops.sdfast.group_norm(x32, 2, None, None, 1e-5, None, None, None, True)
    assert torch.equal(pre2, x32) and pre2.data_ptr() != x32.data_ptr()


def test_custom_op_fake_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 64, 8, 8).to(memory_format=torch.channels_last)
        y, pre = torch.ops.sdfast.group_norm(x, 8, None, None, 1e-5, torch.empty(2, 64), None, "silu", True)
        assert y.shape == x.shape and y.stride() == x.stride() and pre.stride() == x.stride()
        y, pre = torch.ops.sdfast.group_norm(x, 8, None, None, 1e-5, None, None, None, False)
        assert pre.numel() == 0
    x = torch.randn(1, 16, 3, 3)
    torch.library.opcheck(
        torch.ops.sdfast.group_norm.default,
        (x, 4, torch.ones(16), torch.zeros(16), 1e-5, torch.randn(16), torch.randn(1, 16, 3, 3), "silu", True),
        test_utils=("test_schema", "test_faketensor"),
    )
