"""Q/K/V packing on CPU: the fused projections stay out of the state dict, split_projection matches separate
linears (and runs a hooked fused layer as a module), diffusers-fused and wrapped projections."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention

from sdfast.passes import attention as ap
from sdfast.passes.attention import qkv

from .helpers import attn_modules, run_unet, stock_vs_ours


def test_fused_projections_stay_out_of_the_state_dict(unet_case):
    """The fused to_qkv / to_kv overlap the separate projections' storage: state_dict leaves them out (safetensors
    refuses overlapping tensors, so save_pretrained of an optimized pipeline would fail), a stock state dict loads
    strictly, in place through the views, and undo removes the hooks."""
    unet, inputs, ref = unet_case
    stock_keys = set(unet.state_dict())
    ap.apply(unet)
    try:
        sd = {k: v.clone() for k, v in unet.state_dict().items()}
        assert set(sd) == stock_keys and not any(".to_qkv." in k or ".to_kv." in k for k in sd)
        attn = next(m for n, m in attn_modules(unet).items() if n.endswith("attn1"))
        new = {k: v.clone() for k, v in sd.items()}
        key = next(k for k in new if k.endswith("attn1.to_k.weight"))
        new[key].mul_(2)
        unet.load_state_dict(new, strict=True)  # no missing to_qkv keys
        assert torch.equal(attn.to_qkv.weight[attn.to_q.out_features:][: attn.to_k.out_features], new[key])
        del new[key]  # a missing key of a real layer is still reported
        with pytest.raises(RuntimeError, match="Missing key"):
            unet.load_state_dict(new, strict=True)
        unet.load_state_dict(sd, strict=True)
    finally:
        ap.undo(unet)
    torch.testing.assert_close(run_unet(unet, inputs), ref, rtol=0, atol=0)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_split_projection_matches_separate_linears(bias, layout):
    fused = nn.Linear(24, 3 * 16, bias=bias)
    x = torch.randn(2, 10, 24) if layout == "contiguous" else torch.randn(2, 24, 10).transpose(1, 2)
    parts = qkv.split_projection(fused, x, 3)
    for i, got in enumerate(parts):
        w = fused.weight[16 * i:16 * (i + 1)]
        b = fused.bias[16 * i:16 * (i + 1)] if bias else None
        assert got.shape == (2, 10, 16) and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="do not split"):
        qkv.split_projection(fused, x, 5)


def test_split_projection_runs_a_hooked_fused_layer_as_a_module():
    """Hooks on the fused layer itself (diffusers' own to_qkv, a user's hook) still run: it is called."""
    fused = nn.Linear(8, 3 * 4)
    x = torch.randn(2, 5, 8)
    h = fused.register_forward_pre_hook(lambda m, a: (a[0] * 2,))
    try:
        parts = qkv.split_projection(fused, x, 3)
    finally:
        h.remove()
    torch.testing.assert_close(torch.cat(parts, -1), fused(x * 2))


def test_diffusers_fused_and_wrapped_projections(unet_case):
    unet, inputs, ref = unet_case
    # diffusers' own fusion: our processor uses its to_qkv / to_kv and undo keeps them
    unet.fuse_qkv_projections()
    try:
        assert ap.apply(unet) == 8
        torch.testing.assert_close(run_unet(unet, inputs), ref, rtol=1e-5, atol=1e-5)
        assert ap.undo(unet) == 8
        attn1 = unet.mid_block.attentions[0].transformer_blocks[0].attn1
        assert attn1.fused_projections and hasattr(attn1, "to_qkv")
        assert type(attn1.processor).__name__ == "FusedAttnProcessor2_0"
    finally:
        unet.unfuse_qkv_projections()
        for m in attn_modules(unet).values():
            for name in ("to_qkv", "to_kv"):
                if hasattr(m, name):
                    delattr(m, name)
            m.fused_projections = False
    assert torch.equal(run_unet(unet, inputs), ref)

    # a projection that is not a plain nn.Linear (LoRA-wrapped, quantized): no fusion, still exact
    class Wrapped(nn.Linear):
        pass

    attn = Attention(query_dim=16, heads=2, dim_head=8).eval()
    w = Wrapped(16, 16, bias=False)
    w.load_state_dict(attn.to_q.state_dict())
    attn.to_q = w
    stock_vs_ours(attn, torch.randn(1, 6, 16))
    ap.apply(attn)
    assert not hasattr(attn, "to_qkv")
    ap.undo(attn)
