"""``optimize(pipe, config)``: apply sdfast's pass table to a diffusers pipeline, in place, reversibly.

``PASSES`` is the one table (over the UNet, the ControlNets if any, and the VAE, as each pass says): fp32 VAE ->
attention processor -> norm fusion -> channels_last layout ->
time-embedding packing -> upsampling -> skip concatenation -> convolution biases -> small-K linears -> the DeepCache
split forward -> CUDA graphs -> execution device. Each pass is its own module (``sdfast.passes``, ``sdfast.runtime``), counts what it changed,
and can be undone (``unoptimize`` runs the table backwards). What one pass leaves for another is a typed slot of
``sdfast.passes.state``. The pipeline object stays the same diffusers pipeline.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels import select

from .config import KERNEL_DTYPES, KernelPolicy, OptimizeConfig
from .controlnet import denoising_nets
from .runtime import async_upload, execution_device, host_timesteps

log = logging.getLogger("sdfast")


@dataclass
class OptimizeState:
    """What ``optimize`` did to one pipeline: the config, modules changed per pass, and the graph cache."""

    config: OptimizeConfig
    counts: dict = field(default_factory=dict)
    graphs: object | None = None  # runtime.cuda_graphs.GraphCache
    vae_upcast: bool = False  # the VAE kept in fp32 (its config's force_upcast)
    vae_dtypes: dict | None = None  # {half: dtype it had} for the VAE halves this pass cast (None: none)
    vae_dispatcher: object | None = None  # the fp32 VAE's own AttentionDispatcher (TF32 allowed), if any
    control_overlap: object | None = None  # runtime.control_overlap.ControlOverlap (ControlNets beside the UNet)
    applied: list = field(default_factory=list)  # names of the passes applied, in order


def _denoisers(pipe) -> list[torch.nn.Module]:
    """The convolutional nets the layout and kernel passes rewrite: the denoising nets and the VAE."""
    return [*denoising_nets(pipe), *([pipe.vae] if getattr(pipe, "vae", None) is not None else [])]


def _half_dtype(vae, half: str) -> torch.dtype:
    """The dtype of the VAE's ``half`` ("encoder" or "decoder"): its first convolution's weight."""
    return getattr(vae, half).conv_in.weight.dtype


def _vae_in_own_dtype(vae):
    """Rebind ``vae.decode`` and ``vae.encode`` to cast their input (latents, images) to the dtype of the half that
    takes it (a VAE kept in fp32, a decoder in bf16)."""
    original_decode, original_encode = vae.decode, vae.encode

    def decode(self, z, *args, **kwargs):
        return original_decode(z.to(_half_dtype(self, "decoder")), *args, **kwargs)

    def encode(self, x, *args, **kwargs):
        return original_encode(x.to(_half_dtype(self, "encoder")), *args, **kwargs)

    vae.decode = types.MethodType(decode, vae)
    vae.encode = types.MethodType(encode, vae)


def _check_graphs_before_denoising(pipe, cache) -> None:
    """Rebind ``pipe.check_inputs`` (run at the start of every pipeline call) to run ``session.before_denoising``
    first: the time-embedding refresh, then the check of ``cache``'s graphs."""
    from .runtime import session

    original_check = pipe.check_inputs

    def check_inputs(self, *args, **kwargs):
        session.before_denoising(pipe, cache)
        return original_check(*args, **kwargs)

    pipe.check_inputs = types.MethodType(check_inputs, pipe)


