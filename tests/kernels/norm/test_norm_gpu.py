"""GPU tests of LayerNorm on the real SD shapes (``benchmarks.sd_shapes``): every transformer LayerNorm shape of
SD1.5 and SDXL plus the text encoders' (77 tokens), alone and with the residual add (+ its sum), and bf16/fp32 with
long rows. Outputs are allocated by the op, so the caching allocator is first filled with NaN
(``kernels.testing.poison_allocator``): an element the kernel forgets to write stays NaN. LayerNorm in one CUDA
graph with GroupNorm and GEGLU: tests/kernels/group_norm/test_group_norm_gpu.py."""

from __future__ import annotations

import pytest
import torch

from benchmarks import sd_shapes
from kernels.norm import layer_norm, layer_norm_ref
from kernels.testing import assert_close_rule, poison_allocator

pytestmark = pytest.mark.gpu

ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 5e-5}


def _f32(t):
    return None if t is None else t.float()


@pytest.mark.parametrize("shape", sd_shapes.unique_layer_norm_shapes() + [(2, 77, 768), (2, 77, 1280)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "add_sum"])
def test_layer_norm_sd_shapes(shape, residual):
    g = torch.Generator(device="cuda").manual_seed(0)
    D = shape[-1]
    x = (torch.randn(*shape, device="cuda", generator=g) * 2 + 0.5).half()
    r = torch.randn(*shape, device="cuda", generator=g).half() if residual else None
    w = (torch.rand(D, device="cuda", generator=g) + 0.5).half()
    b = torch.randn(D, device="cuda", generator=g).half()
    poison_allocator(4 * x.numel() * 2)
    out = layer_norm(x, w, b, residual=r, return_sum=residual)
    ref32 = layer_norm_ref(x.float(), w.float(), b.float(), residual=_f32(r), return_sum=residual)
    lowp = layer_norm_ref(x, w, b, residual=r, return_sum=residual, upcast=False)
    if not residual:
        out, ref32, lowp = (out,), (ref32,), (lowp,)
    for o, r32, lp in zip(out, ref32, lowp):
        assert_close_rule(o, r32, lp, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_layer_norm_other_dtypes_and_long_rows(dtype):
    for D in (1280, 12000):
        x = torch.randn(64, D, device="cuda").to(dtype)
        r = torch.randn(64, D, device="cuda").to(dtype)
        w, b = torch.rand(D, device="cuda").to(dtype), torch.randn(D, device="cuda").to(dtype)
        y, s = layer_norm(x, w, b, residual=r, return_sum=True)
        y32, s32 = layer_norm_ref(x.float(), w.float(), b.float(), residual=r.float(), return_sum=True)
        yl, sl = layer_norm_ref(x, w, b, residual=r, return_sum=True, upcast=False)
        assert_close_rule(y, y32, yl, atol=ATOL[dtype])
        assert_close_rule(s, s32, sl, atol=ATOL[dtype])


@pytest.mark.parametrize("shape", sd_shapes.unique_layer_norm_shapes(), ids=lambda s: "x".join(map(str, s)))
def test_layer_norm_fp8_output_sd_shapes(shape):
    """E4M3 output (``out_scale_inv``): within one grid step of the fp32 reference's quantized values, the sum
    unchanged."""
    from kernels.testing import e4m3_far

    g = torch.Generator(device="cuda").manual_seed(0)
    D = shape[-1]
    x = (torch.randn(*shape, device="cuda", generator=g) * 2 + 0.5).half()
    r = torch.randn(*shape, device="cuda", generator=g).half()
    w = (torch.rand(D, device="cuda", generator=g) + 0.5).half()
    b = torch.randn(D, device="cuda", generator=g).half()
    inv = torch.tensor(448.0 / 4.0, device="cuda")
    y, s = layer_norm(x, w, b, residual=r, return_sum=True, out_scale_inv=inv)
    _, ref_s = layer_norm_ref(x, w, b, residual=r, return_sum=True)
    ref_y = layer_norm_ref(ref_s, w, b, out_scale_inv=inv)  # the kernel normalizes the sum rounded to fp16
    assert y.dtype == torch.float8_e4m3fn and torch.equal(s, ref_s)
    assert not e4m3_far(y, ref_y, atol=1e-4 * 112).any()
