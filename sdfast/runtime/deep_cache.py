"""DeepCache: the UNet's deep features computed every ``cache_interval``-th denoising step and reused in between.

Method: Ma, Fang and Wang, "DeepCache: Accelerating Diffusion Models for Free", CVPR 2024 (arXiv 2312.00858;
github.com/horseee/DeepCache); OneDiff ships it as ``cache_interval`` / ``cache_layer_id`` / ``cache_block_id``.
Adjacent denoising steps change a UNet's deep (low-resolution) features little, so the steps between two full
steps run only the shallow path of one skip branch and take the deep feature from the last full step. The images
change (it is an approximation: ``README.md`` says by how much); ``cache_interval=1`` is never routed here.

**The split.** A diffusers ``UNet2DConditionModel`` with n down blocks D_0..D_{n-1}, a mid block M and n up blocks
U_0..U_{n-1} (U_{n-1} is the shallowest, the one before ``conv_out``). Skip branch b (``cache_branch``, 0 <= b < n)
is the path conv_in -> D_0..D_b -> U_{n-1-b}..U_{n-1} -> conv_out. Its *deep feature* is the input of U_{n-1-b}:
the output of U_{n-2-b}, or for b = n-1 the mid block's output (a ControlNet's mid residual added).

- full step: the whole UNet, the same diffusers blocks called in the same order with the same arguments as
  ``UNet2DConditionModel.forward`` (diffusers 0.42), so the same output bit for bit (tested), and the deep feature
  is copied into the cache;
- shallow step: the time embedding, conv_in, D_0..D_b, then U_{n-1-b}..U_{n-1} from the cached deep feature with
  the first ``sum(len(U_j.resnets) for j >= n-1-b)`` skip tensors (those are D_0..D_b's; D_b's downsampler output,
  when it has one, feeds only deeper up blocks: computed and unused, about 4 GFLOP of SD1.5's 1.6 TFLOP per CFG
  step), conv_out.
  The time embedding, the text context and the skip tensors are the current step's; only the deep feature is old.

Step i of a pipeline call's denoising loop (0-based) is full iff ``i % cache_interval == 0`` ("uniform" in the
paper), decided on the host from diffusers' own step index (``callback_on_step_end``): no GPU value is read.

DeepCache's and OneDiff's branch ids are finer: (``cache_layer_id``, ``cache_block_id``) may enter a block in the
middle. sdfast's branch b is their ``cache_layer_id = b, cache_block_id = layers_per_block - 1`` (a whole down
block, all of its up block); the finer ones would need the blocks' forwards rewritten, which sdfast does not do.

**ControlNet.** A ControlNet still runs at every step (its input is the current latents). At a full step its
residuals are added as diffusers does; at a shallow step the residuals of the shallow skip tensors are added
(``zip`` over the first ones), the deeper ones and the mid residual are not used: the cached deep feature carries
those of the last full step. The same holds for T2I-Adapter residuals of the shallow down blocks.

**CUDA graphs** (``runtime.cuda_graphs``). The optimizer installs ``SplitForward`` as the UNet's forward before the
graph pass, so it is what the graph runner captures; the step's ``deep_cache`` keyword (a ``Step``: mode and branch)
is a non-tensor argument, so the full step, the shallow step and the exact forward are three graphs per input
signature. The cached feature lives in ``SplitForward.buffers``: allocated outside any capture (at the first full
step of a shape, which runs eagerly for the graph runner's warm-up before its capture) and so outside the graphs'
shared memory pool, where another graph's replay could overwrite it; the full graph copies into it, the shallow
graph reads it. At most ``MAX_BUFFERS`` shapes are kept; dropping one drops the graphs of every DeepCache step first
(they hold its address). LoRA changes and new weights drop every graph of the UNet as before (``WeightsWatch``).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch

from ..errors import InvalidRequestError

FULL, SHALLOW = "full", "shallow"
MODES = (FULL, SHALLOW)
MAX_BUFFERS = 4  # cached feature shapes kept (SD1.5 512², branch 0, CFG: (2, 320, 64, 64) fp16, 5.2 MB)


@dataclasses.dataclass(frozen=True)
class Step:
    """The ``deep_cache`` keyword argument of one UNet call: ``mode`` ("full" or "shallow") and the skip ``branch``.
    Hashable and not a pytree node: the graph runner keys its graphs on its value."""

    mode: str
    branch: int

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"deep_cache mode must be one of {MODES}, got {self.mode!r}")


def is_diffusers_unet(unet) -> bool:
    """Whether ``unet`` is a diffusers ``UNet2DConditionModel`` (what the split forward splits)."""
    from diffusers import UNet2DConditionModel

    return isinstance(unet, UNet2DConditionModel)


def branches(unet) -> int:
    """The skip branches of ``unet`` a shallow step can take: its number of down blocks (4 for SD 1.x/2.x, 3 for
    SDXL)."""
    return len(unet.down_blocks)


def _skips_needed(unet, branch: int) -> int:
    """Skip tensors the shallow up blocks U_{n-1-branch}..U_{n-1} consume."""
    n = len(unet.up_blocks)
    return sum(len(block.resnets) for block in unet.up_blocks[n - 1 - branch:])


def _skips_made(unet, branch: int) -> int:
    """Skip tensors conv_in and D_0..D_branch produce (each resnet's output, each downsampler's)."""
    return 1 + sum(len(b.resnets) + len(b.downsamplers or ()) for b in unet.down_blocks[:branch + 1])


def check(unet, cache_interval: int, cache_branch: int) -> None:
    """Raise ``InvalidRequestError`` unless ``unet`` can run DeepCache on skip branch ``cache_branch``: field
    ``cache_branch`` for a branch outside [0, ``branches(unet)``), field ``cache_interval`` for a UNet that is not a
    diffusers ``UNet2DConditionModel`` (e.g. a ``torch.compile`` d module) or is one with features the split forward
    does not mirror (GLIGEN, an ``image_hint`` embedding, up and down blocks that do not pair). Nothing to check for
    ``cache_interval`` 1 (the exact forward)."""
    if cache_interval == 1:
        return
    if not is_diffusers_unet(unet):
        raise InvalidRequestError("cache_interval", f"DeepCache splits a diffusers UNet2DConditionModel; this "
                                                    f"pipeline's UNet is a {type(unet).__name__} (use cache_interval=1)")
    n = branches(unet)
    if not 0 <= cache_branch < n:
        raise InvalidRequestError("cache_branch", f"this UNet has {n} skip branches (down blocks): must be in "
                                                  f"[0, {n - 1}] (got {cache_branch})")
    unsupported = ("GLIGEN" if getattr(unet, "position_net", None) is not None else
                   "an image_hint embedding" if unet.config.get("addition_embed_type") == "image_hint" else
                   "unpaired up and down blocks" if len(unet.up_blocks) != n or
                   _skips_needed(unet, cache_branch) > _skips_made(unet, cache_branch) else None)
    if unsupported:
        raise InvalidRequestError("cache_interval", f"DeepCache does not run on a UNet with {unsupported} "
                                                    "(use cache_interval=1)")


def is_full(step_index: int, cache_interval: int) -> bool:
    """Whether denoising step ``step_index`` (0-based) runs the full UNet: every ``cache_interval``-th one."""
    return step_index % cache_interval == 0


class SplitForward:
    """The UNet's forward, installed on the instance (``install``): ``forward(*args, deep_cache=None, **kwargs)``.

    ``deep_cache=None`` calls the forward that was there before (``inner``): the exact UNet, untouched. A ``Step``
    runs the split forward (module docstring): args and kwargs as ``UNet2DConditionModel.forward``'s (``sample``
    (B, C, H, W) latents in the UNet's dtype, any memory format; ``timestep``; ``encoder_hidden_states`` (B, L, D);
    ...); returns what it returns ((B, out_channels, H, W) in ``(sample,)`` or ``UNet2DConditionOutput``).

    ``buffers``: the cached deep features, (B, C_b, H_b, W_b) in the layout the up block's input had, keyed by
    (branch, sample shape, dtype, device), at most ``MAX_BUFFERS`` (least recently used dropped). Raises
    ``RuntimeError`` for a shallow step without a full step before it at that key, or a buffer that would be
    allocated inside a CUDA-graph capture (the first full step of a shape runs eagerly first under the graph
    runner).
    """

    def __init__(self, unet):
        self.unet = unet
        self.inner = unet.forward  # the forward as it was (possibly another pass's)
        self.rebound = "forward" in unet.__dict__
        self.buffers: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def __call__(self, *args, deep_cache: Step | None = None, **kwargs):
        if deep_cache is None:
            return self.inner(*args, **kwargs)
        return _split_forward(self.unet, self, deep_cache, *args, **kwargs)

    # ---- the cache ------------------------------------------------------------------------------------
    @staticmethod
    def key(step: Step, sample: torch.Tensor) -> tuple:
        return step.branch, tuple(sample.shape), sample.dtype, sample.device

    def store(self, key: tuple, feature: torch.Tensor) -> None:
        """Copy ``feature`` into the buffer of ``key`` (allocated on first use, outside any capture)."""
        buf = self.buffers.get(key)
        if buf is None or (buf.shape, buf.stride(), buf.dtype) != (feature.shape, feature.stride(), feature.dtype):
            if feature.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("DeepCache: the cache buffer would be allocated inside a CUDA-graph capture (in the "
                                   "graphs' shared pool); the first full step of a shape must run eagerly first")
            if buf is not None:
                self.drop(key)
            with torch.inference_mode(False):  # an ordinary tensor: copied into in and out of inference mode
                buf = torch.empty_strided(feature.shape, feature.stride(), dtype=feature.dtype, device=feature.device)
            self.buffers[key] = buf
            while len(self.buffers) > MAX_BUFFERS:
                self.drop(next(iter(self.buffers)))
        self.buffers.move_to_end(key)
        buf.copy_(feature)

    def cached(self, key: tuple) -> torch.Tensor:
        """The buffer of ``key``: the deep feature of the last full step at that key."""
        buf = self.buffers.get(key)
        if buf is None:
            raise RuntimeError("DeepCache: a shallow step ran before any full step at this input shape and branch "
                               "(step 0 of every call is a full step)")
        return buf

    def drop(self, key: tuple) -> None:
        """Forget the buffer of ``key``, after dropping the graphs that hold its address (every DeepCache graph of
        the UNet's graph runner, if one captures this forward). The allocator reuses its memory only after the work
        queued so far on the current stream (``record_stream``): no host sync."""
        _drop_deep_cache_graphs(self.unet, self)
        buf = self.buffers.pop(key)
        if buf.is_cuda:
            buf.record_stream(torch.cuda.current_stream(buf.device))

    def clear(self) -> None:
        for key in list(self.buffers):
            self.drop(key)


def _uses_deep_cache(leaf_keys: tuple) -> bool:
    """Whether a graph signature (``GraphedForward``'s leaf keys) has a ``Step`` among its non-tensor values."""
    return any(isinstance(k, tuple) and len(k) == 3 and k[0] == "V" and k[1] is Step for k in leaf_keys)


def _drop_deep_cache_graphs(unet, split: SplitForward) -> None:
    from .cuda_graphs import GraphedForward

    runner = unet.__dict__.get("forward")
    if isinstance(runner, GraphedForward) and runner.eager is split:
        runner.drop_where(_uses_deep_cache)


def installed(unet) -> SplitForward | None:
    """The ``SplitForward`` of ``unet``: its instance forward, or the one its CUDA-graph runner captures; else None."""
    forward = unet.__dict__.get("forward")
    if isinstance(forward, SplitForward):
        return forward
    eager = getattr(forward, "eager", None)  # runtime.cuda_graphs.GraphedForward
    return eager if isinstance(eager, SplitForward) else None


def install(unet) -> bool:
    """Make ``unet.forward`` a ``SplitForward`` over the forward it has (an instance attribute; the class is not
    touched). Returns False when it already has one (directly or under its graph runner), True when installed."""
    if installed(unet) is not None:
        return False
    unet.forward = SplitForward(unet)
    return True


def uninstall(unet) -> bool:
    """Undo ``install``: the forward that was there comes back and the buffers are freed. Returns whether it had a
    ``SplitForward`` as its instance forward (one under a graph runner stays: uninstall the graphs first)."""
    split = unet.__dict__.get("forward")
    if not isinstance(split, SplitForward):
        return False
    split.clear()
    if split.rebound:
        unet.forward = split.inner
    else:
        del unet.forward
    return True


class DeepCache:
    """One pipeline call with DeepCache: a context manager around ``pipe(...)`` plus a ``callback_on_step_end``.

    Inside, every call of ``unet`` gets ``deep_cache=Step(mode, cache_branch)`` (a forward pre-hook on the UNet,
    removed at exit): "full" at steps ``i % cache_interval == 0``, "shallow" in between, ``i`` being the step
    index diffusers hands ``on_step_end`` (reset to 0 on entry). A UNet without a ``SplitForward`` (a pipeline
    not optimized) gets one for the duration. ``full_steps`` / ``shallow_steps`` count the UNet calls of each kind.

        with DeepCache(pipe.unet, 3, 0) as dc:
            pipe(prompt, callback_on_step_end=dc.on_step_end)

    Raises ``InvalidRequestError`` (``check``) on entry; ``ValueError`` for ``cache_interval`` < 2 (1 is the exact
    pipeline: do not wrap it).
    """

    def __init__(self, unet, cache_interval: int, cache_branch: int = 0):
        if isinstance(cache_interval, bool) or not isinstance(cache_interval, int) or cache_interval < 2:
            raise ValueError(f"DeepCache needs cache_interval >= 2 (1 is the exact pipeline), got {cache_interval!r}")
        self.unet, self.cache_interval, self.cache_branch = unet, cache_interval, int(cache_branch)
        self.step = 0
        self.full_steps = self.shallow_steps = 0
        self._handle = None
        self._installed = False

    def __enter__(self) -> DeepCache:
        check(self.unet, self.cache_interval, self.cache_branch)
        self.step = 0
        self._installed = install(self.unet)
        self._handle = self.unet.register_forward_pre_hook(self._pre, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> bool:
        self._handle.remove()
        self._handle = None
        if self._installed:
            uninstall(self.unet)
            self._installed = False
        return False

    def _pre(self, module, args, kwargs):
        full = is_full(self.step, self.cache_interval)
        if full:
            self.full_steps += 1
        else:
            self.shallow_steps += 1
        return args, {**kwargs, "deep_cache": Step(FULL if full else SHALLOW, self.cache_branch)}

    def on_step_end(self, pipe, i, t, callback_kwargs):
        """diffusers' ``callback_on_step_end``: the next UNet call is step ``i + 1``."""
        self.step = i + 1
        return callback_kwargs

    def report(self) -> dict:
        return {"cache_interval": self.cache_interval, "cache_branch": self.cache_branch,
                "full_steps": self.full_steps, "shallow_steps": self.shallow_steps}


def _split_forward(unet, split: SplitForward, step: Step, sample, timestep, encoder_hidden_states,
                   class_labels=None, timestep_cond=None, attention_mask=None, cross_attention_kwargs=None,
                   added_cond_kwargs=None, down_block_additional_residuals=None, mid_block_additional_residual=None,
                   down_intrablock_additional_residuals=None, encoder_attention_mask=None, return_dict: bool = True):
    """``UNet2DConditionModel.forward`` (diffusers 0.42), with LoRA's ``cross_attention_kwargs["scale"]`` as its
    ``apply_lora_scale`` decorator applies it, split at ``step.branch`` (module docstring)."""
    from diffusers.utils import USE_PEFT_BACKEND, scale_lora_layers, unscale_lora_layers

    lora_scale = 1.0
    if cross_attention_kwargs is not None:
        cross_attention_kwargs = cross_attention_kwargs.copy()
        lora_scale = cross_attention_kwargs.pop("scale", 1.0)
    if USE_PEFT_BACKEND:
        scale_lora_layers(unet, lora_scale)
    try:
        return _blocks(unet, split, step, sample, timestep, encoder_hidden_states, class_labels, timestep_cond,
                       attention_mask, cross_attention_kwargs, added_cond_kwargs, down_block_additional_residuals,
                       mid_block_additional_residual, down_intrablock_additional_residuals, encoder_attention_mask,
                       return_dict)
    finally:
        if USE_PEFT_BACKEND:
            unscale_lora_layers(unet, lora_scale)


def _blocks(unet, split, step, sample, timestep, encoder_hidden_states, class_labels, timestep_cond, attention_mask,
            cross_attention_kwargs, added_cond_kwargs, down_block_additional_residuals, mid_block_additional_residual,
            down_intrablock_additional_residuals, encoder_attention_mask, return_dict):
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

    shallow = step.mode == SHALLOW
    key = split.key(step, sample)
    first_up = len(unet.up_blocks) - 1 - step.branch  # U_{n-1-b}: its input is the deep feature

    # -- what every step runs: diffusers' preamble, time embedding, conv_in --
    default_overall_up_factor = 2**unet.num_upsamplers
    forward_upsample_size = any(dim % default_overall_up_factor != 0 for dim in sample.shape[-2:])
    upsample_size = None
    if attention_mask is not None:
        attention_mask = (1 - attention_mask.to(sample.dtype)) * -10000.0
        attention_mask = attention_mask.unsqueeze(1)
    if encoder_attention_mask is not None:
        encoder_attention_mask = (1 - encoder_attention_mask.to(sample.dtype)) * -10000.0
        encoder_attention_mask = encoder_attention_mask.unsqueeze(1)
    if unet.config.center_input_sample:
        sample = 2 * sample - 1.0
    t_emb = unet.get_time_embed(sample=sample, timestep=timestep)
    emb = unet.time_embedding(t_emb, timestep_cond)
    class_emb = unet.get_class_embed(sample=sample, class_labels=class_labels)
    if class_emb is not None:
        emb = torch.cat([emb, class_emb], dim=-1) if unet.config.class_embeddings_concat else emb + class_emb
    aug_emb = unet.get_aug_embed(emb=emb, encoder_hidden_states=encoder_hidden_states,
                                 added_cond_kwargs=added_cond_kwargs)
    emb = emb + aug_emb if aug_emb is not None else emb
    if unet.time_embed_act is not None:
        emb = unet.time_embed_act(emb)
    encoder_hidden_states = unet.process_encoder_hidden_states(encoder_hidden_states=encoder_hidden_states,
                                                               added_cond_kwargs=added_cond_kwargs)
    sample = unet.conv_in(sample)

    is_controlnet = mid_block_additional_residual is not None and down_block_additional_residuals is not None
    is_adapter = down_intrablock_additional_residuals is not None
    if not is_adapter and mid_block_additional_residual is None and down_block_additional_residuals is not None:
        down_intrablock_additional_residuals = down_block_additional_residuals  # T2I-Adapter's old spelling
        is_adapter = True
    cross = dict(encoder_hidden_states=encoder_hidden_states, attention_mask=attention_mask,
                 cross_attention_kwargs=cross_attention_kwargs, encoder_attention_mask=encoder_attention_mask)

    # -- down blocks: all of them (full), D_0..D_b (shallow) --
    down_block_res_samples = (sample,)
    for i, downsample_block in enumerate(unet.down_blocks):
        if shallow and i > step.branch:
            break
        if getattr(downsample_block, "has_cross_attention", False):
            additional_residuals = {}
            if is_adapter and len(down_intrablock_additional_residuals) > 0:
                additional_residuals["additional_residuals"] = down_intrablock_additional_residuals.pop(0)
            sample, res_samples = downsample_block(hidden_states=sample, temb=emb, **cross, **additional_residuals)
        else:
            sample, res_samples = downsample_block(hidden_states=sample, temb=emb)
            if is_adapter and len(down_intrablock_additional_residuals) > 0:
                sample += down_intrablock_additional_residuals.pop(0)
        down_block_res_samples += res_samples
    if shallow:  # the skips of the shallow up blocks: the first ones (D_b's downsampler output feeds deeper blocks)
        down_block_res_samples = down_block_res_samples[:_skips_needed(unet, step.branch)]
    if is_controlnet:
        down_block_res_samples = tuple(s + r for s, r in zip(down_block_res_samples, down_block_additional_residuals))

    # -- mid block (full only) --
    if not shallow and unet.mid_block is not None:
        if getattr(unet.mid_block, "has_cross_attention", False):
            sample = unet.mid_block(sample, emb, **cross)
        else:
            sample = unet.mid_block(sample, emb)
        if (is_adapter and len(down_intrablock_additional_residuals) > 0
                and sample.shape == down_intrablock_additional_residuals[0].shape):
            sample += down_intrablock_additional_residuals.pop(0)
    if not shallow and is_controlnet:
        sample = sample + mid_block_additional_residual

    # -- up blocks: U_0..U_{n-1} (full; the input of U_{n-1-b} cached), U_{n-1-b}.. from the cache (shallow) --
    for i, upsample_block in enumerate(unet.up_blocks):
        if shallow and i < first_up:
            continue
        if i == first_up:
            if shallow:
                sample = split.cached(key)
            else:
                split.store(key, sample)
        is_final_block = i == len(unet.up_blocks) - 1
        res_samples = down_block_res_samples[-len(upsample_block.resnets):]
        down_block_res_samples = down_block_res_samples[:-len(upsample_block.resnets)]
        if not is_final_block and forward_upsample_size:
            upsample_size = down_block_res_samples[-1].shape[2:]
        if getattr(upsample_block, "has_cross_attention", False):
            sample = upsample_block(hidden_states=sample, temb=emb, res_hidden_states_tuple=res_samples,
                                    upsample_size=upsample_size, **cross)
        else:
            sample = upsample_block(hidden_states=sample, temb=emb, res_hidden_states_tuple=res_samples,
                                    upsample_size=upsample_size)

    if unet.conv_norm_out:
        sample = unet.conv_norm_out(sample)
        sample = unet.conv_act(sample)
    sample = unet.conv_out(sample)
    if not return_dict:
        return (sample,)
    return UNet2DConditionOutput(sample=sample)
