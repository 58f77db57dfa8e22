"""Fused normalization kernels: GroupNorm (+ channel bias, residual, SiLU; NCHW and channels_last),
InstanceNorm, LayerNorm (+ residual) and GEGLU.

Each op has a plain-PyTorch ``*_ref`` beside it and is registered as ``torch.ops.sdfast.<name>``.
"""

from kernels.norm.geglu import geglu, geglu_ref
from kernels.norm.group_norm import group_norm, group_norm_ref, instance_norm
from kernels.norm.layer_norm import layer_norm, layer_norm_ref

__all__ = [
    "group_norm",
    "group_norm_ref",
    "instance_norm",
    "layer_norm",
    "layer_norm_ref",
    "geglu",
    "geglu_ref",
]
