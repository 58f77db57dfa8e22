"""Mixed layout: convolutions and norms in channels_last (NHWC), tokens (B, H*W, C) for linears and attention.

With every GroupNorm on sdfast's layout-preserving kernel, NHWC flows from ``conv_in`` to ``conv_out``
with no conversions: the token view of an NHWC tensor (``permute(0, 2, 3, 1).reshape(B, H*W, C)``) is
free, and ``Transformer2DModel``'s output goes back to NHWC without the ``.contiguous()`` that would
convert it to NCHW (its ``_get_output_for_continuous_inputs`` is rebound on the instance). SD 1.x's 1x1
``proj_in``/``proj_out`` convolutions run as linears on that token view (``_operate_on_continuous_inputs``
is rebound too): no conv bias passes, and proj_out's bias and the residual add are one kernel.

A VAE's ``encode`` (img2img, inpainting) is rebound on the instance to give its latent distribution back in NCHW,
as stock does: its convolutions run NHWC and would hand channels_last latents to the UNet, whose CUDA graphs are
keyed by the inputs' strides (the txt2img ones would not be replayed).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from kernels.elementwise import bias_residual_add
from kernels.gemm.linear_projection import linear_projection
from sdfast.passes.linear import routable
from sdfast.passes.state import TOKENS_LINEAR
from sdfast.passes._modules import runs_as_its_class


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _pointwise_conv(m: nn.Module) -> bool:
    """A plain 1x1 ``nn.Conv2d`` (SD 1.x ``proj_in``/``proj_out``): on NHWC memory it is a linear on the tokens."""
    return (
        runs_as_its_class(m, nn.Conv2d) and m.kernel_size == (1, 1) and m.stride == (1, 1) and m.padding == (0, 0)
        and m.dilation == (1, 1) and m.groups == 1 and m.padding_mode == "zeros"
    )


def _is_channels_last(x: torch.Tensor) -> bool:
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)


def _transformer_input(self, hidden_states):
    """``Transformer2DModel._operate_on_continuous_inputs``; a 1x1 ``proj_in`` on NHWC input runs as one
    linear (GEMM with the bias in its epilogue) on the free token view instead of conv + bias add."""
    batch, _, height, width = hidden_states.shape
    hidden_states = self.norm(hidden_states)
    inner_dim = hidden_states.shape[1]
    if not self.use_linear_projection and _pointwise_conv(self.proj_in) and _is_channels_last(hidden_states):
        tokens = hidden_states.permute(0, 2, 3, 1).reshape(batch, height * width, inner_dim)
        weight, bias = self.proj_in.weight.flatten(1), self.proj_in.bias
        tma = TOKENS_LINEAR.get(self, False) and routable(tokens, weight, bias)
        out = (linear_projection if tma else F.linear)(tokens, weight, bias)
        return out, out.shape[-1]
    if not self.use_linear_projection:
        hidden_states = self.proj_in(hidden_states)
        inner_dim = hidden_states.shape[1]
        return hidden_states.permute(0, 2, 3, 1).reshape(batch, height * width, inner_dim), inner_dim
    hidden_states = hidden_states.permute(0, 2, 3, 1).reshape(batch, height * width, inner_dim)
    return self.proj_in(hidden_states), inner_dim


def _transformer_output(self, hidden_states, residual, batch_size, height, width, inner_dim):
    """``Transformer2DModel._get_output_for_continuous_inputs`` that keeps the residual's memory format; a
    1x1 ``proj_out`` before an NHWC residual runs as a bias-free linear on the tokens (its output is NHWC
    memory) and one ``bias_residual_add``, instead of a layout copy, conv, bias add and residual add."""
    fmt = torch.channels_last if _is_channels_last(residual) else torch.contiguous_format
    if not self.use_linear_projection:
        if (_pointwise_conv(self.proj_out) and fmt is torch.channels_last and residual.dtype == hidden_states.dtype
                and residual.dtype in _KERNEL_DTYPES):  # else (autocast's mixed dtypes, fp64) diffusers' own ops
            weight, bias = self.proj_out.weight.flatten(1), self.proj_out.bias
            if TOKENS_LINEAR.get(self, False) and routable(hidden_states, weight, bias):
                # sdfast.passes.linear: the bias and the residual in the GEMM's epilogue
                tokens = residual.permute(0, 2, 3, 1).reshape(batch_size, height * width, -1)  # a view (NHWC memory)
                out = linear_projection(hidden_states, weight, bias, tokens)
                return out.reshape(batch_size, height, width, -1).permute(0, 3, 1, 2)
            out = F.linear(hidden_states, self.proj_out.weight.flatten(1))
            out = out.reshape(batch_size, height, width, -1).permute(0, 3, 1, 2)
            return bias_residual_add(out, self.proj_out.bias, residual)
        hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
        hidden_states = self.proj_out(hidden_states.contiguous(memory_format=fmt))
    else:
        hidden_states = self.proj_out(hidden_states)
        hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
        hidden_states = hidden_states.contiguous(memory_format=fmt)
    return hidden_states + residual


def _encode_nchw(vae) -> None:
    """Rebind ``vae.encode`` so that its ``latent_dist``'s tensors (``parameters``, ``mean``, ``logvar``, ``std``,
    ``var``) are NCHW-contiguous; the ``encode`` it wraps is kept for ``undo``."""
    previous = vae.__dict__.get("encode")
    original = vae.encode

    def encode(self, x, *args, **kwargs):
        out = original(x, *args, **kwargs)
        dist = out[0] if isinstance(out, tuple) else out.latent_dist
        for name in ("parameters", "mean", "logvar", "std", "var"):
            t = getattr(dist, name, None)
            if isinstance(t, torch.Tensor):
                setattr(dist, name, t.contiguous())
        return out

    vae.encode = types.MethodType(encode, vae)
    vae._sdfast_layout_encode = previous


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
            m._operate_on_continuous_inputs = types.MethodType(_transformer_input, m)
            m._sdfast_layout = True
            changed += 1
    if changed and hasattr(model, "encoder") and callable(getattr(model, "encode", None)) \
            and "_sdfast_layout_encode" not in model.__dict__:
        _encode_nchw(model)
    return changed


def undo(model: nn.Module) -> int:
    restored = 0
    if "_sdfast_layout_encode" in model.__dict__:
        previous = model.__dict__.pop("_sdfast_layout_encode")
        if previous is None:
            del model.encode
        else:
            model.encode = previous
    for _, m in model.named_modules():
        if getattr(m, "_sdfast_layout", False):
            if isinstance(m, nn.Conv2d):
                m.to(memory_format=torch.contiguous_format)
            else:
                del m._get_output_for_continuous_inputs
                del m._operate_on_continuous_inputs
            del m._sdfast_layout
            restored += 1
    return restored
