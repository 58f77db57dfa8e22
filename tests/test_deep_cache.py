"""Issue 34: DeepCache (``sdfast.runtime.deep_cache``) on the CPU, on the tiny SD 1.x, 2.x and SDXL architectures.

The split forward against the UNet's own forward (its full step bit-equal; its shallow step equal to the UNet with
the deep feature swapped in by a hook, the plain-PyTorch statement of DeepCache), the engine's schedule (the full
UNet on every N-th step only, counted by hooks on the mid block), ``cache_interval=1`` as the exact pipeline, bad
values, and the instance patches undone. Unoptimized engines (no Triton interpreter) but one: the optimizer's pass.
The graphs (a full and a shallow one per signature, the cache outside their pool) are tested on the GPU:
``tests/test_deep_cache_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sdfast
from sdfast.errors import GenerationCancelled, InvalidRequestError
from sdfast.request import Img2ImgRequest, Txt2ImgRequest
from sdfast.runtime import deep_cache
from sdfast.runtime.deep_cache import FULL, SHALLOW, Step

SMALL = dict(height=32, width=32)
ARCHS = ("tiny", "tiny-v", "tiny-xl")


@pytest.fixture(scope="module")
def engines():
    return {arch: sdfast.load(f"random:{arch}", optimize=False) for arch in ARCHS}


def _px(img):
    return np.asarray(img).astype(np.int16)


def _inputs(unet, batch: int = 2, size=(5, 7), seed: int = 0):
    """UNet call inputs: latents (batch, 4, *size) (odd sides: diffusers forwards the upsample sizes), a timestep,
    a text context, and SDXL's added conditions."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, unet.config.in_channels, *size, generator=g)
    ctx = torch.randn(batch, 77, unet.config.cross_attention_dim, generator=g)
    kw = {"return_dict": False}
    if unet.config.addition_embed_type == "text_time":
        pooled = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
        kw["added_cond_kwargs"] = {"text_embeds": torch.randn(batch, pooled, generator=g),
                                   "time_ids": torch.randn(batch, 6, generator=g)}
    return x, ctx, kw


def _controlnet_residuals(unet, x, t, ctx, kw, seed: int = 1):
    """Random ControlNet-like residuals of the shapes of ``unet``'s skip tensors and mid-block output."""
    shapes = []
    hooks = [unet.conv_in.register_forward_hook(lambda m, a, out: shapes.append(out.shape))]
    hooks += [b.register_forward_hook(lambda m, a, out: shapes.extend(r.shape for r in out[1]))
              for b in unet.down_blocks]
    hooks.append(unet.mid_block.register_forward_hook(lambda m, a, out: shapes.append(out.shape)))
    unet(x, t, ctx, **kw)
    for h in hooks:
        h.remove()
    g = torch.Generator().manual_seed(seed)
    res = [torch.randn(s, generator=g) * 0.5 for s in shapes]
    return {"down_block_additional_residuals": tuple(res[:-1]), "mid_block_additional_residual": res[-1]}


