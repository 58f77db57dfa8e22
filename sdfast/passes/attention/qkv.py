"""Q/K/V projection packing: one GEMM for self-attention's Q, K, V (``to_qkv``) and cross-attention's K, V (``to_kv``).

``fuse`` packs the separate ``nn.Linear`` weights into one (the names diffusers' ``Attention.fuse_projections()``
uses) and makes ``to_q`` / ``to_k`` / ``to_v`` views of it, so no memory is added; ``unfuse`` gives them their own
storage back. The packed layer stays out of ``state_dict`` / ``load_state_dict`` (state-dict hooks), so saved
checkpoints keep the stock keys. ``fused_layer`` says when the packed layer may run in place of the separate ones
(not when one is wrapped, hooked or has had its weight replaced); ``split_projection`` runs it as one batched GEMM
whose outputs are contiguous per projection.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn as nn

from sdfast.passes._modules import runs_as_its_class
from sdfast.passes.state import ATTENTION_STATE

log = logging.getLogger("sdfast.attention")

# Names of the fused Q/K/V (K/V) projections this pass adds: views of to_q/to_k/to_v's weights, used
# only while those are plain nn.Linear, so other passes (quantize_, sparsify_) never convert them.
FUSED_PROJECTIONS = (".to_qkv", ".to_kv")


def fused_layer(attn: nn.Module, name: str) -> Optional[nn.Module]:
    """``attn.to_qkv`` / ``attn.to_kv`` when one GEMM on it computes exactly what the separate projections
    compute now, else None (the caller then runs ``to_q``/``to_k``/``to_v``). Not so when a projection is
    wrapped (a PEFT LoRA layer from ``load_lora_weights``: its adapter must run) or hooked (forward hooks or
    pre-hooks, e.g. the calibration of ``quantize_``/``sparsify_``; an instance-level forward), or, for layers
    :func:`apply` fused, when a projection's weight or bias no longer lives in the fused tensor (replaced
    by ``module.to(...)``, ``param.data = ...``, a safe LoRA merge): the fused copy would be stale."""
    if not getattr(attn, "fused_projections", False):
        return None
    fused = getattr(attn, name, None)
    if fused is None:
        return None
    parts = (attn.to_k, attn.to_v) if name == "to_kv" else (attn.to_q, attn.to_k, attn.to_v)
    if not all(runs_as_its_class(p, nn.Linear) for p in parts):
        return None  # a wrapped, hooked (calibration, user hooks) or re-bound projection must run itself
    state = ATTENTION_STATE.get(attn)
    if state is None or state.get("fused") != name:
        return fused  # fused by diffusers (``fuse_projections``): its own copy, as stock uses it
    row = 0
    for p in parts:
        for mine, whole in ((p.weight, fused.weight), (p.bias, fused.bias)):
            if mine is None:
                continue
            expected = whole.data_ptr() + row * whole.stride(0) * whole.element_size()
            if mine.data_ptr() != expected or mine.dtype != whole.dtype:
                if not state.get("stale_logged"):
                    state["stale_logged"] = True
                    log.info("sdfast attention: projection weights of a fused %s were replaced; running the "
                             "separate projections (re-apply the pass to fuse again)", name)
                return None
        row += p.out_features
    return fused


def split_projection(fused: nn.Linear, x: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
    """The ``parts`` equal projections packed in ``fused`` (weight (parts * N, K): rows ``[i * N, (i + 1) * N)``
    are projection ``i``; bias (parts * N,) or None) applied to ``x`` (..., K), as ONE batched GEMM:
    ``bmm(x broadcast to (parts, M, K), weight viewed (parts, K, N))`` writes (parts, M, N), so each projection
    comes back contiguous, (..., N), in the layout its own ``nn.Linear`` gives. One wide GEMM (``fused(x)``)
    would give (..., parts * N), whose per-projection views are interleaved (row stride parts * N): torch 2.11's
    SDPA faulted on those on sm_90 and had to get packed copies (see ``backends._sdpa_layout``).

    Numerics: the separate GEMMs' products and fp32 accumulation; bit-identical to them at the UNets' bias-free
    shapes on sm_90 (``benchmarks/bench_qkv.py`` checks it). With a bias, ``baddbmm`` adds it before the one rounding,
    where ``F.linear`` on a non-contiguous input rounds the product and the sum separately (a last-bit
    difference in fp16). A fused layer that does not run as a plain ``nn.Linear`` (hooks, a replaced forward)
    is called as a module and its output split into views, so what it adds still runs.
    Raises ``ValueError`` if the weight's rows do not split in ``parts``."""
    w = fused.weight
    if w.shape[0] % parts:
        raise ValueError(f"split_projection: {w.shape[0]} weight rows do not split into {parts} projections")
    n, k = w.shape[0] // parts, w.shape[1]
    if not runs_as_its_class(fused, nn.Linear):
        out = fused(x)
        return out.view(*out.shape[:-1], parts, n).unbind(-2)
    x2 = x.reshape(-1, k)
    a = x2.unsqueeze(0).expand(parts, *x2.shape)  # batch stride 0: the input is read, never copied
    wt = w.view(parts, n, k).transpose(1, 2)
    if fused.bias is None:
        out = torch.bmm(a, wt)
    else:
        out = torch.baddbmm(fused.bias.view(parts, 1, n), a, wt)
    return out.view(parts, *x.shape[:-1], n).unbind(0)


