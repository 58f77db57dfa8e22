"""Upsampling pass: diffusers ``Upsample2D`` (nearest 2x, then its conv) upsamples on sdfast's kernel.

``Upsample2D`` calls ``F.interpolate(scale_factor=2, mode="nearest")``; on channels_last memory PyTorch's kernel
for it runs far below the memory bandwidth (``kernels.elementwise.upsample``). The rebound forward
(per instance, reversible with ``undo``) runs ``upsample_nearest2x``, bit-identical, and then the block's conv
as before. What the kernel does not cover runs diffusers' own forward: a norm before the upsampling, a
transposed conv, ``interpolate=False``, an ``output_size`` that is not exactly twice the input, an input that
is not (B, C, H, W). Inference only: the kernel has no autograd formula.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.elementwise import upsample_nearest2x
from sdfast.passes._modules import rebind_forward, restore_forwards

_MARKER = "_sdfast_upsample"


def _supported(m: nn.Module) -> bool:
    from diffusers.models.upsampling import Upsample2D

    return (
        isinstance(m, Upsample2D)
        and getattr(m, "norm", None) is None
        and not m.use_conv_transpose
        and m.interpolate
    )


def fused_upsample_forward(self, hidden_states: torch.Tensor, output_size=None, *args, **kwargs) -> torch.Tensor:
    """diffusers ``Upsample2D.forward`` with the nearest 2x upsampling on ``upsample_nearest2x``."""
    from diffusers.models.upsampling import Upsample2D

    h, w = hidden_states.shape[-2:]
    twice = output_size is None or tuple(output_size) == (2 * h, 2 * w)
    if args or kwargs or hidden_states.dim() != 4 or not twice:
        return Upsample2D.forward(self, hidden_states, output_size, *args, **kwargs)
    assert hidden_states.shape[1] == self.channels
    hidden_states = upsample_nearest2x(hidden_states)
    if self.use_conv:
        hidden_states = self.conv(hidden_states) if self.name == "conv" else self.Conv2d_0(hidden_states)
    return hidden_states


def apply(model: nn.Module) -> int:
    """Rebind the forward of every supported ``Upsample2D`` in ``model``. Returns how many."""
    changed = 0
    for m in model.modules():
        if _supported(m) and "forward" not in m.__dict__:  # not ours already, nor a forward someone else set
            rebind_forward(m, fused_upsample_forward, _MARKER)
            changed += 1
    return changed


def undo(model: nn.Module) -> int:
    """Restore every forward ``apply`` rebound. Returns how many."""
    return restore_forwards(model, _MARKER)
