"""GroupNorm with fp32 statistics, fused pre-adds and SiLU, for NCHW and channels_last (NHWC) memory: the public
entry, the ``torch.ops.sdfast.group_norm`` custom op and the choice between its kernels.

    pre = x (+ channel_bias[b, c]) (+ residual)          # rounded to x.dtype, as eager PyTorch does
    y   = (pre - mean[b, g]) * rstd[b, g] * weight[c] + bias[c]
    y   = silu(y)                                         # activation="silu"

This is the ResNet block's pattern in SD: ``norm2(conv1(h) + temb)`` + SiLU (``channel_bias`` is the
time-embedding projection, (B, C)), and ``norm1`` of the next block after the residual add
(``residual``; ``return_sum=True`` also returns ``pre`` so the residual stream is kept). The fusion
list follows the fastest SD engines (TensorRT's GroupNorm plugins, stable-fast, Paddle's
``fused_group_norm``); the channels_last method follows Apex/stable-fast NHWC GroupNorm: keep the
memory order and reduce over channel groups inside each row, never copy to NCHW.

A call is checked here, then runs one of:

* the Triton kernels of its plan (``kernels.group_norm.plan``): "onepass" and "twopass"
  (``kernels.group_norm.triton_groups``) or, channels_last, "nhwc_tiles" (``kernels.group_norm.triton_nhwc``);
* on an sm_90 GPU, channels_last or contiguous NCHW: the CUDA C++ cluster kernels (``kernels.group_norm.cluster``:
  one read, one launch, statistics through thread-block clusters) where they can run and, timed once per call
  signature, are faster than the Triton kernels;
* the PyTorch reference (``kernels.group_norm.ref``) where Triton cannot run (``kernels.dispatch``).

Method: Wu & He 2018 (GroupNorm).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from kernels.checks import check_like
from kernels.checks import is_channels_last as _is_channels_last
from kernels.dispatch import use_triton
from kernels.group_norm import cluster, triton_groups, triton_nhwc
from kernels.group_norm.plan import group_norm_plan
from kernels.group_norm.ref import ACTIVATIONS, group_norm_ref

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------
def _check_layout(t: torch.Tensor, name: str) -> None:
    if not (t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)):
        raise ValueError(
            f"group_norm: {name} must be NCHW-contiguous or channels_last (NHWC), got shape "
            f"{tuple(t.shape)} with strides {t.stride()}"
        )


def _check_inputs(x, num_groups, weight, bias, channel_bias, residual, activation) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"group_norm: x must be (B, C, H, W), got {shape}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"group_norm: x dtype {x.dtype} not supported; use one of {_SUPPORTED_DTYPES}")
    B, C = x.shape[:2]
    if not isinstance(num_groups, int) or num_groups <= 0 or C % num_groups != 0:
        raise ValueError(f"group_norm: C={C} channels must be divisible by num_groups={num_groups} (a positive int)")
    _check_layout(x, "x")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if tuple(t.shape) != (C,):
            raise ValueError(f"group_norm: {name} must have shape ({C},), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"group_norm: {name} must be floating point, got {t.dtype}")
    if channel_bias is not None:
        s = tuple(channel_bias.shape)
        ok = s in ((C,), (B, C), (1, C), (B, C, 1, 1), (1, C, 1, 1))
        if not ok:
            raise ValueError(f"group_norm: channel_bias must be (C,) or (B, C) = ({C},) or ({B}, {C}), got {s}")
        if channel_bias.dtype != x.dtype:
            raise TypeError(f"group_norm: channel_bias dtype {channel_bias.dtype} must match x dtype {x.dtype}")
    if residual is not None:
        check_like("group_norm", "residual", residual, x)
        _check_layout(residual, "residual")
    if activation not in ACTIVATIONS:
        raise ValueError(f"group_norm: activation must be one of {ACTIVATIONS}, got {activation!r}")
    devs = {t.device for t in (x, weight, bias, channel_bias, residual) if t is not None}
    if len(devs) > 1:
        raise ValueError(f"group_norm: all tensors must be on one device, got {sorted(map(str, devs))}")


def _group_norm_impl(x, num_groups, weight, bias, eps, channel_bias, residual, activation, return_sum):
    _check_inputs(x, num_groups, weight, bias, channel_bias, residual, activation)
    has_add = channel_bias is not None or residual is not None
    if not use_triton("group_norm", x, weight, bias, channel_bias, residual):
        out = group_norm_ref(
            x, num_groups, weight, bias, eps, channel_bias=channel_bias, residual=residual,
            activation=activation, return_sum=return_sum,
        )
        if not return_sum:
            return out, x.new_empty(0)
        y, pre = out
        return y, (pre.clone() if pre.data_ptr() == x.data_ptr() else pre)

    B, C, H, W = x.shape
    HW = H * W
    G = num_groups
    y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    pre = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) if return_sum else x.new_empty(0)
    if x.numel() == 0:
        return y, pre
    if return_sum and not has_add:
        pre.copy_(x)
    if C * HW >= 2**31:
        raise NotImplementedError(f"group_norm: C*H*W = {C * HW} per batch item needs 64-bit offsets (max 2**31 - 1)")
    silu = activation == "silu"
    write_pre = return_sum and has_add
    triton_call = functools.partial(_launch_triton, x, G, weight, bias, eps, channel_bias, residual, silu, write_pre,
                                    y, pre)
    if x.is_cuda and cluster.run_if_faster(
        x, G, weight, bias, eps, channel_bias, residual, silu, y, pre if write_pre else None, triton_call
    ):
        return y, pre
    triton_call()
    return y, pre


def _launch_triton(x, G, weight, bias, eps, channel_bias, residual, silu, write_pre, y, pre) -> None:
    """The Triton kernels of the plan for this call, writing ``y`` (and ``pre`` when ``write_pre``)."""
    B, C, H, W = x.shape
    plan = group_norm_plan(B, C, H * W, G, _is_channels_last(x), x.element_size(), residual is not None)
    mod = triton_nhwc if plan.path == "nhwc_tiles" else triton_groups
    mod.launch(plan, x, G, weight, bias, eps, channel_bias, residual, silu, write_pre, y, pre)


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("sdfast::group_norm", mutates_args=())
def _group_norm_op(
    x: torch.Tensor,
    num_groups: int,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    channel_bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    activation: Optional[str],
    return_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _group_norm_impl(x, num_groups, weight, bias, eps, channel_bias, residual, activation, return_sum)


@_group_norm_op.register_fake
def _group_norm_fake(x, num_groups, weight, bias, eps, channel_bias, residual, activation, return_sum):
    _check_inputs(x, num_groups, weight, bias, channel_bias, residual, activation)
    y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    pre = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) if return_sum else x.new_empty(0)
    return y, pre


def group_norm(
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
):
    """Fused GroupNorm: ``y = act(GroupNorm(x + channel_bias + residual) * weight + bias)``.

    x: (B, C, H, W) fp16/bf16/fp32, NCHW-contiguous or channels_last (NHWC); the output has x's
    dtype and memory format (no layout copy in either). num_groups divides C (any channels per
    group, any H*W). weight, bias: (C,) or None (affine=False). channel_bias: (C,) or (B, C) in x's
    dtype (e.g. the ResNet block's time-embedding projection). residual: (B, C, H, W) in x's dtype,
    either layout. activation: None or "silu". Statistics are fp32 (biased variance, as
    ``torch.nn.GroupNorm``); ``pre`` is rounded to x's dtype before normalizing, as eager PyTorch's
    separate add would. Returns ``y``, or ``(y, pre)`` with ``return_sum`` (``pre`` in x's layout).

    Raises ValueError (shape, layout, groups, activation, devices) or TypeError (dtypes). Runs the
    PyTorch reference where Triton cannot run (``kernels.dispatch``). Registered as
    ``torch.ops.sdfast.group_norm`` (one opaque op for torch.compile and CUDA graphs).
    Method: Wu & He 2018; fusions as in TensorRT/stable-fast SD GroupNorm plugins.
    """
    if return_sum and channel_bias is None and residual is None:
        y, _ = torch.ops.sdfast.group_norm(x, num_groups, weight, bias, float(eps), None, None, activation, False)
        return y, x
    y, pre = torch.ops.sdfast.group_norm(
        x, num_groups, weight, bias, float(eps), channel_bias, residual, activation, bool(return_sum)
    )
    return (y, pre) if return_sum else y


__all__ = ["group_norm"]
