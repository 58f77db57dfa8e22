"""A ControlNet's step on a second CUDA stream, beside the UNet's down blocks.

In diffusers' ControlNet pipelines (ControlNet: Zhang et al., "Adding Conditional Control to Text-to-Image Diffusion
Models", ICCV 2023) every denoising step runs the ControlNet(s), then the UNet with their residuals
(``down_block_additional_residuals``, ``mid_block_additional_residual``). ``UNet2DConditionModel.forward`` first reads
those residuals after its last down block (it adds them to the skip tensors before the mid block), so its time
embedding, conv_in and down blocks do not depend on the ControlNet and can run at the same time as it: two CUDA
streams, each replaying its graph, the GPU's block scheduler filling one's idle SMs (wave tails, small grids) with
the other's blocks.

- ``ControlOverlap`` holds the side stream (high priority: the ControlNet, longer than the down blocks, is the
  critical path) and whether work queued on it is not joined yet (``pending``). ``install`` makes
  ``ControlNetOnSide`` the forward of ``pipe.controlnet`` (a ``ControlNetModel``, or a ``MultiControlNetModel``, whose
  sums then run on the side stream too): while armed, a call waits for the main stream's work so far and runs
  wholly on the side stream (its graph replays, the output clones, the conditioning scale), and returns residuals
  that only the side stream has written.
- ``UNetSplit`` (a ``runtime.cuda_graphs.GraphSplit``): the UNet's graph runner captures a step that takes ControlNet
  residuals as two graphs, cut where ``down_blocks[-1]`` returns. At replay: the first graph on the main stream; the
  residuals copied into the second graph's inputs on the side stream after the ControlNet; the main stream joins;
  the second graph. Every other path of the runner (eager, a capture, one graph) joins first.

The ControlNets' graphs get a memory pool of their own (``pool``: the shared pool is safe only for graphs that
replay one at a time) and are captured on a stream of their own (``capture_stream``: a graph keeps the cuBLAS
workspace of the stream it was captured on, and two graphs replaying at once must not share one).

Residuals returned while armed are valid on the main stream only after a join, so overlap is armed only where their
one consumer is known to be the UNet call: inside an engine call
(``runtime.session.CallSession.call``, which joins at its end) of one of diffusers' six ControlNet pipelines
(``PIPELINES``, exact classes), whose loops hand the residuals from the ControlNet to the UNet unchanged, except with
``guess_mode`` (they are concatenated with zeros first: such a call runs on the main stream). A user's own
``pipe(...)`` and direct calls of the ControlNet run on the main stream, as before, and so does a call that a hook
on the main stream could watch in between (``ControlNetOnSide``; ``stream_safe`` marks the hooks that read no
tensor). The images are the same bit for bit: the same kernels on the same inputs (tested on the GPU).
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch.nn.modules import module as nn_module
from torch.utils import _pytree as pytree

from sdfast.runtime import execution_device
from sdfast.runtime.cuda_graphs import GraphSplit

# diffusers' ControlNet pipelines whose denoising loop passes the ControlNet's residuals straight to the UNet.
PIPELINES = frozenset((
    "StableDiffusionControlNetPipeline", "StableDiffusionControlNetImg2ImgPipeline",
    "StableDiffusionControlNetInpaintPipeline", "StableDiffusionXLControlNetPipeline",
    "StableDiffusionXLControlNetImg2ImgPipeline", "StableDiffusionXLControlNetInpaintPipeline",
))

# ControlNetModel.forward's first five parameters (sample, timestep, encoder_hidden_states, controlnet_cond,
# conditioning_scale); a call that passes more of them by position (guess_mode could be among them, unseen) runs on
# the main stream. diffusers' pipelines pass two by position.
_MAX_POSITIONAL = 5


def stream_safe(hook):
    """``hook`` (a forward hook or pre-hook) marked as reading no tensor argument or output: it may run on the main
    stream between the ControlNet's call and the UNet's while the ControlNet's residuals are still being written
    on the side stream (a timer recording CUDA events, DeepCache's pre-hook adding a keyword). Any other hook on
    ``pipe.controlnet`` (forward hooks), on ``pipe.unet`` (pre-hooks) or global runs the ControlNet on the main
    stream (``ControlNetOnSide``)."""

    def safe(*args, **kwargs):
        return hook(*args, **kwargs)

    safe.sdfast_stream_safe = True
    return safe


def _may_read_residuals(*hook_dicts) -> bool:
    return any(not getattr(h, "sdfast_stream_safe", False) for hooks in hook_dicts for h in hooks.values())


def overlaps_in(pipe) -> bool:
    """Whether ``pipe`` is exactly one of diffusers' pipelines in ``PIPELINES`` (a subclass may change the loop; the
    optimizer's own, ``runtime.execution_device``, does not)."""
    import diffusers

    cls = execution_device.original_class(pipe)
    return cls.__name__ in PIPELINES and getattr(diffusers, cls.__name__, None) is cls


class ControlOverlap:
    """The side stream of one optimized ControlNet pipeline, and what runs on it (module docstring)."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.stream = torch.cuda.Stream(device=pipe.unet.device, priority=-1)
        # The ControlNets' graphs replay beside the UNet's: a memory pool of their own, and a capture stream of their
        # own (cuBLAS gives each stream its workspace, and a graph keeps the capture stream's).
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_stream = torch.cuda.Stream(device=pipe.unet.device)
        self.unet_split = UNetSplit(pipe.unet, self)
        self.armed = False
        self.pending = False  # work queued on the side stream that the main stream has not waited for
        self.runs = 0  # ControlNet calls run on the side stream
        self.forward: ControlNetOnSide | None = None

    def install(self) -> None:
        """``pipe.controlnet``'s forward becomes a ``ControlNetOnSide`` over the one it has (its graph runner)."""
        self.forward = ControlNetOnSide(self.pipe.controlnet, self)
        self.pipe.controlnet.forward = self.forward

    def uninstall(self) -> None:
        """Undo ``install`` (before the graph runners are uninstalled: the forward under it is one)."""
        forward, self.forward = self.forward, None
        if forward is None:
            return
        net = forward.net
        if net.__dict__.get("forward") is forward:
            if forward.rebound:
                net.forward = forward.inner
            else:
                del net.forward

    @contextlib.contextmanager
    def armed_for(self, pipe):
        """Around one call of ``pipe``: the ControlNet runs on the side stream when ``overlaps_in(pipe)``; at the
        end (also on an error) the main stream joins it."""
        if not overlaps_in(pipe):
            yield
            return
        self.armed = True
        try:
            yield
        finally:
            self.armed = False
            self.join()

    def run(self, fn, args: tuple, kwargs: dict):
        """``fn(*args, **kwargs)`` on the side stream, after the main stream's work so far. The arguments' memory is
        kept from reuse until the side stream has read them (``record_stream``)."""
        main = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(main)
        for x in pytree.tree_leaves((args, kwargs)):
            if isinstance(x, torch.Tensor) and x.is_cuda:
                x.record_stream(self.stream)
        self.pending = True
        self.runs += 1
        with torch.cuda.stream(self.stream):
            return fn(*args, **kwargs)

    def join(self) -> None:
        """The main stream waits for the side stream's work so far (nothing to wait for: nothing happens)."""
        if self.pending:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.pending = False

    def copy_then_join(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (static buffer, residual): on the side stream, after the ControlNet that wrote the residual,
        when work is pending there; then the join."""
        if not self.pending:
            for static, x in pairs:
                static.copy_(x)
            return
        with torch.cuda.stream(self.stream):
            for static, x in pairs:
                static.copy_(x)
        self.join()


class ControlNetOnSide:
    """``pipe.controlnet``'s forward: the forward it had (``inner``), on the side stream while ``overlap`` is armed and
    the call is not ``guess_mode``, not recording gradients and not inside a capture, and no hook that runs on the
    main stream before the UNet's join could read the residuals: a forward hook on ``pipe.controlnet`` (it runs
    after this forward returns), a forward pre-hook on ``pipe.unet``, a global one (all but ``stream_safe`` ones)."""

    def __init__(self, net: torch.nn.Module, overlap: ControlOverlap):
        self.net = net
        self.overlap = overlap
        self.inner = net.forward
        self.rebound = "forward" in net.__dict__

    def __call__(self, *args, **kwargs):
        if (not self.overlap.armed or kwargs.get("guess_mode") or len(args) > _MAX_POSITIONAL
                or torch.is_grad_enabled() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
                or _may_read_residuals(self.net._forward_hooks, self.overlap.pipe.unet._forward_pre_hooks,
                                       nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks)):
            return self.inner(*args, **kwargs)
        return self.overlap.run(self.inner, args, kwargs)


def _runs_stock_forward(unet: torch.nn.Module, forward) -> bool:
    """Whether ``forward`` (the UNet runner's eager forward) is diffusers' ``UNet2DConditionModel.forward`` bound to
    ``unet``, directly or under the DeepCache split forward (``runtime.deep_cache``, which calls it for exact steps):
    the forward whose first read of the ControlNet residuals comes after the last down block."""
    import diffusers

    from sdfast.runtime.deep_cache import SplitForward

    f = forward.inner if isinstance(forward, SplitForward) else forward
    return (isinstance(f, types.MethodType) and f.__func__ is diffusers.UNet2DConditionModel.forward
            and f.__self__ is unet)


class UNetSplit(GraphSplit):
    """The UNet's ``GraphSplit``: a call with both ControlNet residual arguments, through diffusers' own forward (not
    a DeepCache step), is cut where ``down_blocks[-1]`` returns; the residuals are its deferred arguments."""

    def __init__(self, unet: torch.nn.Module, overlap: ControlOverlap):
        self.unet = unet
        self.overlap = overlap

    def cut_after(self, forward, args: tuple, kwargs: dict) -> torch.nn.Module | None:
        if (kwargs.get("deep_cache") is not None or kwargs.get("down_block_additional_residuals") is None
                or kwargs.get("mid_block_additional_residual") is None or not _runs_stock_forward(self.unet, forward)):
            return None
        return self.unet.down_blocks[-1]

    def deferred(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
        return (*kwargs["down_block_additional_residuals"], kwargs["mid_block_additional_residual"])

    def copy_deferred(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.overlap.copy_then_join(pairs)

    def join(self) -> None:
        self.overlap.join()
