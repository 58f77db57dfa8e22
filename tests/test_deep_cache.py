"""Issue 34: DeepCache (``sdfast.runtime.deep_cache``) on the CPU, on the tiny SD 1.x, 2.x and SDXL architectures.

The split forward against the UNet's own forward at every skip branch, those entering an up block in the middle and
those at block boundaries (its full step bit-equal, with ControlNet, T2I-Adapter residuals and FreeU too; its shallow
step equal to the UNet with the deep feature swapped in by a hook, the plain-PyTorch statement of DeepCache; the
modules a shallow step runs), the layer-by-layer helpers against the blocks' forwards, the engine's schedule (the full
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


def _adapter_residuals(unet, x, t, ctx, kw, seed: int = 2):
    """Random T2I-Adapter-like intrablock residuals: one per down block, of the shape diffusers adds it at (a
    CrossAttnDownBlock2D's last layer's output, a DownBlock2D's output), as a fresh list per call (diffusers pops
    it)."""
    shapes = []
    hooks = []
    for block in unet.down_blocks:
        if getattr(block, "has_cross_attention", False):
            hooks.append(block.attentions[-1].register_forward_hook(lambda m, a, out: shapes.append(out[0].shape)))
        else:
            hooks.append(block.register_forward_hook(lambda m, a, out: shapes.append(out[0].shape)))
    unet(x, t, ctx, **kw)
    for h in hooks:
        h.remove()
    g = torch.Generator().manual_seed(seed)
    res = [torch.randn(s, generator=g) * 0.5 for s in shapes]
    return lambda: {"down_intrablock_additional_residuals": list(res)}


def _feature_hook(unet, branch: int, swap=None):
    """A hook on the stock forward at the deep feature of ``branch`` (the hidden state entering up ResNet
    N-1-branch): with ``swap`` None it records that tensor (returned list), else it replaces it by ``swap``.
    Returns (handle, list)."""
    j, j0 = deep_cache._entry(unet, branch)
    block = unet.up_blocks[j]
    seen = []
    if j0 == 0:  # the block's input
        def pre(m, args, kwargs):
            if swap is None:
                seen.append(kwargs["hidden_states"].clone())
                return None
            return args, {**kwargs, "hidden_states": swap}
        return block.register_forward_pre_hook(pre, with_kwargs=True), seen
    cross = getattr(block, "has_cross_attention", False)
    layer = block.attentions[j0 - 1] if cross else block.resnets[j0 - 1]  # the last module of layer j0-1

    def post(m, args, out):
        if swap is None:
            seen.append((out[0] if cross else out).clone())
            return None
        return (swap,) if cross else swap
    return layer.register_forward_hook(post), seen


@pytest.mark.parametrize("residuals", ["plain", "controlnet", "adapter"])
@pytest.mark.parametrize("arch", ARCHS)
def test_split_forward_full_step_is_the_unet_and_shallow_step_is_deepcache(engines, arch, residuals):
    """For every branch m (those entering an up block in the middle and those at a block's boundary): the full
    step equals ``UNet2DConditionModel.forward`` bit for bit; a shallow step at the same inputs gives the same
    output again (its shallow path recomputes what the full one did); a shallow step at new inputs equals the
    UNet's own forward with the hidden state entering up ResNet N-1-m replaced by the feature the full step cached
    (a hook on the stock forward): DeepCache's formulation. With ControlNet and T2I-Adapter residuals too."""
    unet = engines[arch].pipe.unet
    x, ctx, kw = _inputs(unet)
    x2, ctx2, _ = _inputs(unet, seed=5)
    t, t2 = torch.tensor(700), torch.tensor(640)
    if residuals == "controlnet":
        net, net2 = _controlnet_residuals(unet, x, t, ctx, kw), _controlnet_residuals(unet, x2, t2, ctx2, kw, seed=6)
        extra, extra2 = (lambda: net), (lambda: net2)
    elif residuals == "adapter":
        extra, extra2 = _adapter_residuals(unet, x, t, ctx, kw), _adapter_residuals(unet, x2, t2, ctx2, kw, seed=7)
    else:
        extra = extra2 = dict
    assert deep_cache.install(unet)
    try:
        with torch.no_grad():
            ref = unet(x, t, ctx, **kw, **extra())[0]  # deep_cache=None: the forward as it was
            new = unet(x2, t2, ctx2, **kw, **extra2())[0]
            assert deep_cache.branches(unet) == 4
            for m in range(deep_cache.branches(unet)):
                hook, seen = _feature_hook(unet, m)
                assert torch.equal(unet(x, t, ctx, **kw, **extra())[0], ref)
                hook.remove()
                full = unet(x, t, ctx, **kw, **extra(), deep_cache=Step(FULL, m))[0]
                assert torch.equal(full, ref), m
                same = unet(x, t, ctx, **kw, **extra(), deep_cache=Step(SHALLOW, m))[0]
                assert torch.equal(same, ref), m
                shallow = unet(x2, t2, ctx2, **kw, **extra2(), deep_cache=Step(SHALLOW, m))[0]
                swap, _ = _feature_hook(unet, m, swap=seen[0])
                expected = unet(x2, t2, ctx2, **kw, **extra2())[0]
                swap.remove()
                assert torch.equal(shallow, expected), m
                assert not torch.equal(shallow, new), m  # the deep part is old
    finally:
        assert deep_cache.uninstall(unet)
    assert "forward" not in unet.__dict__


def _modules_run(unet):
    """Hooks counting the calls of the mid block and of every ResNet, downsampler and upsampler of the down and up
    blocks, by module name."""
    named = {"mid_block": unet.mid_block}
    for kind in ("down_blocks", "up_blocks"):
        for i, block in enumerate(getattr(unet, kind)):
            for part in ("resnets", "downsamplers", "upsamplers"):
                for k, m in enumerate(getattr(block, part, None) or ()):
                    named[f"{kind}.{i}.{part}.{k}"] = m
    counts = dict.fromkeys(named, 0)
    def count(name):
        return lambda *a: counts.__setitem__(name, counts[name] + 1)

    handles = [m.register_forward_hook(count(name)) for name, m in named.items()]
    return counts, handles


@pytest.mark.parametrize("arch", ["tiny", "tiny-xl"])
def test_a_shallow_step_runs_the_down_layers_to_s_m_and_the_last_m_plus_1_up_layers(engines, arch):
    """What a shallow step at branch m runs, read by hooks: the down ResNets and downsamplers whose outputs are
    s_1..s_m (a downsampler only when its output is one of them), the up ResNets N-1-m..N-1 and the upsamplers of
    their blocks, each once; never the mid block."""
    unet = engines[arch].pipe.unet
    x, ctx, kw = _inputs(unet)
    down = []  # the modules making s_1..s_{N-1}, in order
    for i, block in enumerate(unet.down_blocks):
        down += [f"down_blocks.{i}.resnets.{k}" for k in range(len(block.resnets))]
        down += [f"down_blocks.{i}.downsamplers.0"] * len(block.downsamplers or ())
    up, upsamplers = [], []  # the up ResNets in execution order; (upsampler, the index of its block's last ResNet)
    for j, block in enumerate(unet.up_blocks):
        up += [f"up_blocks.{j}.resnets.{k}" for k in range(len(block.resnets))]
        upsamplers += [(f"up_blocks.{j}.upsamplers.0", len(up) - 1)] * len(block.upsamplers or ())
    n = deep_cache.branches(unet)
    assert len(down) == n - 1 and len(up) == n
    deep_cache.install(unet)
    try:
        with torch.no_grad():
            for m in range(n):
                unet(x, torch.tensor(10), ctx, **kw, deep_cache=Step(FULL, m))
                counts, handles = _modules_run(unet)
                try:
                    unet(x, torch.tensor(10), ctx, **kw, deep_cache=Step(SHALLOW, m))
                finally:
                    for h in handles:
                        h.remove()
                ran = {name for name, c in counts.items() if c}
                expected = set(down[:m]) | set(up[n - 1 - m:]) | {u for u, last in upsamplers if last >= n - 1 - m}
                assert ran == expected, (m, sorted(ran ^ expected))
                assert max(counts.values()) == 1, m
    finally:
        deep_cache.uninstall(unet)


@pytest.mark.parametrize("arch", ARCHS)
def test_full_step_with_freeu_is_the_unet(engines, arch):
    """FreeU (``enable_freeu``: the up blocks rescale the hidden state and the skip before concatenating) in the
    up block a branch splits: the full step is still the UNet's forward bit for bit, the shallow step at the same
    inputs too."""
    unet = engines[arch].pipe.unet
    x, ctx, kw = _inputs(unet, size=(8, 8))
    unet.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    deep_cache.install(unet)
    try:
        with torch.no_grad():
            ref = unet(x, torch.tensor(300), ctx, **kw)[0]
            for m in range(deep_cache.branches(unet)):
                assert torch.equal(unet(x, torch.tensor(300), ctx, **kw, deep_cache=Step(FULL, m))[0], ref), m
                assert torch.equal(unet(x, torch.tensor(300), ctx, **kw, deep_cache=Step(SHALLOW, m))[0], ref), m
    finally:
        unet.disable_freeu()
        deep_cache.uninstall(unet)
    with torch.no_grad():
        assert not torch.equal(unet(x, torch.tensor(300), ctx, **kw)[0], ref)  # FreeU changed it


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_helpers_are_the_blocks_forwards(engines, arch):
    """``_down_layers`` with every count gives the block's first skip tensors (all of them: the block's forward,
    the T2I-Adapter residual where diffusers adds it); ``_up_layers`` over any split start..stop, start..end gives
    the block's forward: bit for bit."""
    from sdfast.runtime.deep_cache import _down_layers, _up_layers

    unet = engines[arch].pipe.unet
    g = torch.Generator().manual_seed(3)
    temb = torch.randn(2, unet.time_embedding.linear_2.out_features, generator=g)
    cross = dict(encoder_hidden_states=torch.randn(2, 7, unet.config.cross_attention_dim, generator=g),
                 attention_mask=None, cross_attention_kwargs=None, encoder_attention_mask=None)
    with torch.no_grad():
        h = torch.randn(2, unet.config.block_out_channels[0], 6, 6, generator=g)
        for block in unet.down_blocks:
            is_cross = getattr(block, "has_cross_attention", False)
            kw = cross if is_cross else {}
            out, skips = block(hidden_states=h, temb=temb, **kw)
            total = deep_cache._down_skips(block)
            for count in range(1, total + 1):
                mine, part = _down_layers(block, h, temb, cross, count)
                assert len(part) == count and all(torch.equal(a, b) for a, b in zip(part, skips)), count
            assert torch.equal(mine, out)
            r = torch.randn(skips[len(block.resnets) - 1 if is_cross else -1].shape, generator=g)
            if is_cross:
                out_r, skips_r = block(hidden_states=h, temb=temb, additional_residuals=r, **kw)
            else:
                out_r, skips_r = block(hidden_states=h, temb=temb)
                out_r += r  # where UNet2DConditionModel.forward adds it (in place: the last skip tensor too)
            for count in range(1, total + 1):
                mine, part = _down_layers(block, h, temb, cross, count, r)
                assert all(torch.equal(a, b) for a, b in zip(part, skips_r)), count
            assert torch.equal(mine, out_r)
            h = out
        for block in unet.up_blocks:
            layers = len(block.resnets)
            res = tuple(torch.randn(2, r.in_channels - block.resnets[0].out_channels if i == layers - 1 else
                                    r.in_channels - r.out_channels, *h.shape[2:], generator=g)
                        for i, r in enumerate(block.resnets))[::-1]  # res[-1] enters layer 0
            hin = torch.randn(2, block.resnets[0].in_channels - res[-1].shape[1], *h.shape[2:], generator=g)
            kw = cross if getattr(block, "has_cross_attention", False) else {}
            ref = block(hidden_states=hin, res_hidden_states_tuple=res, temb=temb, upsample_size=None, **kw)
            assert torch.equal(_up_layers(block, hin, res, temb, cross, None, 0, layers), ref)
            for split in range(1, layers):
                mid = _up_layers(block, hin, res[-split:], temb, cross, None, 0, split)
                assert torch.equal(_up_layers(block, mid, res[:-split], temb, cross, None, split, layers), ref), split
            with pytest.raises(ValueError, match="skip tensors"):
                _up_layers(block, hin, res, temb, cross, None, 1, layers)
            h = ref


def test_branches_and_their_entries_on_the_real_architectures():
    """N skip tensors: 12 for SD 1.x/2.x, 9 for SDXL; branch m enters the up path at up ResNet N-1-m; the old
    whole-block branches b are m = sum(len(U_j.resnets) for j >= n-1-b) - 1 (entering U_{n-1-b} at its first
    layer). The tiny ones: 4."""
    from diffusers import UNet2DConditionModel

    from sdfast.architectures import ARCHITECTURES

    for arch, n in (("sd15", 12), ("sd21", 12), ("sdxl", 9), ("tiny", 4), ("tiny-v", 4), ("tiny-xl", 4)):
        with torch.device("meta"):
            unet = UNet2DConditionModel.from_config(ARCHITECTURES[arch]["unet"])
        assert deep_cache.branches(unet) == n, arch
        per_block = len(unet.up_blocks[0].resnets)
        assert [deep_cache._entry(unet, m) for m in range(n)] == \
            [(len(unet.up_blocks) - 1 - m // per_block, per_block - 1 - m % per_block) for m in range(n)]
        up = [len(b.resnets) for b in unet.up_blocks]
        for b in range(len(unet.down_blocks)):
            assert deep_cache._entry(unet, sum(up[len(up) - 1 - b:]) - 1) == (len(up) - 1 - b, 0)
        for m in range(n):
            deep_cache.check(unet, 2, m)
        with pytest.raises(InvalidRequestError, match=rf"\[0, {n - 1}\]") as e:
            deep_cache.check(unet, 2, n)
        assert e.value.field == "cache_branch"
        with pytest.raises(ValueError):
            deep_cache._entry(unet, n)
    # SD1.5 branch 0: conv_in's skip into U_3's last layer (ResNet + attention); SDXL's: into U_2's last ResNet
    with torch.device("meta"):
        sd15 = UNet2DConditionModel.from_config(ARCHITECTURES["sd15"]["unet"])
        sdxl = UNet2DConditionModel.from_config(ARCHITECTURES["sdxl"]["unet"])
    assert deep_cache._entry(sd15, 0) == (3, 2) and deep_cache._entry(sdxl, 0) == (2, 2)


def test_a_branch_inside_a_block_the_helpers_do_not_mirror_is_refused(engines):
    """A branch entering in the middle a block of another class (here a subclass of UpBlock2D) is refused naming
    ``cache_branch``; branches at its boundaries run."""
    unet = engines["tiny"].pipe.unet  # U_0 is an UpBlock2D of two ResNets: branch 2 enters it at layer 1
    block = unet.up_blocks[0]
    cls = type(block)
    block.__class__ = type("OtherUpBlock", (cls,), {})
    try:
        with pytest.raises(InvalidRequestError, match="OtherUpBlock") as e:
            deep_cache.check(unet, 2, 2)
        assert e.value.field == "cache_branch"
        for m in (0, 1, 3):
            deep_cache.check(unet, 2, m)
    finally:
        block.__class__ = cls


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
    ({"cache_interval": 2, "cache_branch": 4}, "cache_branch"),  # random:tiny has 4 skip tensors: branches 0-3
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


def test_optimized_pipeline_captures_the_split_forward_and_unoptimize_removes_it(monkeypatch):
    """The optimizer's DeepCache pass: the UNet's forward is the split forward (what the graph pass captures on a
    GPU) over the passes' rewritten blocks; its full step at every branch is the optimized UNet's forward bit for
    bit, the up block it splits concatenating on the skip-concat pass's kernel as that block's rebound forward
    does (one ``cat_channels`` per up ResNet), and its shallow step at the same inputs gives that output again (at
    branch 0 up to the rounding of a time-embedding projection computed on its own); a DeepCache call on the
    optimized pipeline takes the same schedule and gives the unoptimized pipeline's image (fp32 fused kernels:
    within a level or two); ``unoptimize`` removes it."""
    from sdfast.passes import skip_concat

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
    cats = []
    real = skip_concat.cat_channels
    monkeypatch.setattr(skip_concat, "cat_channels", lambda x, y: cats.append(1) or real(x, y))
    x, ctx, kw = _inputs(unet, batch=1, size=(4, 4))
    x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = split.inner(x, torch.tensor(500), ctx, **kw)[0]
        ups = len(cats)
        assert ups == deep_cache.branches(unet)
        for m in range(deep_cache.branches(unet)):
            del cats[:]
            assert torch.equal(unet(x, torch.tensor(500), ctx, **kw, deep_cache=Step(FULL, m))[0], ref), m
            assert len(cats) == ups, m
            shallow = unet(x, torch.tensor(500), ctx, **kw, deep_cache=Step(SHALLOW, m))[0]
            if m == 0:  # no down ResNet runs: the up ResNet projects the time embedding on its own (the temb pass's
                torch.testing.assert_close(shallow, ref, rtol=1e-5, atol=1e-6)  # leader is the first down ResNet)
            else:
                assert torch.equal(shallow, ref), m
    sdfast.unoptimize(fast.pipe)
    assert "forward" not in unet.__dict__ and deep_cache.installed(unet) is None
