"""Fused elementwise epilogues that no neighbouring kernel can absorb (bias + residual adds), nearest 2x
upsampling and channel concatenation in the input's memory format.

Each op has a plain-PyTorch ``*_ref`` beside it and is registered as ``torch.ops.sdfast.<name>``.
"""

from kernels.elementwise.bias_residual import bias_residual_add, bias_residual_add_ref
from kernels.elementwise.concat import cat_channels, cat_channels_ref
from kernels.elementwise.upsample import upsample_nearest2x, upsample_nearest2x_ref

__all__ = ["bias_residual_add", "bias_residual_add_ref", "cat_channels", "cat_channels_ref", "upsample_nearest2x",
           "upsample_nearest2x_ref"]
