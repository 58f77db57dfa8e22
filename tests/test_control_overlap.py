"""The ControlNet beside the UNet's down blocks (``sdfast.runtime.control_overlap``), what the CPU can check: the
UNet reads the ControlNet's residuals only after the module where its step's graph is cut (against the diffusers
installed), the cut is made only for diffusers' own forward with both residual arguments, overlap is armed only for
diffusers' six ControlNet pipelines, and the ControlNet's forward runs on the side stream only while armed. The
streams and the split graphs themselves are checked on the GPU (``test_control_overlap_gpu.py``)."""

import types

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from sdfast.controlnet import build_random_controlnet
from sdfast.loading import build_random_pipeline
from sdfast.runtime import control_overlap, execution_device
from sdfast.runtime.control_overlap import PIPELINES, ControlNetOnSide, UNetSplit, overlaps_in
from sdfast.runtime.deep_cache import SplitForward, Step


class _Uses(TorchFunctionMode):
    """Logs ("use", op) for every op that takes one of ``tensors`` (by identity) as an argument."""

    def __init__(self, tensors, log):
        super().__init__()
        self.ids, self.log = {id(t) for t in tensors}, log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name != "__get__" and any(id(x) in self.ids for x in pytree.tree_leaves((args, kwargs))):
            self.log.append(("use", name))
        return func(*args, **kwargs)


def _inputs(arch):
    """The tiny pipeline of ``arch``, its ControlNet's residuals for one step, and the UNet's keyword arguments."""
    pipe = build_random_pipeline(arch)
    net = build_random_controlnet(f"{arch}-controlnet")
    g = torch.Generator().manual_seed(0)
    sample = torch.randn(2, pipe.unet.config.in_channels, 8, 8, generator=g)
    ctx = torch.randn(2, 4, pipe.unet.config.cross_attention_dim, generator=g)
    kwargs = {}
    if pipe.unet.config.addition_embed_type == "text_time":
        text = pipe.unet.add_embedding.linear_1.in_features - 6 * pipe.unet.config.addition_time_embed_dim
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.randn(2, text, generator=g),
                                       "time_ids": torch.randn(2, 6, generator=g)}
    cond = torch.rand(2, 3, 64, 64, generator=g)
    with torch.no_grad():
        down, mid = net(sample, 10, encoder_hidden_states=ctx, controlnet_cond=cond, return_dict=False, **kwargs)
    kwargs.update(down_block_additional_residuals=down, mid_block_additional_residual=mid)
    return pipe.unet, (sample, 10), dict(kwargs, encoder_hidden_states=ctx)


@pytest.mark.parametrize("arch", ["tiny", "tiny-xl"])
def test_the_unet_reads_the_residuals_only_after_the_cut(arch):
    """What the split graph relies on: diffusers' forward reads no residual before ``down_blocks[-1]`` returns (its
    first graph would read stale residuals), and reads every one after."""
    unet, args, kwargs = _inputs(arch)
    split = UNetSplit(unet, overlap=None)
    cut = split.cut_after(unet.forward, args, kwargs)
    assert cut is unet.down_blocks[-1]
    residuals = split.deferred(args, kwargs)
    assert len(residuals) == len(kwargs["down_block_additional_residuals"]) + 1
    log = []
    handle = cut.register_forward_hook(lambda *a: log.append(("cut", "")))
    try:
        with torch.no_grad(), _Uses(residuals, log):
            unet(*args, **kwargs)
    finally:
        handle.remove()
    kinds = [k for k, _ in log]
    assert kinds.count("cut") == 1 and "use" in kinds
    assert kinds.index("cut") < kinds.index("use"), log[:5]
    assert kinds.count("use") >= len(residuals)  # each is added to its skip tensor (or the mid block's output)


def test_the_cut_only_for_diffusers_forward_with_both_residuals():
    unet, args, kwargs = _inputs("tiny")
    split = UNetSplit(unet, overlap=None)
    assert split.cut_after(SplitForward(unet), args, kwargs) is unet.down_blocks[-1]  # the exact step under DeepCache's
    assert split.cut_after(SplitForward(unet), args, dict(kwargs, deep_cache=Step("full", 0))) is None
    assert split.cut_after(unet.forward, args, dict(kwargs, mid_block_additional_residual=None)) is None
    assert split.cut_after(unet.forward, args, dict(kwargs, down_block_additional_residuals=None)) is None
    assert split.cut_after(lambda *a, **k: unet(*a, **k), args, kwargs) is None  # a wrapper: its reads are unknown
    other = build_random_pipeline("tiny").unet
    assert split.cut_after(other.forward, args, kwargs) is None  # another UNet's forward


