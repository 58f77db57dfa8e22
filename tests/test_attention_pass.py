"""The attention pass on CPU: processor parity with diffusers' AttnProcessor2_0 on tiny random
models, projection fusion and undo, filter_fn, and the dispatcher's measured choice / exclusion."""

import logging
import time
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
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


@pytest.fixture(scope="module")
def unet_case():
    unet = tiny_unet()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 8, 8, generator=g)
    t = torch.tensor([10, 500])
    ehs = torch.randn(2, 7, 32, generator=g)
    with torch.no_grad():
        ref = unet(x, t, ehs).sample
    return unet, (x, t, ehs), ref


def _run(unet, inputs):
    with torch.no_grad():
        return unet(*inputs).sample


def _attn_modules(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, Attention)}


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
        attn = next(m for n, m in _attn_modules(unet).items() if n.endswith("attn1"))
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
    torch.testing.assert_close(_run(unet, inputs), ref, rtol=0, atol=0)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_split_projection_matches_separate_linears(bias, layout):
    fused = nn.Linear(24, 3 * 16, bias=bias)
    x = torch.randn(2, 10, 24) if layout == "contiguous" else torch.randn(2, 24, 10).transpose(1, 2)
    parts = ap.split_projection(fused, x, 3)
    for i, got in enumerate(parts):
        w = fused.weight[16 * i:16 * (i + 1)]
        b = fused.bias[16 * i:16 * (i + 1)] if bias else None
        assert got.shape == (2, 10, 16) and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="do not split"):
        ap.split_projection(fused, x, 5)


def test_split_projection_runs_a_hooked_fused_layer_as_a_module():
    """Hooks on the fused layer itself (diffusers' own to_qkv, a user's hook) still run: it is called."""
    fused = nn.Linear(8, 3 * 4)
    x = torch.randn(2, 5, 8)
    h = fused.register_forward_pre_hook(lambda m, a: (a[0] * 2,))
    try:
        parts = ap.split_projection(fused, x, 3)
    finally:
        h.remove()
    torch.testing.assert_close(torch.cat(parts, -1), fused(x * 2))


def test_unet_parity_fusion_and_undo(unet_case):
    unet, inputs, ref = unet_case
    stock_procs = {n: m.processor for n, m in _attn_modules(unet).items()}
    assert all(isinstance(p, AttnProcessor2_0) for p in stock_procs.values())

    n = ap.apply(unet)
    try:
        assert n == 8  # 4 transformer blocks x (self, cross)
        mods = _attn_modules(unet)
        assert all(isinstance(m.processor, ap.SdfastAttnProcessor) for m in mods.values())
        for name, m in mods.items():
            if name.endswith("attn1"):  # self-attention: one QKV GEMM, weights shared
                assert isinstance(m.to_qkv, nn.Linear) and not hasattr(m, "to_kv")
                assert m.to_q.weight.data_ptr() == m.to_qkv.weight.data_ptr()
                assert m.to_v.weight.untyped_storage().data_ptr() == m.to_qkv.weight.untyped_storage().data_ptr()
            else:  # cross-attention: one KV GEMM
                assert isinstance(m.to_kv, nn.Linear) and not hasattr(m, "to_qkv")
                assert m.to_k.weight.data_ptr() == m.to_kv.weight.data_ptr()
        out = _run(unet, inputs)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert ap.apply(unet) == 0  # already converted
    finally:
        assert ap.undo(unet) == 8
    mods = _attn_modules(unet)
    for name, m in mods.items():
        assert m.processor is stock_procs[name]
        assert not hasattr(m, "to_qkv") and not hasattr(m, "to_kv") and not m.fused_projections
        assert m.to_k.weight.untyped_storage().nbytes() == m.to_k.weight.numel() * 4  # own storage
    assert torch.equal(_run(unet, inputs), ref)  # exactly stock again
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
        for name, m in _attn_modules(unet).items():
            assert isinstance(m.processor, ap.SdfastAttnProcessor) == name.endswith("attn1")
            assert not hasattr(m, "to_qkv")
        torch.testing.assert_close(_run(unet, inputs), ref, rtol=1e-5, atol=1e-5)
        assert ap.apply(unet) == 4  # the rest
    finally:
        assert ap.undo(unet) == 8
    assert torch.equal(_run(unet, inputs), ref)


