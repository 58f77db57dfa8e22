"""``optimize(pipe, config)``: compose sdfast's passes on a diffusers pipeline, in place, reversibly.

Order: attention processor -> norm fusion -> channels_last layout -> time-embedding packing -> upsampling -> skip
concatenation -> convolution biases -> small-K linears -> CUDA graphs. Each pass is its own module (``sdfast.passes``,
``sdfast.runtime``), counts what it changed, and can be undone (``unoptimize``). The pipeline object stays the same
diffusers pipeline.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field

import torch

from .config import KERNEL_DTYPES, OptimizeConfig
from .runtime import execution_device, host_timesteps

log = logging.getLogger("sdfast")


@dataclass
class OptimizeState:
    """What ``optimize`` did to one pipeline: the config, modules changed per pass, and the graph cache."""

    config: OptimizeConfig
    counts: dict = field(default_factory=dict)
    graphs: object | None = None  # runtime.cuda_graphs.GraphCache
    vae_upcast: bool = False
    vae_dispatcher: object | None = None  # the fp32 VAE's own AttentionDispatcher (TF32 allowed), if any


def _denoisers(pipe) -> list[torch.nn.Module]:
    return [m for m in (getattr(pipe, "unet", None), getattr(pipe, "vae", None)) if m is not None]


def _vae_decode_in_own_dtype(vae):
    """Rebind ``vae.decode`` to cast latents to the VAE's dtype (for a VAE kept in fp32)."""
    original = vae.decode

    def decode(self, z, *args, **kwargs):
        return original(z.to(self.dtype), *args, **kwargs)

    vae.decode = types.MethodType(decode, vae)


def _install_graphs(pipe, state: OptimizeState) -> None:
    from .runtime import session
    from .runtime.cross_kv import CrossKV
    from .runtime.cuda_graphs import GraphCache

    cache = GraphCache(max_graphs=state.config.max_graphs, parallel_compile=state.config.parallel_compile)
    cache.install("unet", pipe.unet, conditioning=CrossKV(pipe.unet) if state.config.cross_kv_once else None)
    for name in ("text_encoder", "text_encoder_2"):
        if getattr(pipe, name, None) is not None:
            cache.install(name, getattr(pipe, name))
    cache.install("vae_decoder", pipe.vae.decoder)
    original_check = pipe.check_inputs

    def check_inputs(self, *args, **kwargs):  # runs at the start of every pipeline call
        session.before_denoising(pipe, cache)  # time-embedding refresh, then the graph check
        return original_check(*args, **kwargs)

    pipe.check_inputs = types.MethodType(check_inputs, pipe)
    state.graphs = cache
    host_timesteps.keep_on_host(pipe.scheduler)  # no GPU->host sync per step in the scheduler (PNDM)


def optimize(pipe, config: OptimizeConfig | None = None):
    """Optimize a diffusers SD/SDXL pipeline in place and return it.

    Raises ``TypeError`` if ``pipe`` has no ``unet`` and ``vae``, if its UNet is not in float16, bfloat16 or
    float32 (the fused kernels' dtypes), or if ``config`` is not an ``OptimizeConfig`` (or None). Calling it again
    on an optimized pipeline returns it unchanged with the same config (or None); with another config it raises
    ``ValueError``: ``unoptimize`` first to change the config.
    """
    from .passes import attention, conv_bias, layout, linear, norms, skip_concat, time_embedding, upsample

    if not (hasattr(pipe, "unet") and hasattr(pipe, "vae")):
        raise TypeError(f"optimize expects a diffusers Stable Diffusion pipeline, got {type(pipe).__name__}")
    if pipe.unet.dtype not in KERNEL_DTYPES:
        raise TypeError(f"optimize: the fused kernels take float16, bfloat16 or float32, and this pipeline's UNet is "
                        f"{pipe.unet.dtype}; load it in one of those, or with optimize=False for the stock pipeline")
    if config is not None and not isinstance(config, OptimizeConfig):
        raise TypeError(f"optimize: config must be an sdfast.OptimizeConfig or None, got {type(config).__name__}")
    current: OptimizeState | None = getattr(pipe, "_sdfast", None)
    if current is not None:
        if config is not None and config != current.config:
            raise ValueError("optimize: this pipeline is already optimized with another config; call "
                             "sdfast.unoptimize(pipe) first, then optimize(pipe, config)")
        return pipe
    config = config or OptimizeConfig()
    state = OptimizeState(config=config)
    vae = pipe.vae
    if config.vae_fp32_when_asked and hasattr(pipe, "upcast_vae") and vae.dtype == torch.float16 and vae.config.force_upcast:
        vae.to(torch.float32)
        _vae_decode_in_own_dtype(vae)
        state.vae_upcast = True
    if config.attention:
        if state.vae_upcast and config.vae_tf32:
            state.vae_dispatcher = attention.AttentionDispatcher(allow_tf32=True)
        state.counts["attention"] = sum(
            attention.apply(m, fuse_projections=config.fuse_qkv, dispatcher=state.vae_dispatcher if m is vae else None)
            for m in _denoisers(pipe))
    if config.fuse_norms:
        state.counts["norms"] = sum(norms.apply(m) for m in _denoisers(pipe))
    if config.channels_last:
        state.counts["layout"] = sum(layout.apply(m) for m in _denoisers(pipe))
    if config.fuse_norms and config.batch_temb:  # after the layout pass: the pack's views are the final storage
        state.counts["temb"] = time_embedding.apply(pipe.unet)
    if config.upsample:
        state.counts["upsample"] = sum(upsample.apply(m) for m in _denoisers(pipe))
    if config.skip_concat:
        state.counts["skip_concat"] = skip_concat.apply(pipe.unet)
    if config.conv_bias:
        state.counts["conv_bias"] = sum(conv_bias.apply(m) for m in _denoisers(pipe))
    if config.tma_linear:
        state.counts["linear"] = linear.apply(pipe.unet)
    if config.cuda_graphs and pipe.unet.device.type == "cuda":
        _install_graphs(pipe, state)
        state.counts["cuda_graphs"] = len(state.graphs.runners)
    execution_device.install(pipe)  # no walk over every submodule at each call (host time, GPU idle)
    pipe._sdfast = state
    log.info("sdfast: optimized %s: %s", type(pipe).__name__, state.counts)
    return pipe


def unoptimize(pipe):
    """Undo ``optimize``: the stock modules, processors, layouts and forwards come back. Returns ``pipe``."""
    from .passes import attention, conv_bias, layout, linear, norms, skip_concat, time_embedding, upsample

    if not (hasattr(pipe, "unet") and hasattr(pipe, "vae")):
        raise TypeError(f"unoptimize expects a diffusers Stable Diffusion pipeline, got {type(pipe).__name__}")
    state: OptimizeState | None = getattr(pipe, "_sdfast", None)
    execution_device.uninstall(pipe)  # also on a from_pipe copy, which shares the class but has no state
    if state is None:
        return pipe
    if state.graphs is not None:
        state.graphs.uninstall()
        del pipe.check_inputs
        host_timesteps.release(pipe.scheduler)
    linear.undo(pipe.unet)
    time_embedding.undo(pipe.unet)
    skip_concat.undo(pipe.unet)
    for m in _denoisers(pipe):
        conv_bias.undo(m)
        upsample.undo(m)
        layout.undo(m)
        norms.undo(m)
        attention.undo(m)
    if state.vae_upcast:
        del pipe.vae.decode
        pipe.vae.to(torch.float16)
    pipe._sdfast = None
    return pipe