@pytest.mark.parametrize("controlnet", [False, True], ids=["plain", "controlnet"])
@pytest.mark.parametrize("arch", ARCHS)
def test_split_forward_full_step_is_the_unet_and_shallow_step_is_deepcache(engines, arch, controlnet):
    """For every branch b: the full step equals ``UNet2DConditionModel.forward`` bit for bit; a shallow step at the
    same inputs gives the same output again (its shallow path recomputes what the full one did); a shallow step at
    new inputs equals the UNet's own forward with the input of U_{n-1-b} replaced by the feature the full step
    cached (a forward pre-hook on that up block): DeepCache's formulation. With ControlNet residuals too."""
    unet = engines[arch].pipe.unet
    x, ctx, kw = _inputs(unet)
    x2, ctx2, _ = _inputs(unet, seed=5)
    t, t2 = torch.tensor(700), torch.tensor(640)
    extra = _controlnet_residuals(unet, x, t, ctx, kw) if controlnet else {}
    extra2 = _controlnet_residuals(unet, x2, t2, ctx2, kw, seed=6) if controlnet else {}
    assert deep_cache.install(unet)
    try:
        with torch.no_grad():
            ref = unet(x, t, ctx, **kw, **extra)[0]  # deep_cache=None: the forward as it was
            for b in range(deep_cache.branches(unet)):
                first_up = unet.up_blocks[len(unet.up_blocks) - 1 - b]
                seen = []
                hook = first_up.register_forward_pre_hook(
                    lambda m, args, kwargs: seen.append(kwargs["hidden_states"].clone()), with_kwargs=True)
                full = unet(x, t, ctx, **kw, **extra, deep_cache=Step(FULL, b))[0]
                hook.remove()
                assert torch.equal(full, ref), b
                same = unet(x, t, ctx, **kw, **extra, deep_cache=Step(SHALLOW, b))[0]
                assert torch.equal(same, ref), b
                shallow = unet(x2, t2, ctx2, **kw, **extra2, deep_cache=Step(SHALLOW, b))[0]
                swap = first_up.register_forward_pre_hook(
                    lambda m, args, kwargs: (args, {**kwargs, "hidden_states": seen[0]}), with_kwargs=True)
                expected = unet(x2, t2, ctx2, **kw, **extra2)[0]
                swap.remove()
                assert torch.equal(shallow, expected), b
                assert not torch.equal(shallow, unet(x2, t2, ctx2, **kw, **extra2)[0]), b  # the deep part is old
    finally:
        assert deep_cache.uninstall(unet)
    assert "forward" not in unet.__dict__


def test_split_forward_without_a_full_step_and_bad_modes_raise(engines):
    unet = engines["tiny"].pipe.unet
    x, ctx, kw = _inputs(unet)
    deep_cache.install(unet)
    try:
        with pytest.raises(RuntimeError, match="before any full step"), torch.no_grad():
            unet(x, torch.tensor(10), ctx, **kw, deep_cache=Step(SHALLOW, 0))
    finally:
        deep_cache.uninstall(unet)
    with pytest.raises(ValueError, match="mode"):
        Step("half", 0)


def test_split_forward_buffers_are_bounded(engines):
    unet = engines["tiny"].pipe.unet
    deep_cache.install(unet)
    split = deep_cache.installed(unet)
    try:
        with torch.no_grad():
            for side in range(3, 3 + deep_cache.MAX_BUFFERS + 2):
                x, ctx, kw = _inputs(unet, size=(side, side))
                unet(x, torch.tensor(10), ctx, **kw, deep_cache=Step(FULL, 0))
        assert len(split.buffers) == deep_cache.MAX_BUFFERS
        assert [k[1][-1] for k in split.buffers] == list(range(5, 5 + deep_cache.MAX_BUFFERS))  # the newest kept
    finally:
        deep_cache.uninstall(unet)
    assert not split.buffers


