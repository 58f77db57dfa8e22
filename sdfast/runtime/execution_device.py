"""Answer a pipeline's ``_execution_device`` without walking every submodule at every call.

diffusers' ``DiffusionPipeline._execution_device`` (read once at the start of each pipeline call) looks for
group-offloading hooks in every submodule of every component, then for accelerate's ``_hf_hook``. Each look
is a ``hasattr`` that fails through ``nn.Module.__getattr__``. On the H200 host that walk is the first
20 ms of a 344 ms SD1.5 image and 73 ms of a 1.0 s SDXL one (``benchmarks/trace_e2e.py``, run 7), with the
GPU idle.

``install(pipe)`` gives this one pipeline object a subclass of its own class (same name, module and
behaviour) whose ``_execution_device`` caches stock's answer. The cache is keyed by each component's identity
and device; a component with an offloading hook at its top level (``_hf_hook`` from accelerate,
``_diffusers_hook`` from diffusers' hook registry) is never cached: stock's walk runs every time. The class
itself is not changed. ``uninstall(pipe)`` puts the original class back.
"""

from __future__ import annotations

import torch

_HOOK_ATTRS = ("_hf_hook", "_diffusers_hook")
_SUBCLASSES: dict[type, type] = {}


def _key(pipe):
    """The components' identities and devices, or None when one of them carries an offloading hook."""
    key = []
    for name, module in pipe.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        if any(attr in module.__dict__ for attr in _HOOK_ATTRS):
            return None
        param = next(module.parameters(), None)
        key.append((name, id(module), None if param is None else param.device))
    return tuple(key)


def _cached_execution_device(self):
    key = _key(self)
    if key is None:  # offloading hooks: the execution device lives in them, ask stock every time
        return super(type(self), self)._execution_device
    cached = self.__dict__.get("_sdfast_execution_device")
    if cached is None or cached[0] != key:
        cached = (key, super(type(self), self)._execution_device)
        self.__dict__["_sdfast_execution_device"] = cached
    return cached[1]


def _subclass(cls: type) -> type:
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {
            "_execution_device": property(_cached_execution_device, doc=cls._execution_device.__doc__),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_sdfast_original_class": cls,
        })
    return _SUBCLASSES[cls]


def installed(pipe) -> bool:
    return "_sdfast_original_class" in type(pipe).__dict__


def install(pipe) -> bool:
    """Cache ``pipe._execution_device`` (this instance only). Returns False, changing nothing, for an object
    without that property. Idempotent."""
    if installed(pipe):
        return True
    if not isinstance(getattr(type(pipe), "_execution_device", None), property):
        return False
    pipe.__class__ = _subclass(type(pipe))
    return True


def uninstall(pipe) -> None:
    """Give ``pipe`` its original class back and drop the cached answer."""
    if installed(pipe):
        pipe.__class__ = type(pipe)._sdfast_original_class
    pipe.__dict__.pop("_sdfast_execution_device", None)
