"""Issue 10 (CPU, tiny architectures), continued from tests/test_user_cases.py: LoRA (loaded, fused, scaled,
unloaded; on fused Q/K/V projections), the SD 2 and SDXL variants and single-file checkpoints give stock diffusers'
image on the optimized engine (or a clear error).
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

import sdfast
from sdfast.config import OptimizeConfig
from sdfast.errors import ModelNotFoundError
from tests.user_cases import KW, LONG, TOL, _diff, _FakeGraphs, _pair, _unet_calls, warm_tiny_pair


@pytest.fixture(scope="module")
def tiny():
    """(stock, fast, warm-up image): every case runs on a warmed-up optimized engine."""
    return warm_tiny_pair()


@pytest.fixture(scope="module")
def xl():
    """(stock, fast) tiny-xl engines, shared by the SDXL cases (each leaves them as it found them)."""
    return _pair("tiny-xl")


# --- LoRA ----------------------------------------------------------------------------------------


def _lora_state_dict(unet, targets: list[str], rank: int = 4, strength: float = 0.5, seed: int = 0) -> dict:
    """A rank-``rank`` LoRA for ``unet`` in the PEFT format diffusers' loaders take (``unet.<module>.lora_A/B``),
    on every Linear/Conv2d whose name ends with one of ``targets``. A and B are random (B is not zero, so the
    LoRA has an effect): ``B @ A`` changes each layer's output by about ``strength`` times its input's scale."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, m in unet.named_modules():
        if not any(name == t or name.endswith("." + t) for t in targets):
            continue
        if isinstance(m, torch.nn.Linear):
            a, b = (rank, m.in_features), (m.out_features, rank)
        elif isinstance(m, torch.nn.Conv2d):
            a, b = (rank, m.in_channels, *m.kernel_size), (m.out_channels, rank, 1, 1)
        else:
            continue
        fan_in = int(np.prod(a[1:]))
        sd[f"unet.{name}.lora_A.weight"] = torch.randn(a, generator=g) / fan_in**0.5
        sd[f"unet.{name}.lora_B.weight"] = torch.randn(b, generator=g) * strength / rank**0.5
    assert sd, targets
    return sd


@pytest.fixture
def lora_pair(tiny):
    """The module's engines; afterwards every LoRA is unloaded and the UNet weights are restored exactly
    (a LoRA fused and then unloaded stays baked into the weights, as diffusers documents)."""
    saved = [{k: v.clone() for k, v in engine.pipe.unet.state_dict().items()} for engine in tiny[:2]]
    yield tiny
    for engine, weights in zip(tiny[:2], saved):
        engine.pipe.unload_lora_weights()
        engine.pipe.unet.load_state_dict(weights)  # in place: the fused projections' views stay views


def _unet_out(engine, inputs) -> torch.Tensor:
    with torch.no_grad():
        return engine.pipe.unet(**inputs, return_dict=False)[0].float()


@pytest.fixture(scope="module")
def fused_qkv():
    """An optimized tiny engine with Q/K/V (self-attention) and K/V (cross-attention) projections fused."""
    return sdfast.load("random:tiny", optimize=OptimizeConfig(fuse_qkv=True))


@pytest.mark.parametrize("target", ["to_q", "to_k", "to_v"])
def test_lora_on_each_of_q_k_v_is_applied_by_the_fused_qkv_attention(lora_pair, fused_qkv, target):
    """With ``fuse_qkv`` the attention runs one GEMM on ``to_qkv`` / ``to_kv``: a LoRA on to_q, to_k or to_v
    alone must still change the output exactly as in stock diffusers, loaded (unfused) and fused."""
    stock, fast = lora_pair[0], fused_qkv
    attn = fast.pipe.unet.down_blocks[0].attentions[0].transformer_blocks[0]
    assert hasattr(attn.attn1, "to_qkv") and hasattr(attn.attn2, "to_kv")
    saved = {k: v.clone() for k, v in fast.pipe.unet.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    inputs = dict(sample=torch.randn(2, 4, 5, 3, generator=g), timestep=torch.tensor(500),
                  encoder_hidden_states=torch.randn(2, 77, 32, generator=g))
    base = _unet_out(stock, inputs)
    lora = _lora_state_dict(stock.pipe.unet, [target], strength=1.0)
    for engine in (stock, fast):
        engine.pipe.load_lora_weights(lora, adapter_name=target)
    for state in ("loaded", "fused"):
        if state == "fused":
            for engine in (stock, fast):
                engine.pipe.fuse_lora()
        ours, ref = _unet_out(fast, inputs), _unet_out(stock, inputs)
        assert (ref - base).abs().max() > 0.05, "the test LoRA is too weak to be seen"
        torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3, msg=f"LoRA on {target} ({state})")
    fast.pipe.unload_lora_weights()
    fast.pipe.unet.load_state_dict(saved)