class _Counts:
    """UNet calls seen by hooks: every call runs conv_in, only a full one the mid block."""

    def __init__(self, unet):
        self.calls = self.mid = 0
        self.handles = [unet.conv_in.register_forward_hook(lambda *a: self._add("calls")),
                        unet.mid_block.register_forward_hook(lambda *a: self._add("mid"))]

    def _add(self, name):
        setattr(self, name, getattr(self, name) + 1)

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_interval_1_is_the_exact_pipeline(engines, arch):
    engine = engines[arch]
    kw = dict(seed=7, num_inference_steps=3, guidance_scale=5.0, **SMALL)
    exact = engine.txt2img("a photo of a cat", **kw)[0]
    assert engine.last_deep_cache is None
    kw.pop("seed")
    stock = engine.pipe("a photo of a cat", generator=[torch.Generator("cpu").manual_seed(7)], **kw).images[0]
    assert np.array_equal(_px(exact), _px(stock))
    again = engine.txt2img("a photo of a cat", seed=7, cache_interval=1, cache_branch=1, **kw)[0]
    assert np.array_equal(_px(again), _px(stock)) and engine.last_deep_cache is None


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("interval", [2, 3])
def test_full_unet_on_every_nth_step_only(engines, arch, interval):
    engine = engines[arch]
    unet = engine.pipe.unet
    steps = 5
    kw = dict(seed=3, num_inference_steps=steps, guidance_scale=5.0, scheduler="euler", **SMALL)
    exact = engine.txt2img("a cat", **kw)[0]
    for branch in range(deep_cache.branches(unet)):
        counts = _Counts(unet)
        try:
            image = engine.txt2img("a cat", cache_interval=interval, cache_branch=branch, **kw)[0]
        finally:
            counts.remove()
        full = len(range(0, steps, interval))
        assert (counts.calls, counts.mid) == (steps, full), branch
        assert engine.last_deep_cache == {"cache_interval": interval, "cache_branch": branch, "full_steps": full,
                                          "shallow_steps": steps - full}
        assert not np.array_equal(_px(image), _px(exact)), branch
    assert "forward" not in unet.__dict__ and not unet._forward_pre_hooks  # patches undone after each call


def test_img2img_and_inpaint_count_their_own_steps(engines):
    """img2img and inpainting run the same UNet call: int(steps * strength) steps, the first of them full."""
    engine = engines["tiny"]
    unet = engine.pipe.unet
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    mask = np.zeros((32, 32), np.uint8)
    mask[8:24, 8:24] = 255
    kw = dict(seed=1, num_inference_steps=8, guidance_scale=5.0, scheduler="euler")
    for run in (lambda **k: engine.img2img(image, "a cat", strength=0.75, **kw, **k),
                lambda **k: engine.inpaint(image, mask, "a cat", strength=0.75, **kw, **k)):
        exact = run()[0]
        counts = _Counts(unet)
        try:
            cached = run(cache_interval=4)[0]
        finally:
            counts.remove()
        assert (counts.calls, counts.mid) == (6, 2)
        assert engine.last_deep_cache["full_steps"] == 2 and not np.array_equal(_px(cached), _px(exact))


def test_controlnet_runs_every_step_and_deepcache_every_nth():
    engine = sdfast.load("random:tiny", controlnet="random:tiny-controlnet", optimize=False)
    control = np.zeros((32, 32, 3), np.uint8)
    control[4:28:6] = 255
    kw = dict(seed=2, num_inference_steps=4, guidance_scale=5.0, scheduler="euler", control_image=control)
    exact = engine.txt2img("a cat", **kw)[0]
    net_calls = []
    hook = engine.controlnets[0].register_forward_hook(lambda *a: net_calls.append(1))
    counts = _Counts(engine.pipe.unet)
    try:
        cached = engine.txt2img("a cat", cache_interval=2, **kw)[0]
    finally:
        counts.remove()
        hook.remove()
    assert (len(net_calls), counts.calls, counts.mid) == (4, 4, 2)
    assert not np.array_equal(_px(cached), _px(exact))


def test_should_stop_and_deepcache_share_the_step_callback(engines):
    engine = engines["tiny"]
    unet = engine.pipe.unet
    counts = _Counts(unet)
    seen = []
    try:
        with pytest.raises(GenerationCancelled):
            engine.txt2img("a cat", seed=0, num_inference_steps=6, scheduler="euler", cache_interval=2,
                           should_stop=lambda: len(seen.append(1) or seen) >= 4, **SMALL)
    finally:
        counts.remove()
    assert (counts.calls, counts.mid) == (4, 2)  # steps 0 and 2 full; stopped after step 3
    assert "forward" not in unet.__dict__ and not unet._forward_pre_hooks


