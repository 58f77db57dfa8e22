"""Attention pass: a dispatching attention processor for diffusers' ``Attention`` modules.

What it does to a UNet / VAE (``apply``):

* every stock ``Attention`` (UNet self- and cross-attention in ``Transformer2DModel`` blocks, the VAE
  mid-block attention) gets :class:`SdfastAttnProcessor` (:mod:`.processor`), numerically the same as diffusers'
  ``AttnProcessor2_0`` (spatial_norm, group_norm, norm_cross, attention_mask, 4D input,
  residual_connection, rescale_output_factor);
* Q/K/V projections are fused into one GEMM for self-attention (``to_qkv``) and K/V into one for
  cross-attention (``to_kv``) (:mod:`.qkv`), the names diffusers' ``Attention.fuse_projections()`` uses. Unlike
  diffusers (which keeps a second copy of the weights and has no per-module unfuse on the legacy
  ``Attention``), ``to_q`` / ``to_k`` / ``to_v`` weights become views into the fused weight, so no
  memory is added, and ``undo`` restores separate weights;
* heads are never transposed in memory: q, k, v go to the kernel as (B, H, L, D) strided views of
  the projection output (B, L, H·D), and the kernel output comes back in (B, L, H, D) memory when
  the backend allows it;
* each attention call goes through :class:`AttentionDispatcher` (:mod:`.dispatch`), which picks per shape the
  fastest backend (:mod:`.backends`) that gives the right answer: torch SDPA with a forced backend (cuDNN,
  FlashAttention, memory-efficient, math), SDPA's own choice, xformers (if importable and a probe call works), or
  our Triton kernel (``kernels.attention.flash_attention``).

Pass API (shared by sdfast's passes, after torchao's ``quantize_`` / Liger's ``apply_liger_kernel``):
``apply(module, *, filter_fn=None, dispatcher=None, fuse_projections=True) -> int`` and
``undo(module) -> int``. Run ``undo`` before saving weights, loading or fusing LoRA, or changing
the projection weights, then ``apply`` again: after ``apply`` the fused layers hold the weights.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Mapping, Optional

import torch.nn as nn

from sdfast.passes.attention.backends import BACKEND_NAMES, key_padding_from_mask, xformers_works
from sdfast.passes.attention.dispatch import ATTENTION, AttentionDispatcher, AttentionKey
from sdfast.passes.attention.processor import SdfastAttnProcessor
from sdfast.passes.attention.qkv import fuse, split_projection, unfuse
from sdfast.passes.state import ATTENTION_STATE

log = logging.getLogger("sdfast.attention")

# processors whose math SdfastAttnProcessor reproduces (others, e.g. IP-Adapter or LoRA processors,
# are left alone)
STOCK_PROCESSORS = {"AttnProcessor", "AttnProcessor2_0", "FusedAttnProcessor2_0", "XFormersAttnProcessor"}


def _attention_class():
    from diffusers.models.attention_processor import Attention

    return Attention


def _convertible(attn: nn.Module) -> bool:
    proc = getattr(attn, "processor", None)
    if type(proc).__name__ not in STOCK_PROCESSORS:
        return False
    if getattr(attn, "added_kv_proj_dim", None) is not None or getattr(attn, "to_k", None) is None:
        return False
    if getattr(attn, "is_causal", False):
        return False
    if getattr(attn, "inner_kv_dim", None) != getattr(attn, "inner_dim", None):
        return False
    return True


def _set_processors(module: nn.Module, new: Mapping[str, object]) -> None:
    """Set processors by module name, through the model's ``set_attn_processor`` when it has one."""
    procs = getattr(module, "attn_processors", None) if hasattr(module, "set_attn_processor") else None
    if procs is not None and all(f"{n}.processor" in procs for n in new):
        procs = dict(procs)
        for n, p in new.items():
            procs[f"{n}.processor"] = p
        module.set_attn_processor(procs)
        return
    mods = dict(module.named_modules())
    for n, p in new.items():
        mods[n].set_processor(p)


def apply(
    module: nn.Module,
    *,
    filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
    dispatcher: Optional[AttentionDispatcher] = None,
    fuse_projections: bool = True,
) -> int:
    """Give every stock diffusers ``Attention`` under ``module`` an :class:`SdfastAttnProcessor`.

    Args:
        module: a UNet, VAE, or any ``nn.Module`` containing diffusers ``Attention`` modules
            (or an ``Attention`` itself).
        filter_fn: ``filter_fn(attention_module, qualified_name) -> bool``; False leaves it alone.
        dispatcher: the :class:`AttentionDispatcher` of these modules (default: one with the default options:
            measure every backend, our Triton kernel included, no TF32). Its decisions live in
            :mod:`kernels.select`, so dispatchers with the same options share them.
        fuse_projections: fuse Q/K/V (self) or K/V (cross) projections into one GEMM.

    Returns:
        the number of ``Attention`` modules converted. Modules already converted, modules with a
        non-stock processor (IP-Adapter, LoRA processors, ...) and added-KV / causal / GQA modules
        are skipped. Processors are set through ``module.set_attn_processor`` when available.
    """
    Attention = _attention_class()
    processor = SdfastAttnProcessor(dispatcher)
    new: Dict[str, object] = {}
    for name, m in module.named_modules():
        if not isinstance(m, Attention) or ATTENTION_STATE.get(m) is not None:
            continue
        if isinstance(getattr(m, "processor", None), SdfastAttnProcessor):
            continue
        if filter_fn is not None and not filter_fn(m, name):
            continue
        if not _convertible(m):
            log.debug("sdfast attention: %s skipped (processor %s)", name, type(m.processor).__name__)
            continue
        state = {"processor": m.processor, "fused": fuse(m) if fuse_projections else None}
        ATTENTION_STATE.set(m, state)
        new[name] = processor
    if new:
        _set_processors(module, new)
    return len(new)


def undo(module: nn.Module) -> int:
    """Restore the processors and separate projections that :func:`apply` replaced. A module whose processor
    was set to something else after ``apply`` keeps that processor and its fused projections (the separate
    ``to_q``/``to_k``/``to_v`` remain valid views of them), since that processor may use either.

    Returns the number of ``Attention`` modules restored. Outputs are then bit-identical to
    before ``apply`` (the projection weights are restored with the same values).
    """
    old: Dict[str, object] = {}
    restored = 0
    for name, m in module.named_modules():
        state = ATTENTION_STATE.get(m)
        if state is None:
            continue
        ours = isinstance(getattr(m, "processor", None), SdfastAttnProcessor)
        if ours:  # a processor the user set after apply stays, with the projections it may use (fused or not:
            old[name] = state["processor"]  # the separate layers stay valid views of the fused weight)
            if state["fused"] is not None:
                unfuse(m, state["fused"])
        ATTENTION_STATE.clear(m)
        restored += 1
    if old:
        _set_processors(module, old)
    return restored



__all__ = [
    "AttentionDispatcher",
    "AttentionKey",
    "SdfastAttnProcessor",
    "apply",
    "undo",
    "ATTENTION",
    "key_padding_from_mask",
    "split_projection",
    "xformers_works",
    "BACKEND_NAMES",
]
