"""Issue 34: few-step use (LCM / LCM-LoRA, SDXL-Turbo, SDXL-Lightning): 1 to 8 steps, guidance_scale 0 or 1
(no CFG: the UNet runs once per image per step), and the schedulers those models need (``sdfast.schedulers``:
``lcm``, ``euler_a_trailing``, ``euler_trailing``), on unoptimized tiny SD 1.x and SDXL engines. Every scheduler
also runs on the optimized tiny engine (``tests/test_txt2img.py``) and matches stock on the GPU
(``tests/test_schedulers_gpu.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sdfast
from sdfast.errors import InvalidRequestError

FEW_STEP = ("lcm", "euler_a_trailing", "euler_trailing")


@pytest.fixture(scope="module")
def engines():
    return {arch: sdfast.load(f"random:{arch}", optimize=False) for arch in ("tiny", "tiny-xl")}


@pytest.mark.parametrize("name", ["euler_a_trailing", "euler_trailing"])
@pytest.mark.parametrize("arch", ["tiny", "tiny-xl"])
def test_trailing_spacing_starts_at_the_last_training_timestep(engines, arch, name):
    """What a 1-4 step schedule needs (Lin et al. 2023): the model's own spacing ("leading" for SDXL) would start a
    4-step schedule at timestep 751."""
    scheduler = engines[arch].scheduler_for(name)
    assert scheduler.config.timestep_spacing == "trailing"
    assert type(scheduler).__name__ == {"euler_a_trailing": "EulerAncestralDiscreteScheduler",
                                        "euler_trailing": "EulerDiscreteScheduler"}[name]
    scheduler.set_timesteps(4)
    assert scheduler.timesteps.tolist() == [999, 749, 499, 249]
    scheduler.set_timesteps(1)
    assert scheduler.timesteps.tolist() == [999]


@pytest.mark.parametrize("guidance", [0.0, 1.0, 1.5])
@pytest.mark.parametrize("name", FEW_STEP)
@pytest.mark.parametrize("arch", ["tiny", "tiny-xl"])
def test_few_steps_without_and_with_cfg(engines, arch, name, guidance):
    """1, 4 and 8 steps run; guidance 0 and 1 run the UNet on one latent per image (no CFG), 1.5 on two."""
    engine = engines[arch]
    batches = []
    hook = engine.pipe.unet.register_forward_pre_hook(lambda m, args: batches.append(args[0].shape[0]))
    try:
        for steps in (1, 4, 8) if guidance == 0 else (4,):
            batches.clear()
            image = engine.txt2img("a cat", seed=0, num_inference_steps=steps, guidance_scale=guidance,
                                   scheduler=name, height=32, width=32)[0]
            assert image.size == (32, 32) and np.isfinite(np.asarray(image, np.float32)).all()
            assert batches == [1 if guidance <= 1 else 2] * steps, (steps, batches)
    finally:
        hook.remove()


def test_few_steps_with_deepcache(engines):
    """The tiers combine: 4 steps at cache_interval 2 run steps 0 and 2 full."""
    engine = engines["tiny-xl"]
    mids = []
    hook = engine.pipe.unet.mid_block.register_forward_hook(lambda *a: mids.append(1))
    try:
        engine.txt2img("a cat", seed=0, num_inference_steps=4, guidance_scale=0.0, scheduler="euler_a_trailing",
                       cache_interval=2, height=32, width=32)
    finally:
        hook.remove()
    assert len(mids) == 2 and engine.last_deep_cache["shallow_steps"] == 2


def test_lcm_step_limit_is_a_clear_error(engines):
    with pytest.raises(InvalidRequestError, match="at most 50") as e:
        engines["tiny"].txt2img("a cat", num_inference_steps=51, scheduler="lcm")
    assert e.value.field == "num_inference_steps"


def test_same_images_as_diffusers_at_few_steps(engines):
    """The engine's few-step image is stock diffusers' with the same scheduler (built as diffusers documents it,
    ``from_config`` of the model's config with trailing spacing)."""
    import diffusers

    engine = engines["tiny-xl"]
    ours = engine.txt2img("a cat", seed=3, num_inference_steps=2, guidance_scale=0.0, scheduler="euler_a_trailing",
                          height=32, width=32)[0]
    pipe = engine.pipe
    default = pipe.scheduler
    pipe.scheduler = diffusers.EulerAncestralDiscreteScheduler.from_config(default.config,
                                                                           timestep_spacing="trailing")
    try:
        stock = pipe("a cat", num_inference_steps=2, guidance_scale=0.0, height=32, width=32,
                     generator=[torch.Generator("cpu").manual_seed(3)]).images[0]
    finally:
        pipe.scheduler = default
    assert np.array_equal(np.asarray(ours), np.asarray(stock))