@pytest.mark.parametrize("kwargs, field", [
    ({"cache_interval": 0}, "cache_interval"),
    ({"cache_interval": -2}, "cache_interval"),
    ({"cache_interval": 2.5}, "cache_interval"),
    ({"cache_interval": True}, "cache_interval"),
    ({"cache_interval": "3"}, "cache_interval"),
    ({"cache_interval": 1001}, "cache_interval"),
    ({"cache_branch": -1}, "cache_branch"),
    ({"cache_branch": 1.0}, "cache_branch"),
    ({"cache_branch": 16}, "cache_branch"),
    ({"cache_interval": 2, "cache_branch": 2}, "cache_branch"),  # random:tiny has 2 down blocks: branches 0, 1
])
def test_bad_values_raise_naming_the_field_before_any_step(engines, kwargs, field):
    engine = engines["tiny"]
    calls = []
    hook = engine.pipe.unet.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(InvalidRequestError) as e:
            engine.txt2img("a cat", seed=0, num_inference_steps=2, **kwargs, **SMALL)
        with pytest.raises(InvalidRequestError):
            engine.img2img(np.zeros((32, 32, 3), np.uint8), "a cat", seed=0, num_inference_steps=2, **kwargs)
    finally:
        hook.remove()
    assert e.value.field == field and not calls


def test_a_unet_deepcache_cannot_split_is_refused():
    with pytest.raises(InvalidRequestError, match="UNet2DConditionModel") as e:
        deep_cache.check(torch.nn.Conv2d(4, 4, 1), 2, 0)
    assert e.value.field == "cache_interval"
    deep_cache.check(torch.nn.Conv2d(4, 4, 1), 1, 0)  # the exact pipeline runs any UNet
    with pytest.raises(ValueError, match=">= 2"):
        deep_cache.DeepCache(torch.nn.Conv2d(4, 4, 1), 1)


def test_request_round_trip_and_concat():
    r = Txt2ImgRequest.build("a cat", seed=3, cache_interval=3, cache_branch=1)
    assert (r.cache_interval, r.cache_branch) == (3, 1)
    assert Txt2ImgRequest.build(**r.as_kwargs()) == r
    i = Img2ImgRequest.build(np.zeros((16, 16, 3), np.uint8), "a cat", seed=1, cache_interval=2)
    assert i.cache_interval == 2 and Img2ImgRequest.build(**i.as_kwargs()).cache_interval == 2
    assert Txt2ImgRequest.concat([r, Txt2ImgRequest.build("a dog", seed=5, cache_interval=3, cache_branch=1)])
    with pytest.raises(ValueError, match="DeepCache"):
        Txt2ImgRequest.concat([r, Txt2ImgRequest.build("a dog", seed=5)])


def test_optimized_pipeline_captures_the_split_forward_and_unoptimize_removes_it():
    """The optimizer's DeepCache pass: the UNet's forward is the split forward (what the graph pass captures on a
    GPU) over the passes' rewritten blocks; a DeepCache call on the optimized pipeline takes the same schedule and
    gives the unoptimized pipeline's image (fp32 fused kernels: within a level or two); ``unoptimize`` removes it."""
    fast = sdfast.load("random:tiny")
    plain = sdfast.load("random:tiny", optimize=False)
    unet = fast.pipe.unet
    split = deep_cache.installed(unet)
    assert isinstance(unet.__dict__.get("forward"), deep_cache.SplitForward) and split.inner is not None
    kw = dict(seed=4, num_inference_steps=2, scheduler="euler", cache_interval=2, height=24, width=24)
    a, b = fast.txt2img("a cat", **kw)[0], plain.txt2img("a cat", **kw)[0]
    assert fast.last_deep_cache == {"cache_interval": 2, "cache_branch": 0, "full_steps": 1, "shallow_steps": 1}
    assert len(split.buffers) == 1
    assert np.abs(_px(a) - _px(b)).max() <= 2
    sdfast.unoptimize(fast.pipe)
    assert "forward" not in unet.__dict__ and deep_cache.installed(unet) is None
