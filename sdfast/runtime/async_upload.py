"""Host-to-GPU copies that diffusers makes blocking, made without waiting for the GPU.

diffusers draws its noise on the generator the caller gave: a seeded CPU ``torch.Generator`` (so that a seed gives
the same image on every GPU), then ``randn_tensor`` copies it with ``.to(device)``. It builds SDXL's
micro-conditioning (``_get_add_time_ids``) and a scheduler's timesteps on the host the same way. Such a copy from
pageable memory with ``non_blocking=False`` synchronizes the stream: the host waits until the GPU has run everything
queued, and the GPU then idles while the host prepares and launches the next work. Stochastic samplers (Euler,
Euler ancestral, LCM, DDPM) draw noise at every step, so the denoising loop waits for each UNet step, and the
pipeline's setup waits for the text encoders instead of running beside them.

``AsyncUpload`` is a ``TorchFunctionMode`` that, while it is active, makes each ``Tensor.to`` of a CPU tensor to a CUDA
device (``non_blocking`` not asked for, no ``copy``/``memory_format``) a copy into a new pinned host buffer (dtype
conversion there, on the host) and then ``non_blocking=True``: the same values on the same device, in stream order,
with no wait; PyTorch's caching host allocator keeps the pinned buffer until its copy has run. It records each upload,
so that code that needs the host values back (``runtime.host_timesteps``) takes them without a GPU->host copy.

It is entered only around diffusers code that makes such copies and runs few ops (the mode adds about 1.6 us of
Python to every torch call inside it): a scheduler's ``set_timesteps`` and ``step`` (``runtime.host_timesteps``), and
the pipeline's ``prepare_latents``, while ``_get_add_time_ids`` returns its tensors already uploaded (``install``:
this pipeline object only, for pipelines whose UNet runs in CUDA graphs). Method: "pinned memory and non_blocking
copies", PyTorch's CUDA semantics notes.
"""

from __future__ import annotations

import functools
import types

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

_MARK = "_sdfast_async_upload"  # set on our wrapper functions


class AsyncUpload(TorchFunctionMode):
    """See the module docstring. ``host_copy(t)`` answers the host values of a tensor this mode uploaded."""

    def __init__(self):
        super().__init__()
        self._uploads: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # id(out) -> (out, host, version)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and args:
            out = self._upload(args[0], args[1:], kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _upload(self, src, args, kwargs) -> torch.Tensor | None:
        """``src.to(*args, **kwargs)`` through pinned memory without a wait, or None when the call is not a blocking
        CPU->CUDA copy this mode takes over."""
        if type(src) is not torch.Tensor or src.device.type != "cpu" or "copy" in kwargs:
            return None
        try:
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except TypeError:
            return None
        if device is None or device.type != "cuda" or non_blocking or memory_format is not None:
            return None
        host = src if dtype is None or dtype == src.dtype else src.to(dtype)
        staged = torch.empty_like(host, pin_memory=True).copy_(host)  # a buffer of ours: no one writes it meanwhile
        out = staged.to(device, non_blocking=True)
        self._uploads[id(out)] = (out, host, out._version)
        return out

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """The CPU values of ``t``: those it was uploaded from by this mode when it is such an upload, unchanged since
        (a copy, so that the source's later changes do not show), else ``t.cpu()`` (a copy that waits for the GPU)."""
        record = self._uploads.get(id(t))
        if record is not None and record[0] is t and t._version == record[2]:
            return record[1].clone()
        return t.cpu()


def wrapped_by_us(obj, name: str) -> bool:
    """Whether ``obj``'s instance attribute ``name`` is a method wrapper of this module."""
    fn = obj.__dict__.get(name)
    return getattr(getattr(fn, "__func__", None), _MARK, False)


def wrap_method(obj, name: str, wrapper) -> bool:
    """Set ``obj.name`` to ``wrapper`` (a function of ``(self, *args, **kwargs)`` that calls the class's method)
    bound to ``obj``, with the class method's signature (diffusers inspects some, e.g. ``set_timesteps``). Returns
    False, changing nothing, when ``obj`` has no such method or someone else replaced it on the instance already."""
    if wrapped_by_us(obj, name):
        return True
    if not callable(getattr(obj, name, None)) or name in obj.__dict__:
        return False
    @functools.wraps(getattr(type(obj), name))
    def method(self, *args, **kwargs):  # a function of its own per instance: wraps() writes the signature on it
        return wrapper(self, *args, **kwargs)

    setattr(method, _MARK, True)
    setattr(obj, name, types.MethodType(method, obj))
    return True


def unwrap_method(obj, name: str) -> None:
    """Undo ``wrap_method`` (the class's method comes back)."""
    if obj is not None and wrapped_by_us(obj, name):
        del obj.__dict__[name]


def _prepare_latents(self, *args, **kwargs):
    with AsyncUpload():
        return type(self).prepare_latents(self, *args, **kwargs)


def _get_add_time_ids(self, *args, **kwargs):
    """SDXL's micro-conditioning, built on the host by diffusers, returned already on the execution device (the
    pipeline's own ``.to(device)`` of it is then a no-op): uploaded without a wait."""
    out = type(self)._get_add_time_ids(self, *args, **kwargs)
    device = self._execution_device
    if device.type != "cuda":
        return out
    with AsyncUpload():
        return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, out)


_PIPELINE_METHODS = {"prepare_latents": _prepare_latents, "_get_add_time_ids": _get_add_time_ids}


def install(pipe) -> int:
    """Wrap ``pipe.prepare_latents`` and ``pipe._get_add_time_ids`` (those it has; this instance only). Returns how
    many were wrapped."""
    return sum(wrap_method(pipe, name, fn) for name, fn in _PIPELINE_METHODS.items() if hasattr(pipe, name))


def uninstall(pipe) -> None:
    for name in _PIPELINE_METHODS:
        unwrap_method(pipe, name)