def test_triton_backend_in_unet(unet_case):
    # our kernel (interpreter) inside the real processor; a subset keeps the interpreter time low
    unet, inputs, ref = unet_case
    d = ap.AttentionDispatcher("triton")
    try:
        n = ap.apply(unet, dispatcher=d, filter_fn=lambda m, name: name.startswith("mid_block"))
        assert n == 2
        torch.testing.assert_close(_run(unet, inputs), ref, rtol=1e-5, atol=1e-5)
    finally:
        ap.undo(unet)


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


def _stock_vs_ours(attn, *args, **kwargs):
    with torch.no_grad():
        attn.set_processor(AttnProcessor2_0())
        ref = attn(*args, **kwargs)
        assert ap.apply(attn) == 1
        out = attn(*args, **kwargs)
        assert ap.undo(attn) == 1
        again = attn(*args, **kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(again, ref)


def test_cross_attention_mask_norm_cross_upcast():
    torch.manual_seed(0)
    attn = Attention(
        query_dim=32, cross_attention_dim=16, heads=2, dim_head=16, bias=True,
        cross_attention_norm="layer_norm", upcast_attention=True, upcast_softmax=True,
    ).eval()
    hs, ehs = torch.randn(2, 9, 32), torch.randn(2, 5, 16)
    mask = torch.zeros(2, 1, 5)
    mask[0, :, 3:] = -10000.0  # diffusers' additive encoder mask
    _stock_vs_ours(attn, hs, encoder_hidden_states=ehs, attention_mask=mask)
    _stock_vs_ours(attn, hs, encoder_hidden_states=ehs)
    # a cross module called without context takes K/V from hidden_states (to_kv on hidden_states)
    attn = Attention(query_dim=32, cross_attention_dim=32, heads=2, dim_head=16).eval()
    _stock_vs_ours(attn, hs)


def test_spatial_norm_and_group_norm_4d():
    torch.manual_seed(0)
    attn = Attention(
        query_dim=32, heads=1, dim_head=32, bias=True, spatial_norm_dim=4, residual_connection=True,
        rescale_output_factor=2.0, _from_deprecated_attn_block=True,
    ).eval()
    x, zq = torch.randn(1, 32, 4, 4), torch.randn(1, 4, 2, 2)
    _stock_vs_ours(attn, x, temb=zq)
    attn = Attention(query_dim=32, heads=2, dim_head=16, norm_num_groups=8, bias=True).eval()
    _stock_vs_ours(attn, torch.randn(2, 32, 3, 5))


def test_diffusers_fused_and_wrapped_projections(unet_case):
    unet, inputs, ref = unet_case
    # diffusers' own fusion: our processor uses its to_qkv / to_kv and undo keeps them
    unet.fuse_qkv_projections()
    try:
        assert ap.apply(unet) == 8
        torch.testing.assert_close(_run(unet, inputs), ref, rtol=1e-5, atol=1e-5)
        assert ap.undo(unet) == 8
        attn1 = unet.mid_block.attentions[0].transformer_blocks[0].attn1
        assert attn1.fused_projections and hasattr(attn1, "to_qkv")
        assert type(attn1.processor).__name__ == "FusedAttnProcessor2_0"
    finally:
        unet.unfuse_qkv_projections()
        for m in _attn_modules(unet).values():
            for name in ("to_qkv", "to_kv"):
                if hasattr(m, name):
                    delattr(m, name)
            m.fused_projections = False
    assert torch.equal(_run(unet, inputs), ref)

    # a projection that is not a plain nn.Linear (LoRA-wrapped, quantized): no fusion, still exact
    class Wrapped(nn.Linear):
        pass

    attn = Attention(query_dim=16, heads=2, dim_head=8).eval()
    w = Wrapped(16, 16, bias=False)
    w.load_state_dict(attn.to_q.state_dict())
    attn.to_q = w
    _stock_vs_ours(attn, torch.randn(1, 6, 16))
    ap.apply(attn)
    assert not hasattr(attn, "to_qkv")
    ap.undo(attn)


def test_non_stock_processor_is_left_alone():
    attn = Attention(query_dim=16, heads=2, dim_head=8)

    class Custom(AttnProcessor2_0):
        pass

    attn.set_processor(Custom())
    assert ap.apply(attn) == 0


# ---------------------------------------------------------------------------------------------
# dispatcher
# ---------------------------------------------------------------------------------------------


def _qkv(B=2, H=2, Lq=9, Lk=13, D=16, dtype=torch.float32):
    return (torch.randn(B, H, Lq, D, dtype=dtype), torch.randn(B, H, Lk, D, dtype=dtype),
            torch.randn(B, H, Lk, D, dtype=dtype))


def test_dispatcher_excludes_failing_and_wrong_backends(caplog):
    def boom(q, k, v, attn_mask, scale, upcast):
        raise RuntimeError("simulated kernel failure")

    def wrong(q, k, v, attn_mask, scale, upcast):
        return torch.zeros(q.shape, dtype=q.dtype)

    d = ap.AttentionDispatcher(
        candidates=("boom", "wrong", "math", "sdpa"), extra_backends={"boom": boom, "wrong": wrong},
        measure_cpu=True,
    )
    q, k, v = _qkv()
    with caplog.at_level(logging.INFO, logger="sdfast.attention"):
        out = d(q, k, v)
        out2 = d(q, k, v)  # cached: measured once
    key = ap.AttentionDispatcher.key_for(q, k, None, False)
    assert key == (9, 13, 2, 16, torch.float32, torch.device("cpu"), False, False)
    assert d.choices() == {key: d.choices()[key]} and d.choices()[key] in ("math", "sdpa")
    assert set(d.timings()[key]) == {"math", "sdpa"}
    excl = d.excluded()[key]
    assert "simulated kernel failure" in excl["boom"] and "wrong result" in excl["wrong"]
    assert "'boom' excluded" in caplog.text and "'wrong' excluded" in caplog.text
    assert caplog.text.count("excluded") == 2
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out2, ref)


