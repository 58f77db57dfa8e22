"""The small-K linear pass (``sdfast.passes.linear``): which linears it routes through ``linear_projection`` (and which
it leaves to the other passes), the fp16 UNet output with the TMA GEMM forced (Triton interpreter), undo, and the
``tma_linear`` flag of ``optimize``."""

import pytest
import torch
from torch import nn

import sdfast
from kernels.gemm import linear_projection as lp
from kernels import select
from kernels.select import rules
from sdfast.passes.state import TOKENS_LINEAR
from kernels.gemm.linear_tma import LinearTile
from sdfast.passes import attention, layout, linear, norms
from sdfast.passes.attention.qkv import fused_layer

SMALL = LinearTile(32, 32, 32, 1, 4, group_m=2)


@pytest.fixture
def unet16():
    unet = sdfast.load("random:tiny", optimize=False).pipe.unet.half()
    for p in (attention, norms, layout):
        p.apply(unet)
    return unet


@pytest.fixture
def inputs():
    g = torch.Generator().manual_seed(0)
    return dict(sample=torch.randn(2, 4, 8, 8, generator=g).half(), timestep=torch.tensor(10),
                encoder_hidden_states=torch.randn(2, 7, 32, generator=g).half())


def _rebound(m: nn.Module) -> bool:
    return "forward" in m.__dict__


def test_routes_outputs_and_cross_queries_only(unet16):
    from diffusers.models.attention import BasicTransformerBlock

    blocks = [m for m in unet16.modules() if isinstance(m, BasicTransformerBlock)]
    transformers = linear._transformers(unet16)
    assert linear.apply(unet16) == 3 * len(blocks) + len(transformers)
    for b in blocks:
        assert _rebound(b.attn1.to_out[0]) and _rebound(b.attn2.to_out[0]) and _rebound(b.attn2.to_q)
        # left to the other passes: the fused self-attention QKV, the cached cross K/V, the feed-forward
        assert not any(_rebound(m) for m in (b.attn1.to_q, b.attn1.to_k, b.attn1.to_v, b.attn2.to_k, b.attn2.to_v))
        assert not _rebound(b.ff.net[0].proj) and not _rebound(b.ff.net[-1])
        assert fused_layer(b.attn1, "to_qkv") is not None
    assert all(TOKENS_LINEAR.get(t) for t in transformers)


def test_unet_output_with_the_tma_gemm_forced(unet16, inputs, monkeypatch):
    """Every routed linear (and proj_in / proj_out with its bias and residual) runs the TMA kernel; the UNet's
    output stays within fp16 rounding of the same UNet without the pass."""
    with torch.no_grad():
        want = unet16(**inputs, return_dict=False)[0].float()
    linear.apply(unet16)
    select.clear("linear")
    monkeypatch.setitem(lp.TUNING, "configs", (SMALL,))
    monkeypatch.setitem(rules._pins, "linear", str(SMALL))
    calls = []
    real = lp.linear_tma
    monkeypatch.setattr(lp, "linear_tma", lambda x, w, b, r, c: calls.append(r is not None) or real(x, w, b, r, c))
    with torch.no_grad():
        got = unet16(**inputs, return_dict=False)[0].float()
    n_transformers = len(linear._transformers(unet16))
    assert calls.count(True) == n_transformers  # each proj_out took its residual in the epilogue
    assert len(calls) > 2 * n_transformers
    assert (got - want).abs().max().item() <= 1e-2 * max(1.0, want.abs().max().item())


def test_fp32_runs_the_module_forward(monkeypatch):
    unet = sdfast.load("random:tiny", optimize=False).pipe.unet
    linear.apply(unet)
    monkeypatch.setattr(lp, "linear_projection", lambda *a, **k: pytest.fail("fp32 stays on nn.Linear.forward"))
    attn = next(m for m in unet.modules() if hasattr(m, "to_out"))
    x = torch.randn(2, 5, attn.to_out[0].in_features)
    torch.testing.assert_close(attn.to_out[0](x), nn.Linear.forward(attn.to_out[0], x))


def test_undo_and_optimize_flag():
    pipe = sdfast.load("random:tiny", optimize=False).pipe
    n = linear.apply(pipe.unet)
    assert linear.undo(pipe.unet) == n
    assert not any(_rebound(m) for m in pipe.unet.modules() if isinstance(m, nn.Linear))
    assert not any(TOKENS_LINEAR.get(t) is not None for t in linear._transformers(pipe.unet))
    sdfast.optimize(pipe, sdfast.OptimizeConfig(tma_linear=False, cuda_graphs=False))
    assert "linear" not in pipe._sdfast.counts
    sdfast.unoptimize(pipe)
    sdfast.optimize(pipe, sdfast.OptimizeConfig(cuda_graphs=False))
    assert pipe._sdfast.counts["linear"] == n
    sdfast.unoptimize(pipe)
    assert not any(_rebound(m) for m in pipe.unet.modules() if isinstance(m, nn.Linear))


def test_training_and_autocast_keep_the_stock_forwards(unet16, inputs, monkeypatch):
    """What the kernel cannot give (a gradient, the bias's included; autocast's dtype) runs the stock ops: the routed
    linears and the layout pass's proj_in / proj_out alike (both decide with ``linear.routable``)."""
    linear.apply(unet16)
    select.clear("linear")
    monkeypatch.setitem(lp.TUNING, "configs", (SMALL,))
    monkeypatch.setitem(rules._pins, "linear", str(SMALL))
    monkeypatch.setattr(lp, "linear_tma", lambda *a, **k: pytest.fail("the TMA kernel must not run here"))
    out_proj = unet16.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_out[0]
    x = torch.randn(2, 5, out_proj.in_features).half()
    out_proj.weight.requires_grad_(False)
    out_proj.bias.requires_grad_(True)  # a frozen weight with a trainable bias (BitFit)
    assert out_proj(x).requires_grad
    w = torch.randn(8, out_proj.in_features).half()
    assert not linear.routable(x, w.requires_grad_(True))
    with torch.no_grad():
        assert linear.routable(x, w)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not linear.routable(x, w)
    assert not linear.routable(x.float(), w.float().detach())
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():  # the whole UNet: proj_in / proj_out too
        unet16(**inputs, return_dict=False)
