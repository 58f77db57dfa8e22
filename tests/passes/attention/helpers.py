"""Tiny random models and inputs shared by the attention pass tests."""

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.models.attention_processor import Attention, AttnProcessor2_0

from sdfast.passes import attention as ap


def tiny_unet():
    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=32,
        attention_head_dim=8,
        sample_size=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        norm_num_groups=32,
    ).eval()


def tiny_vae():
    torch.manual_seed(0)
    return AutoencoderKL(
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=16,
    ).eval()


def run_unet(unet, inputs):
    with torch.no_grad():
        return unet(*inputs).sample


def attn_modules(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, Attention)}


def stock_vs_ours(attn, *args, **kwargs):
    with torch.no_grad():
        attn.set_processor(AttnProcessor2_0())
        ref = attn(*args, **kwargs)
        assert ap.apply(attn) == 1
        out = attn(*args, **kwargs)
        assert ap.undo(attn) == 1
        again = attn(*args, **kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(again, ref)


def random_qkv(B=2, H=2, Lq=9, Lk=13, D=16, dtype=torch.float32):
    return (torch.randn(B, H, Lq, D, dtype=dtype), torch.randn(B, H, Lk, D, dtype=dtype),
            torch.randn(B, H, Lk, D, dtype=dtype))