def _install_graphs(pipe, state: OptimizeState) -> None:
    from .runtime.control_embedding import ControlEmbedding
    from .runtime.control_overlap import ControlOverlap
    from .runtime.cross_kv import CrossKV
    from .runtime.cuda_graphs import GraphCache

    config = state.config
    cache = GraphCache(max_graphs=config.max_graphs, parallel_compile=config.parallel_compile)
    controlnets = denoising_nets(pipe)[1:]
    overlap = ControlOverlap(pipe) if controlnets and config.controlnet_overlap else None
    cache.install("unet", pipe.unet, conditionings=(CrossKV(pipe.unet),) if config.cross_kv_once else (),
                  split=overlap and overlap.unet_split)
    for i, net in enumerate(controlnets):  # a ControlNet's scale is applied after its replay
        conditionings = ((CrossKV(net),) if config.cross_kv_once else ()) + (
            (ControlEmbedding(net),) if config.control_embedding_once else ())
        cache.install(f"controlnet_{i}", net, conditionings=conditionings, output_scale="conditioning_scale",
                      pool=overlap and overlap.pool, stream=overlap and overlap.capture_stream)
    if overlap is not None:
        overlap.install()
        state.control_overlap = overlap
    for name in ("text_encoder", "text_encoder_2"):
        if getattr(pipe, name, None) is not None:
            cache.install(name, getattr(pipe, name))
    cache.install("vae_decoder", pipe.vae.decoder)
    cache.install("vae_encoder", pipe.vae.encoder)  # img2img and inpainting: captured at their first call
    _check_graphs_before_denoising(pipe, cache)
    async_upload.install(pipe)  # the noise and SDXL's time ids go to the GPU without a wait
    state.graphs = cache
    host_timesteps.keep_on_host(pipe.scheduler)  # no GPU->host sync per step in the scheduler (PNDM, the noise)


# -- the passes: apply(pipe, state) -> modules changed; undo(pipe, state) --------------------------------------


def _vae_dtype(pipe, state: OptimizeState) -> int:
    """The VAE's own dtypes: fp32 where its config asks (``force_upcast``, ``vae_fp32_when_asked``) on an fp16
    pipeline, then the decoder (with ``post_quant_conv``) in ``vae_decoder_dtype`` if set. Its config keeps
    ``force_upcast``; ``runtime.session`` turns it off during engine calls, so that no pipeline casts the VAE."""
    vae, config = pipe.vae, state.config
    before = {"encoder": _half_dtype(vae, "encoder"), "decoder": _half_dtype(vae, "decoder")}
    if config.vae_fp32_when_asked and hasattr(pipe, "upcast_vae") and vae.dtype == torch.float16 and vae.config.force_upcast:
        vae.to(torch.float32)
        state.vae_upcast = True
    if config.vae_decoder_dtype is not None:
        dtype = getattr(torch, config.vae_decoder_dtype)
        for m in (vae.decoder, getattr(vae, "post_quant_conv", None)):
            if m is not None:
                m.to(dtype)
    if {h: _half_dtype(vae, h) for h in before} == before:
        return 0
    state.vae_dtypes = before
    _vae_in_own_dtype(vae)
    return 1


def _undo_vae_dtype(pipe, state: OptimizeState) -> None:
    if state.vae_dtypes is None:
        return
    vae = pipe.vae
    del vae.decode, vae.encode
    vae.to(state.vae_dtypes["encoder"])  # the whole VAE back (it had one dtype), then the decoder's
    for m in (vae.decoder, getattr(vae, "post_quant_conv", None)):
        if m is not None:
            m.to(state.vae_dtypes["decoder"])
    state.vae_dtypes, state.vae_upcast = None, False


def _attention(pipe, state: OptimizeState) -> int:
    from .passes import attention

    config, policy = state.config, state.config.kernels
    options = dict(backend=policy.attention, triton=policy.attention_triton)
    dispatcher = attention.AttentionDispatcher(**options)
    if state.vae_upcast and config.vae_tf32:
        state.vae_dispatcher = attention.AttentionDispatcher(**options, allow_tf32=True)
    return sum(attention.apply(m, fuse_projections=config.fuse_qkv,
                               dispatcher=state.vae_dispatcher if m is pipe.vae and state.vae_dispatcher else dispatcher)
               for m in _denoisers(pipe))


def _over(nets: Callable, module_name: str, fn_name: str):
    """A pass step: ``sdfast.passes.<module_name>.<fn_name>`` on each net of ``nets(pipe)``, counts summed."""
    def run(pipe, state) -> int:
        import importlib

        fn = getattr(importlib.import_module(f"sdfast.passes.{module_name}"), fn_name)
        return sum(fn(m) or 0 for m in nets(pipe))
    return run


def _per_denoiser(module_name: str, fn_name: str):
    """Over the UNet, the ControlNets and the VAE."""
    return _over(_denoisers, module_name, fn_name)


def _per_denoising_net(module_name: str, fn_name: str):
    """Over the UNet and the ControlNets."""
    return _over(denoising_nets, module_name, fn_name)


def _on_unet(module_name: str, fn_name: str):
    """On the UNet alone."""
    return _over(lambda pipe: [pipe.unet], module_name, fn_name)


