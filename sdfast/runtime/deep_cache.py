"""DeepCache: the UNet's deep features computed every ``cache_interval``-th denoising step and reused in between.

Method: Ma, Fang and Wang, "DeepCache: Accelerating Diffusion Models for Free", CVPR 2024 (arXiv 2312.00858;
github.com/horseee/DeepCache); OneDiff ships it as ``cache_interval`` / ``cache_layer_id`` / ``cache_block_id``.
Adjacent denoising steps change a UNet's deep (low-resolution) features little, so the steps between two full
steps run only the shallow path of one skip branch and take the deep feature from the last full step. The images
change (it is an approximation: ``README.md`` says by how much); ``cache_interval=1`` is never routed here.

**The split.** A diffusers ``UNet2DConditionModel`` with n down blocks D_0..D_{n-1}, a mid block M and n up blocks
U_0..U_{n-1} (U_{n-1} is the shallowest, the one before ``conv_out``) makes N skip tensors s_0..s_{N-1}, in the order
diffusers makes them: s_0 is conv_in's output, then for each down block the output of each ResNet (with its
attention: one *layer*), then its downsampler's output if it has one; N = 1 + sum(len(D.resnets) +
len(D.downsamplers or ())) (``branches``). The up blocks' ResNets, numbered g = 0..N-1 in execution order
(U_0.resnets[0] is g = 0), consume them from the end: up ResNet g concatenates s_{N-1-g}. Skip branch m
(``cache_branch``, 0 <= m < N) is the path through s_0..s_m: conv_in, the down layers up to s_m, the last m + 1 up
layers (up ResNets g0 = N-1-m .. N-1 with their attentions and the upsamplers of their blocks), conv_out. Its *deep
feature* is the hidden state entering up ResNet g0 (before its skip concatenation): with g0 = layer j0 of up block
U_j, for j0 = 0 the input of U_j (the output of U_{j-1}, or for m = N-1 the mid block's output, a ControlNet's mid
residual added); for j0 > 0 the output of U_j's layer j0-1, inside the block.

- full step: the whole UNet, the same diffusers blocks called in the same order with the same arguments as
  ``UNet2DConditionModel.forward`` (diffusers 0.42), except the one up block U_j a branch with j0 > 0 enters in the
  middle: it runs through ``_up_layers`` in two halves (layers 0..j0-1, the feature copied, layers j0..), the
  operations of its forward in the same order. Either way the output is the UNet's bit for bit (tested) and the
  deep feature is copied into the cache;
- shallow step: the time embedding, conv_in, the down blocks whose skip tensors all lie in s_0..s_m (diffusers'
  blocks, whole), the first layers of the next one up to s_m (``_down_layers``; a downsampler's output is its
  block's last skip tensor, so it runs only in a whole block); then, from the cached deep feature, layers j0.. of
  U_j (``_up_layers``; for j0 = 0 the block itself) and U_{j+1}..U_{n-1} whole, conv_norm_out, conv_out. Exactly
  the m + 1 skip tensors the up layers consume are made. The time embedding, the text context and the skip
  tensors are the current step's; only the deep feature is old.

SD 1.x/2.x (N = 12): s_0; D_0 (64² latents at 512², two ResNet + attention layers, downsampler) s_1..s_3; D_1 s_4..s_6;
D_2 s_7..s_9; D_3 (no attention, no downsampler) s_10, s_11; U_0 (no attention) is g 0-2, U_1 3-5, U_2 6-8, U_3 (64²)
9-11. Branch 0 (the default): conv_in, U_3's last layer (ResNet + attention at 64²) on s_0, conv_out; branch 2:
D_0's two layers and all of U_3; branch 11: everything but the mid block. SDXL (N = 9): s_0; D_0 (128² at 1024², no
attention) s_1..s_3; D_1 (64², 2-layer transformers) s_4..s_6; D_2 (32², 10-layer transformers) s_7, s_8; U_0 (32²)
g 0-2, U_1 (64²) 3-5, U_2 (128², no attention) 6-8. Branch 0: conv_in, U_2's last ResNet on s_0, conv_out; branch
2: D_0's two ResNets and all of U_2; branch 8: everything but the mid block. A whole down block with all of its up
block, sdfast's branches before this numbering (b in [0, n)), is m = sum(len(U_j.resnets) for j >= n-1-b) - 1: SD
1.x/2.x 2, 5, 8, 11; SDXL 2, 5, 8.

Step i of a pipeline call's denoising loop (0-based) is full iff ``i % cache_interval == 0`` ("uniform" in the
paper), decided on the host from diffusers' own step index (``callback_on_step_end``): no GPU value is read.

DeepCache's and OneDiff's ids (``cache_layer_id`` L, ``cache_block_id`` B): their shallow step runs the last B + 1
layers of up block U_{n-1-L} and every up block after it, the up layers of sdfast's m = 3L + B on SD 1.x/2.x and
SDXL (whose up blocks have three ResNets), so their default (0, 0) is branch 0 here. Their down path stops after
layer B of D_L, one layer past the skip tensors those up layers pair with in the full UNet; sdfast's shallow step
makes exactly s_0..s_m and pairs every up ResNet with the skip tensor the full UNet gives it.

**ControlNet.** A ControlNet still runs at every step (its input is the current latents). At a full step its
residuals are added as diffusers does; at a shallow step the residuals of s_0..s_m are added (``zip`` over the
first ones), the deeper ones and the mid residual are not used: the cached deep feature carries those of the last
full step. **T2I-Adapter** residuals are added where diffusers adds them, at the end of a down block (after a
``CrossAttnDownBlock2D``'s last layer, after a ``DownBlock2D`` and its downsampler), in the down layers a shallow
step runs: a block run only in part takes its residual only if that point is among its layers (a
``CrossAttnDownBlock2D`` whose layers all run and whose downsampler does not); the mid block's residual, as the
deeper down blocks', is in the cached feature.

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


def _down_skips(block) -> int:
    """Skip tensors down block ``block`` makes: one per ResNet (+ attention) layer, one for its downsampler."""
    return len(block.resnets) + len(block.downsamplers or ())


def branches(unet) -> int:
    """The skip branches of ``unet`` a shallow step can take, N: its skip tensors, conv_in's and those of its down
    blocks (12 for SD 1.x/2.x, 9 for SDXL; branch m in [0, N))."""
    return 1 + sum(_down_skips(block) for block in unet.down_blocks)


def _entry(unet, branch: int) -> tuple[int, int]:
    """(j, j0): the up block U_j and its layer j0 where the shallow up path of ``branch`` starts (up ResNet
    g0 = N-1-branch). ``ValueError`` for a branch outside [0, N) or up blocks with fewer ResNets than that."""
    g = branches(unet) - 1 - branch
    if branch >= 0 and g >= 0:
        for j, block in enumerate(unet.up_blocks):
            if g < len(block.resnets):
                return j, g
            g -= len(block.resnets)
    raise ValueError(f"DeepCache: no up layer pairs with skip branch {branch} of this UNet")


def _split_blocks(unet, branch: int) -> list:
    """The blocks that ``branch`` enters in the middle (run layer by layer): the down block holding s_branch when
    s_branch is not its last skip tensor, and U_j when j0 > 0."""
    out, made = [], 1
    for block in unet.down_blocks:
        if made <= branch < made + _down_skips(block) - 1:
            out.append(block)
        made += _down_skips(block)
    j, j0 = _entry(unet, branch)
    return out + ([unet.up_blocks[j]] if j0 > 0 else [])


def check(unet, cache_interval: int, cache_branch: int) -> None:
    """Raise ``InvalidRequestError`` unless ``unet`` can run DeepCache on skip branch ``cache_branch``: field
    ``cache_branch`` for a branch outside [0, ``branches(unet)``) or one that enters in the middle a block of a
    class the layer-by-layer helpers do not mirror (diffusers' ``DownBlock2D``, ``CrossAttnDownBlock2D``,
    ``UpBlock2D`` and ``CrossAttnUpBlock2D`` they do), field ``cache_interval`` for a UNet that is not a diffusers
    ``UNet2DConditionModel`` (e.g. a ``torch.compile`` d module) or is one with features the split forward does not
    mirror (GLIGEN, an ``image_hint`` embedding, up blocks whose ResNets do not pair with the skip tensors).
    Nothing to check for ``cache_interval`` 1 (the exact forward)."""
    if cache_interval == 1:
        return
    if not is_diffusers_unet(unet):
        raise InvalidRequestError("cache_interval", f"DeepCache splits a diffusers UNet2DConditionModel; this "
                                                    f"pipeline's UNet is a {type(unet).__name__} (use cache_interval=1)")
    from diffusers.models.unets.unet_2d_blocks import (
        CrossAttnDownBlock2D,
        CrossAttnUpBlock2D,
        DownBlock2D,
        UpBlock2D,
    )

    n = branches(unet)
    unsupported = ("GLIGEN" if getattr(unet, "position_net", None) is not None else
                   "an image_hint embedding" if unet.config.get("addition_embed_type") == "image_hint" else
                   "up blocks whose ResNets do not pair with the skip tensors"
                   if sum(len(block.resnets) for block in unet.up_blocks) != n else None)
    if unsupported:
        raise InvalidRequestError("cache_interval", f"DeepCache does not run on a UNet with {unsupported} "
                                                    "(use cache_interval=1)")
    if not 0 <= cache_branch < n:
        raise InvalidRequestError("cache_branch", f"this UNet has {n} skip branches (its skip connections): must be "
                                                  f"in [0, {n - 1}] (got {cache_branch})")
    mirrored = (DownBlock2D, CrossAttnDownBlock2D, UpBlock2D, CrossAttnUpBlock2D)
    odd = [type(block).__name__ for block in _split_blocks(unet, cache_branch) if type(block) not in mirrored]
    if odd:
        raise InvalidRequestError("cache_branch", f"branch {cache_branch} enters a {odd[0]} in the middle, which "
                                                  "DeepCache's split forward does not run layer by layer; take a "
                                                  "branch at that block's boundary")


def is_full(step_index: int, cache_interval: int) -> bool:
    """Whether denoising step ``step_index`` (0-based) runs the full UNet: every ``cache_interval``-th one."""
    return step_index % cache_interval == 0


class SplitForward:
    """The UNet's forward, installed on the instance (``install``): ``forward(*args, deep_cache=None, **kwargs)``.

    ``deep_cache=None`` calls the forward that was there before (``inner``): the exact UNet, untouched. A ``Step``
    runs the split forward (module docstring): args and kwargs as ``UNet2DConditionModel.forward``'s (``sample``
    (B, C, H, W) latents in the UNet's dtype, any memory format; ``timestep``; ``encoder_hidden_states`` (B, L, D);
    ...); returns what it returns ((B, out_channels, H, W) in ``(sample,)`` or ``UNet2DConditionOutput``).

    ``buffers``: the cached deep features, (B, C_b, H_b, W_b) in the layout the deep feature had, keyed by
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
        from .control_overlap import stream_safe  # it adds a keyword and reads no tensor

        self._handle = self.unet.register_forward_pre_hook(stream_safe(self._pre), with_kwargs=True)
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