def project_kv(attn: nn.Module, context: torch.Tensor, *, cross: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``attn`` for ``context`` (B, Lk, C_ctx), as diffusers' ``AttnProcessor2_0`` computes them:
    ``norm_cross`` first (cross-attention only), then ``to_k``/``to_v`` (one ``to_kv`` GEMM when fused).
    Returns (B, Lk, H, D) views of contiguous (B, Lk, H * D) projections (``split_projection`` when fused)."""
    if cross and attn.norm_cross:
        context = attn.norm_encoder_hidden_states(context)
    heads = attn.heads
    to_kv = fused_layer(attn, "to_kv")
    if to_kv is not None:
        key, value = split_projection(to_kv, context, 2)
        head_dim = key.shape[-1] // heads
        return key.view(*key.shape[:2], heads, head_dim), value.view(*value.shape[:2], heads, head_dim)
    key = attn.to_k(context)
    value = attn.to_v(context)
    head_dim = key.shape[-1] // heads
    return key.view(key.shape[0], -1, heads, head_dim), value.view(value.shape[0], -1, heads, head_dim)


@torch.no_grad()
def fuse(attn: nn.Module) -> Optional[str]:
    """Fuse to_q/to_k/to_v into ``to_qkv`` (self-attention) or to_k/to_v into ``to_kv``
    (cross-attention). The separate weights become views of the fused one (no extra memory).
    Returns the name created, or None when skipped (already fused, or not plain ``nn.Linear``
    layers, e.g. LoRA-wrapped or quantized)."""
    if getattr(attn, "fused_projections", False):
        return None
    cross = bool(getattr(attn, "is_cross_attention", False))
    parts = [attn.to_k, attn.to_v] if cross else [attn.to_q, attn.to_k, attn.to_v]
    if any(type(p) is not nn.Linear for p in parts):
        return None
    w0 = parts[0].weight
    if w0.device.type == "meta" or any(
        p.weight.dtype != w0.dtype or p.weight.device != w0.device or p.in_features != parts[0].in_features
        for p in parts
    ):
        return None
    has_bias = [p.bias is not None for p in parts]
    if any(has_bias) and not all(has_bias):
        return None
    name = "to_kv" if cross else "to_qkv"
    out_features = sum(p.out_features for p in parts)
    fused = nn.Linear(parts[0].in_features, out_features, bias=all(has_bias), device=w0.device, dtype=w0.dtype)
    fused.weight.data = torch.cat([p.weight.data for p in parts])
    fused.weight.requires_grad_(w0.requires_grad)
    if all(has_bias):
        fused.bias.data = torch.cat([p.bias.data for p in parts])
        fused.bias.requires_grad_(parts[0].bias.requires_grad)
    off = 0
    for p in parts:  # share storage: the separate layers stay valid, no second copy
        n = p.out_features
        p.weight.data = fused.weight.data[off : off + n]
        if p.bias is not None:
            p.bias.data = fused.bias.data[off : off + n]
        off += n
    setattr(attn, name, fused)
    attn.fused_projections = True
    _hide_fused_from_state_dict(fused)
    return name


def _hide_fused_from_state_dict(fused: nn.Module) -> None:
    """Keep ``fused`` (to_qkv / to_kv) out of ``state_dict`` and out of what ``load_state_dict`` expects: its
    weight overlaps the separate projections' (they are views of it), which safetensors refuses to save
    (``save_pretrained`` of an optimized pipeline), and a stock checkpoint has no such keys. The hooks live on
    ``fused`` itself, so they see exactly its own keys (its prefix) and go with it. On load, a key the state dict
    lacks is filled with the layer's current tensor (a copy onto itself): the separate projections, loaded
    first, have already written the new values in place through their views."""

    def drop(module, state_dict, prefix, local_metadata):
        for name in module._parameters:
            state_dict.pop(prefix + name, None)

    def fill(module, state_dict, prefix, *args):
        for name, t in module._parameters.items():
            if t is not None:
                state_dict.setdefault(prefix + name, t.detach())

    fused.register_state_dict_post_hook(drop)
    fused.register_load_state_dict_pre_hook(fill)


@torch.no_grad()
def unfuse(attn: nn.Module, name: str) -> None:
    cross = name == "to_kv"
    parts = [attn.to_k, attn.to_v] if cross else [attn.to_q, attn.to_k, attn.to_v]
    for p in parts:  # own storage again (exact same values)
        if type(p) is not nn.Linear:
            continue  # replaced since (quantized, pruned, LoRA-wrapped): it no longer lives in the fused tensor
        p.weight.data = p.weight.data.clone()
        if p.bias is not None:
            p.bias.data = p.bias.data.clone()
    if hasattr(attn, name):
        delattr(attn, name)
    attn.fused_projections = False

