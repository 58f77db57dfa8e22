"""Fused normalization kernels: LayerNorm (+ residual) and GEGLU (GroupNorm is ``kernels.group_norm``).

Each op has a plain-PyTorch ``*_ref`` beside it and is registered as ``torch.ops.sdfast.<name>``.
"""

from kernels.norm.geglu import geglu, geglu_ref
from kernels.norm.layer_norm import layer_norm, layer_norm_ref

__all__ = [
    "layer_norm",
    "layer_norm_ref",
    "geglu",
    "geglu_ref",
]
