"""ControlNet on the GPU, on the real architectures (random weights): the optimized engine (the ControlNets through
the pass table and in their own CUDA graphs, the control image embedded once per call, the UNet step that takes their residuals captured) gives stock
diffusers' ControlNet images, for one and two ControlNets, txt2img and img2img; another conditioning scale replays
the same graphs."""

import gc

import numpy as np
import pytest
import torch
from PIL import Image

import sdfast
from benchmarks.bench_txt2img import psnr

pytestmark = pytest.mark.gpu

PROMPT = "a photo of an astronaut riding a horse on mars"


def _control_image(side, seed=0):
    """A canny-like control image: white strokes on black."""
    rng = np.random.default_rng(seed)
    img = np.zeros((side, side, 3), np.uint8)
    for _ in range(12):
        x0, y0 = rng.integers(0, side, 2)
        img[y0: y0 + side // 4, x0: x0 + 3] = 255
        img[y0: y0 + 3, x0: x0 + side // 4] = 255
    return Image.fromarray(img)


def _free():
    gc.collect()
    torch.cuda.empty_cache()


def _stock_images(model, controlnet, cls_name, calls):
    """Stock diffusers' images (seed 0) of ``calls`` (keyword arguments), on the ControlNet pipeline (``cls_name``:
    another one built from it) of the same random weights as ``sdfast.load(model, controlnet=controlnet)``."""
    import diffusers

    stock = sdfast.load(model, controlnet=controlnet, optimize=False)
    pipe = stock.pipe if cls_name is None else getattr(diffusers, cls_name).from_pipe(stock.pipe, dtype=torch.float16)
    out = [pipe(prompt=PROMPT, generator=[torch.Generator("cpu").manual_seed(0)], **kw).images[0] for kw in calls]
    del stock, pipe
    _free()
    return out


@pytest.mark.parametrize("model, controlnet, side, steps", [
    ("random:sd15", "random:controlnet-sd15", 512, 20),
    ("random:sd21", "random:controlnet-sd21", 768, 12),
    ("random:sdxl", "random:controlnet-sdxl", 1024, 12),
])
def test_controlnet_txt2img_parity_and_graph_reuse(model, controlnet, side, steps):
    control = _control_image(side)
    base = dict(num_inference_steps=steps, guidance_scale=7.5)
    calls = [dict(base, image=control), dict(base, image=control, controlnet_conditioning_scale=0.5)]
    ref, ref_half = _stock_images(model, controlnet, None, calls)
    fast = sdfast.load(model, controlnet=controlnet)
    graphs = fast.pipe._sdfast.graphs
    ours = fast.txt2img(PROMPT, control_image=control, seed=0, **base)[0]
    first = {k: v["captures"] for k, v in graphs.stats().items()}
    half = fast.txt2img(PROMPT, control_image=control, seed=0, controlnet_conditioning_scale=0.5, **base)[0]
    stats = graphs.stats()
    p, p_half = psnr(ours, ref), psnr(half, ref_half)
    print(f"{model} + {controlnet}: txt2img PSNR vs stock fp16 {p:.2f} dB, at scale 0.5 {p_half:.2f} dB")
    assert ours.size == (side, side) and p >= 35 and p_half >= 35
    assert psnr(ours, half) < 40  # the scale matters
    assert first["controlnet_0"] == 1 and not stats["controlnet_0"]["failures"]
    assert {k: v["captures"] for k, v in stats.items()} == first  # another scale: no capture
    calls = 2 * len(fast.pipe.scheduler.timesteps)  # UNet calls of the two images (PNDM runs one more than steps)
    assert stats["controlnet_0"]["replays"] == calls and stats["unet"]["replays"] == calls
    # once per image each: the text K/V and the control image's embedding (runtime.control_embedding)
    assert stats["controlnet_0"]["conditioning_runs"] == 2 * 2 and stats["unet"]["conditioning_runs"] == 2
    del fast
    _free()


def test_two_controlnets_and_img2img_parity():
    model, nets, side = "random:sd15", ["random:controlnet-sd15", "random:controlnet-sd15"], 512
    controls = [_control_image(side, 0), _control_image(side, 1)]
    y, x = np.mgrid[0:side, 0:side] / side
    init = Image.fromarray((np.stack([x, y, (x + y) / 2], -1) * 255).astype(np.uint8))
    base = dict(num_inference_steps=20, guidance_scale=7.5, controlnet_conditioning_scale=[1.0, 0.7])
    ref_t2i, = _stock_images(model, nets, None, [dict(base, image=controls)])
    ref_i2i, = _stock_images(model, nets, "StableDiffusionControlNetImg2ImgPipeline",
                             [dict(base, image=init, control_image=controls, strength=0.6)])
    fast = sdfast.load(model, controlnet=nets)
    t2i = fast.txt2img(PROMPT, control_image=controls, seed=0, **base)[0]
    i2i = fast.img2img(init, PROMPT, control_image=controls, strength=0.6, seed=0, **base)[0]
    stats = fast.pipe._sdfast.graphs.stats()
    p, q = psnr(t2i, ref_t2i), psnr(i2i, ref_i2i)
    print(f"{model} + 2 ControlNets: txt2img PSNR vs stock fp16 {p:.2f} dB, img2img {q:.2f} dB")
    assert p >= 35 and q >= 35
    assert stats["controlnet_0"]["captures"] == stats["controlnet_1"]["captures"] == 1
    assert not stats["controlnet_0"]["failures"] and not stats["controlnet_1"]["failures"]
    del fast
    _free()


def test_controlnet_with_a_lora_parity():
    from tests.test_user_cases_models import _lora_state_dict

    model, controlnet, side = "random:sd15", "random:controlnet-sd15", 512
    control, kw = _control_image(side), dict(num_inference_steps=20, guidance_scale=7.5)
    stock = sdfast.load(model, controlnet=controlnet, optimize=False)
    lora = _lora_state_dict(stock.pipe.unet, ["to_q", "to_k", "to_v", "to_out.0"], strength=0.3)
    stock.pipe.load_lora_weights(lora, adapter_name="style")
    ref = stock.pipe(prompt=PROMPT, image=control, generator=[torch.Generator("cpu").manual_seed(0)], **kw).images[0]
    del stock
    _free()
    fast = sdfast.load(model, controlnet=controlnet)
    plain = fast.txt2img(PROMPT, control_image=control, seed=0, **kw)[0]
    fast.pipe.load_lora_weights(lora, adapter_name="style")
    ours = fast.txt2img(PROMPT, control_image=control, seed=0, **kw)[0]
    p = psnr(ours, ref)
    print(f"{model} + {controlnet} + LoRA: txt2img PSNR vs stock fp16 {p:.2f} dB")
    assert p >= 35 and psnr(ours, plain) < 30  # the LoRA shows, as in stock
    del fast
    _free()