def test_overlap_is_armed_only_for_diffusers_controlnet_pipelines():
    import diffusers

    assert len(PIPELINES) == 6
    for name in PIPELINES:
        cls = getattr(diffusers, name)
        assert overlaps_in(cls.__new__(cls)), name
        sub = type("Custom" + name, (cls,), {})
        assert not overlaps_in(sub.__new__(sub))  # a subclass may change the loop
        assert not overlaps_in(type(name, (cls,), {}).__new__(type(name, (cls,), {})))  # the same name, another class
    assert not overlaps_in(diffusers.StableDiffusionPipeline.__new__(diffusers.StableDiffusionPipeline))
    cls = diffusers.StableDiffusionControlNetPipeline
    pipe = cls.__new__(cls)
    execution_device.install(pipe)  # what the optimizer does to every pipeline: a same-named subclass of its own
    assert type(pipe) is not cls and overlaps_in(pipe)


class _Overlap:
    """Stands in for ``ControlOverlap`` (whose stream needs CUDA): records what ran on the side stream."""

    def __init__(self):
        self.armed, self.ran = False, []
        self.pipe = types.SimpleNamespace(unet=torch.nn.Module())

    def run(self, fn, args, kwargs):
        self.ran.append(kwargs.get("tag"))
        return fn(*args, **kwargs)


def test_the_controlnet_runs_on_the_side_stream_only_while_armed():
    net = torch.nn.Module()
    calls = []
    net.forward = lambda *a, **k: calls.append(k.get("tag")) or "out"
    overlap = _Overlap()
    forward = ControlNetOnSide(net, overlap)
    assert forward.rebound and forward(tag="idle") == "out" and overlap.ran == []
    overlap.armed = True
    with torch.no_grad():
        assert forward(tag="armed") == "out"
        forward(tag="guess", guess_mode=True)  # the pipeline reads the residuals on the main stream
        forward(1, 2, 3, 4, 5, 6, tag="positional")  # more positional arguments than the pipelines pass: unseen guess_mode
    forward(tag="grad")  # autograd: not a pipeline call
    assert overlap.ran == ["armed"] and calls == ["idle", "armed", "guess", "positional", "grad"]


def test_uninstall_restores_the_forward():
    net = torch.nn.Module()
    inner = types.MethodType(lambda self: "inner", net)
    net.forward = inner
    overlap = object.__new__(control_overlap.ControlOverlap)  # no stream: install and uninstall only
    overlap.pipe, overlap.forward = types.SimpleNamespace(controlnet=net), None
    overlap.install()
    assert isinstance(net.forward, ControlNetOnSide)
    overlap.uninstall()
    assert net.forward is inner
    plain = torch.nn.Linear(2, 2)
    overlap.pipe = types.SimpleNamespace(controlnet=plain)
    overlap.install()
    overlap.uninstall()
    assert "forward" not in plain.__dict__


def test_a_hook_on_the_main_stream_that_could_read_the_residuals_keeps_the_controlnet_there():
    """Hooks that run on the main stream between the ControlNet's call and the UNet's join: a forward hook on the
    ControlNet the pipeline calls, a pre-hook on the UNet, a global one. Only ``stream_safe`` ones leave the side
    stream in use (the benchmark's CUDA-event timers, DeepCache's keyword)."""
    net = torch.nn.Module()
    net.forward = lambda *a, **k: "out"
    overlap = _Overlap()
    overlap.armed = True
    forward = ControlNetOnSide(net, overlap)
    unet = overlap.pipe.unet
    cases = [
        lambda: net.register_forward_hook(lambda m, a, o: None),
        lambda: unet.register_forward_pre_hook(lambda m, a: None),
        lambda: torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None),
        lambda: torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: None),
    ]
    with torch.no_grad():
        for register in cases:
            handle = register()
            forward(tag="watched")
            handle.remove()
        assert overlap.ran == []
        handles = [net.register_forward_hook(control_overlap.stream_safe(lambda m, a, o: None)),
                   unet.register_forward_pre_hook(control_overlap.stream_safe(lambda m, a, k: None), with_kwargs=True)]
        forward(tag="safe")
        for h in handles:
            h.remove()
    assert overlap.ran == ["safe"]