def _resnet(block, i: int, h, temb):
    """ResNet ``i`` of ``block``, through the block's gradient checkpointing as its forward does."""
    from ..passes.skip_concat import checkpointing

    if checkpointing(block):
        return block._gradient_checkpointing_func(block.resnets[i], h, temb)
    return block.resnets[i](h, temb)


def _attention(block, i: int, h, cross: dict):
    return block.attentions[i](h, encoder_hidden_states=cross["encoder_hidden_states"],
                               cross_attention_kwargs=cross["cross_attention_kwargs"],
                               attention_mask=cross["attention_mask"],
                               encoder_attention_mask=cross["encoder_attention_mask"], return_dict=False)[0]


def _down_layers(block, h, temb, cross: dict, count: int, additional_residuals=None):
    """The first ``count`` skip tensors of down block ``block`` (diffusers' ``DownBlock2D`` or
    ``CrossAttnDownBlock2D``, 1 <= count <= ``_down_skips(block)``), made as its forward makes them: one ResNet
    (+ attention) layer each, and the downsampler when ``count`` includes its output. Returns (the hidden state
    after the last thing run, the tuple of the ``count`` skip tensors).

    h: (B, C, H, W) the block's input; temb: the time embedding; cross: ``encoder_hidden_states``,
    ``attention_mask``, ``cross_attention_kwargs``, ``encoder_attention_mask`` (read by a ``CrossAttnDownBlock2D``
    only). additional_residuals: the block's T2I-Adapter residual or None, added where diffusers adds it: a
    ``CrossAttnDownBlock2D`` adds it to its last layer's output (before that becomes a skip tensor and enters the
    downsampler), so only when ``count`` reaches its last layer; for a ``DownBlock2D`` the UNet adds it in place to
    the block's output (its last skip tensor too), so only when ``count`` is all of the block's skip tensors."""
    cross_block = getattr(block, "has_cross_attention", False)
    layers = len(block.resnets)
    skips = ()
    for i in range(min(count, layers)):
        h = _resnet(block, i, h, temb)
        if cross_block:
            h = _attention(block, i, h, cross)
            if i == layers - 1 and additional_residuals is not None:
                h = h + additional_residuals
        skips += (h,)
    if count > layers:
        for downsampler in block.downsamplers:
            h = downsampler(h)
        skips += (h,)
    if not cross_block and additional_residuals is not None and count == _down_skips(block):
        h += additional_residuals
    return h, skips


