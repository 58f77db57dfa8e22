"""A ControlNet's embedding of its control image computed once per call, outside the ControlNet step's CUDA graph.

``ControlNetModel.forward`` (diffusers; Zhang et al., "Adding Conditional Control to Text-to-Image Diffusion
Models", ICCV 2023) starts with ``controlnet_cond_embedding(controlnet_cond)``: eight 3x3 convolutions from the
control image at pixel size (B, 3, 8h, 8w) down to the latent size (B, C, h, w), C the UNet's first block width.
The control image is the same tensor at every step of a loop, so the embedding is too; at pixel resolution with
16 to 96 channels those convolutions are a sizeable part of the ControlNet's step, bound by memory traffic.

``ControlEmbedding`` is one of the graph runner's conditionings (``runtime.conditioning``): a small graph runs the
embedding on the static control image (``fill``) and keeps its output in that graph's own memory pool; the step
graph is captured while the embedding module returns that output for that very tensor (``reading``). A ControlNet
that reorders the image's channels first (``controlnet_conditioning_channel_order="bgr"``) hands the embedding
another tensor, which is then embedded inside the step graph as stock does.
"""

from __future__ import annotations

import contextlib

import torch

from sdfast.runtime.conditioning import Conditioning


class ControlEmbedding(Conditioning):
    """The ``controlnet_cond_embedding`` of one ControlNet (``arg_name`` ``controlnet_cond``, the 4th argument of
    its forward)."""

    def __init__(self, module: torch.nn.Module, arg_name: str = "controlnet_cond", arg_index: int = 3):
        super().__init__(module, arg_name, arg_index)

    def _embedding(self) -> torch.nn.Module | None:
        emb = getattr(self.module, "controlnet_cond_embedding", None)
        return emb if isinstance(emb, torch.nn.Module) else None

    def layers(self) -> list:
        emb = self._embedding()
        return [] if emb is None else [emb]

    def fill(self, context: torch.Tensor) -> dict:
        """{"embedding": (B, C, h, w)} for the control image ``context`` (B, 3, 8h, 8w), in the net's dtype."""
        return {"embedding": self._embedding()(context)}

    def params(self) -> list:
        return list(self._embedding().parameters())

    @contextlib.contextmanager
    def reading(self, slots: dict, context: torch.Tensor):
        """While capturing a step graph: the embedding module returns ``slots["embedding"]`` when handed ``context``
        (and embeds any other tensor as usual). Its forward is an instance attribute only inside this block."""
        emb = self._embedding()
        own = emb.__dict__.get("forward")  # a forward another pass set on the instance, restored after
        inner = emb.forward
        out = slots["embedding"]
        emb.forward = lambda cond: out if cond is context else inner(cond)
        try:
            yield
        finally:
            if own is None:
                del emb.forward
            else:
                emb.forward = own
