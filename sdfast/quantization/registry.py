"""The handler table of ``quantize_`` and ``sparsify_``: one handler per config type (torchao's
``register_quantize_module_handler``, ``torchao/quantization/transform_module.py``).

A method is a config dataclass plus a handler registered for its type::

    @register_quantize_module_handler(MyConfig, calibration=lambda config: Calibration(collect=True))
    def _convert(linear: nn.Linear, config: MyConfig, stats) -> nn.Module:
        return MyQuantizedLinear.from_linear(linear, ...)

``quantize_`` (``sdfast.passes.quantize``) and ``sparsify_`` (``sdfast.passes.sparsity``) look the handler up by
the config's type (:func:`handler_for`) and never name a method, so a new method never edits them. A config type
with no handler for the entry point raises a TypeError that names the registered types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

__all__ = ["Calibration", "Handler", "register_quantize_module_handler", "register_sparsify_module_handler",
           "handler_for", "registered"]


@dataclass(frozen=True)
class Calibration:
    """What a method needs from the calibration run, for one config.

    collect: run ``calibration`` (when one is given) and pass each layer's statistics to ``convert``.
    required: what needs it, for the error when ``calibration`` is None (None: it is optional).
    hessian: collect ``X^T X`` too. n_samples: input rows kept per layer (``quantize_``'s statistics).
    """

    collect: bool = False
    required: str | None = None
    hessian: bool = False
    n_samples: int = 0


def _min_features(config: Any, linear: nn.Linear) -> bool:
    return min(linear.in_features, linear.out_features) >= config.min_features


def _nothing(config: Any, targets: dict, stats: dict | None) -> None:
    return None


@dataclass(frozen=True)
class Handler:
    """How the entry point ``entry`` ("quantize_" or "sparsify_") applies one config type.

    convert(linear, config, stats) -> the replacement module; ``stats`` is the layer's calibration statistics
        (None when nothing was collected for it).
    calibration(config) -> :class:`Calibration`: what the run must collect.
    eligible(config, linear) -> whether a targeted layer's shape suits the method (default: both feature counts
        >= ``config.min_features``); the others are counted as skipped for their shape.
    shape_rule(config) -> words added to the "skipped for their shape" warning ("" for none).
    module_types(config) -> the exact module classes the method converts (default ``(nn.Linear,)``; e.g. W8A8's
        static FP8 adds ``nn.Conv2d`` with ``convs=True``); ``convert`` and ``eligible`` get modules of these.
    validate(config, targets, stats): raises before anything is replaced; called with ``stats=None`` before the
        calibration runs and with the statistics after it.
    """

    config_type: type
    entry: str
    convert: Callable[[nn.Linear, Any, Any], nn.Module]
    calibration: Callable[[Any], Calibration] = field(default=lambda config: Calibration())
    eligible: Callable[[Any, nn.Linear], bool] = _min_features
    shape_rule: Callable[[Any], str] = field(default=lambda config: "")
    validate: Callable[[Any, dict, dict | None], None] = _nothing
    module_types: Callable[[Any], tuple] = field(default=lambda config: (nn.Linear,))


_HANDLERS: dict[type, Handler] = {}


def _register(entry: str, config_type: type, **hooks) -> Callable:
    if not isinstance(config_type, type):
        raise TypeError(f"{entry} handlers are registered for a config class, got {config_type!r}")

    def decorator(convert: Callable) -> Callable:
        _HANDLERS[config_type] = Handler(config_type, entry, convert,
                                         **{k: v for k, v in hooks.items() if v is not None})
        return convert

    return decorator


def register_quantize_module_handler(config_type: type, *, calibration=None, eligible=None, shape_rule=None,
                                     validate=None, module_types=None) -> Callable:
    """Decorator: the decorated ``convert(linear, config, stats) -> nn.Module`` is how ``quantize_`` applies
    ``config_type`` (the keyword hooks are :class:`Handler`'s). Registering a type again replaces its handler."""
    return _register("quantize_", config_type, calibration=calibration, eligible=eligible, shape_rule=shape_rule,
                     validate=validate, module_types=module_types)


def register_sparsify_module_handler(config_type: type, *, calibration=None, eligible=None, validate=None) -> Callable:
    """As :func:`register_quantize_module_handler`, for ``sparsify_``; ``stats`` is the layer's ``(H, n)``:
    its ``2 X^T X / n`` Hessian and the ``n`` rows it saw (``(zeros, 0)`` when it saw none)."""
    return _register("sparsify_", config_type, calibration=calibration, eligible=eligible, validate=validate)


def registered(entry: str) -> list[type]:
    """The config types ``entry`` ("quantize_" or "sparsify_") has handlers for, in registration order."""
    return [t for t, h in _HANDLERS.items() if h.entry == entry]


def handler_for(config: Any, entry: str) -> Handler:
    """The handler of ``config``'s type (or its nearest registered base class) for ``entry``; TypeError naming the
    registered config types when there is none."""
    for t in type(config).__mro__:
        h = _HANDLERS.get(t)
        if h is not None and h.entry == entry:
            return h
    names = ", ".join(t.__name__ for t in registered(entry)) or "none"
    raise TypeError(f"{entry}: config must be an instance of a registered config type ({names}), got "
                    f"{type(config).__name__}")
