"""GEGLU (``a * gelu(g)``, exact erf GELU) against diffusers' formula in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.dispatch as dispatch
from kernels.geglu import geglu, geglu_ref
from kernels.geglu.triton_elementwise import geglu_config
from kernels.testing import assert_close_rule

# bf16 runs in the GPU tests: the interpreter rounds fp32 -> bf16 toward zero, not to nearest.
DTYPES = [(torch.float32, 1e-5), (torch.float16, 2e-3)]


@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("D", [1280, 2560, 5120, 100, 7])
def test_geglu(D, dtype, atol):
    h = (torch.randn(2, 3, 2 * D) * 2).to(dtype)
    out = geglu(h)
    assert out.shape == (2, 3, D) and out.dtype == dtype and out.is_contiguous()
    assert_close_rule(out, geglu_ref(h.float()), geglu_ref(h, upcast=False), atol=atol)


def test_matches_diffusers_formula_exactly_in_fp32():
    h = torch.randn(5, 2 * 320)
    hidden, gate = h.chunk(2, dim=-1)
    torch.testing.assert_close(geglu(h), hidden * F.gelu(gate), atol=2e-6, rtol=2e-6)
    # not the tanh approximation
    approx = hidden * F.gelu(gate, approximate="tanh")
    assert (geglu(h) - approx).abs().max() > 1e-5


def test_strided_rows_and_column_blocks():
    h = torch.randn(12, 2 * 640 + 64)[:, : 2 * 640]  # row stride 1344
    assert not h.is_contiguous()
    assert geglu_config(12, 640)["BLOCK_D"] == 128  # 640 = 5 x 128: no masked lanes
    assert_close_rule(geglu(h), geglu_ref(h), geglu_ref(h), atol=1e-5)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="even"):
        geglu(torch.randn(2, 7))
    with pytest.raises(TypeError, match="dtype"):
        geglu(torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous last dim"):
        geglu(torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="cannot be viewed as rows"):
        geglu(torch.randn(6, 4, 64)[::2])  # (3, 4) leading dims with strides that do not merge


def test_fallback_without_interpreter_is_the_reference(monkeypatch):
    monkeypatch.setattr(dispatch, "interpret_mode", lambda: False)
    h = torch.randn(3, 64, dtype=torch.float16)
    assert torch.equal(geglu(h), geglu_ref(h))


def test_custom_op_fake_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert torch.ops.sdfast.geglu(torch.empty(2, 9, 64)).shape == (2, 9, 32)
    torch.library.opcheck(torch.ops.sdfast.geglu.default, (torch.randn(3, 40),),
                          test_utils=("test_schema", "test_faketensor"))
