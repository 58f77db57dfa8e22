"""Work that depends only on a call's conditioning, computed once per pipeline call outside the step's CUDA graph.

Some of what a denoising net computes at every step depends only on an input that stays the same for the whole
loop: the cross-attention K/V of the text embedding (``runtime.cross_kv.CrossKV``) and a ControlNet's embedding of
its control image (``runtime.control_embedding.ControlEmbedding``). A :class:`Conditioning` names that input and
the work; the graph runner (``runtime.cuda_graphs.GraphedForward``, its ``conditionings``) captures, per input
signature, one small graph per conditioning that runs ``fill`` on the static input, and captures the step graph
inside ``reading(slots, context)``, where the net takes the precomputed result instead of computing it. The
small graph is replayed only when the caller's tensor is another one, was changed in place, or the weights it
reads were (``state``), and at the start of every pipeline call (``GraphCache.check``). Eager calls never read
the slots: ``reading`` is only entered while a step graph is captured.
"""

from __future__ import annotations

import weakref

import torch


def _version(t: torch.Tensor):
    """The tensor's in-place version counter; None for inference tensors, which have none (always "changed")."""
    return None if t.is_inference() else t._version


class Conditioning:
    """One piece of per-call work of ``module``, computed from the argument ``arg_name`` (position ``arg_index`` of
    its forward). Subclasses define ``layers``, ``fill``, ``params`` and ``reading``."""

    def __init__(self, module: torch.nn.Module, arg_name: str, arg_index: int):
        self.module = module
        self.arg_name = arg_name
        self.arg_index = arg_index

    def layers(self) -> list:
        """The modules whose work ``fill`` does; none: nothing to take out of the step graph."""
        raise NotImplementedError

    def context(self, args: tuple, kwargs: dict):
        """The call's conditioning tensor (the ``arg_name`` argument, by name or position), or None."""
        x = kwargs.get(self.arg_name, args[self.arg_index] if len(args) > self.arg_index else None)
        return x if isinstance(x, torch.Tensor) else None

    def fill(self, context: torch.Tensor) -> dict:
        """The work's results for ``context`` (run inside the small graph's capture): the slots."""
        raise NotImplementedError

    def params(self) -> list:
        """The tensors that ``fill`` reads besides the context (their versions are watched)."""
        raise NotImplementedError

    def reading(self, slots: dict, context: torch.Tensor):
        """A context manager: while a step graph is captured inside it, the net takes its results from ``slots``
        when it is handed ``context`` itself."""
        raise NotImplementedError

    def uninstall(self) -> None:
        """Remove whatever ``fill`` left on the modules."""

    @staticmethod
    def state(context: torch.Tensor, params: list) -> tuple | None:
        """What the slots depend on, to compare between calls; None when it cannot be known (inference tensors)."""
        versions = [_version(context), *(_version(p) for p in params)]
        if any(v is None for v in versions):
            return None
        return context.data_ptr(), tuple(context.shape), tuple(versions)


class SeenContext:
    """Which context a conditioning graph last ran on: a weak reference and ``Conditioning.state``."""

    def __init__(self):
        self.ref = None
        self.state = None

    def same(self, x: torch.Tensor, state) -> bool:
        return state is not None and self.ref is not None and self.ref() is x and self.state == state

    def set(self, x: torch.Tensor, state) -> None:
        self.ref, self.state = weakref.ref(x), state

    def forget(self) -> None:
        self.ref = self.state = None
