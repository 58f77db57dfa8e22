"""``CrossKV``: cross-attention K/V projected once per context (CPU: the slot logic; the graphs are GPU tests)."""

import pytest
import torch

from sdfast.passes.attention.processor import SdfastAttnProcessor
from sdfast.passes.state import CROSS_KV
from sdfast.runtime.conditioning import SeenContext
from sdfast.runtime.cross_kv import CrossKV


def _unet_inputs(unet, batch=2):
    g = torch.Generator().manual_seed(0)
    c = unet.config
    sample = torch.randn(batch, c.in_channels, 8, 8, generator=g)
    ctx = torch.randn(batch, 77, c.cross_attention_dim, generator=g)
    return sample, torch.tensor(10), ctx


def test_step_reading_the_slots_equals_the_stock_step(tiny_engine):
    unet = tiny_engine.pipe.unet
    cache = CrossKV(unet)
    layers = cache.layers()
    assert layers and all(isinstance(m.processor, SdfastAttnProcessor) and m.is_cross_attention for m in layers)
    sample, t, ctx = _unet_inputs(unet)
    with torch.no_grad():
        ref = unet(sample, t, encoder_hidden_states=ctx).sample
        slots = cache.fill(ctx)
        assert set(slots) == {id(m) for m in layers}
        assert all(CROSS_KV.get(m) is cache for m in layers)
        with cache.reading(slots, ctx):
            out = unet(sample, t, encoder_hidden_states=ctx).sample
    assert torch.equal(out, ref)


def test_slots_are_read_only_while_capturing_and_only_for_that_context(tiny_engine):
    unet = tiny_engine.pipe.unet
    cache = CrossKV(unet)
    sample, t, ctx = _unet_inputs(unet)
    with torch.no_grad():
        slots = cache.fill(ctx)
        # poisoned slots: a step that read them would differ from the stock step
        poisoned = {k: (torch.full_like(kk, 7.0), torch.full_like(vv, -7.0)) for k, (kk, vv) in slots.items()}
        ref = unet(sample, t, encoder_hidden_states=ctx).sample
        assert torch.equal(unet(sample, t, encoder_hidden_states=ctx).sample, ref)  # outside reading(): unused
        other = ctx.clone()  # same values, another tensor: not the captured context
        with cache.reading(poisoned, ctx):
            assert torch.equal(unet(sample, t, encoder_hidden_states=other).sample, ref)
            assert not torch.equal(unet(sample, t, encoder_hidden_states=ctx).sample, ref)
    layer = cache.layers()[0]
    assert cache.lookup(layer, ctx) is None
    cache.uninstall()
    assert all(CROSS_KV.get(m) is None for m in unet.modules())


def test_state_follows_in_place_changes_of_context_and_weights(tiny_engine):
    unet = tiny_engine.pipe.unet
    cache = CrossKV(unet)
    params = cache.params()
    assert params and any(p is cache.layers()[0].to_k.weight for p in params)
    ctx = torch.randn(2, 77, unet.config.cross_attention_dim)
    s0 = CrossKV.state(ctx, params)
    assert CrossKV.state(ctx, params) == s0
    ctx.mul_(2)
    s1 = CrossKV.state(ctx, params)
    assert s1 != s0
    with torch.no_grad():
        cache.layers()[-1].to_v.weight.add_(1)  # a fused LoRA: same storage, new values
    assert CrossKV.state(ctx, params) != s1
    with torch.inference_mode():
        frozen = torch.randn(2, 77, unet.config.cross_attention_dim)
    assert CrossKV.state(frozen, params) is None  # no version counter: always re-projected


def test_seen_context_needs_the_same_live_tensor_and_state():
    seen = SeenContext()
    x = torch.ones(3)
    assert not seen.same(x, (1,))
    seen.set(x, (1,))
    assert seen.same(x, (1,))
    assert not seen.same(x, (2,)) and not seen.same(x.clone(), (1,)) and not seen.same(x, None)
    seen.forget()
    assert not seen.same(x, (1,))


@pytest.mark.parametrize("positional", [False, True])
def test_context_is_found_by_name_or_position(tiny_engine, positional):
    cache = CrossKV(tiny_engine.pipe.unet)
    ctx = torch.zeros(1)
    args, kwargs = ((1, 2, ctx), {}) if positional else ((1, 2), {"encoder_hidden_states": ctx})
    assert cache.context(args, kwargs) is ctx
    assert cache.context((1, 2), {}) is None
    # with cross_attention_kwargs (a LoRA scale the UNet's forward applies around the layers): no projection graph
    assert cache.context(args, {**kwargs, "cross_attention_kwargs": {"scale": 0.5}}) is None
    assert cache.context(args, {**kwargs, "cross_attention_kwargs": None}) is ctx


def test_no_layers_when_the_unet_transforms_the_context_first(tiny_engine):
    unet = tiny_engine.pipe.unet
    cache = CrossKV(unet)
    assert cache.layers()
    unet.encoder_hid_proj = torch.nn.Identity()  # what IP-Adapter / text_proj UNets carry
    try:
        assert cache.layers() == []
    finally:
        unet.encoder_hid_proj = None