def _up_layers(block, h, res_tuple: tuple, temb, cross: dict, upsample_size, start: int, stop: int):
    """Layers ``start``..``stop``-1 of up block ``block`` (diffusers' ``UpBlock2D`` or ``CrossAttnUpBlock2D``,
    0 <= start < stop <= len(block.resnets)), run as its forward runs them, and its upsamplers when ``stop`` is its
    last layer. Returns the hidden state after them.

    h: (B, C, H, W) the hidden state entering layer ``start`` (the block's input for 0); res_tuple: the skip tensors
    of these layers, ``stop - start`` of them, popped from the end as the block pops its own (layer ``start``
    takes the last one). Each layer: FreeU's rescaling of the two tensors (``apply_freeu``) when the block has
    ``s1``, ``s2``, ``b1``, ``b2`` set, the concatenation along the channels on the function the block's forward
    uses (``skip_concat.concat_of``: the optimizer's kernel where it rebound the forward, else ``torch.cat``), the
    ResNet (checkpointed as the block would be), the attention (``CrossAttnUpBlock2D``: ``cross`` as in
    ``_down_layers``). upsample_size: the upsamplers' output size or None."""
    from diffusers.utils.torch_utils import apply_freeu

    from ..passes.skip_concat import concat_of, freeu_enabled

    if len(res_tuple) != stop - start:
        raise ValueError(f"_up_layers: layers {start}..{stop - 1} take {stop - start} skip tensors, got "
                         f"{len(res_tuple)}")
    cat = concat_of(block)
    freeu = freeu_enabled(block)
    cross_block = getattr(block, "has_cross_attention", False)
    for i in range(start, stop):
        res_hidden_states = res_tuple[-1]
        res_tuple = res_tuple[:-1]
        if freeu:
            h, res_hidden_states = apply_freeu(block.resolution_idx, h, res_hidden_states, s1=block.s1, s2=block.s2,
                                               b1=block.b1, b2=block.b2)
        h = _resnet(block, i, cat(h, res_hidden_states), temb)
        if cross_block:
            h = _attention(block, i, h, cross)
    if stop == len(block.resnets):
        for upsampler in block.upsamplers or ():
            h = upsampler(h, upsample_size)
    return h


