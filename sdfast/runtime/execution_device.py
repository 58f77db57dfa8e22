"""Answer a pipeline's ``_execution_device`` without walking every submodule at every call.

diffusers' ``DiffusionPipeline._execution_device`` (read once at the start of each pipeline call) looks for
group-offloading hooks in every submodule of every component, then for accelerate's ``_hf_hook``. Each look
is a ``hasattr`` that fails through ``nn.Module.__getattr__``: tens of milliseconds of host time at the start
of every image, with the GPU idle (``benchmarks/trace_e2e.py`` shows it).

``install(pipe)`` gives this one pipeline object a subclass of its own class (same name, module and
behaviour) whose ``_execution_device`` caches stock's answer. The cache is keyed by each component's identity
and device. While any module of a component carries an offloading hook (``_hf_hook`` from accelerate,
``_diffusers_hook`` from diffusers' hook registry: group offloading at leaf level hooks only the leaves) stock's
walk runs every time. Submodules are listed once per component object (a module added inside a component
later is not seen). The class itself is not changed. ``uninstall(pipe)`` puts the original class back.
"""

from __future__ import annotations

import torch

_SUBCLASSES: dict[type, type] = {}


def _key(pipe, state: dict):
    """The components' identities and devices, or None when a module of theirs carries an offloading hook.
    ``state["modules"]`` maps each current component's id to (the component, its submodules' ``__dict__``),
    listed once per component object (a flat list scanned with dict lookups: no ``__getattr__`` miss per module)."""
    key, listed = [], {}
    for name, module in pipe.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        subs = state["modules"].get(id(module))
        if subs is None or subs[0] is not module:
            subs = (module, [m.__dict__ for m in module.modules()])
        listed[id(module)] = subs
        if [d for d in subs[1] if "_hf_hook" in d or "_diffusers_hook" in d]:  # inlined lookups: 4x faster than any() over a generator
            key = None
            break
        param = next(module.parameters(), None)
        key.append((name, id(module), None if param is None else param.device))
    state["modules"] = listed  # only the current components: a replaced one is not kept alive
    return None if key is None else tuple(key)


def _subclass(cls: type) -> type:
    if cls in _SUBCLASSES:
        return _SUBCLASSES[cls]

    def _execution_device(self):
        stock = getattr(cls, "_execution_device").fget  # looked up per call: whatever the class has now
        state = self.__dict__.setdefault("_sdfast_execution_device", {"modules": {}, "key": None, "device": None})
        key = _key(self, state)
        if key is None:  # offloading hooks: the execution device lives in them, ask stock every time
            return stock(self)
        if state["key"] != key:
            state["key"], state["device"] = key, stock(self)
        return state["device"]

    _SUBCLASSES[cls] = type(cls.__name__, (cls,), {
        "_execution_device": property(_execution_device, doc=cls._execution_device.__doc__),
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
