"""A 3x3, stride-1, padding-1 convolution on the faster of two paths, chosen per call signature.

* cuDNN (``F.conv2d``);
* im2col then one cuBLAS GEMM: :func:`kernels.conv.im2col.im2col3x3` writes the (N*H*W, 9*Cin) patch matrix and
  ``F.linear`` multiplies it by the channels_last weight seen as (Cout, 9*Cin); the (N*H*W, Cout) product is the
  channels_last output. At SD1.5's 8x8 level cuDNN runs these convolutions at 170-260 TFLOP/s (H200, run 16): 128
  output pixels with CFG, a 29-59 MB weight; cuBLAS splits the long K of such a skinny GEMM over the SMs.

The GEMM path is only measured where it can win: at most ``TUNING["max_rows"]`` output pixels (its patch matrix is
9x the input; at SD's larger levels cuDNN runs at 450-640 TFLOP/s, run 16's sweep). The choice is measured once per
signature (shapes, strides, dtype, device) as GPU time (:func:`kernels.choice.gpu_times_us`) and logged, as is
(once per reason) why a signature runs cuDNN unmeasured (such a signature is kept as cuDNN's at once). The GEMM
path must win by ``TUNING["margin"]`` (3 %): near ties (SD1.5's 16x16 level) would otherwise flip between runs and
give rounding-level different images. Inside CUDA graph capture or a ``kernels.precompile`` dry run no measurable
signature is timed or kept (the capture runs cuDNN; the dry run compiles the im2col kernel); under
``torch.compile`` cuDNN is traced. ``SDFAST_CONV_GEMM=0`` (read at import) pins
cuDNN; ``TUNING["force"]`` pins either path (tests).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from kernels import choice, precompile
from kernels.conv.im2col import im2col3x3
from kernels.dispatch import has_kernel_choice, log_fallback
from kernels.gemm._common import plain_tensor

log = logging.getLogger("sdfast.kernels")

TUNING = {
    "enabled": os.environ.get("SDFAST_CONV_GEMM", "1") != "0",
    "max_rows": 4096,  # N*H*W above this: cuDNN without measuring
    "force": None,  # None: measure; "cudnn" or "gemm": always that path (where the GEMM path can run)
    "margin": 0.97,  # the GEMM path is kept only below this fraction of cuDNN's time (no flip-flop on ties)
}
_PATHS = ("cudnn", "gemm")

_choices: dict[tuple, str] = {}  # signature -> "cudnn" or "gemm"


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
    if not TUNING["enabled"]:
        return "SDFAST_CONV_GEMM=0"
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
    """``F.conv2d(x, weight, bias, stride=1, padding=1)`` for a (Cout, Cin, 3, 3) weight, on the measured path.

    Args: x (N, Cin, H, W); weight (Cout, Cin, 3, 3); bias (Cout,) or None; the dtypes of ``F.conv2d``. Returns
    (N, Cout, H, W): channels_last when x is (both paths). Raises what ``F.conv2d`` raises for bad shapes.
    """
    if torch.compiler.is_compiling():  # Dynamo cannot trace the choice (timing): cuDNN
        return cudnn_conv3x3(x, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return cudnn_conv3x3(x, weight, bias)  # the im2col op has no autograd formula
    key = choice.signature(x, weight, bias)
    if key not in _choices:
        why = gemm_problem(x, weight, bias)
        if why is not None:
            if has_kernel_choice(x):  # on a CPU without the interpreter cuDNN's path is the only one: no log
                log_fallback("conv3x3", why, instead="cuDNN")
            _choices[key] = "cudnn"
        elif TUNING["force"] is not None:
            if TUNING["force"] not in _PATHS:
                raise ValueError(f"conv3x3: TUNING['force'] must be None or one of {_PATHS}, got {TUNING['force']!r}")
            _choices[key] = TUNING["force"]
        elif precompile.active():  # compile the im2col kernel (launches are skipped), keep nothing
            im2col3x3(x)
            return cudnn_conv3x3(x, weight, bias)
        elif not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return cudnn_conv3x3(x, weight, bias)  # nothing is timed here; a later eager call measures
        else:
            with torch.cuda.device(x.device):  # time on x's GPU, whichever is current
                _choices[key] = _measure(x, weight, bias)
    path = gemm_conv3x3 if _choices[key] == "gemm" else cudnn_conv3x3
    return path(x, weight, bias)


def _measure(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """Time both paths; return "gemm" when it takes less than ``TUNING["margin"]`` of cuDNN's time, else "cudnn".
    A GEMM path that fails (e.g. out of memory for the patch matrix) is logged and cuDNN kept."""
    try:
        gemm_conv3x3(x, weight, bias)
    except Exception as e:  # noqa: BLE001 - e.g. torch.cuda.OutOfMemoryError for a large patch matrix
        log_fallback("conv3x3", f"im2col + cuBLAS failed: {type(e).__name__}: {e}", instead="cuDNN")
        return "cudnn"
    times = choice.gpu_times_us({"cudnn": lambda: cudnn_conv3x3(x, weight, bias),
                                 "gemm": lambda: gemm_conv3x3(x, weight, bias)})
    best = "gemm" if times["gemm"] < TUNING["margin"] * times["cudnn"] else "cudnn"
    log.info("conv3x3 x %s weight %s %s: cuDNN %.1f us, im2col + cuBLAS %.1f us -> %s", tuple(x.shape),
             tuple(weight.shape), x.dtype,
             times["cudnn"], times["gemm"], best)
    return best


__all__ = ["TUNING", "conv3x3", "cudnn_conv3x3", "gemm_conv3x3", "gemm_problem"]
