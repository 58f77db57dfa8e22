"""Issue 34 (GPU): DeepCache inside the CUDA-graph runtime (``sdfast.runtime.deep_cache``, ``runtime.cuda_graphs``).

A full-step and a shallow-step graph per input signature, reused across calls; the cached deep feature outside
the graphs' shared pool (so another graph's replay cannot overwrite it) and the graphed images equal to the same
engine's eager DeepCache images; a new resolution (new graphs, a second buffer); LoRA after warm-up (the weights
watch drops and recaptures the DeepCache graphs too); no host sync inside a DeepCache UNet step; SDXL and
ControlNet. Images are compared as PSNR against an engine with the same passes but ``cuda_graphs=False`` (the same
kernels, eager) and against stock diffusers with DeepCache (``optimize=False``: fp16 rounding apart).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import sdfast
from sdfast.errors import InvalidRequestError
from sdfast.runtime import deep_cache

pytestmark = pytest.mark.gpu

PROMPT = "a photo of an astronaut riding a horse on mars"
SAME = 40.0  # dB: graphed vs eager with the same kernels (the graph replays them)
PARITY = 35.0  # dB: sdfast vs stock diffusers, both with DeepCache (tests/test_engine_gpu.py's bar)


def psnr(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = np.mean((a - b) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _free():
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def sd15():
    """(graphed, eager with the same passes, stock) SD1.5 engines on the same seeded weights."""
    engines = (sdfast.load("random:sd15"), sdfast.load("random:sd15", optimize=sdfast.OptimizeConfig(cuda_graphs=False)),
               sdfast.load("random:sd15", optimize=False))
    yield engines
    del engines
    _free()


def _runner(engine):
    return engine.pipe._sdfast.graphs.runners["unet"]


def _deep_cache_keys(engine) -> list:
    return [key for key in _runner(engine).graphs if deep_cache._uses_deep_cache(key[1])]


def _modes(keys, shape=None, branch=0) -> list[str]:
    """The DeepCache modes of graph signatures ``keys`` at skip branch ``branch`` (all: None), with a tensor of
    ``shape`` only when given."""
    def steps(key):
        if shape is not None and not any(leaf[0] == "T" and leaf[1] == shape for leaf in key[1]):
            return []
        return [leaf[2].mode for leaf in key[1] if leaf[0] == "V" and leaf[1] is deep_cache.Step
                and branch in (None, leaf[2].branch)]

    return sorted(mode for key in keys for mode in steps(key))


def test_a_full_and_a_shallow_graph_per_signature_reused_across_calls(sd15):
    fast, eager, stock = sd15
    kw = dict(seed=0, num_inference_steps=10, scheduler="euler", cache_interval=3)
    first = fast.txt2img(PROMPT, **kw)[0]
    assert fast.last_deep_cache == {"cache_interval": 3, "cache_branch": 0, "full_steps": 4, "shallow_steps": 6}
    keys = _deep_cache_keys(fast)
    assert _modes(keys) == ["full", "shallow"]
    runner = _runner(fast)
    captures, replays = runner.stats.captures, runner.stats.replays
    again = fast.txt2img(PROMPT, **kw)[0]
    assert runner.stats.captures == captures and runner.stats.replays == replays + 10  # every step a replay
    assert psnr(first, again) >= 50
    exact = fast.txt2img(PROMPT, **{**kw, "cache_interval": 1})[0]
    p_eager, p_stock = psnr(first, eager.txt2img(PROMPT, **kw)[0]), psnr(first, stock.txt2img(PROMPT, **kw)[0])
    print(f"sd15 DeepCache 3: vs eager {p_eager:.1f} dB, vs stock DeepCache {p_stock:.1f} dB, "
          f"vs exact {psnr(first, exact):.1f} dB")
    assert p_eager >= SAME and p_stock >= PARITY
    assert psnr(first, exact) < float("inf")  # it is an approximation


def test_the_cache_is_outside_the_graph_pool_and_survives_other_replays(sd15):
    """The buffer's memory segment is not in the graphs' shared pool; other graphs (another size, the exact UNet,
    the VAE, the text encoders) replayed between two DeepCache calls leave its image unchanged."""
    fast, _, _ = sd15
    kw = dict(seed=1, num_inference_steps=6, scheduler="euler", cache_interval=2, cache_branch=1)
    a = fast.txt2img(PROMPT, **kw)[0]
    split = deep_cache.installed(fast.pipe.unet)
    pool = tuple(fast.pipe._sdfast.graphs.pool)
    for buf in split.buffers.values():
        seg = next((s for s in torch.cuda.memory_snapshot()
                    if s["address"] <= buf.data_ptr() < s["address"] + s["total_size"]), None)
        assert seg is not None
        if "segment_pool_id" in seg:
            assert tuple(seg["segment_pool_id"]) != pool, seg["segment_pool_id"]
    fast.txt2img(PROMPT, seed=2, num_inference_steps=3, height=384, width=640)  # exact graphs at another size
    fast.txt2img(PROMPT, seed=2, num_inference_steps=3, height=384, width=384, cache_interval=2)
    b = fast.txt2img(PROMPT, **kw)[0]
    assert psnr(a, b) >= 50


def test_a_new_resolution_gets_its_graphs_and_buffer(sd15):
    fast, eager, _ = sd15
    kw = dict(seed=3, num_inference_steps=6, scheduler="euler", cache_interval=2)
    fast.txt2img(PROMPT, **kw, height=512, width=512)
    assert _modes(_deep_cache_keys(fast), (2, 4, 64, 64)) == ["full", "shallow"]
    image = fast.txt2img(PROMPT, **kw, height=448, width=576)[0]
    assert image.size == (576, 448)
    assert _modes(_deep_cache_keys(fast), (2, 4, 56, 72)) == ["full", "shallow"]  # CFG: batch 2, latents 56 x 72
    split = deep_cache.installed(fast.pipe.unet)
    assert {key[1] for key in split.buffers} >= {(2, 4, 56, 72)}
    assert psnr(image, eager.txt2img(PROMPT, **kw, height=448, width=576)[0]) >= SAME


def test_lora_after_warm_up_recaptures_the_deep_cache_graphs(sd15):
    from tests.test_user_cases_models import _lora_state_dict

    fast, eager, _ = sd15
    kw = dict(seed=4, num_inference_steps=6, scheduler="euler", cache_interval=2, height=384, width=384)
    base = fast.txt2img(PROMPT, **kw)[0]
    runner = _runner(fast)
    captures = runner.stats.captures
    saved = [{k: v.detach().clone() for k, v in e.pipe.unet.state_dict().items()} for e in (fast, eager)]
    lora = _lora_state_dict(eager.pipe.unet, ["to_q", "to_k", "to_v", "to_out.0"], strength=0.3)
    try:
        for e in (fast, eager):
            e.pipe.load_lora_weights(lora, adapter_name="style")
        with_lora = fast.txt2img(PROMPT, **kw)[0]
        assert runner.stats.captures >= captures + 2  # the full and the shallow graph again
        assert _modes(_deep_cache_keys(fast)) == ["full", "shallow"]
        assert psnr(with_lora, base) < 30  # the LoRA shows
        assert psnr(with_lora, eager.txt2img(PROMPT, **kw)[0]) >= SAME
    finally:
        for e, weights in zip((fast, eager), saved):
            e.pipe.unload_lora_weights()
            e.pipe.unet.load_state_dict(weights)
    assert psnr(fast.txt2img(PROMPT, **kw)[0], base) >= 45


def test_no_host_sync_inside_a_deep_cache_step(sd15):
    """On a warm engine, every UNet call of a DeepCache image (the host's mode choice, the input copies, the
    replay of the full or the shallow graph) runs with CUDA's sync debug mode set to error."""
    fast, _, _ = sd15
    kw = dict(seed=5, num_inference_steps=6, scheduler="euler", cache_interval=3)
    fast.txt2img(PROMPT, **kw)  # warm: graphs captured (capture itself synchronizes)
    unet = fast.pipe.unet
    pre = unet.register_forward_pre_hook(lambda *a: torch.cuda.set_sync_debug_mode("error"))
    post = unet.register_forward_hook(lambda *a: torch.cuda.set_sync_debug_mode("default"))
    try:
        fast.txt2img(PROMPT, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        pre.remove()
        post.remove()
    assert fast.last_deep_cache["full_steps"] == 2


def test_sdxl_deep_cache_graphs_and_parity():
    fast = sdfast.load("random:sdxl")
    eager = sdfast.load("random:sdxl", optimize=sdfast.OptimizeConfig(cuda_graphs=False))
    try:
        for branch in (0, 4, 8):  # U_2's last ResNet; U_1 entered at its layer 1; everything but the mid block
            kw = dict(seed=6, num_inference_steps=8, cache_interval=2, cache_branch=branch)
            a = fast.txt2img(PROMPT, **kw)[0]
            assert a.size == (1024, 1024) and fast.last_deep_cache["full_steps"] == 4
            p = psnr(a, eager.txt2img(PROMPT, **kw)[0])
            print(f"sdxl DeepCache 2, branch {branch}: vs eager {p:.1f} dB")
            assert p >= SAME
        assert _modes(_deep_cache_keys(fast), branch=None) == ["full"] * 3 + ["shallow"] * 3
        with pytest.raises(InvalidRequestError, match="cache_branch"):
            fast.txt2img(PROMPT, num_inference_steps=2, cache_interval=2, cache_branch=9)  # SDXL: branches 0-8
    finally:
        del fast, eager
        _free()


def test_controlnet_with_deep_cache_graphed_matches_eager():
    fast = sdfast.load("random:sd15", controlnet="random:controlnet-sd15")
    eager = sdfast.load("random:sd15", controlnet="random:controlnet-sd15",
                        optimize=sdfast.OptimizeConfig(cuda_graphs=False))
    try:
        from benchmarks.bench_txt2img import control_image

        kw = dict(seed=7, num_inference_steps=6, scheduler="euler", cache_interval=2,
                  control_image=control_image(512, 512))
        a = fast.txt2img(PROMPT, **kw)[0]
        assert fast.last_deep_cache["full_steps"] == 3
        assert psnr(a, eager.txt2img(PROMPT, **kw)[0]) >= SAME
        assert _modes(_deep_cache_keys(fast)) == ["full", "shallow"]
    finally:
        del fast, eager
        _free()
