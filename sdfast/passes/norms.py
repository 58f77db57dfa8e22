"""Norm fusion: GroupNorm(+time-embedding bias)(+SiLU), LayerNorm(+residual add) and GEGLU on sdfast's
fused kernels (``kernels.norm``), wired in at block level.

Rewrites (each per module instance, reversible with ``undo``):
- ``ResnetBlock2D`` (time_embedding_norm "default", or any other but "scale_shift" without a time-embedding
  projection, as in the VAE's up blocks, labelled "group"; no up/down-sampling): ``forward`` is rebound to one
  that runs norm1+SiLU as one kernel, adds the time-embedding projection and conv1's bias as a
  per-(batch, channel) bias inside norm2+SiLU, and ends with one bias + shortcut add kernel. diffusers
  reuses ``self.nonlinearity`` on the time embedding, so SiLU is fused here at block level rather than by
  replacing the SiLU module.
- ``conv_norm_out`` + ``conv_act`` (UNet and VAE decoder tails): GroupNorm+SiLU as one kernel.
- every other ``nn.GroupNorm`` (Transformer2D input norm, VAE attention group_norm): the fused GroupNorm.
- ``BasicTransformerBlock`` (norm_type "layer_norm"): norm2/norm3 fused with the residual add before them. With the
  feed-forward's linears quantized to static FP8 (``W8A8Config(dtype="fp8", activations="static")``), norm3 stores
  the GEGLU projection's E4M3 input and the GEGLU GEMM its output layer's: no quantize pass between them.
- ``GEGLU``: projection and ``a * gelu(g)`` in one GEMM where that measured faster, else the projection, then
  one kernel for ``a * gelu(g)``.
Sources of the fusion patterns: stable-fast, Paddle Inference and TensorRT's SD demo (GroupNorm+SiLU,
bias-add+norm), Liger-Kernel (fused norms).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.conv.conv3x3 import conv3x3
from kernels.elementwise import bias_residual_add
from kernels.geglu import geglu, geglu_projection
from kernels.geglu.projection import geglu_projection_fp8
from kernels.gemm.fp8_static import fp8_linear
from kernels.group_norm import group_norm
from kernels.norm import layer_norm
from sdfast.passes._modules import rebind_forward, runs_as_its_class, runs_as_its_class_or_bound
from sdfast.passes.state import BLOCK_TEMB, NORMS_FUSED

_MARKER = NORMS_FUSED.attr  # set on every module apply changed (undo looks for it; time_embedding reads it)

FilterFn = Callable[[nn.Module, str], bool]


class FusedGroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` (optionally + SiLU) on sdfast's fused kernel; shares the original's parameters.

    Input (B, C, H, W) in NCHW or NHWC memory, output in the same layout; (B, C, L) inputs are viewed
    as (B, C, L, 1). ``activation`` is None or "silu".
    """

    def __init__(self, source: nn.GroupNorm, activation: str | None = None):
        nn.Module.__init__(self)
        self.num_groups, self.num_channels, self.eps, self.affine = source.num_groups, source.num_channels, source.eps, source.affine
        self.weight, self.bias = source.weight, source.bias  # the same Parameter objects: in-place updates are seen
        self.activation = activation
        self.source = [source]  # not a submodule: keeps state_dict keys unchanged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            return self.forward(x.unsqueeze(2)).squeeze(2)  # (B, C, 1, L): stride(3) is the token stride in both layouts
        return group_norm(_dense(x), self.num_groups, self.weight, self.bias, self.eps, activation=self.activation)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation}"


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` if it is NCHW-contiguous or channels_last (what the kernels read), else an NCHW copy (a sliced or
    transposed view handed to a block directly; inside a UNet every activation is dense)."""
    if x.dim() != 4 or x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last):
        return x
    return x.contiguous()


def _resnet_supported(m: nn.Module) -> bool:
    from diffusers.models.resnet import ResnetBlock2D

    if not isinstance(m, ResnetBlock2D):
        return False
    # Without a time-embedding projection, every time_embedding_norm but "scale_shift" is norm2 alone
    # (the VAE decoder's up blocks pass "group"); "default" also adds a raw temb, see fused_resnet_forward.
    plain_norm2 = m.time_embedding_norm == "default" or (m.time_emb_proj is None and m.time_embedding_norm != "scale_shift")
    return (
        plain_norm2
        and m.upsample is None
        and m.downsample is None
        and isinstance(m.nonlinearity, nn.SiLU)
        and type(m.norm1) is nn.GroupNorm
        and type(m.norm2) is nn.GroupNorm
    )


def folded_conv_bias(conv: nn.Module) -> torch.Tensor | None:
    """The bias that the fused forwards take out of ``conv`` and add later: that of a plain ``nn.Conv2d`` or an FP8
    ``W8A8StaticConv2d`` with one; None for anything else (no bias, a PEFT LoRA wrapper, a conv with hooks or a
    replaced ``forward``: those run as they are)."""
    from sdfast.quantization.conv import W8A8StaticConv2d

    if conv.bias is None:
        return None
    return conv.bias if runs_as_its_class(conv, nn.Conv2d) or runs_as_its_class(conv, W8A8StaticConv2d) else None


def _conv_without_bias(conv: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``conv(x)`` minus its folded bias (``folded_conv_bias``), and that bias; ``(conv(x), None)`` without one."""
    bias = folded_conv_bias(conv)
    if bias is not None:
        return _conv_forward_no_bias(conv, x), bias
    return conv(x), None


def _conv_forward_no_bias(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``conv`` without its bias; a 3x3, stride-1, padding-1 one on the measured faster of cuDNN and im2col +
    cuBLAS (``kernels.conv.conv3x3``: the GEMM wins at SD1.5's 8x8 level); an FP8 one on its measured path."""
    if not isinstance(conv, nn.Conv2d):  # W8A8StaticConv2d (folded_conv_bias takes no other)
        return conv(x, bias=False)
    if (conv.kernel_size == (3, 3) and conv.stride == (1, 1) and conv.padding == (1, 1) and conv.dilation == (1, 1)
            and conv.groups == 1 and conv.padding_mode == "zeros"):
        return conv3x3(x, conv.weight, None)
    return conv._conv_forward(x, conv.weight, None)


def _sum_biases(*biases: torch.Tensor | None) -> torch.Tensor | None:
    present = [b for b in biases if b is not None]
    if not present:
        return None
    total = present[0]
    for b in present[1:]:
        total = total + b
    return total


def fused_resnet_forward(self, input_tensor: torch.Tensor, temb: torch.Tensor | None, *args, **kwargs) -> torch.Tensor:
    """diffusers ``ResnetBlock2D.forward`` (see ``_resnet_supported``) with the norms and adds fused.

    The convolutions run without their biases (PyTorch adds a conv bias in a separate full-tensor pass):
    conv1's bias joins the time-embedding projection as norm2's per-(batch, channel) bias, and conv2's and
    conv_shortcut's biases, the shortcut add and ``output_scale_factor`` are one ``bias_residual_add``."""
    if temb is not None and self.time_emb_proj is None and self.time_embedding_norm == "default":
        from diffusers.models.resnet import ResnetBlock2D  # stock adds the raw temb to h (no block passes one)

        return ResnetBlock2D.forward(self, input_tensor, temb, *args, **kwargs)
    n1, n2 = self.norm1, self.norm2
    input_tensor = _dense(input_tensor)
    h = group_norm(input_tensor, n1.num_groups, n1.weight, n1.bias, n1.eps, activation="silu")
    h, b1 = _conv_without_bias(self.conv1, h)
    channel_bias = _time_bias(self, temb, b1)
    if channel_bias is not None:
        channel_bias = channel_bias.to(h.dtype)  # under autocast: an fp32 conv bias, a bf16 activation
    h = group_norm(h, n2.num_groups, n2.weight, n2.bias, n2.eps, channel_bias=channel_bias, activation="silu")
    h = self.dropout(h)
    h, b2 = _conv_without_bias(self.conv2, h)
    shortcut, bs = (input_tensor, None) if self.conv_shortcut is None else _conv_without_bias(self.conv_shortcut, input_tensor)
    if shortcut.dtype != h.dtype:  # autocast: stock adds a low-precision h to an fp32 input (type promotion)
        bias = _sum_biases(b2, bs)
        h = h if bias is None else h + bias.to(h.dtype).view(1, -1, 1, 1)
        out = shortcut + h
        return out if self.output_scale_factor == 1 else out / self.output_scale_factor
    return bias_residual_add(h, b2, shortcut, bias2=bs, out_scale=self.output_scale_factor)


def _time_bias(block: nn.Module, temb: torch.Tensor | None, conv_bias: torch.Tensor | None) -> torch.Tensor | None:
    """norm2's per-(batch, channel) bias: ``time_emb_proj(silu(temb))`` + conv1's folded bias. From the UNet's
    packed projections when ``sdfast.passes.time_embedding`` applies (they fold conv1's bias exactly when
    ``conv_bias`` is not None), else computed here."""
    pack = BLOCK_TEMB.get(block)
    if pack is not None and temb is not None:
        packed = pack.lookup(block, temb)
        if packed is not None:
            return packed
    t = None
    if block.time_emb_proj is not None and temb is not None:
        t = block.time_emb_proj(temb if block.skip_time_act else F.silu(temb))
    return _sum_biases(t, conv_bias)


def _block_supported(m: nn.Module) -> bool:
    from diffusers.models.attention import BasicTransformerBlock

    return (
        isinstance(m, BasicTransformerBlock)
        and m.norm_type == "layer_norm"
        and m.pos_embed is None
        and not m.only_cross_attention
        and m.attn2 is not None
        and m._chunk_size is None
        and all(type(n) is nn.LayerNorm and n.weight is not None for n in (m.norm1, m.norm2, m.norm3))
    )


def fused_transformer_block_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask=None,
    encoder_hidden_states=None,
    encoder_attention_mask=None,
    timestep=None,
    cross_attention_kwargs=None,
    class_labels=None,
    added_cond_kwargs=None,
) -> torch.Tensor:
    """diffusers ``BasicTransformerBlock.forward`` (layer_norm variant) with residual adds fused into norms."""
    kwargs = dict(cross_attention_kwargs or {})
    if "gligen" in kwargs:  # GLIGEN control needs the library's path
        return type(self).forward(self, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                  timestep, cross_attention_kwargs, class_labels, added_cond_kwargs)
    n1, n2, n3 = self.norm1, self.norm2, self.norm3
    if hidden_states.stride(-1) != 1:  # the token view of an NCHW tensor; channels_last gives contiguous rows
        hidden_states = hidden_states.contiguous()
    x = layer_norm(hidden_states, n1.weight, n1.bias, n1.eps)
    a = self.attn1(x, encoder_hidden_states=None, attention_mask=attention_mask, **kwargs)
    x, h = layer_norm(a, n2.weight, n2.bias, n2.eps, residual=hidden_states, return_sum=True)
    a = self.attn2(x, encoder_hidden_states=encoder_hidden_states, attention_mask=encoder_attention_mask, **kwargs)
    fp8 = _fp8_feedforward(self.ff, a)
    if fp8 is not None:  # norm3 writes the FP8 projection's input; the GEGLU GEMM writes the output layer's
        proj, out = fp8
        q, h = layer_norm(a, n3.weight, n3.bias, n3.eps, residual=h, return_sum=True, out_scale_inv=proj.input_scale_inv)
        g = geglu_projection_fp8(q.view(-1, q.shape[-1]), proj.weight_q, proj.input_scale, proj.w_scale, proj.bias,
                                 out_scale_inv=out.input_scale_inv, out_dtype=a.dtype, fast_accum=proj.fast_accum)
        y = fp8_linear(g, out.weight_q, out.input_scale, out.w_scale, out.bias, out_dtype=a.dtype,
                       fast_accum=out.fast_accum)
        return y.view(h.shape) + h
    out_proj = _ff_out_projection(self.ff, a)
    if out_proj is None:
        x, h = layer_norm(a, n3.weight, n3.bias, n3.eps, residual=h, return_sum=True)
        return self.ff(x) + h
    # The residual add and ff's output bias in the output GEMM: norm3's kernel stores h + bias, and the GEMM
    # adds its product to it in place (cuBLAS beta = 1): no separate bias or residual pass over the tokens.
    x, h = layer_norm(a, n3.weight, n3.bias, n3.eps, residual=h, return_sum=True, sum_bias=out_proj.bias)
    for m in self.ff.net[:-1]:
        x = m(x)
    h.view(-1, h.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]), out_proj.weight.t())
    return h


def _fp8_feedforward(ff: nn.Module, a: torch.Tensor) -> tuple | None:
    """``(proj, out)``, the two static FP8 linears of diffusers' ``FeedForward`` (GEGLU, dropout, Linear), when the
    block may run it on FP8 tensors end to end: norm3 storing ``proj``'s E4M3 input, the GEGLU GEMM storing ``out``'s
    (``kernels.geglu.projection.geglu_projection_fp8``). Both must be ``W8A8StaticLinear`` without SmoothQuant
    smoothing (its per-channel multiply is the quantize kernel's), every module running its own (or the norms pass's)
    forward with no hooks or wrappers, with no autograd and no autocast; else None."""
    from diffusers.models.activations import GEGLU
    from diffusers.models.attention import FeedForward

    from sdfast.quantization.modules import W8A8StaticLinear

    net = getattr(ff, "net", None)
    if not runs_as_its_class(ff, FeedForward) or net is None or len(net) != 3:
        return None
    gate, drop, out = net
    proj = getattr(gate, "proj", None)
    if not runs_as_its_class_or_bound(gate, GEGLU, fused_geglu_forward):
        return None
    if not (runs_as_its_class(drop, nn.Dropout) and (drop.p == 0 or not drop.training)):
        return None
    for lin in (proj, out):
        if not runs_as_its_class(lin, W8A8StaticLinear) or lin.smooth is not None:
            return None
    if a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    if torch.is_grad_enabled() or torch.is_autocast_enabled(a.device.type):
        return None
    return proj, out


def _ff_out_projection(ff: nn.Module, a: torch.Tensor) -> nn.Linear | None:
    """The last layer of diffusers' ``FeedForward`` (GEGLU/GELU, dropout, then a Linear) when the block may run
    its bias and residual inside that GEMM (an in-place ``addmm_`` on the block's residual stream, ``a``'s
    dtype): a plain ``nn.Linear`` with a bias in ``a``'s dtype, in a ``FeedForward`` that runs its own
    ``forward`` over ``net`` (no hooks, no replaced forward), with no autograd and no autocast."""
    from diffusers.models.attention import FeedForward

    net = getattr(ff, "net", None)
    if not runs_as_its_class(ff, FeedForward) or net is None or len(net) < 2:
        return None
    last = net[-1]
    if not runs_as_its_class(last, nn.Linear) or last.bias is None or last.weight.dtype != a.dtype:
        return None
    if torch.is_grad_enabled() or torch.is_autocast_enabled(a.device.type):
        return None
    return last


def fused_geglu_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """diffusers ``GEGLU.forward``. A plain ``nn.Linear`` projection (no hooks, no autograd) runs with the activation
    on the faster of the TMA GEMM with a GEGLU epilogue and cuBLAS + the GEGLU kernel, measured per shape
    (``kernels.geglu.projection``); any other projection (quantized, 2:4, LoRA layers) runs, then
    ``a * gelu(g)`` as one kernel."""
    proj = self.proj
    if runs_as_its_class(proj, nn.Linear) and not torch.is_grad_enabled() and not torch.is_autocast_enabled(
            hidden_states.device.type) and proj.weight.dtype == hidden_states.dtype:
        return geglu_projection(hidden_states, proj.weight, proj.bias)
    return geglu(proj(hidden_states))


def apply(model: nn.Module, *, filter_fn: FilterFn | None = None) -> int:
    """Fuse the norms of ``model`` (a UNet, a VAE or any module holding them). Returns modules changed.

    Skips what is already converted and what ``filter_fn(module, name)`` rejects.
    """
    from diffusers.models.activations import GEGLU

    changed = 0
    seen_tails: set[int] = set()
    for name, m in list(model.named_modules()):
        if getattr(m, _MARKER, False) or isinstance(m, FusedGroupNorm) or (filter_fn and not filter_fn(m, name)):
            continue
        if _resnet_supported(m):
            rebind_forward(m, fused_resnet_forward, _MARKER)
        elif _block_supported(m):
            rebind_forward(m, fused_transformer_block_forward, _MARKER)
        elif isinstance(m, GEGLU) and isinstance(m.proj, nn.Module):  # any projection: quantized, 2:4, LoRA
            rebind_forward(m, fused_geglu_forward, _MARKER)
        elif type(getattr(m, "conv_norm_out", None)) is nn.GroupNorm and isinstance(getattr(m, "conv_act", None), nn.SiLU):
            m._sdfast_tail = (m.conv_norm_out, m.conv_act)
            m.conv_norm_out = FusedGroupNorm(m.conv_norm_out, activation="silu")
            m.conv_act = nn.Identity()
            seen_tails.add(id(m.conv_norm_out.source[0]))
            setattr(m, _MARKER, True)
        else:
            continue
        changed += 1
    changed += _swap_plain_group_norms(model, filter_fn, skip=seen_tails)
    return changed


def _swap_plain_group_norms(model: nn.Module, filter_fn: FilterFn | None, skip: set[int]) -> int:
    """Every remaining ``nn.GroupNorm`` that is a direct child of a module not already rebound."""
    changed = 0
    for pname, parent in list(model.named_modules()):
        if _resnet_supported(parent) and getattr(parent, _MARKER, False):
            continue  # its norms run inside the fused forward
        for cname, child in list(parent.named_children()):
            if type(child) is not nn.GroupNorm or id(child) in skip:
                continue
            full = f"{pname}.{cname}" if pname else cname
            if filter_fn and not filter_fn(child, full):
                continue
            setattr(parent, cname, FusedGroupNorm(child))
            changed += 1
    return changed


def _original(fused: FusedGroupNorm) -> nn.GroupNorm:
    """The GroupNorm ``fused`` replaced, holding the Parameters ``fused`` holds now (a weight replaced while
    optimized, e.g. ``norm.weight = nn.Parameter(...)`` or ``load_state_dict(..., assign=True)``, stays)."""
    source = fused.source[0]
    source.weight, source.bias = fused.weight, fused.bias
    return source


def undo(model: nn.Module) -> int:
    """Restore every module ``apply`` changed, with their current weights. Returns how many were restored."""
    restored = 0
    for _, m in list(model.named_modules()):
        if getattr(m, _MARKER, False):
            if hasattr(m, "_sdfast_tail"):
                norm_out, act = m._sdfast_tail
                if isinstance(m.conv_norm_out, FusedGroupNorm):
                    norm_out = _original(m.conv_norm_out)
                m.conv_norm_out, m.conv_act = norm_out, act
                del m._sdfast_tail
            else:
                del m.forward
            delattr(m, _MARKER)
            restored += 1
        for cname, child in list(m.named_children()):
            if isinstance(child, FusedGroupNorm):
                setattr(m, cname, _original(child))
                restored += 1
    return restored
