"""Mixed layout: convolutions and norms in channels_last (NHWC), tokens (B, H*W, C) for linears and attention.

With every GroupNorm on sdfast's layout-preserving kernel, NHWC flows from ``conv_in`` to ``conv_out``
with no conversions: the token view of an NHWC tensor (``permute(0, 2, 3, 1).reshape(B, H*W, C)``) is
free, and ``Transformer2DModel``'s output goes back to NHWC without the ``.contiguous()`` that would
convert it to NCHW (its ``_get_output_for_continuous_inputs`` is rebound on the instance).
"""

from __future__ import annotations

import types

import torch
from torch import nn


def _transformer_output(self, hidden_states, residual, batch_size, height, width, inner_dim):
    """``Transformer2DModel._get_output_for_continuous_inputs`` that keeps the residual's memory format."""
    fmt = torch.channels_last if residual.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    if not self.use_linear_projection:
        hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
        hidden_states = self.proj_out(hidden_states.contiguous(memory_format=fmt))
    else:
        hidden_states = self.proj_out(hidden_states)
        hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
        hidden_states = hidden_states.contiguous(memory_format=fmt)
    return hidden_states + residual


def apply(model: nn.Module, *, filter_fn=None) -> int:
    """Convert ``model``'s 4-D weights to channels_last and rebind Transformer2D outputs. Returns modules changed."""
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    changed = 0
    for name, m in model.named_modules():
        if filter_fn and not filter_fn(m, name):
            continue
        if isinstance(m, nn.Conv2d) and not m.weight.is_contiguous(memory_format=torch.channels_last):
            m.to(memory_format=torch.channels_last)
            m._sdfast_layout = True
            changed += 1
        elif isinstance(m, Transformer2DModel) and m.is_input_continuous and not getattr(m, "_sdfast_layout", False):
            m._get_output_for_continuous_inputs = types.MethodType(_transformer_output, m)
            m._sdfast_layout = True
            changed += 1
    return changed


def undo(model: nn.Module) -> int:
    restored = 0
    for _, m in model.named_modules():
        if getattr(m, "_sdfast_layout", False):
            if isinstance(m, nn.Conv2d):
                m.to(memory_format=torch.contiguous_format)
            else:
                del m._get_output_for_continuous_inputs
            del m._sdfast_layout
            restored += 1
    return restored
