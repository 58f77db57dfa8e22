"""Fused LayerNorm (+ residual) (GroupNorm is ``kernels.group_norm``, GEGLU ``kernels.geglu``).

The op has a plain-PyTorch ``*_ref`` beside it and is registered as ``torch.ops.sdfast.<name>``.
"""

from kernels.norm.layer_norm import layer_norm, layer_norm_ref

__all__ = [
    "layer_norm",
    "layer_norm_ref",
]
