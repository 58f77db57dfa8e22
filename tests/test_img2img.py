"""img2img and inpainting on random:tiny (CPU): the same pixels as diffusers' img2img and inpaint pipelines on the
same weights, the derived pipelines share the engine's optimized modules and state, and bad input raises before any
step."""

import numpy as np
import pytest
import torch
from PIL import Image

import sdfast
from sdfast.errors import InvalidRequestError
from sdfast.request import Img2ImgRequest


def _image(w=48, h=40, seed=0):
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype(np.uint8))


def _px(img):
    return np.asarray(img).astype(np.int16)


@pytest.fixture(scope="module")
def engines():
    """An optimized and a stock random:tiny engine (fp32, CPU), the same seeded weights."""
    return sdfast.load("random:tiny"), sdfast.load("random:tiny", optimize=False)


def _stock(pipe, image, **kw):
    from diffusers import StableDiffusionImg2ImgPipeline

    seeds = kw.pop("seeds")
    return StableDiffusionImg2ImgPipeline.from_pipe(pipe)(
        image=image, generator=[torch.Generator("cpu").manual_seed(s) for s in seeds], **kw).images


@pytest.mark.parametrize("size", [(48, 40), (51, 43)])  # (51, 43): rounded down to 48 x 40, as diffusers does
def test_same_pixels_as_diffusers_img2img(engines, size):
    fast, stock = engines
    image = _image(*size)
    ours = fast.img2img(image, "a photo of a cat", strength=0.6, num_inference_steps=4, guidance_scale=5.0, seed=3,
                        num_images_per_prompt=2)
    ref = _stock(stock.pipe, image, prompt="a photo of a cat", strength=0.6, num_inference_steps=4,
                 guidance_scale=5.0, num_images_per_prompt=2, seeds=[3, 4])
    assert [im.size for im in ours] == [(48, 40)] * 2 and [im.info["seed"] for im in ours] == ["3", "4"]
    # the same pixels up to one level on a few of them: the fused Triton kernels (in the interpreter) round fp32
    # differently from PyTorch's ops, and how much depends on the intra-op thread count (exact with two threads,
    # a few pixels one level apart with one)
    for a, b in zip(ours, ref):
        d = np.abs(_px(a) - _px(b))
        assert d.max() <= 1 and (d > 0).mean() < 0.01, (d.max(), (d > 0).mean())
    assert not np.array_equal(_px(ours[0]), _px(ours[1]))  # each image its own seed (noise and latent sample)


def test_the_image_and_strength_matter_and_an_array_is_the_same_image(engines):
    fast, _ = engines
    kw = dict(num_inference_steps=4, guidance_scale=1.0, seed=1)
    a = fast.img2img(_image(), "a cat", strength=0.5, **kw)[0]
    assert np.array_equal(_px(a), _px(fast.img2img(np.asarray(_image()), "a cat", strength=0.5, **kw)[0]))
    assert np.array_equal(_px(a), _px(fast.img2img(_image().convert("RGBA"), "a cat", strength=0.5, **kw)[0]))
    assert not np.array_equal(_px(a), _px(fast.img2img(_image(seed=1), "a cat", strength=0.5, **kw)[0]))
    assert not np.array_equal(_px(a), _px(fast.img2img(_image(), "a cat", strength=1.0, **kw)[0]))


def test_the_img2img_pipeline_shares_the_optimized_components(engines):
    fast, stock = engines
    derived = fast.pipeline_for("img2img")
    assert derived is fast.pipeline_for("img2img") and fast.pipeline_for("txt2img") is fast.pipe
    assert type(derived).__name__ == "StableDiffusionImg2ImgPipeline"
    assert all(getattr(derived, n) is getattr(fast.pipe, n) for n in ("unet", "vae", "text_encoder", "tokenizer"))
    assert derived._sdfast is fast.pipe._sdfast
    assert getattr(stock.pipeline_for("img2img"), "_sdfast", None) is None  # an unoptimized engine's stays stock
    with pytest.raises(ValueError, match="task must be"):
        fast.pipeline_for("video")


def test_the_img2img_pipeline_follows_unoptimize_and_optimize():
    engine = sdfast.load("random:tiny")
    first = engine.pipeline_for("img2img")
    sdfast.unoptimize(engine.pipe)
    stock = engine.pipeline_for("img2img")
    assert stock is not first and getattr(stock, "_sdfast", None) is None
    sdfast.optimize(engine.pipe)
    again = engine.pipeline_for("img2img")
    assert again._sdfast is engine.pipe._sdfast and again is engine.pipeline_for("img2img")