def test_dispatcher_probing_is_silent_and_logged_at_debug_but_run_time_warnings_show(caplog):
    # torch's forced SDPA backends warn their reasons ("Flash attention kernel not used because", ...) when a
    # probe cannot run the inputs; a first image at a new shape printed dozens of them.
    def refuses(q, k, v, attn_mask, scale, upcast):
        warnings.warn("Flash attention kernel not used because: head_dim should be no more than 256", UserWarning)
        raise RuntimeError("No available kernel. Aborting execution.")

    def picked(q, k, v, attn_mask, scale, upcast):
        warnings.warn("picked kernel says hello", UserWarning)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    d = ap.AttentionDispatcher(candidates=("refuses", "picked"), extra_backends={"refuses": refuses, "picked": picked},
                               measure_cpu=True)
    q, k, v = _qkv()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG, logger="sdfast.attention"):
        warnings.simplefilter("always")
        d(q, k, v)  # probes both, then runs the winner
        assert [str(w.message) for w in caught] == ["picked kernel says hello"]  # the real call's, not the probes'
        d(q, k, v)
    key = d.key_for(q, k, None, False)
    assert d.choices()[key] == "picked" and "No available kernel" in d.excluded()[key]["refuses"]
    assert [str(w.message) for w in caught] == ["picked kernel says hello"] * 2
    assert caplog.text.count("head_dim should be no more than 256") == 1  # once, at debug level
    assert caplog.text.count("picked kernel says hello") == 1  # each probe call warned; logged once
    assert "'refuses' excluded" in caplog.text