def _graphs(pipe, state: OptimizeState) -> int:
    _install_graphs(pipe, state)
    return len(state.graphs.runners)


def _undo_graphs(pipe, state: OptimizeState) -> None:
    if state.control_overlap is not None:  # its forward wraps a graph runner's
        state.control_overlap.uninstall()
        state.control_overlap = None
    state.graphs.uninstall()
    del pipe.check_inputs
    async_upload.uninstall(pipe)
    host_timesteps.release(pipe.scheduler)


def _deep_cache(pipe, state: OptimizeState) -> int:
    """The UNet's forward becomes ``runtime.deep_cache.SplitForward`` (the exact forward unless a call asks for a
    DeepCache step), so the graph pass captures the full and shallow steps as graphs of their own."""
    from .runtime import deep_cache

    return int(deep_cache.is_diffusers_unet(pipe.unet) and deep_cache.install(pipe.unet))


def _undo_deep_cache(pipe, state: OptimizeState) -> None:
    from .runtime import deep_cache

    deep_cache.uninstall(pipe.unet)


def _execution_device(pipe, state: OptimizeState) -> int:
    """``pipe._execution_device`` and its diffusers models' ``device``/``dtype`` without a walk over every submodule
    at each call (host time with the GPU idle)."""
    execution_device.install(pipe)
    for component in pipe.components.values():
        execution_device.install_model(component)
    return 1


def _undo_execution_device(pipe, state: OptimizeState) -> None:
    execution_device.uninstall(pipe)
    for component in pipe.components.values():
        execution_device.uninstall_model(component)


@dataclass(frozen=True)
class Pass:
    """One rewrite of a pipeline. ``enabled(config, pipe)``: whether ``optimize`` applies it; ``apply(pipe, state)``
    returns how many modules it changed (kept in ``state.counts[name]`` when ``counted``); ``undo(pipe, state)``
    reverses it (``unoptimize`` runs the applied passes' undos in reverse order)."""

    name: str
    enabled: Callable
    apply: Callable
    undo: Callable
    counted: bool = True


# The one pass table: optimize applies it top to bottom, unoptimize undoes it bottom to top. Order matters where a
# pass reads what an earlier one left (sdfast.passes.state): time-embedding packing needs the norm pass's fused
# ResNet blocks and runs after the layout pass (the pack's views are the final storage); the DeepCache split forward
# goes in before the CUDA graphs, which capture it; CUDA graphs come last.
PASSES: tuple[Pass, ...] = (
    Pass("vae_dtype", lambda c, p: c.vae_fp32_when_asked or c.vae_decoder_dtype is not None, _vae_dtype,
         _undo_vae_dtype, counted=False),
    Pass("attention", lambda c, p: c.attention, _attention, _per_denoiser("attention", "undo")),
    Pass("norms", lambda c, p: c.fuse_norms, _per_denoiser("norms", "apply"), _per_denoiser("norms", "undo")),
    Pass("layout", lambda c, p: c.channels_last, _per_denoiser("layout", "apply"), _per_denoiser("layout", "undo")),
    Pass("temb", lambda c, p: c.fuse_norms and c.batch_temb, _per_denoising_net("time_embedding", "apply"),
         _per_denoising_net("time_embedding", "undo")),
    Pass("upsample", lambda c, p: c.upsample, _per_denoiser("upsample", "apply"), _per_denoiser("upsample", "undo")),
    Pass("skip_concat", lambda c, p: c.skip_concat, _on_unet("skip_concat", "apply"), _on_unet("skip_concat", "undo")),
    Pass("conv_bias", lambda c, p: c.conv_bias, _per_denoiser("conv_bias", "apply"),
         _per_denoiser("conv_bias", "undo")),
    Pass("linear", lambda c, p: c.tma_linear, _per_denoising_net("linear", "apply"),
         _per_denoising_net("linear", "undo")),
    Pass("deep_cache", lambda c, p: True, _deep_cache, _undo_deep_cache, counted=False),
    Pass("cuda_graphs", lambda c, p: c.cuda_graphs and p.unet.device.type == "cuda", _graphs, _undo_graphs),
    Pass("execution_device", lambda c, p: True, _execution_device, _undo_execution_device, counted=False),
)


_policy_in_force: KernelPolicy | None = None


