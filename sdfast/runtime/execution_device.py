"""Answer a pipeline's ``_execution_device``, and its diffusers models' ``device`` and ``dtype``, without probing
every submodule with a failing attribute lookup at every call.

diffusers' ``DiffusionPipeline._execution_device`` (read once at the start of each pipeline call) looks for
group-offloading hooks in every submodule of every component, then for accelerate's ``_hf_hook``; a
``ModelMixin``'s ``device`` and ``dtype`` (the SDXL pipeline reads the VAE's three times per call) look for
diffusers hooks in every submodule. Each look is a ``hasattr`` that fails through ``nn.Module.__getattr__`` (about
a microsecond and a half): 10 ms for SDXL's UNet, 1 ms for its VAE, with the GPU idle (``benchmarks/trace_e2e.py``
shows it).

``install(pipe)`` gives this one pipeline object a subclass of its own class (same name, module and
behaviour) whose ``_execution_device`` caches stock's answer. The cache is keyed by each component's identity
and device. While any module of a component carries an offloading hook (``_hf_hook`` from accelerate,
``_diffusers_hook`` from diffusers' hook registry: group offloading at leaf level hooks only the leaves) stock's
walk runs every time. Submodules are listed once per component object (a module added inside a component
later is not seen). The class itself is not changed. ``uninstall(pipe)`` puts the original class back.

``install_model(model)`` does the same for one diffusers ``ModelMixin`` (a UNet, a VAE, a ControlNet): its
``device`` and ``dtype`` take stock's answer the short way, with nothing cached. The hook probe reads each
submodule's ``__dict__`` (where a hook registry lives: it is a plain attribute, never a parameter, buffer or
submodule); with a hook anywhere stock answers; without one the answer is what stock then computes: the first
parameter's (or buffer's) device, the first floating parameter's dtype outside ``_keep_in_fp32_modules``.
"""

from __future__ import annotations

from itertools import chain

import torch

_SUBCLASSES: dict[type, type] = {}
_MODEL_SUBCLASSES: dict[type, type] = {}


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


def _same_named_subclass(cls: type, **getters) -> type:
    """A subclass of ``cls`` with its name, module and qualified name (what diffusers saves and logs), whose
    properties ``getters`` (name -> getter) replace the class's, with their docstrings."""
    props = {name: property(fget, doc=getattr(cls, name).__doc__) for name, fget in getters.items()}
    return type(cls.__name__, (cls,), {**props, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                       "_sdfast_original_class": cls})


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

    _SUBCLASSES[cls] = _same_named_subclass(cls, _execution_device=_execution_device)
    return _SUBCLASSES[cls]


def installed(obj) -> bool:
    """Whether ``obj`` (a pipeline, or a model after ``install_model``) has one of this module's subclasses."""
    return "_sdfast_original_class" in type(obj).__dict__


def original_class(obj) -> type:
    """``obj``'s class as it was before ``install`` / ``install_model`` (its own class otherwise)."""
    return type(obj)._sdfast_original_class if installed(obj) else type(obj)


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


# -- diffusers models: device and dtype ----------------------------------------------------------------------------
def _has_diffusers_hook(model: torch.nn.Module) -> bool:
    """``hasattr(m, "_diffusers_hook")`` for any module ``m`` of ``model``, as dict lookups."""
    return any("_diffusers_hook" in m.__dict__ for m in model.modules())


def _model_subclass(cls: type) -> type:
    if cls in _MODEL_SUBCLASSES:
        return _MODEL_SUBCLASSES[cls]

    def device(self):
        if _has_diffusers_hook(self):  # group offloading: the onload device lives in the hook
            return cls.device.fget(self)
        first = next(chain(self.parameters(), self.buffers()), None)
        return cls.device.fget(self) if first is None else first.device

    def dtype(self):
        if _has_diffusers_hook(self):  # layerwise casting: the compute dtype lives in the hook
            return cls.dtype.fget(self)
        keep = getattr(self, "_keep_in_fp32_modules", None)
        for name, param in self.named_parameters():
            if keep and any(m in name for m in keep):
                continue
            if param.is_floating_point():
                return param.dtype
        return cls.dtype.fget(self)  # no floating parameter outside the fp32 modules: stock's own fallbacks

    _MODEL_SUBCLASSES[cls] = _same_named_subclass(cls, device=device, dtype=dtype)
    return _MODEL_SUBCLASSES[cls]


def install_model(model) -> bool:
    """Answer ``model.device`` and ``model.dtype`` the short way (this instance only). Returns False, changing
    nothing, for an object that is not a diffusers ``ModelMixin`` (e.g. a transformers text encoder, whose
    ``device`` reads the first parameter already). Idempotent."""
    from diffusers import ModelMixin

    if not isinstance(model, ModelMixin):
        return False
    if not installed(model):
        model.__class__ = _model_subclass(type(model))
    return True


def uninstall_model(model) -> None:
    """Give ``model`` its original class back."""
    if installed(model):
        model.__class__ = type(model)._sdfast_original_class