def test_dispatcher_winner_failing_later_falls_back(caplog):
    state = {"fail": False}

    def flaky(q, k, v, attn_mask, scale, upcast):
        if state["fail"]:
            raise RuntimeError("unsupported batch size")
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    d = ap.AttentionDispatcher(candidates=("flaky",), extra_backends={"flaky": flaky}, measure_cpu=True)
    q, k, v = _qkv()
    d(q, k, v)
    key = d.key_for(q, k, None, False)
    assert d.choices()[key] == "flaky"
    state["fail"] = True
    with caplog.at_level(logging.INFO, logger="sdfast.attention"):
        out = d(q[:1], k[:1], v[:1])
    assert d.choices()[key] == "sdpa" and "'flaky' excluded" in caplog.text
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q[:1], k[:1], v[:1]))


def test_dispatcher_out_of_memory_is_raised_and_nothing_is_cached():
    """An OOM is the request's size, not a backend's fault: while measuring or after the pick it is
    raised as is, no backend is excluded, no choice cached; the next call (memory freed) measures again."""
    state = {"oom": True}

    def big(q, k, v, attn_mask, scale, upcast):
        if state["oom"]:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    d = ap.AttentionDispatcher(candidates=("big", "math"), extra_backends={"big": big}, measure_cpu=True)
    q, k, v = _qkv()
    key = d.key_for(q, k, None, False)
    with pytest.raises(torch.OutOfMemoryError):
        d(q, k, v)
    assert key not in d.choices() and key not in d.excluded()
    state["oom"] = False
    d(q, k, v)
    assert set(d.timings()[key]) == {"big", "math"} and key not in d.excluded()
    d._choice[key] = "big"
    state["oom"] = True
    with pytest.raises(torch.OutOfMemoryError):
        d(q, k, v)
    assert d.choices()[key] == "big" and key not in d.excluded()


def test_dispatcher_all_fail_raises():
    def boom(*a):
        raise RuntimeError("nope")

    d = ap.AttentionDispatcher(candidates=("boom",), extra_backends={"boom": boom}, measure_cpu=True)
    with pytest.raises(RuntimeError, match="no backend"):
        d(*_qkv())


def test_dispatcher_cpu_default_and_keys():
    d = ap.AttentionDispatcher()
    q, k, v = _qkv()
    mask = torch.ones(2, 1, 1, 13, dtype=torch.bool)
    d(q, k, v)
    d(q, k, v, attn_mask=mask, upcast=True)
    ch = d.choices()
    assert len(ch) == 2 and set(ch.values()) == {"sdpa"}
    assert {key.has_mask for key in ch} == {False, True} and {key.upcast for key in ch} == {False, True}