@pytest.mark.parametrize("cross", [False, True])
def test_projection_weight_replaced_after_fusing_is_used_not_the_stale_fused_copy(cross):
    """``param.data = ...`` (or a safe LoRA merge) gives a projection new storage: the fused Q/K/V (K/V)
    GEMM would still read the old weights, so the optimized attention must run the projections apart."""
    import copy

    from diffusers.models.attention_processor import Attention

    from sdfast.passes import attention

    torch.manual_seed(0)
    ref = Attention(32, cross_attention_dim=16 if cross else None, heads=4, dim_head=8).eval()
    ours = copy.deepcopy(ref)
    assert attention.apply(ours) == 1 and hasattr(ours, "to_kv" if cross else "to_qkv")
    x, ctx = torch.randn(2, 6, 32), (torch.randn(2, 5, 16) if cross else None)
    for name in ("to_k", "to_v") if cross else ("to_q", "to_k", "to_v"):
        new = torch.randn_like(getattr(ref, name).weight)
        getattr(ref, name).weight.data = new.clone()
        getattr(ours, name).weight.data = new.clone()
        with torch.no_grad():
            torch.testing.assert_close(ours(x, ctx), ref(x, ctx), atol=1e-5, rtol=1e-5, msg=name)


def test_lora_load_fuse_unfuse_scale_unload_after_warm_up_matches_stock(lora_pair):
    stock, fast, base = lora_pair
    lora = _lora_state_dict(stock.pipe.unet, ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out",
                                              "ff.net.0.proj", "ff.net.2", "conv1", "conv2", "time_emb_proj"])
    steps = [
        ("load", lambda p: p.load_lora_weights(lora, adapter_name="style")),
        ("fuse", lambda p: p.fuse_lora()),
        ("unfuse", lambda p: p.unfuse_lora()),
        ("scale 0.5", lambda p: p.set_adapters(["style"], adapter_weights=[0.5])),
        ("unload", lambda p: p.unload_lora_weights()),
    ]
    images = {}
    for name, step in steps:
        for engine in (stock, fast):
            step(engine.pipe)
        images[name] = fast.txt2img("a cat", seed=0, **KW)  # base: the warm-up image
        assert _diff(images[name], stock.txt2img("a cat", seed=0, **KW)) <= TOL, name
    assert _diff(images["load"], base) > 5
    assert _diff(images["fuse"], images["load"]) <= TOL and _diff(images["unfuse"], images["load"]) <= TOL
    assert _diff(images["scale 0.5"], images["load"]) > TOL
    assert _diff(images["unload"], base) <= 1


def test_lora_fuse_unfuse_scale_disable_each_change_the_cuda_graph_weights_state(tiny):
    """CUDA graphs bake the LoRA layers' Python branches (merged? which adapters? what scale?) in at
    capture: each LoRA state change must be seen by ``WeightsWatch``, so ``GraphCache.check`` drops the
    stale graphs (the GPU twin, test_gpu_lora_..., checks the images)."""
    from sdfast.runtime.cuda_graphs import WeightsWatch

    _, fast, _ = tiny
    pipe = fast.pipe
    lora = _lora_state_dict(pipe.unet, ["to_q", "to_v"])
    watch = WeightsWatch(pipe.unet)
    first = watch.state
    try:
        for i, step in enumerate((
            lambda: pipe.load_lora_weights(lora, adapter_name="style"),
            lambda: pipe.set_adapters(["style"], adapter_weights=[0.5]),
            lambda: pipe.fuse_lora(),
            lambda: pipe.unfuse_lora(),
            lambda: pipe.disable_lora(),
            lambda: pipe.enable_lora(),
        )):
            step()
            assert watch.changed(), f"LoRA step {i} left the CUDA-graph weights state unchanged"
            assert not watch.changed()  # the new state is the reference now
    finally:
        pipe.unload_lora_weights()
    assert watch.changed() and watch.state[1] == first[1]  # the original storages again


def test_hooks_on_q_k_v_run_with_fused_qkv(fused_qkv):
    """A hooked projection (user hooks, the calibration of quantize_/sparsify_) runs itself instead of the
    fused GEMM, so its hooks fire, as they do without fuse_qkv."""
    unet = fused_qkv.pipe.unet
    calls = []
    handles = []
    for name, m in unet.named_modules():
        if name.endswith("attn1.to_q"):
            handles.append(m.register_forward_hook(lambda mod, a, out: calls.append("q")))
        elif name.endswith("attn2.to_k"):
            handles.append(m.register_forward_pre_hook(lambda mod, a: calls.append("k")))
    try:
        fused_qkv.txt2img("a cat", seed=0, **dict(KW, num_inference_steps=1))
    finally:
        for h in handles:
            h.remove()
    assert calls.count("q") >= 4 and calls.count("k") >= 4, calls