@pytest.mark.parametrize("image, kwargs, field", [
    ("cat.png", {}, "image"),
    (np.zeros((40, 48), np.uint8), {}, "image"),
    (np.zeros((40, 48, 3), np.float32), {}, "image"),
    (Image.new("RGB", (4, 40)), {}, "image"),
    (None, {"strength": 0}, "strength"),
    (None, {"strength": 1.5}, "strength"),
    (None, {"strength": True}, "strength"),
    (None, {"strength": "0.5"}, "strength"),
    (None, {"strength": 0.1, "num_inference_steps": 5}, "strength"),  # int(5 * 0.1) = 0 steps
    (None, {"num_inference_steps": 0}, "num_inference_steps"),
    (None, {"guidance_scale": float("nan")}, "guidance_scale"),
])
def test_bad_input_raises_before_any_step(engines, image, kwargs, field):
    fast, _ = engines
    with pytest.raises(InvalidRequestError) as info:
        fast.img2img(_image() if image is None else image, "a cat", **kwargs)
    assert info.value.field == field


def test_request_round_trip_and_concat():
    r = Img2ImgRequest.build(_image(51, 43), ["a", "b"], strength=0.25, num_inference_steps=8, seed=5)
    assert (r.width, r.height, r.denoising_steps, r.seeds) == (48, 40, 2, (5, 6))
    again = Img2ImgRequest.build(**r.as_kwargs())
    assert again == r
    assert r.task == "img2img" and r.pipeline_kwargs(40, 48) == {"image": r.image, "strength": 0.25}
    other = Img2ImgRequest.build(_image(48, 40, seed=1), "c", strength=0.25, num_inference_steps=8, seed=9)
    both = Img2ImgRequest.concat([r, other])  # one init image per output image, in order (the service's batches)
    assert both.prompts == ("a", "b", "c") and both.seeds == (5, 6, 9) and both.image == [r.image, r.image, other.image]
    assert Img2ImgRequest.concat([both]).image == both.image
    with pytest.raises(ValueError, match="same strength"):
        Img2ImgRequest.concat([r, Img2ImgRequest.build(_image(), "c", strength=0.5, num_inference_steps=8, seed=9)])
    with pytest.raises(ValueError, match="same size"):
        Img2ImgRequest.concat([r, Img2ImgRequest.build(_image(64, 40), "c", strength=0.25, num_inference_steps=8, seed=9)])


def test_share_leaves_an_unoptimized_pipeline_as_it_is(engines):
    from sdfast.optimizer import share

    _, stock = engines
    derived = object.__new__(type(stock.pipe))
    assert share(stock.pipe, derived) is derived and "_sdfast" not in derived.__dict__


def test_sdxl_same_pixels_as_diffusers_img2img():
    from diffusers import StableDiffusionXLImg2ImgPipeline

    fast, stock = sdfast.load("random:tiny-xl"), sdfast.load("random:tiny-xl", optimize=False)
    image = _image(32, 32)
    ours = fast.img2img(image, "a cat", strength=0.5, num_inference_steps=4, guidance_scale=5.0, seed=2)[0]
    ref = StableDiffusionXLImg2ImgPipeline.from_pipe(stock.pipe)(
        prompt="a cat", image=image, strength=0.5, num_inference_steps=4, guidance_scale=5.0,
        generator=[torch.Generator("cpu").manual_seed(2)]).images[0]
    assert type(fast.pipeline_for("img2img")).__name__ == "StableDiffusionXLImg2ImgPipeline"
    assert ours.size == (32, 32) and np.array_equal(_px(ours), _px(ref))


def test_the_unet_and_decoder_get_nchw_latents_as_in_txt2img(engines):
    """The layout pass runs the VAE's convolutions NHWC; its ``encode`` hands the latents back NCHW (as stock), so
    img2img's UNet and decoder inputs have txt2img's strides and replay txt2img's CUDA graphs (keyed by strides)."""
    fast, _ = engines
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, args, name=name: seen.append((name, args[0].is_contiguous())))
             for name, m in (("unet", fast.pipe.unet), ("decoder", fast.pipe.vae.decoder))]
    try:
        fast.img2img(_image(), "a cat", strength=0.5, num_inference_steps=4, seed=0)
    finally:
        for h in hooks:
            h.remove()
    assert {name for name, _ in seen} == {"unet", "decoder"} and all(ok for _, ok in seen), seen
    dist = fast.pipe.vae.encode(torch.zeros(1, 3, 16, 16)).latent_dist
    assert dist.mean.is_contiguous() and dist.std.is_contiguous()
    sdfast.unoptimize(fast.pipe)
    assert "encode" not in fast.pipe.vae.__dict__  # undo gives the VAE its own encode back
    sdfast.optimize(fast.pipe)


