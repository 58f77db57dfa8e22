"""A 3x3, stride-1, padding-1 convolution on the faster of two paths, chosen per call signature.

* cuDNN (``F.conv2d``);
* im2col then one cuBLAS GEMM: :func:`kernels.conv.im2col.im2col3x3` writes the (N*H*W, 9*Cin) patch matrix and
  ``F.linear`` multiplies it by the channels_last weight seen as (Cout, 9*Cin); the (N*H*W, Cout) product is the
  channels_last output. At small latent sizes (few output pixels, a large weight) cuDNN leaves SMs idle, while
  cuBLAS splits the long K of such a skinny GEMM over them.

The choice is the kernel-choice service's ``conv3x3`` (:mod:`kernels.select`): the GEMM path is a candidate only
at most ``TUNING["max_rows"]`` output pixels (its patch matrix is 9x the input, and cuDNN is fast at SD's larger
levels) and must win by the choice's margin (3 %), so near ties do not flip between processes and give
rounding-level different images. The kernel policy pins either path (``sdfast.KernelPolicy.conv3x3``); under
``torch.compile`` or with autograd cuDNN runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import select
from kernels.conv.im2col import im2col3x3
from kernels.gemm._common import plain_tensor

TUNING = {
    "max_rows": 4096,  # N*H*W above this: cuDNN without measuring
}

CHOICE = select.Choice("conv3x3", default="cudnn", margin=0.97)


def cudnn_conv3x3(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.conv2d(x, weight, bias, 1, 1)


def gemm_conv3x3(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """im2col, then ``F.linear`` with the channels_last weight as (Cout, 9*Cin): a channels_last (N, Cout, H, W)."""
    n, cin, h, w = x.shape
    cout = weight.shape[0]
    w2d = weight.permute(0, 2, 3, 1).reshape(cout, 9 * cin)  # a view: the weight is channels_last (gemm_problem)
    return F.linear(im2col3x3(x), w2d, bias).view(n, h, w, cout).permute(0, 3, 1, 2)


def gemm_problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why the im2col + GEMM path does not take these tensors (None when it does)."""
    if not all(plain_tensor(t) for t in (x, weight, bias) if t is not None):
        return "a tensor subclass or a non-strided layout (the im2col kernel reads plain dense memory)"
    if x.dim() != 4 or weight.dim() != 4 or tuple(weight.shape[1:]) != (x.shape[1], 3, 3):
        return "not a 3x3 convolution's x (N, Cin, H, W) and weight (Cout, Cin, 3, 3)"
    if x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
        return f"dtypes {x.dtype}/{weight.dtype} (fp16 or bf16, one dtype)"
    if bias is not None and (bias.dtype != x.dtype or tuple(bias.shape) != (weight.shape[0],)):
        return "the bias is not (Cout,) in x's dtype"
    if not (x.is_contiguous(memory_format=torch.channels_last)
            and weight.is_contiguous(memory_format=torch.channels_last)):
        return "x or the weight is not channels_last-contiguous"
    if x.shape[0] * x.shape[2] * x.shape[3] > TUNING["max_rows"]:
        return f"more than {TUNING['max_rows']} output pixels"
    return None


def conv3x3(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride=1, padding=1)`` for a (Cout, Cin, 3, 3) weight, on the chosen path.

    Args: x (N, Cin, H, W); weight (Cout, Cin, 3, 3); bias (Cout,) or None; the dtypes of ``F.conv2d``. Returns
    (N, Cout, H, W): channels_last when x is (both paths). Raises what ``F.conv2d`` raises for bad shapes.
    """
    if torch.compiler.is_compiling():  # Dynamo cannot trace the choice (timing): cuDNN
        return cudnn_conv3x3(x, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return cudnn_conv3x3(x, weight, bias)  # the im2col op has no autograd formula
    path = select.decide(
        CHOICE, select.signature(x, weight, bias), device=x.device,
        candidates={"cudnn": lambda: cudnn_conv3x3(x, weight, bias), "gemm": lambda: gemm_conv3x3(x, weight, bias)},
        problem=lambda name: gemm_problem(x, weight, bias) if name == "gemm" else None,
        compile_all=lambda: im2col3x3(x),
        describe=lambda: f"x {tuple(x.shape)} weight {tuple(weight.shape)} {x.dtype}")
    return (gemm_conv3x3 if path == "gemm" else cudnn_conv3x3)(x, weight, bias)


__all__ = ["CHOICE", "TUNING", "conv3x3", "cudnn_conv3x3", "gemm_conv3x3", "gemm_problem"]