def test_dispatcher_forced_backend_env(monkeypatch):
    monkeypatch.setenv(ap.ENV_BACKEND, "math")
    d = ap.AttentionDispatcher()
    assert d.forced == "math"
    q, k, v = _qkv()
    torch.testing.assert_close(d(q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert d.choices() == {}  # forced: nothing measured
    assert ap.AttentionDispatcher("auto").forced is None
    monkeypatch.setenv(ap.ENV_BACKEND, "nonsense")
    with pytest.raises(ValueError, match="unknown attention backend"):
        ap.AttentionDispatcher()
    with pytest.raises(ValueError, match="unknown attention backends"):
        ap.AttentionDispatcher("math", candidates=("math", "nope"))


def test_dispatcher_capture_uses_safe_default(monkeypatch, caplog):
    calls = []

    def spy(q, k, v, attn_mask, scale, upcast):
        calls.append(1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    d = ap.AttentionDispatcher(candidates=("spy",), extra_backends={"spy": spy}, measure_cpu=True)
    monkeypatch.setattr(ap, "_capturing_or_compiling", lambda device: True)
    with caplog.at_level(logging.WARNING, logger="sdfast.attention"):
        d(*_qkv())
    assert calls == [] and d.choices() == {} and "capture" in caplog.text


def test_triton_backend_key_padding_mask():
    q, k, v = _qkv(Lk=40)
    keep = torch.ones(2, 40, dtype=torch.bool)
    keep[1, 20:] = False
    mask4 = keep[:, None, None, :]
    out = ap.AttentionDispatcher("triton")(q, k, v, attn_mask=mask4)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask4)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert ap.key_padding_from_mask(mask4, 2, 40).shape == (2, 40)
    with pytest.raises(NotImplementedError):
        ap.key_padding_from_mask(torch.zeros(2, 1, 1, 40), 2, 40)  # additive float mask
    with pytest.raises(NotImplementedError):
        ap.key_padding_from_mask(torch.ones(2, 2, 1, 40, dtype=torch.bool), 2, 40)  # per-head


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


def test_dispatcher_skips_a_much_slower_backend_after_a_probe_on_a_query_slice(caplog):
    """With a long best time, a candidate first runs on 1/64 of the queries; if that extrapolates past
    slow_factor x the best, it is excluded (logged) without a full-size run or a timing loop."""
    full_calls = []

    def slow(q, k, v, attn_mask, scale, upcast):
        if q.shape[2] == 1024:
            full_calls.append(1)
        time.sleep(q.shape[2] * 2e-5)  # 20 ms at 1024 queries
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    d = ap.AttentionDispatcher(candidates=("sdpa", "slow"), extra_backends={"slow": slow}, measure_cpu=True)
    d.probe_us = 0.0  # the CPU's SDPA is fast: probe whatever the best time
    q, k, v = _qkv(B=1, H=1, Lq=1024, Lk=16)
    with caplog.at_level(logging.INFO, logger="sdfast.attention"):
        d(q, k, v)
    key = d.key_for(q, k, None, False)
    assert d.choices()[key] == "sdpa" and "too slow" in d.excluded()[key]["slow"]
    assert not full_calls and "'slow' excluded" in caplog.text
    d2 = ap.AttentionDispatcher(candidates=("sdpa", "slow"), extra_backends={"slow": slow}, measure_cpu=True)
    d2.slow_factor = 1e9  # never too slow: measured in full
    d2(q, k, v)
    assert full_calls and "slow" in d2.timings()[key]


def test_dispatcher_measures_a_new_length_in_a_measured_bucket_on_the_near_best_backends_only(caplog):
    """Another image size gives keys whose lengths fall in the power-of-two buckets of keys already measured:
    only the backends within mate_factor of that key's best are checked and timed; another bucket, or another
    head count, measures every candidate."""
    calls = []

    def spied(name):
        def run(q, k, v, attn_mask, scale, upcast):
            calls.append((name, q.shape[2]))
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        return run

    backends = {name: spied(name) for name in ("fast", "near", "slow")}
    d = ap.AttentionDispatcher(candidates=tuple(backends), extra_backends=backends, measure_cpu=True)
    q, k, v = _qkv(B=1, H=2, Lq=64, Lk=64)  # self-attention at SD1.5's 8x8 latents
    d(q, k, v)
    key = d.key_for(q, k, None, False)
    assert set(d.timings()[key]) == {"fast", "near", "slow"}
    d._timings[key] = {"fast": 10.0, "near": 12.0, "slow": 40.0}  # CPU timings are noise: pin them (µs)
    calls.clear()
    q2, k2, v2 = _qkv(B=1, H=2, Lq=80, Lk=80)  # the same layer at 10x8 latents: the buckets of 64
    with caplog.at_level(logging.INFO, logger="sdfast.attention"):
        out = d(q2, k2, v2)
    key2 = d.key_for(q2, k2, None, False)
    assert set(d.timings()[key2]) == {"fast", "near"} and ("slow", 80) not in calls
    assert "the backends within 1.25x" in caplog.text
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q2, k2, v2))
    for other in (dict(Lq=64, Lk=77),  # cross-attention over 77 tokens: the same buckets, not a mate
                  dict(Lq=128, Lk=128),  # another bucket
                  dict(Lq=80, Lk=80, H=3)):  # another head count
        q3, k3, v3 = _qkv(**{"B": 1, "H": 2, **other})
        d(q3, k3, v3)
        assert set(d.timings()[d.key_for(q3, k3, None, False)]) == {"fast", "near", "slow"}, other