def test_a_vae_kept_in_fp32_has_force_upcast_off_only_during_a_call():
    """SDXL's VAE kept in fp32 (``force_upcast``): during an engine call its config says force_upcast False (diffusers'
    SDXL img2img would otherwise cast the VAE to fp32 and back to the embeddings' dtype, replacing its weights), and
    True again after, also after a failed call."""
    from sdfast.runtime.session import CallSession

    engine = sdfast.load("random:tiny-xl", dtype=torch.float16, device="cpu")
    pipe = engine.pipe
    assert pipe._sdfast.vae_upcast and pipe.vae.config.force_upcast
    session = CallSession(pipe)
    with session.call(pipe.scheduler, what="test"):
        assert pipe.vae.config.force_upcast is False
    assert pipe.vae.config.force_upcast is True
    with pytest.raises(KeyError):
        with session.call(pipe.scheduler, what="test"):
            raise KeyError("a failed call")
    assert pipe.vae.config.force_upcast is True
    ptrs = [p.data_ptr() for p in pipe.vae.parameters()]
    engine.img2img(_image(32, 32), "a cat", strength=0.5, num_inference_steps=2, seed=0)
    assert pipe.vae.dtype == torch.float32 and [p.data_ptr() for p in pipe.vae.parameters()] == ptrs
    stock = sdfast.load("random:tiny", device="cpu")  # an fp32 VAE of its own: nothing to switch
    with CallSession(stock.pipe).call(stock.pipe.scheduler, what="test"):
        assert not stock.pipe._sdfast.vae_upcast



def _mask(w=48, h=40):
    m = np.zeros((h, w), np.uint8)
    m[8:24, 16:40] = 255
    return Image.fromarray(m)


@pytest.mark.parametrize("arch, cls", [("tiny", "StableDiffusionInpaintPipeline"),
                                       ("tiny-xl", "StableDiffusionXLInpaintPipeline")])
def test_inpaint_same_pixels_as_diffusers(arch, cls):
    import diffusers

    fast, stock = sdfast.load(f"random:{arch}"), sdfast.load(f"random:{arch}", optimize=False)
    kw = dict(num_inference_steps=4, guidance_scale=5.0, strength=1.0)
    ours = fast.inpaint(_image(), np.asarray(_mask()), "a cat", seed=3, **kw)  # a mask array is the same mask
    ref = getattr(diffusers, cls).from_pipe(stock.pipe)(
        prompt="a cat", image=_image(), mask_image=_mask(), height=40, width=48,
        generator=[torch.Generator("cpu").manual_seed(3)], **kw).images
    assert type(fast.pipeline_for("inpaint")).__name__ == cls
    assert fast.pipeline_for("inpaint")._sdfast is fast.pipe._sdfast
    assert ours[0].size == (48, 40) and np.array_equal(_px(ours[0]), _px(ref[0]))


def test_inpaint_image_i_of_a_batch_is_its_seed_alone(engines):
    _, stock = engines  # what the engine hands diffusers; the optimized kernels are checked above
    kw = dict(num_inference_steps=2, guidance_scale=5.0, strength=0.75)
    two = stock.inpaint(_image(32, 32), _mask(32, 32), "a cat", seed=5, num_images_per_prompt=2, **kw)
    alone = stock.inpaint(_image(32, 32), _mask(32, 32), "a cat", seed=6, **kw)
    assert np.array_equal(_px(two[1]), _px(alone[0])) and not np.array_equal(_px(two[0]), _px(two[1]))


@pytest.mark.parametrize("mask, field", [
    (Image.new("L", (48, 32)), "mask_image"),
    (np.zeros((40, 48), np.float32), "mask_image"),
    ("mask.png", "mask_image"),
    (None, "image"),
])
def test_inpaint_bad_input_raises_before_any_step(engines, mask, field):
    fast, _ = engines
    image = "cat.png" if mask is None else _image()
    with pytest.raises(InvalidRequestError) as info:
        fast.inpaint(image, _mask() if mask is None else mask, "a cat")
    assert info.value.field == field


