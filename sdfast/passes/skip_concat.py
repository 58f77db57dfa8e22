"""Skip-connection pass: the UNet up blocks concatenate their skip connections on sdfast's kernel.

diffusers' ``UpBlock2D`` and ``CrossAttnUpBlock2D`` run ``torch.cat([hidden_states, res_hidden_states], dim=1)``
before each ResNet block. On channels_last memory PyTorch's kernel for it runs at about half the memory
bandwidth (``kernels.elementwise.concat``). The rebound forward (per instance, reversible with ``undo``) is
diffusers' forward with that one call on ``cat_channels``, bit-identical. Whatever else the forward can do runs
diffusers' own: FreeU (``enable_freeu``, which rescales the two tensors first), gradient checkpointing while
gradients are on, the deprecated positional ``scale`` argument; tensors that are not channels_last (the kernel is
tuned for that layout) or that need gradients (it has no autograd formula) are concatenated by ``torch.cat``.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.elementwise import cat_channels
from sdfast.passes._modules import rebind_forward, restore_forwards

_MARKER = "_sdfast_skip_concat"


def _block_classes() -> tuple[type, ...]:
    from diffusers.models.unets.unet_2d_blocks import CrossAttnUpBlock2D, UpBlock2D

    return UpBlock2D, CrossAttnUpBlock2D


def freeu_enabled(block: nn.Module) -> bool:
    """Whether an up block's forward applies FreeU (``enable_freeu`` set all of ``s1``, ``s2``, ``b1``, ``b2``), as
    diffusers' forward decides it."""
    return bool(all(getattr(block, n, None) for n in ("s1", "s2", "b1", "b2")))


def checkpointing(block: nn.Module) -> bool:
    """Whether ``block``'s forward runs its ResNets through gradient checkpointing now (gradients on)."""
    return torch.is_grad_enabled() and block.gradient_checkpointing


def _fast_path(block: nn.Module) -> bool:
    """Whether the rebound forward of ``block`` runs its own loop (else diffusers' forward): no FreeU, no gradient
    checkpointing while gradients are on."""
    return not (freeu_enabled(block) or checkpointing(block))


def cat_skip(hidden_states: torch.Tensor, res_hidden_states: torch.Tensor) -> torch.Tensor:
    """``torch.cat([hidden_states, res_hidden_states], dim=1)``, the same values: on ``cat_channels`` for two
    channels_last 4-D tensors of one dtype that need no gradients, else on ``torch.cat``."""
    grads = torch.is_grad_enabled() and (hidden_states.requires_grad or res_hidden_states.requires_grad)
    if hidden_states.dim() == res_hidden_states.dim() == 4 and hidden_states.dtype == res_hidden_states.dtype \
            and hidden_states.is_contiguous(memory_format=torch.channels_last) \
            and not grads:  # channels_last: what the kernel is tuned for (NCHW: torch.cat); no autograd formula
        return cat_channels(hidden_states, res_hidden_states)
    return torch.cat([hidden_states, res_hidden_states], dim=1)


def _torch_cat(hidden_states: torch.Tensor, res_hidden_states: torch.Tensor) -> torch.Tensor:
    return torch.cat([hidden_states, res_hidden_states], dim=1)


def concat_of(block: nn.Module):
    """The skip concatenation ``block``'s forward runs before each ResNet, as ``f(hidden_states, res_hidden_states)``:
    ``cat_skip`` when ``apply`` rebound it and its own loop runs (no FreeU, no gradient checkpointing while gradients
    are on), else diffusers' ``torch.cat`` along dim 1. For code that runs an up block layer by layer
    (``sdfast.runtime.deep_cache``) and must do what the block's forward does."""
    return cat_skip if getattr(block, _MARKER, False) and _fast_path(block) else _torch_cat


def _upsample(block: nn.Module, hidden_states: torch.Tensor, upsample_size) -> torch.Tensor:
    for upsampler in block.upsamplers or ():
        hidden_states = upsampler(hidden_states, upsample_size)
    return hidden_states


def up_block_forward(self, hidden_states, res_hidden_states_tuple, temb=None, upsample_size=None, *args, **kwargs):
    """diffusers ``UpBlock2D.forward`` with the skip concatenation on ``cat_channels``."""
    cls = type(self)
    if args or kwargs or not _fast_path(self):
        return cls.forward(self, hidden_states, res_hidden_states_tuple, temb, upsample_size, *args, **kwargs)
    skips = list(res_hidden_states_tuple)
    for resnet in self.resnets:
        hidden_states = resnet(cat_skip(hidden_states, skips.pop()), temb)
    return _upsample(self, hidden_states, upsample_size)


def cross_attn_up_block_forward(self, hidden_states, res_hidden_states_tuple, temb=None, encoder_hidden_states=None,
                                cross_attention_kwargs=None, upsample_size=None, attention_mask=None,
                                encoder_attention_mask=None):
    """diffusers ``CrossAttnUpBlock2D.forward`` with the skip concatenation on ``cat_channels``."""
    if not _fast_path(self) or (cross_attention_kwargs or {}).get("scale") is not None:
        return type(self).forward(self, hidden_states, res_hidden_states_tuple, temb, encoder_hidden_states,
                                  cross_attention_kwargs, upsample_size, attention_mask, encoder_attention_mask)
    skips = list(res_hidden_states_tuple)
    for resnet, attn in zip(self.resnets, self.attentions):
        hidden_states = resnet(cat_skip(hidden_states, skips.pop()), temb)
        hidden_states = attn(hidden_states, encoder_hidden_states=encoder_hidden_states,
                             cross_attention_kwargs=cross_attention_kwargs, attention_mask=attention_mask,
                             encoder_attention_mask=encoder_attention_mask, return_dict=False)[0]
    return _upsample(self, hidden_states, upsample_size)


def apply(model: nn.Module) -> int:
    """Rebind the forward of every ``UpBlock2D`` / ``CrossAttnUpBlock2D`` (exactly those classes) in ``model``.
    Returns how many."""
    up, cross = _block_classes()
    changed = 0
    for m in model.modules():
        if type(m) not in (up, cross) or "forward" in m.__dict__:  # ours already, or a forward someone else set
            continue
        rebind_forward(m, up_block_forward if type(m) is up else cross_attn_up_block_forward, _MARKER)
        changed += 1
    return changed


def undo(model: nn.Module) -> int:
    """Restore every forward ``apply`` rebound. Returns how many."""
    return restore_forwards(model, _MARKER)
