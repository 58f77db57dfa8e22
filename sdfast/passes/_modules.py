"""Whether a module can be bypassed (its weights used directly, e.g. ``conv._conv_forward(x, w, None)`` or
``F.linear(x, proj.weight)``) without changing what running it would do."""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as _module


def runs_as_its_class(m: nn.Module, cls: type) -> bool:
    """True when ``m`` is exactly ``cls`` and calling it would run ``cls.forward`` and nothing else: no
    forward (pre-)hooks on it or global ones, and no instance-level ``forward`` (diffusers' hook registry,
    e.g. ``apply_layerwise_casting``, and other wrappers replace ``module.forward``)."""
    return (
        type(m) is cls
        and "forward" not in m.__dict__
        and not m._forward_hooks
        and not m._forward_pre_hooks
        and not _module._global_forward_hooks
        and not _module._global_forward_pre_hooks
    )