def test_inpaint_request_round_trip():
    from sdfast.request import InpaintRequest

    r = InpaintRequest.build(_image(), _mask().convert("RGB"), "a cat", num_inference_steps=8, seed=1)
    assert r.strength == 1.0 and r.mask_image.mode == "L" and r.denoising_steps == 8
    assert InpaintRequest.build(**r.as_kwargs()) == r
    both = InpaintRequest.concat([r, r])
    assert both.image == [r.image] * 2 and both.mask_image == [r.mask_image] * 2
    assert r.task == "inpaint" and r.pipeline_kwargs(40, 48) == dict(
        image=r.image, mask_image=r.mask_image, strength=1.0, height=40, width=48)


# --- inpainting checkpoints: UNets with 9 input channels (4 latents + 1 mask + 4 masked-image latents) ----------


@pytest.fixture(scope="module")
def inpainting_pairs():
    """``pair(arch)``: an optimized and a stock engine of the inpainting architecture ``arch`` (the same seeded
    weights), loaded once per module."""
    loaded = {}

    def pair(arch):
        if arch not in loaded:
            loaded[arch] = sdfast.load(f"random:{arch}"), sdfast.load(f"random:{arch}", optimize=False)
        return loaded[arch]

    return pair


@pytest.mark.parametrize("arch, cls", [("tiny-inpaint", "StableDiffusionInpaintPipeline"),
                                       ("tiny-xl-inpaint", "StableDiffusionXLInpaintPipeline")])
def test_inpainting_checkpoint_same_pixels_as_diffusers(inpainting_pairs, arch, cls):
    """The optimized engine (the 9-channel ``conv_in`` channels_last, its bias on the conv-bias kernel) and the stock
    one give diffusers' inpaint pipeline's image, whose UNet gets the 9 channels."""
    fast, stock = inpainting_pairs(arch)
    assert type(stock.pipe).__name__ == cls and stock.pipe.unet.config.in_channels == 9
    conv_in = fast.pipe.unet.conv_in
    assert conv_in.weight.is_contiguous(memory_format=torch.channels_last) and conv_in._sdfast_conv_bias
    kw = dict(num_inference_steps=2, guidance_scale=5.0, strength=1.0)
    channels = []
    hook = fast.pipe.unet.register_forward_pre_hook(lambda m, args: channels.append(args[0].shape[1]))
    try:
        ours = fast.inpaint(_image(), _mask(), "a cat", seed=3, **kw)[0]
    finally:
        hook.remove()
    plain = stock.inpaint(_image(), _mask(), "a cat", seed=3, **kw)[0]
    ref = stock.pipe(prompt="a cat", image=_image(), mask_image=_mask(), height=40, width=48,
                     generator=[torch.Generator("cpu").manual_seed(3)], **kw).images[0]
    assert channels and set(channels) == {9}
    assert ours.size == (48, 40) and np.array_equal(_px(plain), _px(ref))
    # the optimized kernels sum fp32 in another order (about 1e-6 apart on the decoded image): a pixel may round to
    # the next level, as in tests/test_user_cases.py
    assert np.abs(_px(ours) - _px(ref)).max() <= 1


@pytest.mark.parametrize("arch", ["tiny-inpaint", "tiny-xl-inpaint"])
def test_an_inpainting_checkpoint_refuses_txt2img_and_img2img_before_any_step(inpainting_pairs, engines, arch):
    fast, stock = inpainting_pairs(arch)
    assert fast.tasks == stock.tasks == ("inpaint",) and engines[0].tasks == ("txt2img", "img2img", "inpaint")
    steps = []
    hook = fast.pipe.unet.register_forward_pre_hook(lambda m, args: steps.append(1))
    calls = {"txt2img": lambda: fast.txt2img("a cat", num_inference_steps=2),
             "img2img": lambda: fast.img2img(_image(), "a cat", num_inference_steps=2),
             "run": lambda: fast.run(fast.request("a cat", num_inference_steps=2))}
    try:
        for what, call in calls.items():
            with pytest.raises(InvalidRequestError) as info:
                call()
            task = "img2img" if what == "img2img" else "txt2img"
            assert info.value.field == "model", what
            assert (f"'random:{arch}' is an inpainting checkpoint (its UNet takes 9 input channels" in str(info.value)
                    and f"cannot run {task}; it runs inpainting only" in str(info.value)), str(info.value)
        with pytest.raises(InvalidRequestError, match="cannot run img2img"):
            stock.pipeline_for("img2img")
    finally:
        hook.remove()
    assert steps == []
