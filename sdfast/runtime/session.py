"""What happens around one pipeline call: the one place that knows the order of sdfast's per-call steps.

``Engine.run`` opens a ``CallSession`` for each call; the optimizer's patched ``pipe.check_inputs`` calls
``before_denoising`` (so a user's own ``pipe(...)`` on an optimized pipeline gets it too). In call order:

1. ``CallSession.before_text_encoders``: the text encoders' CUDA-graph check (their weights or hooks may have
   changed since the last call), before the engine encodes the prompt itself (``sdfast.prompts``). Every graph
   check is made at the module's first run after it was asked for (``GraphCache.check``): a module the call does not
   run is not checked, and a late one (the VAE decoder) is checked while the GPU still works.
2. ``CallSession.call`` (a context manager around ``pipe(...)``): the scheduler goes in, with its timesteps kept
   on the host when the UNet runs in CUDA graphs (``runtime.host_timesteps``: no GPU->host sync per step) and
   released otherwise; a forward hook on the VAE decoder records a one-element "all finite" flag on the device
   (no wait for the decoder); a mark of the graph cache is taken. A VAE the optimizer keeps in fp32 has its config's
   ``force_upcast`` off for the call: it already is what that flag asks for, and diffusers' SDXL img2img pipeline
   would otherwise cast the VAE to fp32 and back to fp16 (dropping its CUDA graph, and leaving it in fp16). The
   ControlNets run beside the UNet's down blocks (``runtime.control_overlap``: armed for diffusers' own ControlNet
   pipelines, joined at the end of the call).
3. ``before_denoising`` (from ``check_inputs``, inside the pipeline call): the time-embedding pack is refreshed
   first (``passes.time_embedding``: a changed parameter repacks, so the graph check sees its new storage at
   once and one capture follows, not two), then every CUDA graph is due for its check. The engine makes the
   denoising nets' refresh and check itself just before ``pipe(...)`` (``CallSession.check_denoising_nets``),
   while the GPU still runs the text encoders; ``before_denoising`` then leaves them out.
4. On ``torch.OutOfMemoryError`` (or a host allocation failure) the graphs captured since the mark are dropped,
   so a call that could not complete frees their buffers, and a host ``MemoryError`` is raised as
   ``torch.OutOfMemoryError`` (one error type for the service to answer 503).
5. ``check_finite``: after the pixels and the flags came back, ``NonFiniteOutputError`` instead of a black image.
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import NonFiniteOutputError
from . import host_timesteps

TEXT_ENCODERS = ("text_encoder", "text_encoder_2")


def graphs_of(pipe):
    """The pipeline's CUDA-graph cache (``runtime.cuda_graphs.GraphCache``), or None (not optimized, or without
    CUDA graphs)."""
    return getattr(getattr(pipe, "_sdfast", None), "graphs", None)


def _refresh_denoising_nets(pipe) -> list:
    """The time-embedding refresh of the UNet and the ControlNets (before their graph check, so that it sees a
    repacked storage at once); returns those nets."""
    from ..controlnet import denoising_nets
    from ..passes import time_embedding

    nets = denoising_nets(pipe)
    for net in nets:
        time_embedding.refresh(net)
    return nets


def before_denoising(pipe, graphs) -> None:
    """At the start of every pipeline call (the optimizer's ``check_inputs``): the time-embedding refresh, then
    every graph of ``graphs`` is due for its check (at its next run). When the engine already refreshed and checked
    the denoising nets for this call (``CallSession.check_denoising_nets``), only the rest is due."""
    if not graphs.checked_early():
        _refresh_denoising_nets(pipe)
    graphs.check()


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


@contextlib.contextmanager
def oom_guard(graphs, *, what, mark: int | None = None):
    """Around work that may run out of memory (a pipeline call, one step of ``runtime.step_batch``): on
    ``torch.OutOfMemoryError`` or a host allocation failure, the graphs of ``graphs`` (a ``GraphCache`` or None)
    captured since ``mark`` (default: now) are dropped, so their buffers are freed, and a host failure is raised as
    ``torch.OutOfMemoryError`` (``what`` in its message, e.g. "2 image(s) of 512x512 on cuda:0"): one error type for
    the service to answer 503. ``what``: a string, or a callable returning one, called only for that message (it
    runs around every denoising step of ``runtime.step_batch``: no formatting, no device query on the way in)."""
    if mark is None and graphs is not None:
        mark = graphs.mark()
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
        if not _is_oom(e):
            raise
        if graphs is not None:  # graphs captured for work that could not complete: free their buffers
            graphs.drop_since(mark)
        if not isinstance(e, torch.OutOfMemoryError):  # host memory: the same error type as CUDA's
            raise torch.OutOfMemoryError(
                f"out of host memory for {what() if callable(what) else what} ({e}); "
                "ask for fewer or smaller images") from e
        raise


class CallSession:
    """The per-call steps around one ``pipe(...)`` of ``pipe`` (see the module docstring)."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.graphs = graphs_of(pipe)

    @property
    def graphed(self) -> bool:
        """Whether the pipeline runs in CUDA graphs (then prompt and negative prompt share one encoder batch)."""
        return self.graphs is not None

    def check_denoising_nets(self) -> None:
        """Inside ``call``, just before ``pipe(...)``, while the GPU still runs the text encoders the engine queued:
        the denoising nets' time-embedding refresh and graph check, which ``before_denoising`` would otherwise leave
        to the first step, with the GPU idle (SDXL's UNet: about 1,900 modules compared). Nothing runs between this
        and the pipeline's ``check_inputs`` but diffusers' own setup, so the weights cannot change in between."""
        if self.graphs is not None:
            self.graphs.check_early(_refresh_denoising_nets(self.pipe))

    def before_text_encoders(self) -> None:
        """The text encoders' graph check, before the engine runs them (the pipeline's own check of all graphs
        comes after the encoders ran)."""
        if self.graphs is not None:
            self.graphs.check(names=TEXT_ENCODERS)

    @contextlib.contextmanager
    def call(self, scheduler, *, what):
        """Around ``pipe(...)``: sets ``scheduler``, collects the VAE decoder's finite flags into the list it
        yields, and on running out of memory drops the graphs captured inside and raises
        ``torch.OutOfMemoryError`` (``what``, e.g. "2 image(s) of 512x512 on cuda:0", or a callable returning it,
        words a host one)."""
        pipe, graphs = self.pipe, self.graphs
        pipe.scheduler = scheduler
        if graphs is not None:  # the graph runner uploads a host timestep by value: no per-step sync (PNDM)
            host_timesteps.keep_on_host(scheduler)
        else:  # an eager UNet would copy it to the GPU with a sync at every step
            host_timesteps.release(scheduler)
        finite: list[torch.Tensor] = []
        hook = pipe.vae.decoder.register_forward_hook(  # a flag on the device: no wait for the decoder here
            lambda module, args, output: finite.append(torch.isfinite(output).all())
        )
        mark = graphs.mark() if graphs is not None else None
        state = getattr(pipe, "_sdfast", None)
        upcast = getattr(state, "vae_dtypes", None) is not None and bool(pipe.vae.config.get("force_upcast", False))
        if upcast:
            pipe.vae.register_to_config(force_upcast=False)
        overlap = getattr(state, "control_overlap", None)  # the ControlNets beside the UNet: joined before a drop
        try:
            with oom_guard(graphs, what=what, mark=mark), (
                    overlap.armed_for(pipe) if overlap is not None else contextlib.nullcontext()):
                yield finite
        finally:
            if graphs is not None:  # a check_denoising_nets whose pipeline call never reached its check
                graphs.forget_early()
            hook.remove()
            if upcast:
                pipe.vae.register_to_config(force_upcast=True)

    def check_finite(self, all_finite: bool, guidance_scale: float) -> None:
        """Raise ``NonFiniteOutputError`` unless the images (and the decoder's flags) were all finite."""
        if all_finite:
            return
        dtype = self.pipe.unet.dtype
        raise NonFiniteOutputError(
            "the pipeline produced NaN/Inf values; no image is returned. "
            + ("Likely an fp16 overflow or a broken kernel: try dtype=torch.float32, optimize=False, or report it"
               if dtype in (torch.float16, torch.bfloat16) else f"It runs in {dtype} already: check guidance_scale "
               f"({guidance_scale:g}) and the weights, try optimize=False, or report it")
        )
