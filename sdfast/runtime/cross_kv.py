"""Cross-attention K/V computed once per text conditioning, outside the UNet step's CUDA graph.

Every cross-attention layer of an SD/SDXL UNet projects the same text embedding
(``encoder_hidden_states``, fixed for a whole denoising loop) to K and V at every step. On SDXL that is
140 GEMMs per step with M = 2 x 77 rows and weights up to 2048 x 1280, each bound by reading its weight with
few CTAs (about 3 % of an SDXL step on sm_90).

``CrossKV`` is one of the runner's conditionings (``runtime.conditioning``): the graph runner
(``GraphedForward``, its ``conditionings`` argument) captures two graphs per input signature instead of one:

* the projection graph: ``fill(context)`` runs ``project_kv`` of every cross-attention layer on the static
  context buffer; its (key, value) outputs are the slots, kept alive in that graph's own memory pool (in the
  shared pool, another graph's replay could overwrite them);
* the step graph, captured inside ``reading(slots, context)``: each layer's processor
  (``SdfastAttnProcessor``) takes its K/V from the slots (``lookup``) when it is handed that same context
  tensor, so the step graph holds no K/V projection.

Eager calls (hooks, capture failures) never read the slots: ``lookup`` returns None outside ``reading``, and the
processor projects as usual.
"""

from __future__ import annotations

import contextlib

import torch

from sdfast.passes.attention.processor import SdfastAttnProcessor
from sdfast.passes.state import CROSS_KV
from sdfast.passes.attention.qkv import project_kv
from sdfast.runtime.conditioning import Conditioning


class CrossKV(Conditioning):
    """The cross-attention layers of one UNet (or ControlNet) and, while a step graph is captured, their K/V slots."""

    def __init__(self, module: torch.nn.Module, arg_name: str = "encoder_hidden_states", arg_index: int = 2):
        super().__init__(module, arg_name, arg_index)  # position in forward(sample, timestep, encoder_hidden_states, ...)
        self._slots: dict | None = None
        self._source: torch.Tensor | None = None

    def layers(self) -> list:
        """Cross-attention modules whose processor is sdfast's (the only one that consults the slots); none when
        the UNet transforms the context before its blocks (``encoder_hid_proj``: the layers see another tensor)."""
        if getattr(self.module, "encoder_hid_proj", None) is not None:
            return []
        return [m for m in self.module.modules()
                if getattr(m, "is_cross_attention", False) and isinstance(getattr(m, "processor", None), SdfastAttnProcessor)]

    def context(self, args: tuple, kwargs: dict):
        """The call's context tensor (``encoder_hidden_states``), or None. None too for a call with
        ``cross_attention_kwargs``: the UNet's forward applies some of them around the layers (diffusers scales
        PEFT LoRA layers by ``{"scale": s}`` for the duration of the call), which a projection run outside
        that forward would not see; such calls project K/V inside the step graph, as stock does."""
        if kwargs.get("cross_attention_kwargs"):
            return None
        return super().context(args, kwargs)

    def fill(self, context: torch.Tensor) -> dict:
        """K/V of every layer for ``context``: {id(layer): (key, value)}. Sets each layer's cache attribute."""
        slots = {}
        for m in self.layers():
            CROSS_KV.set(m, self)
            slots[id(m)] = project_kv(m, context, cross=True)
        return slots

    def params(self) -> list:
        """The tensors that ``fill`` reads besides the context (projection weights, ``norm_cross``)."""
        out = []
        for m in self.layers():
            for name in ("to_k", "to_v", "to_kv", "norm_cross"):
                sub = getattr(m, name, None)
                if isinstance(sub, torch.nn.Module):
                    out.extend(sub.parameters())
        return out

    @contextlib.contextmanager
    def reading(self, slots: dict, context: torch.Tensor):
        """While capturing a step graph: processors handed ``context`` take K/V from ``slots``."""
        self._slots, self._source = slots, context
        try:
            yield
        finally:
            self._slots, self._source = None, None

    def lookup(self, attn: torch.nn.Module, context: torch.Tensor):
        """(key, value) of ``attn`` for ``context`` from the slots being captured, else None."""
        if self._slots is None or context is not self._source:
            return None
        return self._slots.get(id(attn))

    def uninstall(self) -> None:
        for m in self.module.modules():
            CROSS_KV.clear(m)
