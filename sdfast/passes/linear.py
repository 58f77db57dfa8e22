"""Small-K linear pass: the UNet's linear layers with K <= 640 run on the TMA GEMM where it measured faster.

SD1.5's attention projections at 64x64 and 32x32 latents (``to_out``, cross-attention ``to_q``: K = 320 or 640) and
SD 1.x's 1x1 ``proj_in`` / ``proj_out`` (which ``sdfast.passes.layout`` runs as linears on the token view) go
through :func:`kernels.gemm.linear_projection.linear_projection`: per call signature, the faster of cuBLAS and the
TMA GEMM of :mod:`kernels.gemm.linear_tma`, measured at warm-up. ``proj_out`` then also takes its bias and the
residual in the GEMM's epilogue. Larger K stays on cuBLAS without measuring (it won every such shape of
``python -m benchmarks.ops.gemm tma`` on sm_90).

Per instance and reversible: ``nn.Linear`` modules get their own forward (what the kernel cannot take, e.g. fp32,
autocast or gradients, runs ``nn.Linear.forward``), ``Transformer2DModel`` instances a marker that the layout pass's
projections read.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.gemm._common import TMA_DTYPES
from kernels.gemm.linear_projection import linear_projection
from sdfast.passes._modules import rebind_forward, restore_forwards, runs_as_its_class
from sdfast.passes.state import TOKENS_LINEAR

MAX_K = 640  # above this cuBLAS won every SD1.5/SDXL linear shape of the sweep
_MARKER = "_sdfast_linear"


def routable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether a linear on these tensors may run ``linear_projection``: fp16/bf16 inference, no autocast (which
    would change the result's dtype) and nothing that needs a gradient (the kernel has no backward), bias included."""
    if x.dtype not in TMA_DTYPES or weight.dtype != x.dtype or torch.is_autocast_enabled(x.device.type):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)))


def tma_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through ``linear_projection`` where :func:`routable`, else the class's own."""
    if routable(x, self.weight, self.bias):
        return linear_projection(x, self.weight, self.bias)
    return nn.Linear.forward(self, x)


def _transformers(model: nn.Module):
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    return [m for m in model.modules() if isinstance(m, Transformer2DModel)]


def _targets(block: nn.Module) -> list[nn.Module]:
    """A transformer's linears that nothing else bypasses: ``proj_in``/``proj_out`` (SDXL's are linears), each
    attention's ``to_out[0]``, and a cross-attention's ``to_q``. Not the self-attention Q/K/V and cross K/V (the
    attention pass runs them as one fused GEMM, the runtime caches cross K/V), not the feed-forward's (GEGLU runs
    its projection with the activation, the last layer takes the residual): those passes require plain modules."""
    from diffusers.models.attention_processor import Attention

    found = [block.proj_in, block.proj_out]
    for attn in block.modules():
        if isinstance(attn, Attention):
            found.append(attn.to_out[0])
            if attn.is_cross_attention:
                found.append(attn.to_q)
    return [m for m in found if runs_as_its_class(m, nn.Linear) and m.in_features <= MAX_K]


def apply(model: nn.Module) -> int:
    """Route ``model``'s (a UNet's) small-K linears through ``linear_projection``. Returns how many modules."""
    changed = 0
    for block in _transformers(model):
        for m in _targets(block):
            rebind_forward(m, tma_linear_forward, _MARKER)
            changed += 1
        TOKENS_LINEAR.set(block, True)
        changed += 1
    return changed


def undo(model: nn.Module) -> int:
    """Restore every forward and marker ``apply`` set. Returns how many."""
    restored = restore_forwards(model, _MARKER)
    for block in _transformers(model):
        if TOKENS_LINEAR.clear(block):
            restored += 1
    return restored