# --- model variants ------------------------------------------------------------------------------


def test_sd2_like_v_prediction_upcast_attention_matches_stock():
    stock, fast = _pair("tiny-v")
    pipe = fast.pipe
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    assert pipe.unet.config.upcast_attention and pipe.unet.config.use_linear_projection
    assert pipe.tokenizer.pad_token_id == 0  # SD 2.x pads with "!"
    for prompt in ("a cat", LONG):
        a = fast.txt2img(prompt, seed=16, **KW)
        assert _diff(a, stock.txt2img(prompt, seed=16, **KW)) <= TOL, prompt[:20]


def test_sdxl_like_two_encoders_pooled_time_ids_matches_stock(xl):
    stock, fast = xl
    calls, hook = _unet_calls(fast)
    try:
        a = fast.txt2img("a cat", seed=17, **KW)
    finally:
        hook.remove()
    assert calls[0] == (2, 77, {"text_embeds": (2, 48), "time_ids": (2, 6)})
    assert _diff(a, stock.txt2img("a cat", seed=17, **KW)) <= TOL
    for negative in (None, "blurry"):  # zeroed negative embeddings / an encoded one, both chunked
        a = fast.txt2img(LONG, negative_prompt=negative, seed=18, **KW)
        assert a[0].info["prompt_chunks"] == "3"
        assert _diff(a, stock.txt2img(LONG, negative_prompt=negative, seed=18, **KW)) <= TOL, negative


@pytest.mark.parametrize("arch", ["sd15", "sd21", "sdxl", "tiny", "tiny-v", "tiny-xl"])
def test_schedulers_built_from_an_architecture_take_its_published_config(arch):
    # SD 1.5, 2.1 and SDXL base publish clip_sample / set_alpha_to_one false and skip_prk_steps true; a config
    # without them gives DDIM its class defaults (x0 clipped to [-1, 1], the SD latents' range is about +-4)
    # and PNDM its PRK warm-up steps.
    from sdfast.architectures import get_architecture
    from sdfast.schedulers import make_scheduler

    base = get_architecture(arch)["scheduler"]
    ddim, pndm = make_scheduler("ddim", base).config, make_scheduler("pndm", base).config
    assert (ddim.clip_sample, ddim.set_alpha_to_one, pndm.skip_prk_steps) == (False, False, True)


def test_sdxl_like_ddim_matches_stock_step_by_step(xl):
    # With DDIM's clip_sample (the class default, which tiny-xl's Euler config used to leave on) every step
    # grew the fp32 rounding difference of the optimized kernels about 2x (1e-5 -> 3e-4 in 6 steps), and the
    # image differed; SDXL fp16 on the GPU ended 16-19 dB from stock.
    stock, fast = xl
    seen = {}
    for tag, engine in (("stock", stock), ("fast", fast)):
        sched, outputs = engine.scheduler_for("ddim"), seen.setdefault(tag, [])
        step = sched.step

        def recording_step(model_output, timestep, sample, *args, _step=step, _out=outputs, **kwargs):
            _out.append(model_output.detach().clone())
            return _step(model_output, timestep, sample, *args, **kwargs)

        sched.step = recording_step  # this instance only
        try:
            seen[tag + " image"] = engine.txt2img("a teapot", seed=11, **dict(KW, num_inference_steps=6))
        finally:
            del sched.step
    assert len(seen["fast"]) == len(seen["stock"]) == 6
    drift = [float((a - b).abs().max()) for a, b in zip(seen["fast"], seen["stock"])]
    assert max(drift) <= 5e-5, drift
    assert _diff(seen["fast image"], seen["stock image"]) == 0


def test_sdxl_vae_force_upcast_is_kept_in_fp32_when_the_pipeline_is_fp16():
    engine = sdfast.load("random:tiny-xl", dtype=torch.float16, device="cpu")
    assert engine.pipe.vae.config.force_upcast
    assert engine.pipe.unet.dtype == torch.float16 and engine.pipe.vae.dtype == torch.float32
    assert engine.pipe._sdfast.vae_upcast
    sd1 = sdfast.load("random:tiny", dtype=torch.float16, device="cpu")  # SD1's VAE does not ask for it
    assert sd1.pipe.vae.dtype == torch.float16 and not sd1.pipe._sdfast.vae_upcast


