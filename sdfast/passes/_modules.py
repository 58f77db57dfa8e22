"""Module helpers shared by the passes: whether a module can be bypassed (its weights used directly, e.g.
``conv._conv_forward(x, w, None)`` or ``F.linear(x, proj.weight)``) without changing what running it would do, and
the per-instance forward rebinding that several passes undo by a marker attribute."""

from __future__ import annotations

import types

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


def runs_as_its_class_or_bound(m: nn.Module, cls: type, forward) -> bool:
    """:func:`runs_as_its_class`, or ``m``'s instance ``forward`` is exactly ``forward`` bound to ``m`` (a pass's
    :func:`rebind_forward`), with no hooks: a wrapper in between (diffusers' hook registry, accelerate's hooks, a
    ``functools.partial``) makes it False."""
    fn = m.__dict__.get("forward")
    if fn is None:
        return runs_as_its_class(m, cls)
    return (
        type(m) is cls
        and isinstance(fn, types.MethodType) and fn.__func__ is forward and fn.__self__ is m
        and not m._forward_hooks
        and not m._forward_pre_hooks
        and not _module._global_forward_hooks
        and not _module._global_forward_pre_hooks
    )


def rebind_forward(m: nn.Module, forward, marker: str) -> None:
    """Give ``m`` its own ``forward`` (``forward(self, ...)`` bound to it) and set the pass's ``marker`` attribute,
    which ``restore_forwards`` looks for."""
    m.forward = types.MethodType(forward, m)
    setattr(m, marker, True)


def restore_forwards(model: nn.Module, marker: str) -> int:
    """Delete the instance ``forward`` (and ``marker``) of every module under ``model`` that ``rebind_forward``
    marked: the class's forward runs again. Returns how many."""
    restored = 0
    for m in model.modules():
        if getattr(m, marker, False):
            del m.forward
            delattr(m, marker)
            restored += 1
    return restored
