"""The contracts between passes: typed slots on modules instead of attribute strings read across modules.

A :class:`Slot` is one piece of state a pass leaves on a module for another pass or for the runtime to read
(e.g. the time-embedding pack the norm pass's fused ResNet forward reads). Each slot is declared here once, with
its value's type and who writes and reads it; passes use ``SLOT.get(m)`` / ``SLOT.set(m, v)`` / ``SLOT.clear(m)``.
A pass's private markers (what its own ``undo`` looks for) stay in that pass's module.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Slot(Generic[T]):
    """A named value kept in a module instance's ``__dict__`` (never a parameter, buffer or submodule, so it is not
    in the state dict and survives ``.to()``)."""

    def __init__(self, name: str, doc: str):
        self.attr = f"_sdfast_{name}"
        self.__doc__ = doc

    def get(self, module: Any, default: T | None = None) -> T | None:
        return module.__dict__.get(self.attr, default)

    def set(self, module: Any, value: T) -> None:
        module.__dict__[self.attr] = value

    def clear(self, module: Any) -> T | None:
        return module.__dict__.pop(self.attr, None)

    def __repr__(self) -> str:
        return f"Slot({self.attr!r})"


NORMS_FUSED: Slot[bool] = Slot(
    "norms", "On a module the norm pass rebound (a ResnetBlock2D, a transformer block, a decoder tail); the "
    "time-embedding pass packs only ResNet blocks whose forward is the fused one.")
TEMB_PACK: Slot[Any] = Slot(
    "temb_pack", "On the UNet: its time-embedding pack (sdfast.passes.time_embedding.TembPack), written by that pass.")
BLOCK_TEMB: Slot[Any] = Slot(
    "temb", "On each packed ResnetBlock2D: the UNet's TembPack; the fused ResNet forward (sdfast.passes.norms) takes "
    "its time-embedding bias from the pack instead of running time_emb_proj.")
TOKENS_LINEAR: Slot[bool] = Slot(
    "tma_linear", "On a Transformer2DModel whose proj_in / proj_out run on kernels.gemm.linear_projection (written by "
    "sdfast.passes.linear); the channels_last token path (sdfast.passes.layout) then routes them through it.")

ATTENTION_STATE: Slot[dict] = Slot(
    "attention_state", "On each Attention module the attention pass converted: {'processor': the processor it "
    "replaced, 'fused': 'to_qkv' / 'to_kv' / None (the projections it fused, sdfast.passes.attention.qkv)}; "
    "qkv.fused_layer reads it to tell our fusion from diffusers' own.")
CROSS_KV: Slot[Any] = Slot(
    "cross_kv", "On each cross-attention module while the UNet's graphs project the text embedding once per call: "
    "the sdfast.runtime.cross_kv.CrossKV whose slots hold its K and V (written by the runtime, read by the attention "
    "processor instead of projecting at every step).")

__all__ = ["ATTENTION_STATE", "BLOCK_TEMB", "CROSS_KV", "NORMS_FUSED", "Slot", "TEMB_PACK", "TOKENS_LINEAR"]
