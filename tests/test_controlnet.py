"""ControlNet on random:tiny / tiny-xl (CPU): the engine gives the pixels of diffusers' ControlNet pipelines (txt2img,
img2img, inpainting; one and two ControlNets) on the same weights, its ControlNets go through the pass table, and
bad input raises before any step."""

import numpy as np
import pytest
import torch
from PIL import Image

import sdfast
from sdfast.controlnet import build_random_controlnet
from sdfast.errors import InvalidRequestError, ModelNotFoundError
from sdfast.loading import build_random_pipeline
from sdfast.request import Txt2ImgRequest


def _image(w=48, h=40, seed=0):
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype(np.uint8))


def _mask(w=48, h=40):
    m = np.zeros((h, w), np.uint8)
    m[h // 4: 3 * h // 4, w // 4: 3 * w // 4] = 255
    return Image.fromarray(m)


def _px(img):
    return np.asarray(img).astype(np.int16)


def _same(a, b) -> bool:
    """The same image up to one level on a few pixels: the fused Triton kernels (here in the interpreter, fp32) round
    differently from PyTorch's ops, and a ControlNet doubles the fused layers a step runs (measured: at most one
    level, on 0.03 % of the pixels; exact without the interpreter)."""
    d = np.abs(_px(a) - _px(b))
    return a.size == b.size and d.max() <= 1 and (d > 0).mean() < 0.01


@pytest.fixture(scope="module")
def tiny():
    """An optimized random:tiny engine with one tiny ControlNet, one with two, and the stock pipeline's parts."""
    one = sdfast.load("random:tiny", controlnet="random:tiny-controlnet")
    two = sdfast.load("random:tiny", controlnet=["random:tiny-controlnet", "random:tiny-controlnet"])
    return one, two, build_random_pipeline("tiny")


@pytest.fixture(scope="module")
def plain():
    """An unoptimized one: what the engine passes to diffusers, checked without the interpreter's cost (an optimized
    step of a fused kernel in Triton's interpreter takes seconds; the optimized ControlNet's parity is checked above
    and on the GPU)."""
    return sdfast.load("random:tiny", controlnet="random:tiny-controlnet", optimize=False)


def _stock(base, cls_name, nets, **kw):
    import diffusers

    seeds = kw.pop("seeds")
    cls = getattr(diffusers, cls_name)
    pipe = cls.from_pipe(base, controlnet=nets if len(nets) > 1 else nets[0], dtype=base.unet.dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe(generator=[torch.Generator("cpu").manual_seed(s) for s in seeds], **kw).images


def _nets(n, name="tiny-controlnet"):
    """The random ControlNets ``sdfast.load(..., controlnet=[...])`` builds: seed 1 + i for ControlNet i."""
    return [build_random_controlnet(name, seed=1 + i) for i in range(n)]


def test_txt2img_same_pixels_as_diffusers_controlnet_pipeline(tiny):
    one, _, base = tiny
    control = _image(32, 40, seed=5)
    kw = dict(num_inference_steps=2, guidance_scale=5.0)
    ours = one.txt2img("a photo of a cat", control_image=control, seed=3, num_images_per_prompt=2, **kw)
    ref = _stock(base, "StableDiffusionControlNetPipeline", _nets(1), prompt="a photo of a cat", image=control,
                 num_images_per_prompt=2, seeds=[3, 4], **kw)
    assert [im.size for im in ours] == [(32, 40)] * 2  # the control image's size without height / width
    assert all(_same(a, b) for a, b in zip(ours, ref))
    # the control image matters (so the comparison above could fail)
    other = one.txt2img("a photo of a cat", control_image=_image(32, 40, seed=6), seed=3, **kw)[0]
    assert not _same(other, ours[0])


def test_scale_and_guidance_window_as_diffusers(plain, tiny):
    one, base = plain, tiny[2]
    control = _image(seed=5)  # 48 x 40, resized to 32 x 32
    kw = dict(num_inference_steps=4, guidance_scale=5.0, height=32, width=32)
    window = dict(controlnet_conditioning_scale=0.5, control_guidance_start=0.25, control_guidance_end=0.75)
    ours = one.txt2img("a cat", control_image=control, seed=0, **window, **kw)
    ref = _stock(base, "StableDiffusionControlNetPipeline", _nets(1), prompt="a cat", image=control, seeds=[0],
                 **window, **kw)
    full = _stock(base, "StableDiffusionControlNetPipeline", _nets(1), prompt="a cat", image=control, seeds=[0], **kw)
    assert ours[0].size == (32, 32) and np.array_equal(_px(ours[0]), _px(ref[0])) and not _same(ref[0], full[0])


def test_two_controlnets_same_pixels_as_diffusers(tiny):
    _, two, base = tiny
    images = [_image(32, 32, seed=5), _image(32, 32, seed=7)]
    kw = dict(num_inference_steps=2, guidance_scale=5.0)
    ours = two.txt2img("a cat", control_image=images, controlnet_conditioning_scale=[1.0, 0.5], seed=1, **kw)
    ref, first_only = (_stock(base, "StableDiffusionControlNetPipeline", _nets(2), prompt="a cat", image=images,
                              controlnet_conditioning_scale=scales, seeds=[1], **kw) for scales in ([1.0, 0.5], [1.0, 0.0]))
    assert _same(ours[0], ref[0]) and not _same(ref[0], first_only[0])  # and the second ControlNet counts


def test_img2img_and_inpaint_with_a_controlnet_same_pixels_as_diffusers(plain, tiny):
    one, base = plain, tiny[2]
    image, control = _image(32, 32), _image(seed=5)  # the control image is resized to the image's size
    kw = dict(num_inference_steps=4, guidance_scale=5.0, strength=0.5)
    ours = one.img2img(image, "a cat", control_image=control, seed=2, **kw)
    ref = _stock(base, "StableDiffusionControlNetImg2ImgPipeline", _nets(1), prompt="a cat", image=image,
                 control_image=control, height=32, width=32, seeds=[2], **kw)
    assert ours[0].size == (32, 32) and np.array_equal(_px(ours[0]), _px(ref[0]))
    ours = one.inpaint(image, _mask(32, 32), "a cat", control_image=control, seed=2, **kw)
    ref = _stock(base, "StableDiffusionControlNetInpaintPipeline", _nets(1), prompt="a cat", image=image,
                 mask_image=_mask(32, 32), control_image=control, height=32, width=32, seeds=[2], **kw)
    assert np.array_equal(_px(ours[0]), _px(ref[0]))


@pytest.mark.parametrize("arch, cls", [("tiny-xl", "StableDiffusionXLControlNetPipeline"),
                                       ("tiny-v", "StableDiffusionControlNetPipeline")])  # SDXL; SD 2.x-shaped
def test_sdxl_and_sd2_controlnet_same_pixels_as_diffusers(arch, cls):
    engine = sdfast.load(f"random:{arch}", controlnet=f"random:{arch}-controlnet")
    control = _image(32, 32, seed=5)
    kw = dict(num_inference_steps=2, guidance_scale=5.0)
    ours = engine.txt2img("a cat", control_image=control, seed=0, **kw)
    ref = _stock(build_random_pipeline(arch), cls, _nets(1, f"{arch}-controlnet"), prompt="a cat", image=control,
                 seeds=[0], **kw)
    assert _same(ours[0], ref[0])
    assert type(engine.pipe).__name__ == cls
    assert type(engine.pipeline_for("img2img")).__name__ == cls.replace("ControlNetPipeline", "ControlNetImg2ImgPipeline")


def test_the_controlnets_are_optimized_and_shared(tiny):
    one, two, _ = tiny
    net = one.controlnets[0]
    assert one.pipe._sdfast.counts["attention"] > 0
    # every pass that rewrites the UNet's encoder half rewrote the ControlNet's too
    from sdfast.passes.attention.processor import SdfastAttnProcessor

    assert all(isinstance(p, SdfastAttnProcessor) for p in net.attn_processors.values())
    assert net.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert len(two.controlnets) == 2 and two.controlnets[0] is not two.controlnets[1]
    derived = one.pipeline_for("inpaint")
    assert type(derived).__name__ == "StableDiffusionControlNetInpaintPipeline" and derived.controlnet is net
    sdfast.unoptimize(one.pipe)
    try:
        assert not any(isinstance(p, SdfastAttnProcessor) for p in net.attn_processors.values())
        assert not net.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    finally:
        sdfast.optimize(one.pipe)


def test_bad_control_input_raises_naming_the_field(tiny):
    one, two, _ = tiny
    with pytest.raises(InvalidRequestError, match="control_image.*loaded with 1 ControlNet") as e:
        one.txt2img("a cat", num_inference_steps=1)
    assert e.value.field == "control_image"
    with pytest.raises(InvalidRequestError, match="the model has 2, got 1"):
        two.txt2img("a cat", control_image=_image(), num_inference_steps=1)
    with pytest.raises(InvalidRequestError, match="no ControlNet"):
        sdfast.load("random:tiny", optimize=False).txt2img("a cat", control_image=_image(), num_inference_steps=1)
    cases = [
        (dict(control_image="x.png"), "control_image"),
        (dict(control_image=[_image(), 3]), "control_image[1]"),
        (dict(control_image=[]), "control_image"),
        (dict(control_image=_image(), controlnet_conditioning_scale=-1), "controlnet_conditioning_scale"),
        (dict(control_image=_image(), controlnet_conditioning_scale=float("nan")), "controlnet_conditioning_scale"),
        (dict(control_image=_image(), controlnet_conditioning_scale=[1.0, 1.0]), "controlnet_conditioning_scale"),
        (dict(control_image=_image(), control_guidance_end=1.5), "control_guidance_end"),
        (dict(control_image=_image(), control_guidance_start=0.5, control_guidance_end=0.5), "control_guidance_start"),
    ]
    sixteen_bit = Image.fromarray(np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.uint16))
    cases += [
        (dict(controlnet_conditioning_scale=0.5), "controlnet_conditioning_scale"),  # without a control image
        (dict(control_guidance_start=5), "control_guidance_start"),
        (dict(control_guidance_end=float("nan")), "control_guidance_end"),
        (dict(control_image=sixteen_bit), "control_image"),  # 8-bit conversion would clip it (almost all white)
    ]
    for kwargs, field in cases:
        with pytest.raises(InvalidRequestError) as e:
            Txt2ImgRequest.build("a cat", **kwargs)
        assert e.value.field == field, kwargs
    from sdfast.request import InpaintRequest

    float_mask = Image.fromarray(np.ones((40, 48), np.float32))  # mode F in [0, 1]: 8-bit conversion makes it black
    with pytest.raises(InvalidRequestError, match="mode F") as e:
        InpaintRequest.build(_image(), float_mask, "a cat")
    assert e.value.field == "mask_image"


def test_a_request_with_control_inputs_builds_again_and_does_not_batch():
    r = Txt2ImgRequest.build("a cat", control_image=[_image(), _image(seed=1)], controlnet_conditioning_scale=0.5,
                             seed=1)
    assert (r.height, r.width) == (40, 48)
    one_side = Txt2ImgRequest.build("a cat", control_image=_image(), height=32)  # the other side: the control image's
    assert (one_side.height, one_side.width) == (32, 48)
    again = Txt2ImgRequest.build(**r.as_kwargs())
    assert again.control.conditioning_scale == (0.5, 0.5) and len(again.control.images) == 2
    assert Txt2ImgRequest.build("a cat", control_image=_image()).control.conditioning_scale is None  # diffusers default
    with pytest.raises(ValueError, match="no control image"):
        Txt2ImgRequest.concat([r, r])


def test_controlnet_loading_errors():
    with pytest.raises(ModelNotFoundError, match="known: random:controlnet-sd15"):
        sdfast.load("random:tiny", controlnet="random:nope", optimize=False)
    with pytest.raises(ValueError, match="another base model"):
        sdfast.load("random:tiny", controlnet="random:tiny-xl-controlnet", optimize=False)
    with pytest.raises(ModelNotFoundError, match="no such folder"):
        sdfast.load("random:tiny", controlnet="/nonexistent/controlnet", optimize=False)
    with pytest.raises(TypeError, match="controlnet"):
        sdfast.load("random:tiny", controlnet=3, optimize=False)


def test_a_folder_of_another_model_is_not_a_controlnet(tmp_path):
    build_random_pipeline("tiny").unet.save_pretrained(tmp_path / "unet")
    with pytest.raises(ModelNotFoundError, match="cannot be loaded as a diffusers ControlNetModel"):
        sdfast.load("random:tiny", controlnet=str(tmp_path / "unet"), optimize=False)


def test_a_controlnet_folder_loads(tmp_path):
    build_random_controlnet("tiny-controlnet", seed=4).save_pretrained(tmp_path / "cn")
    engine = sdfast.load("random:tiny", controlnet=str(tmp_path / "cn"), optimize=False)
    ref = build_random_controlnet("tiny-controlnet", seed=4)
    assert all(torch.equal(a, b) for a, b in zip(engine.controlnets[0].state_dict().values(),
                                                 ref.state_dict().values()))


def test_a_lora_on_the_unet_of_a_controlnet_engine_as_diffusers(tiny):
    from tests.test_user_cases_models import _lora_state_dict

    one, _, base = tiny
    control = _image(32, 32, seed=5)
    kw = dict(num_inference_steps=2, guidance_scale=5.0)
    lora = _lora_state_dict(one.pipe.unet, ["to_q", "to_k", "to_v", "to_out.0"], strength=1.0)
    plain = one.txt2img("a cat", control_image=control, seed=0, **kw)[0]
    one.pipe.load_lora_weights(lora, adapter_name="style")
    try:
        ours = one.txt2img("a cat", control_image=control, seed=0, **kw)[0]
    finally:
        one.pipe.unload_lora_weights()
    import diffusers

    stock = diffusers.StableDiffusionControlNetPipeline.from_pipe(base, controlnet=_nets(1)[0], dtype=base.unet.dtype)
    stock.load_lora_weights(lora, adapter_name="style")
    ref = _stock(stock, "StableDiffusionControlNetPipeline", [stock.controlnet], prompt="a cat", image=control,
                 seeds=[0], **kw)
    stock.unload_lora_weights()
    assert _same(ours, ref[0]) and not _same(ours, plain)  # the LoRA shows, as in diffusers


def test_a_single_file_controlnet_loads(tmp_path):
    """A ``.safetensors`` ControlNet with diffusers' keys, loaded offline with the config made for the model's UNet
    (``architectures.controlnet_config``: the published control-image embedding widths, 16/32/96/256); a file that
    is no ControlNet is a ModelNotFoundError naming it."""
    import diffusers
    import safetensors.torch

    from sdfast.architectures import controlnet_config

    config = controlnet_config(build_random_pipeline("tiny").unet.config)
    config.pop("_class_name")
    torch.manual_seed(2)
    net = diffusers.ControlNetModel(**config)
    path = tmp_path / "control.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    engine = sdfast.load("random:tiny", controlnet=str(path), optimize=False)
    loaded = engine.controlnets[0]
    assert loaded.dtype == engine.pipe.unet.dtype
    assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(loaded.state_dict().values(), net.state_dict().values()))
    bad = tmp_path / "other.safetensors"
    safetensors.torch.save_file({"weight": torch.zeros(2)}, str(bad))
    with pytest.raises(ModelNotFoundError, match="other.safetensors"):
        sdfast.load("random:tiny", controlnet=str(bad), optimize=False)
