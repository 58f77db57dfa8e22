"""Input checks and layout tests shared by the kernels' launchers (messages name the op and argument)."""

from __future__ import annotations

import torch


def is_channels_last(x: torch.Tensor) -> bool:
    """True when ``x`` (4D) is in channels_last memory and not (also) NCHW-contiguous."""
    return (not x.is_contiguous()) and x.is_contiguous(memory_format=torch.channels_last)


def check_like(op: str, name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``t`` has ``x``'s shape, ``TypeError`` unless it has ``x``'s dtype."""
    if tuple(t.shape) != tuple(x.shape):
        raise ValueError(f"{op}: {name} shape {tuple(t.shape)} must equal x shape {tuple(x.shape)}")
    if t.dtype != x.dtype:
        raise TypeError(f"{op}: {name} dtype {t.dtype} must match x dtype {x.dtype}")
