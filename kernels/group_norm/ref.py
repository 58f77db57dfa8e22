"""Plain-PyTorch GroupNorm with the kernels' fusions: the reference every GroupNorm kernel is tested against.

    pre = x (+ channel_bias[b, c]) (+ residual)          # rounded to x.dtype, as eager PyTorch does
    y   = (pre - mean[b, g]) * rstd[b, g] * weight[c] + bias[c]
    y   = silu(y)                                         # activation="silu"

Method: Wu & He 2018 (GroupNorm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.checks import is_channels_last as _is_channels_last

ACTIVATIONS = (None, "silu")


def _like_layout(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t`` in the memory format of ``x`` (NCHW-contiguous or channels_last)."""
    if _is_channels_last(x):
        return t.contiguous(memory_format=torch.channels_last)
    return t.contiguous()


def _channel_bias_4d(channel_bias: torch.Tensor, B: int, C: int) -> torch.Tensor:
    """A (C,), (B, C), (1, C), (B, C, 1, 1) or (1, C, 1, 1) channel bias as (B or 1, C, 1, 1)."""
    cb = channel_bias
    if cb.dim() == 4:
        cb = cb.flatten(1)
    if cb.dim() == 1:
        cb = cb[None]
    return cb.reshape(cb.shape[0], C, 1, 1)


def group_norm_ref(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    channel_bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    return_sum: bool = False,
    upcast: bool = True,
):
    """Plain-PyTorch GroupNorm with the same fusions as :func:`group_norm`.

    x: (B, C, H, W), NCHW or channels_last; weight, bias: (C,) or None; channel_bias: (C,) or (B, C);
    residual: like x. With ``upcast`` every step runs in fp32 and the outputs are cast back to
    ``x.dtype``; without it the adds and the norm run in ``x.dtype`` (the "torch low precision"
    baseline of the tolerance rule). Outputs are in x's memory format.
    Returns ``y``, or ``(y, pre)`` with ``return_sum``.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    dt = x.dtype
    cdt = torch.promote_types(dt, torch.float32) if upcast else dt  # fp64 stays fp64
    B, C = x.shape[:2]
    pre = x.to(cdt)
    if channel_bias is not None:
        pre = pre + _channel_bias_4d(channel_bias, B, C).to(cdt)
    if residual is not None:
        pre = pre + residual.to(cdt)
    w = None if weight is None else weight.to(cdt)
    b = None if bias is None else bias.to(cdt)
    # NCHW: PyTorch's CPU channels_last GroupNorm uses sum/sum-of-squares statistics, which cancel
    # when |mean| >> std; the reference should be the accurate one.
    y = F.group_norm(pre.contiguous(), num_groups, w, b, eps)
    if activation == "silu":
        y = F.silu(y)
    y = _like_layout(y.to(dt), x)
    if return_sum:
        return y, _like_layout(pre.to(dt), x)
    return y