def _down_path(unet, sample, emb, cross: dict, adapter, make: int):
    """conv_in's output ``sample`` through the down layers until ``make`` skip tensors are made (N: every down
    block): diffusers' blocks whole, the last one in part (``_down_layers``) when only its first skip tensors are
    needed. ``adapter``: the T2I-Adapter residuals (a list, popped one per down block as diffusers pops them) or
    None. Returns (the hidden state, the skip tensors s_0..s_{make-1})."""
    skips = (sample,)
    for block in unet.down_blocks:
        count = min(make - len(skips), _down_skips(block))
        if count <= 0:
            break
        residual = adapter.pop(0) if adapter is not None and len(adapter) > 0 else None
        if count < _down_skips(block):
            sample, res_samples = _down_layers(block, sample, emb, cross, count, residual)
        elif getattr(block, "has_cross_attention", False):
            extra = {} if residual is None else {"additional_residuals": residual}
            sample, res_samples = block(hidden_states=sample, temb=emb, **cross, **extra)
        else:
            sample, res_samples = block(hidden_states=sample, temb=emb)
            if residual is not None:
                sample += residual
        skips += res_samples
    return sample, skips


def _up_block(block, sample, res_samples, emb, cross: dict, upsample_size):
    """Up block ``block`` whole: diffusers' block called as ``UNet2DConditionModel.forward`` calls it."""
    if getattr(block, "has_cross_attention", False):
        return block(hidden_states=sample, temb=emb, res_hidden_states_tuple=res_samples, upsample_size=upsample_size,
                     **cross)
    return block(hidden_states=sample, temb=emb, res_hidden_states_tuple=res_samples, upsample_size=upsample_size)


