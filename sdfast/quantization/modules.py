"""Quantized replacements for ``nn.Linear`` (built by ``sdfast.passes.quantize.quantize_``).

Every module keeps ``in_features`` / ``out_features``, takes (..., K) input in fp16 / bf16 / fp32 and
returns (..., N) in the input's dtype, stores its quantized tensors as buffers (so ``.to(device)``
moves them; integer buffers are never cast by ``.half()``), and can give back an ``nn.Linear``
(:meth:`QuantizedLinear.to_linear`): the exact original when one was kept, else the dequantized weight.

* :class:`W8A8Linear`: SmoothQuant int8 or FP8 E4M3 (``kernels.gemm.w8a8``), optional ZeroQuant groups.
* :class:`W8A8StaticLinear`: FP8 E4M3 with static per-tensor scales on cuBLASLt (``kernels.gemm.fp8_static``).
* :class:`W4A16Linear`: packed int4, AWQ / GPTQ / RTN (``kernels.gemm.w4a16``; ``backend="csrc"`` uses
  the CUDA C++ cp.async kernel where it applies).
* :class:`Int8OutlierLinear`: LLM.int8() (``kernels.gemm.int8_outlier``).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from kernels.dispatch import log_fallback
from kernels.gemm.fp8_static import fp8_linear, quantize_static
from kernels.gemm.int8_outlier import int8_outlier_linear
from kernels.gemm.w4a16 import dequantize_w4, pack_int4, quantize_int4_groups, w4a16_linear
from kernels.gemm.w8a8 import (
    FP8_QMAX,
    dequantize_weight,
    quantize_weight_per_channel,
    smoothquant_scales,
    w8a8_linear,
)

from .calibration import LinearStats
from .shared_input import quantize_input


def _nbytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


@functools.lru_cache(maxsize=None)
def _csrc_builds() -> bool:
    """Whether the CUDA C++ kernels build and load here (once per process; ``backend="auto"`` falls back to Triton,
    logged, when not: no nvcc, an unsupported GPU)."""
    from kernels.csrc.build import backend

    try:
        backend()
        return True
    except RuntimeError as e:
        log_fallback("w4a16 csrc", f"the CUDA C++ kernel did not build, Triton runs instead: {str(e)[:300]}")
        return False


def _unsmooth(w: torch.Tensor, smooth: torch.Tensor | None) -> torch.Tensor:
    """A SmoothQuant weight ``W diag(s)`` back to ``W``: times ``smooth = 1 / s`` per input channel."""
    return w if smooth is None else w * smooth.float()[None, :]


class QuantizedLinear(nn.Module):
    """Base class of sdfast's quantized linears (``quantize_`` skips modules of this type)."""

    in_features: int
    out_features: int

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, orig_dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.orig_dtype = orig_dtype
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._original: tuple[torch.Tensor, torch.Tensor | None] | None = None  # CPU copy for an exact undo

    def dequantized_weight(self) -> torch.Tensor:
        """(N, K) fp32 weight the module effectively multiplies by (``x @ W^T``, smoothing folded back)."""
        raise NotImplementedError

    def weight_nbytes(self) -> int:
        """Bytes of the stored weight representation (quantized weight, scales, zeros, smoothing)."""
        raise NotImplementedError

    def keep_original(self, linear: nn.Linear) -> None:
        """Keep a CPU copy of ``linear``'s weight and bias so :meth:`to_linear` restores it exactly."""
        self._original = (
            linear.weight.detach().to("cpu", copy=True),
            None if linear.bias is None else linear.bias.detach().to("cpu", copy=True),
        )

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` on this module's device: the kept original, else the dequantized weight in ``orig_dtype``."""
        dev = next((b.device for b in self.buffers() if b is not None), torch.device("cpu"))
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=dev, dtype=self.orig_dtype)
        with torch.no_grad():
            if self._original is not None:
                lin.weight.copy_(self._original[0])
                if self._original[1] is not None:
                    lin.bias.copy_(self._original[1])
            else:
                lin.weight.copy_(self.dequantized_weight())
                if self.bias is not None:
                    lin.bias.copy_(self.bias)
        return lin


class W8A8Linear(QuantizedLinear):
    """SmoothQuant W8A8 (int8 or FP8 E4M3) linear: per-channel (or per-group) weights, per-token activations.

    Buffers: ``qweight`` (N, K) int8 (FP8 is stored as its uint8 bit pattern so dtype casts leave it
    alone), ``w_scale`` fp32 (N,) or (N, ceil(K/group_size)), ``smooth`` fp32 (K,) or None, ``bias``.
    """

    def __init__(self, in_features: int, out_features: int, *, qweight, w_scale, smooth, bias, dtype: str,
                 group_size: int | None, orig_dtype: torch.dtype, alpha: float | None = None):
        super().__init__(in_features, out_features, bias, orig_dtype)
        if dtype not in ("int8", "fp8"):
            raise ValueError(f"W8A8Linear: dtype must be 'int8' or 'fp8', got {dtype!r}")
        self.qdtype = dtype
        self.group_size = group_size
        self.alpha = alpha
        self.register_buffer("qweight", qweight.view(torch.uint8) if dtype == "fp8" else qweight)
        self.register_buffer("w_scale", w_scale)
        self.register_buffer("smooth", smooth)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, act_absmax: torch.Tensor | None = None, alpha: float = 0.5,
                    dtype: str = "int8", group_size: int | None = None) -> "W8A8Linear":
        """Quantize ``linear``. With ``act_absmax`` (K,) the SmoothQuant factors (``alpha``) are applied;
        without it the layer is plain per-token × per-channel W8A8 (no smoothing)."""
        w = linear.weight.detach().float()
        smooth = None
        if act_absmax is not None and alpha > 0:
            s = smoothquant_scales(act_absmax.to(w.device), w, alpha)
            w = w * s[None, :]
            smooth = (1.0 / s).contiguous()
        tdt = torch.float8_e4m3fn if dtype == "fp8" else torch.int8
        q, scale = quantize_weight_per_channel(w, tdt, group_size)
        return cls(linear.in_features, linear.out_features, qweight=q, w_scale=scale, smooth=smooth,
                   bias=linear.bias, dtype=dtype, group_size=group_size, orig_dtype=linear.weight.dtype,
                   alpha=alpha if smooth is not None else None)

    @property
    def weight_q(self) -> torch.Tensor:
        """The quantized weight in its real dtype (int8 or float8_e4m3fn)."""
        return self.qweight.view(torch.float8_e4m3fn) if self.qdtype == "fp8" else self.qweight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w8a8_linear(x, self.weight_q, self.w_scale, self.bias, smooth=self.smooth, group_size=self.group_size)

    def dequantized_weight(self) -> torch.Tensor:
        return _unsmooth(dequantize_weight(self.weight_q, self.w_scale, self.group_size), self.smooth)

    def weight_nbytes(self) -> int:
        return _nbytes(self.qweight, self.w_scale, self.smooth)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.qdtype}, "
                f"smooth={'alpha=%g' % self.alpha if self.smooth is not None else None}, group_size={self.group_size}, "
                f"bias={self.bias is not None}")


class W8A8StaticLinear(QuantizedLinear):
    """FP8 E4M3 linear with static per-tensor scales (``kernels.gemm.fp8_static``): the activation scale is
    fixed by calibration (``input_amax / 448``), the weight has one scale, the GEMM is cuBLASLt's
    ``torch._scaled_mm``. Inputs beyond the calibrated ``input_amax`` saturate at ±448 · scale.

    Buffers: ``qweight`` (N, K) E4M3 stored as its uint8 bit pattern, ``w_scale`` () fp32, ``input_scale`` ()
    fp32, ``input_scale_inv`` () fp32 (``1 / input_scale``, what the quantize kernel multiplies by),
    ``smooth`` (K,) fp32 or None, ``bias``. ``input_amax`` (a float) and the smoothing decide
    ``quant_key``: linears reading the same input with equal keys share one quantize pass inside a
    :class:`~sdfast.quantization.shared_input.SharedInputQuantization` block. K and N must be multiples of 16.
    """

    def __init__(self, in_features: int, out_features: int, *, qweight, w_scale, input_amax: float, smooth, bias,
                 orig_dtype: torch.dtype, fast_accum: bool = True, alpha: float | None = None):
        super().__init__(in_features, out_features, bias, orig_dtype)
        if in_features % 16 or out_features % 16:
            raise ValueError(f"W8A8StaticLinear: in_features={in_features} and out_features={out_features} must be "
                             "multiples of 16 (cuBLASLt FP8)")
        if not (input_amax > 0 and math.isfinite(input_amax)):
            raise ValueError(f"W8A8StaticLinear: input_amax must be a positive finite number, got {input_amax!r}")
        self.input_amax = float(input_amax)
        self.fast_accum = fast_accum
        self.alpha = alpha
        scale = torch.tensor(self.input_amax / FP8_QMAX, dtype=torch.float32, device=qweight.device)
        self.register_buffer("qweight", qweight.view(torch.uint8))
        self.register_buffer("w_scale", w_scale.reshape(()).float())
        self.register_buffer("input_scale", scale)
        self.register_buffer("input_scale_inv", 1.0 / scale)
        self.register_buffer("smooth", smooth)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, act_absmax: torch.Tensor, alpha: float = 0.0,
                    fast_accum: bool = True) -> "W8A8StaticLinear":
        """Quantize ``linear`` from its calibrated per-input-channel ``act_absmax`` (K,); ``alpha > 0`` applies
        SmoothQuant's smoothing first (then the layer's input is quantized on its own, not shared)."""
        w = linear.weight.detach().float()
        amax = act_absmax.to(w.device).float()
        smooth = None
        if alpha > 0:
            s = smoothquant_scales(amax, w, alpha)
            w = w * s[None, :]
            smooth = (1.0 / s).contiguous()
            amax = amax * smooth
        w_scale = w.abs().amax().clamp_min(1e-12) / FP8_QMAX
        qweight = (w / w_scale).clamp(-FP8_QMAX, FP8_QMAX).to(torch.float8_e4m3fn)
        return cls(linear.in_features, linear.out_features, qweight=qweight, w_scale=w_scale,
                   input_amax=max(float(amax.max()), 1e-12), smooth=smooth, bias=linear.bias,
                   orig_dtype=linear.weight.dtype, fast_accum=fast_accum, alpha=alpha if smooth is not None else None)

    _FP32_BUFFERS = ("w_scale", "input_scale", "input_scale_inv", "smooth")

    def _apply(self, fn, recurse=True):
        """Device moves apply to every buffer; dtype casts (``.half()``) leave the fp32 scales alone (448 / amax
        overflows fp16 for small ranges). The quantized weight is uint8, which casts never touch."""
        keep = {n: self._buffers[n] for n in self._FP32_BUFFERS if self._buffers.get(n) is not None}
        super()._apply(fn, recurse)
        for n, t in keep.items():
            self._buffers[n] = t.to(self._buffers[n].device)
        return self

    def get_extra_state(self) -> dict:
        return {"input_amax": self.input_amax}

    def set_extra_state(self, state: dict) -> None:
        """``load_state_dict`` brings the calibrated range with the scale buffers, so ``quant_key`` follows them."""
        self.input_amax = float(state["input_amax"])

    @property
    def weight_q(self) -> torch.Tensor:
        """The quantized weight as ``float8_e4m3fn`` (N, K)."""
        return self.qweight.view(torch.float8_e4m3fn)

    @property
    def quant_key(self) -> tuple:
        """Equal keys quantize an input identically (same scale, no per-layer smoothing)."""
        return (self.input_amax, None if self.smooth is None else id(self))

    def quantize_input(self, x2d: torch.Tensor) -> torch.Tensor:
        """(M, K) float -> (M, K) E4M3 with this layer's static scale (and smoothing)."""
        return quantize_static(x2d, self.input_scale_inv, self.smooth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = quantize_input(self, x)
        y = fp8_linear(q, self.weight_q, self.input_scale, self.w_scale, self.bias, out_dtype=x.dtype,
                       fast_accum=self.fast_accum)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return _unsmooth(self.weight_q.float() * self.w_scale.float(), self.smooth)

    def weight_nbytes(self) -> int:
        return _nbytes(self.qweight, self.w_scale, self.smooth)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, dtype=fp8, activations=static, "
                f"input_amax={self.input_amax:.4g}, smooth={'alpha=%g' % self.alpha if self.smooth is not None else None}, "
                f"fast_accum={self.fast_accum}, bias={self.bias is not None}")


class W4A16Linear(QuantizedLinear):
    """Weight-only int4 linear (AWQ / GPTQ / RTN), dequantized inside the GEMM main loop.

    Buffers: ``qweight`` int32 (N, ceil(K/8)), ``scales`` (N, G) in the layer's dtype, ``zeros`` uint8
    (N, G), ``smooth`` fp32 (K,) (AWQ's ``1/s``) or None, ``bias``. ``backend``: ``"triton"``, ``"csrc"``
    (the CUDA C++ kernel for fp16 CUDA input with K % 32 == 0 and group_size % 32 == 0; anything else, and
    ``smooth`` handling, goes through Triton / a torch multiply) or ``"auto"``: the CUDA C++ kernel where it
    applies to a call of at least ``CSRC_MIN_TOKENS`` rows and builds, else Triton (the CUDA C++ kernel measured
    faster at 2048 tokens and more, slower at fewer, on sm_90).
    """

    CSRC_MIN_TOKENS = 1024

    def __init__(self, in_features: int, out_features: int, *, qweight, scales, zeros, smooth, bias,
                 group_size: int, method: str, orig_dtype: torch.dtype, backend: str = "auto"):
        super().__init__(in_features, out_features, bias, orig_dtype)
        if backend not in ("auto", "triton", "csrc"):
            raise ValueError(f"W4A16Linear: backend must be 'auto', 'triton' or 'csrc', got {backend!r}")
        self.group_size = group_size
        self.method = method
        self.backend = backend
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("smooth", smooth)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, method: str = "rtn", group_size: int = 128,
                    stats: LinearStats | None = None, damp: float = 0.01, n_grid: int = 20,
                    backend: str = "auto") -> "W4A16Linear":
        """Quantize ``linear`` with ``method`` ``"rtn"``, ``"awq"`` (needs ``stats`` with samples) or
        ``"gptq"`` (needs ``stats`` with ``xtx``). Raises ValueError when the statistics are missing."""
        w = linear.weight.detach().float()
        smooth = None
        if method == "rtn":
            q, s, z = quantize_int4_groups(w, group_size)
        elif method == "awq":
            if stats is None or stats.samples is None:
                raise ValueError("W4A16 AWQ needs calibration statistics with input samples")
            from .awq import awq_quantize

            q, s, z, smooth = awq_quantize(w, stats.absmean, stats.samples, group_size, n_grid)
        elif method == "gptq":
            if stats is None or stats.xtx is None:
                raise ValueError("W4A16 GPTQ needs calibration statistics with X^T X (hessian=True)")
            from .gptq import gptq_quantize

            q, s, z = gptq_quantize(w, stats.hessian, group_size, damp)
        else:
            raise ValueError(f"W4A16: method must be 'awq', 'gptq' or 'rtn', got {method!r}")
        return cls(linear.in_features, linear.out_features, qweight=pack_int4(q), scales=s.to(linear.weight.dtype),
                   zeros=z, smooth=smooth, bias=linear.bias, group_size=group_size, method=method,
                   orig_dtype=linear.weight.dtype, backend=backend)

    def uses_csrc(self, is_cuda: bool, dtype: torch.dtype, tokens: int) -> bool:
        """Whether a call with this input runs the CUDA C++ kernel (see ``backend`` in the class docstring)."""
        applies = (self.backend != "triton" and is_cuda and dtype == torch.float16 and self.in_features % 32 == 0
                   and self.group_size % 32 == 0 and self.scales.dtype == torch.float16
                   and (self.bias is None or self.bias.dtype == torch.float16))
        if not applies or self.backend == "csrc":
            return applies
        return tokens >= self.CSRC_MIN_TOKENS and _csrc_builds()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_csrc(x.is_cuda, x.dtype, x.numel() // max(self.in_features, 1)):
            from kernels.csrc.build import gemm_w4a16

            x2 = x.reshape(-1, self.in_features)
            if self.smooth is not None:
                x2 = x2 * self.smooth.to(x2.dtype)
            y = gemm_w4a16(x2, self.qweight, self.scales, self.zeros, self.bias, group_size=self.group_size)
            return y.reshape(*x.shape[:-1], self.out_features)
        return w4a16_linear(x, self.qweight, self.scales, self.zeros, self.bias, group_size=self.group_size,
                            smooth=self.smooth)

    def dequantized_weight(self) -> torch.Tensor:
        return _unsmooth(dequantize_w4(self.qweight, self.scales, self.zeros, self.in_features, self.group_size),
                         self.smooth)

    def weight_nbytes(self) -> int:
        return _nbytes(self.qweight, self.scales, self.zeros, self.smooth)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, method={self.method}, "
                f"group_size={self.group_size}, backend={self.backend}, bias={self.bias is not None}")


class Int8OutlierLinear(QuantizedLinear):
    """LLM.int8() linear: int8 per-channel weight; outlier input columns (|x| > threshold) in 16-bit.

    ``outlier_mask`` (K,) bool buffer: fixed from calibration when given (static), else None and the
    columns are found per call (dynamic, as in the paper).
    """

    def __init__(self, in_features: int, out_features: int, *, qweight, w_scale, bias, threshold: float,
                 outlier_mask: torch.Tensor | None, orig_dtype: torch.dtype):
        super().__init__(in_features, out_features, bias, orig_dtype)
        self.threshold = float(threshold)
        self.register_buffer("qweight", qweight)
        self.register_buffer("w_scale", w_scale)
        self.register_buffer("outlier_mask", outlier_mask)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, threshold: float = 6.0,
                    act_absmax: torch.Tensor | None = None) -> "Int8OutlierLinear":
        """Quantize ``linear``; with ``act_absmax`` (K,) the outlier columns are fixed to ``act_absmax > threshold``."""
        q, scale = quantize_weight_per_channel(linear.weight.detach().float(), torch.int8)
        mask = None if act_absmax is None else (act_absmax.to(q.device) > threshold).contiguous()
        return cls(linear.in_features, linear.out_features, qweight=q, w_scale=scale, bias=linear.bias,
                   threshold=threshold, outlier_mask=mask, orig_dtype=linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_outlier_linear(x, self.qweight, self.w_scale, self.bias, threshold=self.threshold,
                                   outlier_mask=self.outlier_mask)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_weight(self.qweight, self.w_scale)

    def weight_nbytes(self) -> int:
        return _nbytes(self.qweight, self.w_scale, self.outlier_mask)

    def extra_repr(self) -> str:
        n_out = None if self.outlier_mask is None else int(self.outlier_mask.sum())
        return (f"in_features={self.in_features}, out_features={self.out_features}, threshold={self.threshold}, "
                f"static_outliers={n_out}, bias={self.bias is not None}")


__all__ = ["QuantizedLinear", "W8A8Linear", "W4A16Linear", "Int8OutlierLinear"]