def test_dispatcher_measures_the_rest_when_the_near_best_backends_fail_at_the_new_length(caplog):
    """The bucket mate's best backend raising at the new length (say, a kernel with a length limit) is excluded
    there, and the backends left out by the narrowing are measured instead of the key failing."""
    def picky(q, k, v, attn_mask, scale, upcast):
        if q.shape[2] != 64:
            raise NotImplementedError("only 64 queries")
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    d = ap.AttentionDispatcher(candidates=("picky", "math"), extra_backends={"picky": picky}, measure_cpu=True)
    q, k, v = _qkv(B=1, H=2, Lq=64, Lk=64)
    d(q, k, v)
    d._timings[d.key_for(q, k, None, False)] = {"picky": 10.0, "math": 100.0}  # pinned: "math" is left out next
    q2, k2, v2 = _qkv(B=1, H=2, Lq=80, Lk=80)
    with caplog.at_level(logging.INFO, logger="sdfast.attention"):
        out = d(q2, k2, v2)
    key2 = d.key_for(q2, k2, None, False)
    assert d.choices()[key2] == "math" and set(d.timings()[key2]) == {"math"}
    assert "only 64 queries" in d.excluded()[key2]["picky"] and "measures ['picky']" in caplog.text
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q2, k2, v2))
    # a mate's backend excluded after it was timed there (it failed after being picked) is not kept
    d._excluded.setdefault(d.key_for(q, k, None, False), {})["picky"] = "failed after being picked"
    q3, k3, v3 = _qkv(B=1, H=2, Lq=96, Lk=96)
    with caplog.at_level(logging.INFO, logger="sdfast.attention"):
        d(q3, k3, v3)
    assert "measures ['math']" in caplog.text


@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_tf32_backend_is_chunked_fp32_math_on_the_cpu(monkeypatch, mask):
    monkeypatch.setattr(ap, "_SCORE_CHUNK_ELEMS", 2 * 3 * 37 * 7)  # 7 query rows per chunk: 6 chunks, the last short
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g) for n in (40, 37, 37))
    m = None
    if mask == "bool":
        m = torch.rand(2, 1, 40, 37, generator=g) > 0.3
        m[..., 0] = True
    elif mask == "float":
        m = torch.randn(1, 3, 1, 37, generator=g)
    out = ap._tf32_backend(q, k, v, m, 0.25, False)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(NotImplementedError, match="fp32"):
        ap._tf32_backend(q.half(), k.half(), v.half(), None, 0.25, False)


def test_tf32_is_a_candidate_only_when_allowed_for_fp32_and_checked_at_fp16_tolerance():
    from types import SimpleNamespace

    def on_cuda(dtype):  # what _candidate_names reads of a tensor
        return SimpleNamespace(shape=(1, 1, 4, 8), dtype=dtype, device=torch.device("cuda"))

    q32, q16 = on_cuda(torch.float32), on_cuda(torch.float16)
    assert "tf32" in ap.AttentionDispatcher(allow_tf32=True)._candidate_names(q32, q32)
    assert "tf32" not in ap.AttentionDispatcher(allow_tf32=True)._candidate_names(q16, q16)
    assert "tf32" not in ap.AttentionDispatcher()._candidate_names(q32, q32)
    assert ap._COMPUTE_DTYPE["tf32"] is torch.float16


@pytest.mark.parametrize("api", ["untouched", "legacy", "new"])
def test_tf32_matmul_flag_is_restored_through_the_callers_api(api):
    m = torch.backends.cuda.matmul
    saved = m.fp32_precision
    try:
        if api == "legacy":
            m.allow_tf32 = False
        elif api == "new":
            m.fp32_precision = "ieee"
        before = m.fp32_precision
        with ap._tf32_matmuls():
            assert m.fp32_precision == "tf32"
        # "none" (never set) reads back as "ieee" once the legacy flag was written: the same setting (no TF32)
        assert m.fp32_precision == before or (before, m.fp32_precision) == ("none", "ieee")
        if api != "new":
            assert m.allow_tf32 is False
    finally:
        m.fp32_precision = saved


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
        assert unet_procs == {id(ap.default_dispatcher())}
        if tf32:
            assert state.vae_dispatcher.allow_tf32 and vae_procs == {id(state.vae_dispatcher)}
        else:
            assert state.vae_dispatcher is None and vae_procs == unet_procs
