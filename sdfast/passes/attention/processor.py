"""The diffusers attention processor: :class:`SdfastAttnProcessor`, numerically diffusers' ``AttnProcessor2_0``.

It projects Q/K/V (one packed GEMM when :mod:`.qkv` fused them, a cross-attention K/V cache when
``sdfast.runtime.cross_kv`` installed one), hands q/k/v to the dispatcher as (B, H, L, D) strided views of the
projection outputs (heads never transposed in memory), and applies the output projection and the module's
norms, residual and rescale as stock does.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from sdfast.passes.attention.dispatch import AttentionDispatcher
from sdfast.passes.attention.qkv import fused_layer, project_kv, split_projection
from sdfast.passes.state import CROSS_KV
from sdfast.quantization.shared_input import SharedInputQuantization



class SdfastAttnProcessor:
    """Attention processor for diffusers' ``Attention``: same result as ``AttnProcessor2_0``.

    hidden_states: (B, L, C) or (B, C, H, W) (VAE); encoder_hidden_states: (B, Lk, C_ctx) or None.
    Uses ``attn.to_qkv`` (self-attention) / ``attn.to_kv`` (cross-attention) when the module's
    projections are fused (by :func:`apply` or by diffusers), else ``to_q``/``to_k``/``to_v``.
    Attention runs through ``dispatcher`` with q/k/v as (B, H, L, D) strided views; the softmax scale is
    ``attn.scale``. diffusers' ``upcast_attention`` / ``upcast_softmax`` (SD 2.x, the VAE) ask for fp32
    scores and an fp32 softmax, with the probabilities cast back to the value dtype before P·V (diffusers'
    ``Attention.get_attention_scores``); every backend here already computes exactly that (fp32
    accumulation and softmax), so the dispatcher is called with ``upcast=False``: the Triton kernel's
    split-P mode is more precise than stock and slower on the VAE.
    """

    def __init__(self, dispatcher: Optional[AttentionDispatcher] = None):
        self.dispatcher = dispatcher if dispatcher is not None else AttentionDispatcher()

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        temb: Optional[torch.Tensor] = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)

        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        heads = attn.heads
        with SharedInputQuantization():  # static-scale quantized Q/K/V read one quantized copy of the input
            query, key, value, head_dim = self._project(attn, hidden_states, encoder_hidden_states, batch_size)

        # (B, L, H, D) -> (B, H, L, D) views: no copies
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        out = self.dispatcher(query, key, value, attn_mask=attention_mask, scale=attn.scale, upcast=False)

        out = out.transpose(1, 2).reshape(batch_size, -1, heads * head_dim)
        out = out.to(query.dtype)
        out = attn.to_out[0](out)
        out = attn.to_out[1](out)
        if input_ndim == 4:
            out = out.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            out = out + residual
        if attn.rescale_output_factor != 1.0:  # x / 1.0 is x: skip the pass over the output (140 per SDXL step)
            out = out / attn.rescale_output_factor
        return out

    @staticmethod
    def _project(attn, hidden_states, encoder_hidden_states, batch_size):
        """Q, K, V as (B, L, H, D) views, and the head dim (the fused ``to_qkv`` GEMM when there is one)."""
        heads = attn.heads
        to_qkv = fused_layer(attn, "to_qkv") if encoder_hidden_states is None else None
        if to_qkv is not None:
            query, key, value = split_projection(to_qkv, hidden_states, 3)
            head_dim = query.shape[-1] // heads
            return tuple(t.view(*t.shape[:2], heads, head_dim) for t in (query, key, value)) + (head_dim,)
        query = attn.to_q(hidden_states)
        cached = None
        if encoder_hidden_states is not None and (kv_cache := CROSS_KV.get(attn)) is not None:
            cached = kv_cache.lookup(attn, encoder_hidden_states)  # K/V computed outside the step's graph
        if cached is not None:
            key, value = cached
        else:
            key, value = project_kv(attn, hidden_states if encoder_hidden_states is None else encoder_hidden_states,
                                    cross=encoder_hidden_states is not None)
        head_dim = key.shape[-1]
        return query.view(batch_size, -1, heads, head_dim), key, value, head_dim

