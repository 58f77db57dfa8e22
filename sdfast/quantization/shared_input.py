"""Quantize one input once for the several linears that read it (an attention's Q/K/V projections).

``to_q``, ``to_k`` and ``to_v`` of a self-attention read the same tensor. Quantized with the same static
scale (and no per-layer smoothing), their 8-bit inputs are identical, so one quantize pass can serve all
three. Inside a :class:`SharedInputQuantization` block, :func:`quantize_input` remembers what it
quantized, keyed by the input tensor object, its version counter (an in-place change is a new input) and
the layer's quantization key; outside a block it always quantizes. The memory lives only for the block
(the attention processor wraps its projections in one), so nothing outlives the call it was made for.

    with SharedInputQuantization():
        q = attn.to_q(x); k = attn.to_k(x); v = attn.to_v(x)     # x quantized once

Layers take part by having a ``quant_key`` (hashable: equal keys quantize equally) and a
``quantize_input(x2d)`` method; see ``sdfast.quantization.modules.W8A8StaticLinear``.
"""

from __future__ import annotations

import threading

import torch

_local = threading.local()


class SharedInputQuantization:
    """Context manager: within it, :func:`quantize_input` quantizes each (input, key) once. Per thread.
    Nested blocks (the same object entered twice too) share the outermost block's memory, which ends with
    that block."""

    __slots__ = ()

    def __enter__(self) -> "SharedInputQuantization":
        depth = getattr(_local, "depth", 0)
        if depth == 0:
            _local.memo = {}
        _local.depth = depth + 1
        return self

    def __exit__(self, *exc) -> None:
        _local.depth -= 1
        if _local.depth == 0:
            _local.memo = None


def _keyable(x: torch.Tensor) -> bool:
    """Inference-mode tensors have no version counter, and under torch.compile the version is symbolic:
    those inputs are quantized by each layer (correct, just not shared)."""
    return not x.is_inference() and not torch.compiler.is_compiling()


def quantize_input(layer, x: torch.Tensor) -> torch.Tensor:
    """``layer.quantize_input(x.reshape(-1, K))``, shared within a :class:`SharedInputQuantization` block
    with every layer of equal ``quant_key`` that is given the same, unmodified ``x``."""
    memo = getattr(_local, "memo", None)
    if memo is None or not _keyable(x):
        return layer.quantize_input(x.reshape(-1, x.shape[-1]))
    key = (id(x), x._version, layer.quant_key)
    hit = memo.get(key)
    if hit is not None and hit[0] is x:  # the same object (an id can be reused once x is freed)
        return hit[1]
    q = layer.quantize_input(x.reshape(-1, x.shape[-1]))
    memo[key] = (x, q)
    return q


__all__ = ["SharedInputQuantization", "quantize_input"]
