"""SdfastAttnProcessor on CPU: parity with diffusers' AttnProcessor2_0 (VAE mid-block, masks, norm_cross, upcast,
spatial and group norm, 4D input) and the stock upcast numerics; our Triton kernel inside the processor."""

import torch
from diffusers.models.attention_processor import Attention

from sdfast.passes import attention as ap

from .helpers import run_unet, stock_vs_ours, tiny_vae


def test_vae_mid_block_parity():
    # group_norm, residual_connection, rescale_output_factor, 4D input, upcast_softmax, 1 head
    vae = tiny_vae()
    img = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        ref = vae(img).sample
        assert ap.apply(vae) == 2  # encoder and decoder mid-blocks
        attn = vae.decoder.mid_block.attentions[0]
        assert attn.group_norm is not None and attn.residual_connection and attn.heads == 1
        torch.testing.assert_close(vae(img).sample, ref, rtol=1e-5, atol=1e-5)
        assert ap.undo(vae) == 2
        assert torch.equal(vae(img).sample, ref)
        assert ap.apply(vae, dispatcher=ap.AttentionDispatcher("triton")) == 2
        torch.testing.assert_close(vae(img).sample, ref, rtol=1e-5, atol=1e-5)
        ap.undo(vae)


def test_cross_attention_mask_norm_cross_upcast():
    torch.manual_seed(0)
    attn = Attention(
        query_dim=32, cross_attention_dim=16, heads=2, dim_head=16, bias=True,
        cross_attention_norm="layer_norm", upcast_attention=True, upcast_softmax=True,
    ).eval()
    hs, ehs = torch.randn(2, 9, 32), torch.randn(2, 5, 16)
    mask = torch.zeros(2, 1, 5)
    mask[0, :, 3:] = -10000.0  # diffusers' additive encoder mask
    stock_vs_ours(attn, hs, encoder_hidden_states=ehs, attention_mask=mask)
    stock_vs_ours(attn, hs, encoder_hidden_states=ehs)
    # a cross module called without context takes K/V from hidden_states (to_kv on hidden_states)
    attn = Attention(query_dim=32, cross_attention_dim=32, heads=2, dim_head=16).eval()
    stock_vs_ours(attn, hs)


def test_spatial_norm_and_group_norm_4d():
    torch.manual_seed(0)
    attn = Attention(
        query_dim=32, heads=1, dim_head=32, bias=True, spatial_norm_dim=4, residual_connection=True,
        rescale_output_factor=2.0, _from_deprecated_attn_block=True,
    ).eval()
    x, zq = torch.randn(1, 32, 4, 4), torch.randn(1, 4, 2, 2)
    stock_vs_ours(attn, x, temb=zq)
    attn = Attention(query_dim=32, heads=2, dim_head=16, norm_num_groups=8, bias=True).eval()
    stock_vs_ours(attn, torch.randn(2, 32, 3, 5))


def test_processor_upcast_modules_use_the_stock_numerics():
    # diffusers' upcast flags ask for an fp32 softmax with P cast back to the value dtype, which every
    # backend does: the processor must not ask for the kernel's slower split-P mode.
    seen = []

    def spy(q, k, v, attn_mask, scale, upcast):
        seen.append(upcast)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)

    d = ap.AttentionDispatcher("spy", extra_backends={"spy": spy})
    attn = Attention(query_dim=32, heads=2, dim_head=16, upcast_attention=True, upcast_softmax=True).eval()
    attn.set_processor(ap.SdfastAttnProcessor(d))
    with torch.no_grad():
        attn(torch.randn(1, 6, 32))
    assert seen == [False]


def test_triton_backend_in_unet(unet_case):
    # our kernel (interpreter) inside the real processor; a subset keeps the interpreter time low
    unet, inputs, ref = unet_case
    d = ap.AttentionDispatcher("triton")
    try:
        n = ap.apply(unet, dispatcher=d, filter_fn=lambda m, name: name.startswith("mid_block"))
        assert n == 2
        torch.testing.assert_close(run_unet(unet, inputs), ref, rtol=1e-5, atol=1e-5)
    finally:
        ap.undo(unet)
