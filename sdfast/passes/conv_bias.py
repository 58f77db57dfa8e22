"""Convolution bias pass: the convolutions outside the fused blocks add their bias in one vectorized kernel.

PyTorch's cuDNN path runs a convolution without its bias and then adds the bias in a separate broadcast kernel;
on channels_last memory that kernel is PyTorch's generic (not vectorized) elementwise loop, well below the memory
bandwidth (measured on sm_90: ``benchmarks/results/h200-2026-11-30-run12/``). The ResNet blocks and SD 1.x's 1x1 transformer projections already fold their biases
(``sdfast.passes.norms``, ``sdfast.passes.layout``); this pass covers the rest: the UNet's ``conv_in``/``conv_out``,
those of the VAE's decoder and encoder, the VAE's ``post_quant_conv``, the convolutions of
``Downsample2D``/``Upsample2D``, and a ControlNet's ``conv_in`` and output ("zero") convolutions.
Their forward (per instance, reversible with ``undo``) runs the convolution without bias and then
``bias_residual_add(y, bias)``: one read and one write of the output, the bias added in fp32 and rounded once.
What the kernel does not take (not 4-D, another dtype than fp16/bf16/fp32, a bias in another dtype than the
input's or removed since, autocast, gradients) runs ``nn.Conv2d.forward``.

A ControlNet's zero convolutions (``controlnet_down_blocks``, ``controlnet_mid_block``: 1x1, one per residual it
hands the UNet) on channels_last input run as one linear on the free (B, H, W, C) view instead
(``pointwise_forward``): a GEMM with the bias in its epilogue, its output channels_last as the convolution's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.elementwise import bias_residual_add
from sdfast.passes._modules import rebind_forward, restore_forwards, runs_as_its_class

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ROOT_CONVS = ("conv_in", "conv_out", "post_quant_conv")
_ZERO_CONVS = ("controlnet_down_blocks", "controlnet_mid_block")  # a ControlNet's per-residual 1x1 convolutions
_MARKER = "_sdfast_conv_bias"


def _classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(blocks whose every conv is covered, VAE halves whose root convs are covered)."""
    from diffusers.models.autoencoders.vae import Decoder, Encoder
    from diffusers.models.downsampling import Downsample2D
    from diffusers.models.upsampling import Upsample2D

    return (Downsample2D, Upsample2D), (Decoder, Encoder)


def conv_bias_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``nn.Conv2d.forward`` with the bias added by ``bias_residual_add``."""
    if (self.bias is None or x.dim() != 4 or x.dtype not in _KERNEL_DTYPES or self.bias.dtype != x.dtype
            or torch.is_autocast_enabled(x.device.type) or _needs_grad(self, x)):
        return nn.Conv2d.forward(self, x)
    y = self._conv_forward(x, self.weight, None)
    if not (y.is_contiguous() or y.is_contiguous(memory_format=torch.channels_last)):
        return y + self.bias.view(1, -1, 1, 1)
    return bias_residual_add(y, self.bias)


def pointwise_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A 1x1 convolution (stride 1, no padding, one group) on channels_last ``x`` (B, C, H, W): ``F.linear`` on the
    (B, H, W, C) view, the bias in the GEMM's epilogue; returns (B, O, H, W) in channels_last memory. Other input
    goes through :func:`conv_bias_forward`."""
    if not (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and x.dtype == self.weight.dtype
            and not torch.is_autocast_enabled(x.device.type) and not _needs_grad(self, x)):
        return conv_bias_forward(self, x)
    return F.linear(x.permute(0, 2, 3, 1), self.weight.flatten(1), self.bias).permute(0, 3, 1, 2)


def _pointwise(conv: nn.Module) -> bool:
    return (conv.kernel_size == (1, 1) and conv.stride == (1, 1) and conv.padding == (0, 0)
            and conv.dilation == (1, 1) and conv.groups == 1)


def _needs_grad(conv: nn.Module, x: torch.Tensor) -> bool:
    """The kernel has no autograd formula: training runs the module's own forward."""
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in (conv.weight, conv.bias)))


def _targets(model: nn.Module):
    """(convolution, its forward) for every covered convolution of ``model``."""
    owners, halves = _classes()
    zero = {id(m) for name in _ZERO_CONVS if isinstance(getattr(model, name, None), nn.Module)
            for m in getattr(model, name).modules()}
    for parent in model.modules():
        for cname, child in parent.named_children():
            if not (runs_as_its_class(child, nn.Conv2d) and child.bias is not None):
                continue
            if id(child) in zero:
                yield child, pointwise_forward if _pointwise(child) else conv_bias_forward
            elif (cname in _ROOT_CONVS and (parent is model or isinstance(parent, halves))) or isinstance(parent, owners):
                yield child, conv_bias_forward


def apply(model: nn.Module) -> int:
    """Rebind the forward of the covered convolutions of ``model`` (a UNet, a ControlNet or a VAE). Returns how
    many."""
    convs = list(_targets(model))
    for conv, forward in convs:
        rebind_forward(conv, forward, _MARKER)
    return len(convs)


def undo(model: nn.Module) -> int:
    """Restore every forward ``apply`` rebound. Returns how many."""
    return restore_forwards(model, _MARKER)
