"""The quantized replacement for a 3x3 ``nn.Conv2d`` (built by ``sdfast.passes.quantize.quantize_`` with
``W8A8Config(activations="static", convs=True)``).

:class:`W8A8StaticConv2d`: FP8 E4M3 activations with one static scale (calibrated ``input_amax / 448``), FP8 E4M3
weights with one scale per output channel, the convolution as an implicit GEMM on the tensor cores
(``kernels.conv.fp8_conv3x3``), the bias in its epilogue. Each call signature runs the fastest of the FP8 path
(quantize the input in one pass, then the convolution: the pointer kernel "fp8" or the TMA kernel "fp8_tma") and
the 16-bit convolution on the original weight ("cudnn": ``kernels.conv.conv3x3``, itself the measured faster of cuDNN
and im2col + cuBLAS), measured by the kernel-choice service (choice ``fp8_conv3x3``;
``KernelPolicy.fp8_conv3x3`` pins one), so a shape where FP8 does not pay keeps cuDNN's speed and 16-bit numerics.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels import select
from kernels.conv.conv3x3 import conv3x3
from kernels.conv.fp8_conv3x3 import fp8_conv3x3
from kernels.conv.fp8_conv3x3 import problem as fp8_problem
from kernels.conv.fp8_conv3x3 import tma_problem
from kernels.gemm.fp8_static import quantize_static
from kernels.gemm.w8a8 import FP8_QMAX

CHOICE = select.Choice("fp8_conv3x3", default="fp8")
_FP8 = torch.float8_e4m3fn


def conv_problem(conv: nn.Module) -> str | None:
    """Why ``conv`` cannot become a :class:`W8A8StaticConv2d` (None when it can): a plain ``nn.Conv2d``, 3x3,
    stride 1, padding 1, no dilation, one group, zero padding, Cin a multiple of 32, Cout of 16."""
    if type(conv) is not nn.Conv2d:
        return f"{type(conv).__name__} is not a plain nn.Conv2d"
    if (conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.groups, conv.padding_mode) != (
            (3, 3), (1, 1), (1, 1), (1, 1), 1, "zeros"):
        return "not a 3x3, stride-1, padding-1, ungrouped, zero-padded convolution"
    if conv.in_channels % 32 or conv.out_channels % 16:
        return f"in_channels={conv.in_channels} (a multiple of 32 needed), out_channels={conv.out_channels} (of 16)"
    return None


class W8A8StaticConv2d(nn.Module):
    """A 3x3, stride-1, padding-1 convolution on FP8 E4M3 with static scales (see the module docstring).

    Input (N, Cin, H, W) fp16 / bf16 / fp32 (channels_last avoids a copy; NCHW is converted), output (N, Cout, H, W) in the
    input's dtype, channels_last. Inputs beyond the calibrated ``input_amax`` saturate at ±448 · ``input_scale``.

    Buffers: ``weight`` (Cout, Cin, 3, 3) the original weight, channels_last (cuDNN's candidate, and ``to_conv``'s
    exact undo); ``qweight`` (Cout, 3, 3, Cin) E4M3 stored as its uint8 bit pattern; ``w_scale`` (Cout,) fp32;
    ``input_scale`` / ``input_scale_inv`` () fp32; ``bias`` (Cout,) or None. Dtype casts (``.half()``) leave the fp32
    scales and the uint8 weight alone. ``fast_accum``: the kernels' FP8 accumulation (``kernels.conv.fp8_conv3x3``).
    """

    def __init__(self, in_channels: int, out_channels: int, *, weight: torch.Tensor, qweight: torch.Tensor,
                 w_scale: torch.Tensor, input_amax: float, bias: torch.Tensor | None, fast_accum: bool = True):
        super().__init__()
        if not (input_amax > 0 and math.isfinite(input_amax)):
            raise ValueError(f"W8A8StaticConv2d: input_amax must be a positive finite number, got {input_amax!r}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding = (3, 3), (1, 1), (1, 1)
        self.input_amax = float(input_amax)
        self.fast_accum = bool(fast_accum)
        scale = torch.tensor(self.input_amax / FP8_QMAX, dtype=torch.float32, device=qweight.device)
        self.register_buffer("weight", weight.detach().clone().contiguous(memory_format=torch.channels_last))
        self.register_buffer("qweight", qweight.contiguous().view(torch.uint8))
        self.register_buffer("w_scale", w_scale.float().contiguous())
        self.register_buffer("input_scale", scale)
        self.register_buffer("input_scale_inv", 1.0 / scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, *, input_amax: float, fast_accum: bool = True) -> "W8A8StaticConv2d":
        """Quantize ``conv`` (see :func:`conv_problem`) with its calibrated input range ``input_amax`` (the largest
        |x| seen): per-output-channel weight scales ``amax_co / 448``. Raises ValueError for a conv it cannot take."""
        why = conv_problem(conv)
        if why is not None:
            raise ValueError(f"W8A8StaticConv2d: {why}")
        w = conv.weight.detach().float().permute(0, 2, 3, 1)  # (Cout, 3, 3, Cin)
        w_scale = w.abs().amax(dim=(1, 2, 3)).clamp_min(1e-12) / FP8_QMAX
        qweight = (w / w_scale.view(-1, 1, 1, 1)).clamp(-FP8_QMAX, FP8_QMAX).to(_FP8)
        return cls(conv.in_channels, conv.out_channels, weight=conv.weight, qweight=qweight, w_scale=w_scale,
                   input_amax=input_amax, bias=conv.bias, fast_accum=fast_accum)

    _FP32_BUFFERS = ("w_scale", "input_scale", "input_scale_inv")

    def _apply(self, fn, recurse=True):
        """Device moves apply to every buffer; dtype casts leave the fp32 scales alone; the FP8 weight stays
        contiguous (its (Cout, 3, 3, Cin) memory is what the kernels read: ``.to(memory_format=...)`` would permute
        it)."""
        keep = {n: self._buffers[n] for n in self._FP32_BUFFERS}
        super()._apply(fn, recurse)
        for n, t in keep.items():
            self._buffers[n] = t.to(self._buffers[n].device)
        self._buffers["qweight"] = self._buffers["qweight"].contiguous()
        return self

    def get_extra_state(self) -> dict:
        return {"input_amax": self.input_amax, "fast_accum": self.fast_accum}

    def set_extra_state(self, state: dict) -> None:
        self.input_amax = float(state["input_amax"])
        self.fast_accum = bool(state.get("fast_accum", True))

    @property
    def weight_q(self) -> torch.Tensor:
        """The quantized weight as ``float8_e4m3fn`` (Cout, 3, 3, Cin)."""
        return self.qweight.view(_FP8)

    def _bias(self, bias: bool) -> torch.Tensor | None:
        return self.bias if bias else None

    def fp8_forward(self, x: torch.Tensor, tma: bool = False, bias: bool = True) -> torch.Tensor:
        """The FP8 path: quantize ``x`` (one pass over its NHWC memory), then the implicit-GEMM convolution (the TMA
        kernel with ``tma``), the bias in its epilogue unless ``bias=False``."""
        x = x.contiguous(memory_format=torch.channels_last)
        n, c, h, w = x.shape
        q = quantize_static(x.permute(0, 2, 3, 1).reshape(-1, c), self.input_scale_inv).view(n, h, w, c)
        return fp8_conv3x3(q, self.weight_q, self.input_scale, self.w_scale, self._bias(bias), out_dtype=x.dtype,
                           fast_accum=self.fast_accum, tma=tma)

    def cudnn_forward(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """The 16-bit convolution on the original weight (``kernels.conv.conv3x3``: cuDNN or im2col + cuBLAS)."""
        b = self._bias(bias)
        if x.dtype != self.weight.dtype:  # an fp32 input (CPU tests, autocast off): F.conv2d in the input's dtype
            return F.conv2d(x, self.weight.to(x.dtype), None if b is None else b.to(x.dtype), 1, 1)
        return conv3x3(x, self.weight, b)

    def _problem(self, name: str, x: torch.Tensor) -> str | None:
        if name == "cudnn":
            return None
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            return f"input {tuple(x.shape)} is not (N, {self.in_channels}, H, W)"
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"input dtype {x.dtype} (fp16, bf16 or fp32)"
        if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 9):
            return "FP8 needs an sm_89+ GPU"
        stand_in = torch.empty(0, 1, 1, self.in_channels, dtype=_FP8, device=x.device)  # a fresh (aligned) buffer
        if name == "fp8_tma":
            return tma_problem(stand_in, self.weight_q, self.fast_accum)
        return fp8_problem(stand_in, self.weight_q)

    def forward(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """The convolution of ``x`` on the measured path (see the class docstring); ``bias=False`` leaves the bias out
        (``sdfast.passes.norms`` adds it elsewhere, as it does a plain convolution's)."""
        if torch.is_grad_enabled() and x.requires_grad:  # the FP8 kernels have no backward
            return self.cudnn_forward(x, bias=bias)
        with_bias = bias and self.bias is not None
        path = select.decide(
            CHOICE, select.signature(x, self.qweight) + (with_bias, self.fast_accum), device=x.device,
            candidates={"fp8": lambda: self.fp8_forward(x, bias=bias),
                        "fp8_tma": lambda: self.fp8_forward(x, tma=True, bias=bias),
                        "cudnn": lambda: self.cudnn_forward(x, bias=bias)},
            problem=lambda name: self._problem(name, x), compile_all=self._compile_all(x, bias),
            describe=lambda: f"x {tuple(x.shape)} {x.dtype} -> {self.out_channels} channels")
        if path == "cudnn":
            return self.cudnn_forward(x, bias=bias)
        return self.fp8_forward(x, tma=path == "fp8_tma", bias=bias)

    def _compile_all(self, x: torch.Tensor, bias: bool):
        def run():  # a precompile dry run: both FP8 kernels compile
            self.fp8_forward(x, bias=bias)
            if self._problem("fp8_tma", x) is None:
                self.fp8_forward(x, tma=True, bias=bias)
        return run

    def dequantized_weight(self) -> torch.Tensor:
        """(Cout, Cin, 3, 3) fp32: the weight the FP8 path multiplies by."""
        return (self.weight_q.float() * self.w_scale.view(-1, 1, 1, 1)).permute(0, 3, 1, 2)

    def weight_nbytes(self) -> int:
        """Bytes of the stored weights: the FP8 weight and its scales, and the 16-bit weight kept for cuDNN."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.w_scale, self.weight))

    def to_conv(self) -> nn.Conv2d:
        """The original ``nn.Conv2d`` (its 16-bit weight and bias, kept), on this module's device."""
        conv = nn.Conv2d(self.in_channels, self.out_channels, 3, 1, 1, bias=self.bias is not None,
                         device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            conv.weight.copy_(self.weight)
            if self.bias is not None:
                conv.bias.copy_(self.bias)
        return conv

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size=(3, 3), padding=(1, 1), dtype=fp8, "
                f"activations=static, input_amax={self.input_amax:.4g}, fast_accum={self.fast_accum}, "
                f"bias={self.bias is not None}")


__all__ = ["W8A8StaticConv2d", "conv_problem", "CHOICE"]
