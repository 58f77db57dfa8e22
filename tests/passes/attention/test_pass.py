"""The attention pass (apply / undo) on CPU: UNet parity, fusion and exact undo, filter_fn, non-stock processors
left alone, processors set by the user after apply, and optimize's own dispatcher for the fp32 VAE."""

import torch
import torch.nn as nn
from diffusers.models.attention_processor import Attention, AttnProcessor2_0

from sdfast.passes import attention as ap

from .helpers import attn_modules, run_unet, tiny_unet


def test_unet_parity_fusion_and_undo(unet_case):
    unet, inputs, ref = unet_case
    stock_procs = {n: m.processor for n, m in attn_modules(unet).items()}
    assert all(isinstance(p, AttnProcessor2_0) for p in stock_procs.values())

    n = ap.apply(unet)
    try:
        assert n == 8  # 4 transformer blocks x (self, cross)
        mods = attn_modules(unet)
        assert all(isinstance(m.processor, ap.SdfastAttnProcessor) for m in mods.values())
        for name, m in mods.items():
            if name.endswith("attn1"):  # self-attention: one QKV GEMM, weights shared
                assert isinstance(m.to_qkv, nn.Linear) and not hasattr(m, "to_kv")
                assert m.to_q.weight.data_ptr() == m.to_qkv.weight.data_ptr()
                assert m.to_v.weight.untyped_storage().data_ptr() == m.to_qkv.weight.untyped_storage().data_ptr()
            else:  # cross-attention: one KV GEMM
                assert isinstance(m.to_kv, nn.Linear) and not hasattr(m, "to_qkv")
                assert m.to_k.weight.data_ptr() == m.to_kv.weight.data_ptr()
        out = run_unet(unet, inputs)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert ap.apply(unet) == 0  # already converted
    finally:
        assert ap.undo(unet) == 8
    mods = attn_modules(unet)
    for name, m in mods.items():
        assert m.processor is stock_procs[name]
        assert not hasattr(m, "to_qkv") and not hasattr(m, "to_kv") and not m.fused_projections
        assert m.to_k.weight.untyped_storage().nbytes() == m.to_k.weight.numel() * 4  # own storage
    assert torch.equal(run_unet(unet, inputs), ref)  # exactly stock again
    assert ap.undo(unet) == 0


def test_filter_fn_and_no_fusion(unet_case):
    unet, inputs, ref = unet_case
    seen = []

    def only_self(m, name):
        seen.append(name)
        return name.endswith("attn1")

    try:
        assert ap.apply(unet, filter_fn=only_self, fuse_projections=False) == 4
        assert len(seen) == 8
        for name, m in attn_modules(unet).items():
            assert isinstance(m.processor, ap.SdfastAttnProcessor) == name.endswith("attn1")
            assert not hasattr(m, "to_qkv")
        torch.testing.assert_close(run_unet(unet, inputs), ref, rtol=1e-5, atol=1e-5)
        assert ap.apply(unet) == 4  # the rest
    finally:
        assert ap.undo(unet) == 8
    assert torch.equal(run_unet(unet, inputs), ref)


def test_non_stock_processor_is_left_alone():
    attn = Attention(query_dim=16, heads=2, dim_head=8)

    class Custom(AttnProcessor2_0):
        pass

    attn.set_processor(Custom())
    assert ap.apply(attn) == 0


def test_undo_keeps_a_processor_the_user_set_after_apply():
    unet = tiny_unet()
    before = dict(unet.attn_processors)
    n = ap.apply(unet)
    name = next(iter(before))  # "...attn1.processor"
    mine = AttnProcessor2_0()
    dict(unet.named_modules())[name.removesuffix(".processor")].set_processor(mine)
    assert ap.undo(unet) == n
    after = unet.attn_processors
    assert after[name] is mine
    assert all(after[k] is v for k, v in before.items() if k != name)


def test_undo_keeps_fused_projections_for_a_user_processor_that_needs_them():
    from diffusers.models.attention_processor import FusedAttnProcessor2_0

    unet = tiny_unet()
    ap.apply(unet, fuse_projections=True)
    name, attn = next((n, m) for n, m in unet.named_modules() if hasattr(m, "to_qkv"))
    attn.set_processor(FusedAttnProcessor2_0())
    ap.undo(unet)
    assert isinstance(attn.processor, FusedAttnProcessor2_0) and hasattr(attn, "to_qkv")
    x = torch.randn(1, 16, attn.to_qkv.in_features)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), AttnProcessor2_0()(attn, x), atol=1e-5, rtol=1e-5)


def test_fp32_vae_gets_its_own_tf32_dispatcher():
    import sdfast
    from sdfast import OptimizeConfig

    for tf32 in (True, False):
        pipe = sdfast.load("random:tiny-xl", optimize=False).pipe.to(torch.float16)
        pipe.vae.register_to_config(force_upcast=True)  # as SDXL's VAE config says
        sdfast.optimize(pipe, OptimizeConfig(vae_tf32=tf32))
        state = pipe._sdfast
        assert state.vae_upcast and pipe.vae.dtype == torch.float32
        vae_procs = {id(p.dispatcher) for p in pipe.vae.attn_processors.values()}
        unet_procs = {id(p.dispatcher) for p in pipe.unet.attn_processors.values()}
        unet_dispatchers = {p.dispatcher for p in pipe.unet.attn_processors.values()}
        assert len(unet_procs) == 1 and not next(iter(unet_dispatchers)).allow_tf32
        if tf32:
            assert state.vae_dispatcher.allow_tf32 and vae_procs == {id(state.vae_dispatcher)}
        else:  # the VAE's dispatcher has the UNet's options: the same choice keys (decisions shared)
            vae_d = next(iter(pipe.vae.attn_processors.values())).dispatcher
            assert state.vae_dispatcher is None and vae_d.options == next(iter(unet_dispatchers)).options


def test_the_package_exports_the_attention_choice_not_the_pass_state_slot():
    """``sdfast.passes.attention.ATTENTION`` is the kernel choice (kernels.select); the pass's per-module state is
    ``sdfast.passes.state.ATTENTION_STATE`` (the two once shared a name and the slot shadowed the choice)."""
    from kernels import select
    from sdfast.passes import attention
    from sdfast.passes.state import ATTENTION_STATE, Slot

    assert isinstance(attention.ATTENTION, select.Choice) and attention.ATTENTION.name == "attention"
    assert isinstance(ATTENTION_STATE, Slot)
