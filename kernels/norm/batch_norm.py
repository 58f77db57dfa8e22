"""Inference BatchNorm folded into the preceding convolution.

In eval mode BatchNorm is a per-channel affine map, ``bn(z) = (z - mean) / sqrt(var + eps) * gamma +
beta``, so ``bn(conv(x)) = conv'(x)`` with

    scale = gamma / sqrt(running_var + eps)
    W'    = W * scale[:, None, None, None]
    b'    = (b - running_mean) * scale + beta          (b = 0 when the conv has no bias)

which removes one full read and write of the activation per BatchNorm (the standard inference
fold, e.g. TensorRT's and torch.fx's ``fuse_conv_bn_eval``). SD itself uses GroupNorm; this utility
covers the BatchNorm relatives in the same family (e.g. ControlNet preprocessors, some VAEs).
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def fold_batch_norm_into_conv(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """A new ``nn.Conv2d`` equal to ``bn(conv(x))`` with ``bn`` in eval mode (its running statistics).

    conv: ``nn.Conv2d`` (any stride, padding, dilation, groups, padding_mode; bias or not) with C_out
    output channels; bn: ``nn.BatchNorm2d(C_out)`` with running statistics (affine or not). The fold is
    computed in fp64 and cast back to the conv weight's dtype and device; the inputs are not modified.
    Raises TypeError for other module types, ValueError for a channel mismatch or a BatchNorm without
    running statistics.
    """
    if type(conv) is not nn.Conv2d:
        raise TypeError(f"fold_batch_norm_into_conv: conv must be nn.Conv2d, got {type(conv).__name__}")
    if not isinstance(bn, nn.BatchNorm2d):
        raise TypeError(f"fold_batch_norm_into_conv: bn must be nn.BatchNorm2d, got {type(bn).__name__}")
    if bn.num_features != conv.out_channels:
        raise ValueError(
            f"fold_batch_norm_into_conv: bn has {bn.num_features} features, "
            f"conv has {conv.out_channels} output channels"
        )
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError("fold_batch_norm_into_conv: bn has no running statistics (track_running_stats=False)")

    w = conv.weight.detach()
    dt, dev = w.dtype, w.device
    var = bn.running_var.detach().double()
    mean = bn.running_mean.detach().double()
    gamma = bn.weight.detach().double() if bn.weight is not None else torch.ones_like(var)
    beta = bn.bias.detach().double() if bn.bias is not None else torch.zeros_like(var)
    b = conv.bias.detach().double() if conv.bias is not None else torch.zeros_like(var)
    scale = gamma / torch.sqrt(var + bn.eps)

    fused = copy.deepcopy(conv) if conv.bias is not None else nn.Conv2d(
        conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
        dilation=conv.dilation, groups=conv.groups, bias=True, padding_mode=conv.padding_mode,
        device=dev, dtype=dt,
    )
    with torch.no_grad():
        fused.weight.copy_((w.double() * scale[:, None, None, None]).to(dt))
        fused.bias.copy_(((b - mean) * scale + beta).to(dtype=dt, device=dev))
    fused.train(conv.training)
    return fused


__all__ = ["fold_batch_norm_into_conv"]