def _blocks(unet, split, step, sample, timestep, encoder_hidden_states, class_labels, timestep_cond, attention_mask,
            cross_attention_kwargs, added_cond_kwargs, down_block_additional_residuals, mid_block_additional_residual,
            down_intrablock_additional_residuals, encoder_attention_mask, return_dict):
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

    shallow = step.mode == SHALLOW
    key = split.key(step, sample)
    j, j0 = _entry(unet, step.branch)  # the shallow up path starts at layer j0 of U_j: its input is the deep feature

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

    # -- down layers: all of them (full), those making s_0..s_branch (shallow) --
    sample, down_block_res_samples = _down_path(unet, sample, emb, cross,
                                                down_intrablock_additional_residuals if is_adapter else None,
                                                step.branch + 1 if shallow else branches(unet))
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

    # -- up blocks: U_0..U_{n-1} (full: the input of layer j0 of U_j cached), layer j0 of U_j on (shallow) --
    for i, upsample_block in enumerate(unet.up_blocks):
        if shallow and i < j:
            continue
        first = j0 if shallow and i == j else 0  # the layers before it are the deep part
        taken = len(upsample_block.resnets) - first
        res_samples = down_block_res_samples[-taken:]
        down_block_res_samples = down_block_res_samples[:-taken]
        if i != len(unet.up_blocks) - 1 and forward_upsample_size:
            upsample_size = down_block_res_samples[-1].shape[2:]
        if i != j:
            sample = _up_block(upsample_block, sample, res_samples, emb, cross, upsample_size)
        elif shallow:
            sample = split.cached(key)
            if j0 == 0:
                sample = _up_block(upsample_block, sample, res_samples, emb, cross, upsample_size)
            else:
                sample = _up_layers(upsample_block, sample, res_samples, emb, cross, upsample_size, j0,
                                    len(upsample_block.resnets))
        elif j0 == 0:
            split.store(key, sample)
            sample = _up_block(upsample_block, sample, res_samples, emb, cross, upsample_size)
        else:  # the block in two halves, the feature between them stored
            sample = _up_layers(upsample_block, sample, res_samples[-j0:], emb, cross, upsample_size, 0, j0)
            split.store(key, sample)
            sample = _up_layers(upsample_block, sample, res_samples[:-j0], emb, cross, upsample_size, j0,
                                len(upsample_block.resnets))

    if unet.conv_norm_out:
        sample = unet.conv_norm_out(sample)
        sample = unet.conv_act(sample)
    sample = unet.conv_out(sample)
    if not return_dict:
        return (sample,)
    return UNet2DConditionOutput(sample=sample)