def test_a_graphed_sdxl_pipeline_batches_both_encoders_with_pooled_embeddings(xl, monkeypatch):
    """SDXL: each of the two text encoders runs once, on prompt + negative prompt (2 prompts x 2 images: one batch of
    4 each), and the images are the ones diffusers' own encoding gives, up to the batched encoders' rounding."""
    _, fast = xl
    kw = dict(KW, num_images_per_prompt=2, num_inference_steps=1)  # the encoders' batching: one step shows it
    ref = fast.txt2img(["a cat", "a dog"], negative_prompt="blurry", seed=5, **kw)
    batches = {"text_encoder": [], "text_encoder_2": []}
    hooks = [getattr(fast.pipe, n).register_forward_pre_hook(lambda m, a, n=n: batches[n].append(a[0].shape[0]))
             for n in batches]
    monkeypatch.setattr(fast.pipe._sdfast, "graphs", _FakeGraphs())
    try:
        img = fast.txt2img(["a cat", "a dog"], negative_prompt="blurry", seed=5, **kw)
    finally:
        for h in hooks:
            h.remove()
    assert batches == {"text_encoder": [4], "text_encoder_2": [4]}
    assert len(img) == 4 and _diff(img, ref) <= 1


# --- single-file checkpoints ---------------------------------------------------------------------


@pytest.fixture
def offline(monkeypatch):
    """No network: HF_HUB_OFFLINE and every socket connection raising."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access during an offline load: {args[:2]}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("arch, family", [("tiny", "sd1"), ("tiny-v", "sd2"), ("tiny-xl", "sdxl")])
def test_single_file_checkpoint_loads_offline_with_shipped_configs(tmp_path, offline, arch, family):
    from safetensors.torch import save_file

    from tests.ldm_checkpoint import original_state_dict

    source = sdfast.load(f"random:{arch}", optimize=False, seed=3)
    path = tmp_path / f"{arch}.safetensors"
    save_file(original_state_dict(source.pipe, family), str(path))
    loaded = sdfast.load(str(path), optimize=False)
    assert type(loaded.pipe) is type(source.pipe)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        if getattr(source.pipe, name, None) is None:
            continue
        ours, ref = getattr(loaded.pipe, name).state_dict(), getattr(source.pipe, name).state_dict()
        assert ours.keys() == ref.keys(), name
        assert all(torch.equal(ours[k], ref[k]) for k in ref), name
    assert loaded.pipe.scheduler.config.prediction_type == source.pipe.scheduler.config.prediction_type
    assert loaded.pipe.unet.config.upcast_attention == source.pipe.unet.config.upcast_attention
    if arch == "tiny":
        assert _diff(loaded.txt2img("a cat", seed=19, **KW), source.txt2img("a cat", seed=19, **KW)) == 0


def test_single_file_that_is_not_sd_is_a_clear_error(tmp_path, offline):
    from safetensors.torch import save_file

    save_file({"encoder.weight": torch.randn(4, 4)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ModelNotFoundError, match="not a Stable Diffusion checkpoint"):
        sdfast.load(str(tmp_path / "other.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"\x00not a safetensors file")
    with pytest.raises(ModelNotFoundError, match="cannot be read"):
        sdfast.load(str(tmp_path / "junk.safetensors"))
    (tmp_path / "model.ckpt").write_bytes(b"pickle")
    with pytest.raises(ModelNotFoundError, match="only .safetensors"):
        sdfast.load(str(tmp_path / "model.ckpt"))
    odd = {"cond_stage_model.transformer.text_model.final_layer_norm.weight": torch.ones(4),
           "model.diffusion_model.input_blocks.0.0.weight": torch.randn(48, 4, 3, 3)}
    save_file(odd, str(tmp_path / "odd.safetensors"))
    with pytest.raises(ModelNotFoundError, match="48 conv_in channels.*configs only for sd15 \\(320\\), tiny \\(32\\)"):
        sdfast.load(str(tmp_path / "odd.safetensors"))


def test_incomplete_checkpoint_or_folder_is_a_clear_error(tmp_path, offline):
    """Weights missing from a single file (diffusers leaves them on the meta device) or a component folder
    without its weights file: a ModelNotFoundError that says so, not an unrelated error."""
    from safetensors.torch import save_file

    from tests.ldm_checkpoint import original_state_dict

    source = sdfast.load("random:tiny", optimize=False, seed=3)
    sd = {k: v for k, v in original_state_dict(source.pipe, "sd1").items() if not k.startswith("model.diffusion_model.out.")}
    save_file(sd, str(tmp_path / "partial.safetensors"))
    with pytest.raises(ModelNotFoundError, match=r"is incomplete: weight tensors of the tiny architecture are missing"):
        sdfast.load(str(tmp_path / "partial.safetensors"), optimize=False)
    source.pipe.save_pretrained(tmp_path / "folder")
    for f in (tmp_path / "folder" / "unet").glob("diffusion_pytorch_model*"):
        f.unlink()
    with pytest.raises(ModelNotFoundError, match="is incomplete"):
        sdfast.load(str(tmp_path / "folder"), optimize=False)