def _use_policy(policy: KernelPolicy) -> None:
    """Pin the kernel choices ``policy`` asks for (``kernels.select.set_pins``: process-wide; a second pipeline
    optimized with another policy changes them for the first too, which is logged)."""
    global _policy_in_force
    if _policy_in_force is not None and policy != _policy_in_force:
        log.warning("sdfast: the kernel policy changed to %s; it applies to every optimized pipeline of the process",
                    policy)
    select.set_pins(policy.pins())
    _policy_in_force = policy


def optimize(pipe, config: OptimizeConfig | None = None):
    """Optimize a diffusers SD/SDXL pipeline in place and return it: every pass of ``PASSES`` its config turns on,
    in order.

    Raises ``TypeError`` if ``pipe`` has no ``unet`` and ``vae``, if its UNet is not in float16, bfloat16 or
    float32 (the fused kernels' dtypes), or if ``config`` is not an ``OptimizeConfig`` (or None). Calling it again
    on an optimized pipeline returns it unchanged with the same config (or None); with another config it raises
    ``ValueError``: ``unoptimize`` first to change the config.
    """
    if not (hasattr(pipe, "unet") and hasattr(pipe, "vae")):
        raise TypeError(f"optimize expects a diffusers Stable Diffusion pipeline, got {type(pipe).__name__}")
    if pipe.unet.dtype not in KERNEL_DTYPES:
        raise TypeError(f"optimize: the fused kernels take float16, bfloat16 or float32, and this pipeline's UNet is "
                        f"{pipe.unet.dtype}; load it in one of those, or with optimize=False for the stock pipeline")
    if config is not None and not isinstance(config, OptimizeConfig):
        raise TypeError(f"optimize: config must be an sdfast.OptimizeConfig or None, got {type(config).__name__}")
    if config is not None and config.kernels is None:
        config = dataclasses.replace(config, kernels=KernelPolicy.from_env())
    current: OptimizeState | None = getattr(pipe, "_sdfast", None)
    if current is not None:
        if config is not None and config != current.config:
            raise ValueError("optimize: this pipeline is already optimized with another config; call "
                             "sdfast.unoptimize(pipe) first, then optimize(pipe, config)")
        return pipe
    config = config or OptimizeConfig(kernels=KernelPolicy.from_env())
    _use_policy(config.kernels)
    state = OptimizeState(config=config)
    for p in PASSES:
        if p.enabled(config, pipe):
            count = p.apply(pipe, state)
            state.applied.append(p.name)
            if p.counted:
                state.counts[p.name] = count
    pipe._sdfast = state
    log.info("sdfast: optimized %s: %s", type(pipe).__name__, state.counts)
    return pipe


def share(pipe, derived):
    """Make ``derived``, a pipeline built on ``pipe``'s components (``StableDiffusionImg2ImgPipeline.from_pipe(pipe)``
    and the like), run as optimized as ``pipe``: the modules are the same objects, already rewritten, so only what
    ``optimize`` set on the pipeline object itself is set on ``derived`` too: its state (``derived._sdfast`` is
    ``pipe``'s), the per-call graph check before denoising, and the cached execution device. Returns ``derived``;
    unchanged when ``pipe`` is not optimized. ``unoptimize(pipe)`` undoes the shared modules for both: build the
    derived pipeline again after it."""
    state: OptimizeState | None = getattr(pipe, "_sdfast", None)
    if state is None or getattr(derived, "_sdfast", None) is state:
        return derived
    if state.graphs is not None:
        _check_graphs_before_denoising(derived, state.graphs)
        async_upload.install(derived)
    if "execution_device" in state.applied:
        execution_device.install(derived)
    derived._sdfast = state
    return derived


def unoptimize(pipe):
    """Undo ``optimize``: the passes it applied are undone in reverse order; the stock modules, processors, layouts
    and forwards come back. Returns ``pipe``."""
    if not (hasattr(pipe, "unet") and hasattr(pipe, "vae")):
        raise TypeError(f"unoptimize expects a diffusers Stable Diffusion pipeline, got {type(pipe).__name__}")
    state: OptimizeState | None = getattr(pipe, "_sdfast", None)
    execution_device.uninstall(pipe)  # also on a from_pipe copy, which shares the class but has no state
    if state is None:
        return pipe
    for p in reversed(PASSES):
        if p.name in state.applied:
            p.undo(pipe, state)
    pipe._sdfast = None
    return pipe
