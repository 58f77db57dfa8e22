"""The ControlNets beside the UNet's down blocks on the GPU (``sdfast.runtime.control_overlap``): the engine's images
are the same bit for bit with the overlap on and off (one and two ControlNets, txt2img, img2img, a DeepCache call,
another resolution), the UNet's step with residuals is captured as two graphs, nothing is left pending after a
call, a user's own ``pipe(...)`` stays on one stream with the same image, and ``unoptimize`` restores the
ControlNet's forward."""

import gc

import numpy as np
import pytest
import torch

import sdfast
from sdfast.runtime.control_overlap import ControlNetOnSide
from tests.test_controlnet_gpu import _control_image as _control

pytestmark = pytest.mark.gpu

PROMPT = "a photo of an astronaut riding a horse on mars"


def _px(img):
    return np.asarray(img)


def _images(engine, side, nets):
    """txt2img, another size, img2img and a DeepCache call of ``engine``: the images in that order."""
    control = [_control(side, i) for i in range(nets)]
    small = [c.resize((side // 2, side // 2)) for c in control]
    kw = dict(num_inference_steps=6, guidance_scale=7.5, seed=0)
    one = control[0] if nets == 1 else control
    out = [engine.txt2img(PROMPT, control_image=one, **kw)[0],
           engine.txt2img(PROMPT, control_image=small[0] if nets == 1 else small, height=side // 2, width=side // 2,
                          **kw)[0],
           engine.img2img(control[0].rotate(90), PROMPT, control_image=one, strength=0.6, **kw)[0]]
    if nets == 1:
        out.append(engine.txt2img(PROMPT, control_image=one, cache_interval=2, **kw)[0])
    # a user's own pipe(...): not armed (the ControlNets on the UNet's stream), the UNet's graphs split all the same
    out.append(engine.pipe(PROMPT, image=one, num_inference_steps=6, guidance_scale=7.5,
                           generator=[torch.Generator("cpu").manual_seed(0)]).images[0])
    return out


@pytest.mark.parametrize("model, controlnet, side", [
    ("random:sd15", ["random:controlnet-sd15"], 512),
    ("random:sd15", ["random:controlnet-sd15", "random:controlnet-sd15"], 512),
    ("random:sdxl", ["random:controlnet-sdxl"], 1024),
])
def test_the_same_images_with_the_overlap_on_and_off(model, controlnet, side):
    nets = len(controlnet)
    spec = controlnet[0] if nets == 1 else controlnet
    off = sdfast.load(model, controlnet=spec, optimize=sdfast.OptimizeConfig(controlnet_overlap=False))
    ref = _images(off, side, nets)
    assert off.pipe._sdfast.control_overlap is None
    del off
    gc.collect()
    torch.cuda.empty_cache()

    on = sdfast.load(model, controlnet=spec)
    overlap = on.pipe._sdfast.control_overlap
    control = _control(side) if nets == 1 else [_control(side, i) for i in range(nets)]
    before = overlap.runs
    on.txt2img(PROMPT, control_image=control, num_inference_steps=3)
    assert overlap.runs - before == len(on.pipe.scheduler.timesteps)  # every step's ControlNets on the side stream
    ours = _images(on, side, nets)
    before = overlap.runs
    on.pipe(PROMPT, image=control, num_inference_steps=2)
    assert overlap.runs == before  # a user's own pipe(...): not armed
    stats = on.pipe._sdfast.graphs.stats()
    assert overlap is not None and not overlap.pending and not overlap.armed
    assert stats["unet"]["split_captures"] >= 2 and not stats["unet"]["failures"]  # two sizes (and img2img's)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.size == b.size and np.array_equal(_px(a), _px(b)), f"image {i} differs"
    sdfast.unoptimize(on.pipe)
    assert not isinstance(on.pipe.controlnet.__dict__.get("forward"), ControlNetOnSide)
    del on
    gc.collect()
    torch.cuda.empty_cache()
