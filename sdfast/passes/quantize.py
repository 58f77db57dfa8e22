"""Quantization pass: swap the UNet's ``nn.Linear`` layers (and, for static FP8, its 3x3 convolutions) for quantized
ones, and back.

    from sdfast.passes.quantize import quantize_, dequantize_, W8A8Config, W4A16Config, Int8OutlierConfig

    n = quantize_(pipe.unet, W8A8Config(alpha=0.5),
                  calibration=lambda: pipe("a photo of a cat", num_inference_steps=2))
    print(int(n), n.skipped_shape, n.weight_bytes_after / n.weight_bytes_before)
    dequantize_(pipe.unet)   # back to nn.Linear

Methods (papers): W8A8 SmoothQuant (Xiao et al. 2022; int8, or FP8 E4M3 on sm_89+; with
``group_size`` the ZeroQuant-style group-wise weights of Yao et al. 2022; ``activations="static"``: its
per-tensor static setting in FP8 on cuBLASLt), W4A16 AWQ (Lin et al.
2023) / GPTQ (Frantar et al. 2022) / round-to-nearest, LLM.int8() (Dettmers et al. 2022).

``calibration`` is a callable that runs the model (e.g. the whole pipeline on a few prompts); while
it runs, forward pre-hooks on the targeted linears collect what the method needs (per-input-channel
absmax for SmoothQuant and LLM.int8(), mean |x| and input rows for AWQ, X^T X for GPTQ). SmoothQuant
without calibration is plain per-token W8A8 (no smoothing); LLM.int8() without calibration finds
outlier columns per call; AWQ and GPTQ require calibration.

Default targets (:func:`default_filter`): the UNet transformer blocks' linears (attention
``to_q/to_k/to_v/to_out``, feed-forward ``ff``) and ``proj_in`` / ``proj_out`` where they are linear.
With ``W8A8Config(activations="static", convs=True)`` the
ResNet blocks' and upsamplers' 3x3 convolutions (``resnets``, ``upsamplers``) are targets too
(:class:`~sdfast.quantization.conv.W8A8StaticConv2d`). The VAE and the text encoder have none of these names
under the UNet, so they stay in their dtype unless a ``filter_fn`` selects them. Layers with ``min(in_features, out_features) < config.min_features`` are
skipped and counted (``QuantizeStats.skipped_shape``): they are too small for an 8/4-bit kernel to pay.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from kernels.gemm.w8a8 import check_fp8_supported
from sdfast.passes.attention.qkv import FUSED_PROJECTIONS
from sdfast.quantization.calibration import collect_linear_stats
from sdfast.quantization.conv import W8A8StaticConv2d, conv_problem
from sdfast.quantization.modules import Int8OutlierLinear, QuantizedLinear, W4A16Linear, W8A8Linear, W8A8StaticLinear
from sdfast.quantization.registry import Calibration, handler_for, register_quantize_module_handler

FilterFn = Callable[[nn.Module, str], bool]


class NothingQuantizedWarning(UserWarning):
    """``quantize_`` converted no layer (every target too small, already quantized, or none matched); the message
    says which, and that calibration did not run."""


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------
def _check_ints(config, **minimums) -> None:
    """Each named field of ``config`` is an int (not a bool) >= its minimum; ValueError naming it otherwise."""
    for name, low in minimums.items():
        v = getattr(config, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"{type(config).__name__}: {name} must be an integer >= {low}, got {v!r}")


@dataclass(frozen=True)
class W8A8Config:
    """W8A8: 8-bit weights and activations.

    alpha: SmoothQuant migration strength in [0, 1] (0: no smoothing). Needs calibration to apply.
        Numerics: 0.5 balances activation and weight ranges (paper default).
    dtype: ``"int8"`` (int8 tl.dot, int32 accumulation) or ``"fp8"`` (E4M3, sm_89+ only).
    activations: ``"dynamic"``: per-token scales computed at run time, per-channel weights, our Triton GEMM
        (:class:`~sdfast.quantization.modules.W8A8Linear`). ``"static"`` (fp8 only, needs calibration): one
        activation scale per layer from calibration and one weight scale per tensor (SmoothQuant's
        per-tensor static setting, TensorRT Model Optimizer's FP8 SD recipe), the GEMM in cuBLASLt
        (:class:`~sdfast.quantization.modules.W8A8StaticLinear`); Q/K/V share one quantize pass when
        ``alpha == 0``. Speed: pays on SDXL's large linears, not on SD1.5's (the README's figures). Numerics:
        inputs beyond the calibrated range saturate.
    convs: "static" only: the UNet's 3x3 convolutions too (ResNet blocks, upsamplers), as FP8 implicit GEMMs
        with per-output-channel weight scales (:class:`~sdfast.quantization.conv.W8A8StaticConv2d`); each
        shape runs the faster of that and cuDNN on the kept 16-bit weight (measured). Memory: the 16-bit
        weight stays beside the FP8 one.
    fast_accum: "static" only: cuBLASLt's fast FP8 accumulation (no periodic fp32 promotion); with ``convs`` the
        convolution kernels' too (``kernels.conv.fp8_conv3x3``). Speed: faster
        GEMMs (the README's figures). Numerics: the relative error against the fp32 product of the
        unquantized operands is unchanged (0.037, the E4M3 quantization); the largest error against the fp32
        product of the quantized operands grows to 0.024 at K = 5120.
    group_size: None (per-channel weights) or a multiple of 32 (ZeroQuant group-wise weights, smaller
        weight error, one fp32 scale per group per row); "dynamic" only.
    min_features: layers with in or out features below this are skipped (speed: too small to pay).
    """

    alpha: float = 0.5
    dtype: str = "int8"
    group_size: int | None = None
    min_features: int = 320
    activations: str = "dynamic"
    fast_accum: bool = True
    convs: bool = False

    def __post_init__(self):
        _check_ints(self, min_features=1)
        if self.dtype not in ("int8", "fp8"):
            raise ValueError(f"W8A8Config: dtype must be 'int8' or 'fp8', got {self.dtype!r}")
        if self.activations not in ("dynamic", "static"):
            raise ValueError(f"W8A8Config: activations must be 'dynamic' or 'static', got {self.activations!r}")
        if self.activations == "static" and (self.dtype != "fp8" or self.group_size is not None):
            raise ValueError("W8A8Config: activations='static' runs FP8 per-tensor GEMMs (torch._scaled_mm): it needs "
                             "dtype='fp8' and group_size=None")
        if not isinstance(self.fast_accum, bool):
            raise TypeError(f"W8A8Config: fast_accum must be True or False, got {self.fast_accum!r}")
        if not isinstance(self.convs, bool):
            raise TypeError(f"W8A8Config: convs must be True or False, got {self.convs!r}")
        if self.convs and self.activations != "static":
            raise ValueError("W8A8Config: convs=True quantizes convolutions with static FP8 activations: it needs "
                             "dtype='fp8' and activations='static'")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"W8A8Config: alpha must be in [0, 1], got {self.alpha}")
        if self.group_size is not None and (self.group_size <= 0 or self.group_size % 32):
            raise ValueError(f"W8A8Config: group_size must be None or a positive multiple of 32, got {self.group_size}")

    @classmethod
    def fp8_static(cls, **overrides) -> "W8A8Config":
        """The preset "everything 8-bit that pays" on sm_89+ (Ada, Hopper): static per-tensor FP8 for the
        transformer linears and the ResNet / upsampler 3x3 convolutions, no SmoothQuant smoothing (so the feed-forward
        runs FP8 end to end and Q/K/V share one quantize pass), fast accumulation:
        ``W8A8Config(dtype="fp8", activations="static", alpha=0.0, convs=True)``. ``overrides``: other fields. Needs a
        calibration run; keep sensitive layers in 16 bits with ``quantize_``'s ``filter_fn`` (``sdfast.layer_report``
        shows which)."""
        return cls(**{**dict(dtype="fp8", activations="static", alpha=0.0, convs=True), **overrides})


@dataclass(frozen=True)
class W4A16Config:
    """W4A16 weight-only int4 (asymmetric, per group of ``group_size`` input channels; fp16 activations).

    method: ``"awq"`` (activation-aware scale search; needs calibration), ``"gptq"`` (Hessian error
        compensation; needs calibration; K² fp32 per layer during calibration) or ``"rtn"``
        (round-to-nearest; no calibration).
    group_size: multiple of 16 (128 is standard). Smaller groups: less error, more scale bytes.
    backend: ``"auto"`` (the CUDA C++ cp.async kernel at 1024 tokens or more, where it was faster, else Triton;
        see ``W4A16Linear``), ``"triton"`` or ``"csrc"`` (CUDA C++, built on first use, about a minute once per
        machine; fp16, K % 32 == 0).
    damp: GPTQ diagonal damping (fraction of the mean Hessian diagonal).
    n_grid: AWQ grid points for the scale exponent. n_samples: calibration input rows kept per layer (AWQ).
    min_features: layers with in or out features below this are skipped.
    """

    method: str = "awq"
    group_size: int = 128
    backend: str = "auto"
    damp: float = 0.01
    n_grid: int = 20
    n_samples: int = 256
    min_features: int = 320

    def __post_init__(self):
        _check_ints(self, group_size=16, n_grid=1, n_samples=1, min_features=1)
        if self.method not in ("awq", "gptq", "rtn"):
            raise ValueError(f"W4A16Config: method must be 'awq', 'gptq' or 'rtn', got {self.method!r}")
        if self.group_size <= 0 or self.group_size % 16:
            raise ValueError(f"W4A16Config: group_size must be a positive multiple of 16, got {self.group_size}")
        if self.backend not in ("auto", "triton", "csrc"):
            raise ValueError(f"W4A16Config: backend must be 'auto', 'triton' or 'csrc', got {self.backend!r}")


@dataclass(frozen=True)
class Int8OutlierConfig:
    """LLM.int8(): int8 weights and activations, input columns with any |x| > ``threshold`` in 16-bit.

    static_outliers: with calibration, fix the outlier columns to those seen during calibration
        (no per-call reduction, CUDA-graph friendly); otherwise find them per call (the paper's way).
    min_features: layers with in or out features below this are skipped.
    """

    threshold: float = 6.0
    static_outliers: bool = True
    min_features: int = 320

    def __post_init__(self):
        _check_ints(self, min_features=1)
        if self.threshold <= 0:
            raise ValueError(f"Int8OutlierConfig: threshold must be > 0, got {self.threshold}")


QuantConfig = W8A8Config | W4A16Config | Int8OutlierConfig


class QuantizeStats(int):
    """The number of layers quantized (an ``int``), with details as attributes.

    skipped_shape: targeted layers below ``min_features``; skipped_already: layers already quantized;
    weight_bytes_before / weight_bytes_after: bytes of the quantized layers' weights before / after
    (bias excluded); layers: the quantized module names.
    """

    skipped_shape: int
    skipped_already: int
    weight_bytes_before: int
    weight_bytes_after: int
    layers: list

    def __new__(cls, quantized: int, **kw: Any) -> "QuantizeStats":
        obj = super().__new__(cls, quantized)
        obj.skipped_shape = kw.get("skipped_shape", 0)
        obj.skipped_already = kw.get("skipped_already", 0)
        obj.weight_bytes_before = kw.get("weight_bytes_before", 0)
        obj.weight_bytes_after = kw.get("weight_bytes_after", 0)
        obj.layers = list(kw.get("layers", []))
        return obj

    @property
    def quantized(self) -> int:
        return int(self)

    @property
    def weight_ratio(self) -> float:
        """weight_bytes_after / weight_bytes_before of the quantized layers (1.0 when nothing was quantized: no
        weight changed)."""
        return self.weight_bytes_after / self.weight_bytes_before if self.weight_bytes_before else 1.0

    def __repr__(self) -> str:
        return (f"QuantizeStats(quantized={int(self)}, skipped_shape={self.skipped_shape}, "
                f"skipped_already={self.skipped_already}, weight_ratio={self.weight_ratio:.3f})")


# --------------------------------------------------------------------------------------------
# targets
# --------------------------------------------------------------------------------------------
_QUANTIZED = (QuantizedLinear, W8A8StaticConv2d)  # what quantize_ made (skipped, counted) and dequantize_ undoes
_UNET_LINEAR_SUFFIXES = ("proj_in", "proj_out")
_UNET_CONV_PARENTS = ("resnets", "upsamplers")


def default_filter(module: nn.Module, name: str) -> bool:
    """The UNet's transformer linears: anything under ``transformer_blocks`` (attn1/attn2 ``to_q/k/v/out``,
    ``ff``) and linear ``proj_in`` / ``proj_out``; and its convolutions under ``resnets`` / ``upsamplers`` (a
    target only for a method that converts convolutions, and only where its shape rule takes them: W8A8's
    static FP8 with ``convs=True`` takes the 3x3 ones). VAE attention (``mid_block.attentions.0.to_q``) and
    CLIP layers (``q_proj``, ``fc1``) do not match."""
    parts = name.split(".")
    if any(p in ("vae", "text_encoder", "text_encoder_2") for p in parts):
        return False
    if isinstance(module, nn.Conv2d):  # the 3x3 ones (not the ResNets' 1x1 conv_shortcut)
        return module.kernel_size == (3, 3) and any(p in _UNET_CONV_PARENTS for p in parts)
    if not isinstance(module, nn.Linear):
        return False
    return "transformer_blocks" in parts or parts[-1] in _UNET_LINEAR_SUFFIXES


def _root(module: Any) -> nn.Module:
    if isinstance(module, nn.Module):
        return module
    unet = getattr(module, "unet", None)  # a diffusers pipeline: quantize its UNet
    if isinstance(unet, nn.Module):
        return unet
    raise TypeError(f"quantize_: expected an nn.Module or a pipeline with .unet, got {type(module).__name__}")


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, new)


def _static(config) -> bool:
    return isinstance(config, W8A8Config) and config.activations == "static"


def _check_fp8_device(targets: dict) -> None:
    """FP8 GEMMs need sm_89+: raise before calibrating rather than at the first call."""
    lin = next(iter(targets.values()))
    check_fp8_supported(lin.weight, "quantize_(W8A8Config(activations='static'))",
                        advice="Use W8A8Config(dtype='int8') with the default activations='dynamic' instead.")


def _static_range(name: str, st) -> None:
    """A static scale needs a calibrated range: a layer that saw no tokens or only zeros would saturate every
    real input."""
    amax = float(st.absmax.max()) if st.n_tokens else 0.0
    if not 0.0 < amax < math.inf:
        raise ValueError(f"quantize_: calibration gave {name!r} an input range of {amax} ({st.n_tokens} tokens); a static "
                         "activation scale needs a finite, nonzero range. Calibrate on real prompts, or leave the "
                         "layer out (filter_fn)")


# --------------------------------------------------------------------------------------------
# the methods: one handler per config type (sdfast.quantization.registry)
# --------------------------------------------------------------------------------------------
def _w8a8_calibration(config: W8A8Config) -> Calibration:
    if _static(config):
        return Calibration(collect=True, required="W8A8 activations='static'")
    return Calibration(collect=config.alpha != 0)  # SmoothQuant's smoothing needs the input ranges


def _w8a8_eligible(config: W8A8Config, m: nn.Module) -> bool:
    if isinstance(m, nn.Conv2d):
        return conv_problem(m) is None and min(m.in_channels, m.out_channels) >= config.min_features
    return min(m.in_features, m.out_features) >= config.min_features and not (
        _static(config) and (m.in_features % 16 or m.out_features % 16))  # cuBLASLt FP8: K and N multiples of 16


def _w8a8_shape_rule(config: W8A8Config) -> str:
    if not _static(config):
        return ""
    return ", or not a multiple of 16 as FP8 GEMMs need" + (
        "; convolutions other than 3x3 stride-1 ones, or with in_channels not a multiple of 32" if config.convs else "")


def _w8a8_validate(config: W8A8Config, targets: dict, stats: dict | None) -> None:
    if not _static(config):
        return
    if stats is None:
        _check_fp8_device(targets)
    else:  # before any layer is replaced: an error leaves the module as it was
        for name in targets:
            _static_range(name, stats[name])


@register_quantize_module_handler(W8A8Config, calibration=_w8a8_calibration, eligible=_w8a8_eligible,
                                  shape_rule=_w8a8_shape_rule, validate=_w8a8_validate,
                                  module_types=lambda c: (nn.Linear, nn.Conv2d) if c.convs else (nn.Linear,))
def _w8a8(lin: nn.Module, config: W8A8Config, st) -> nn.Module:
    if isinstance(lin, nn.Conv2d):
        return W8A8StaticConv2d.from_conv(lin, input_amax=max(float(st.absmax.max()), 1e-12), fast_accum=config.fast_accum)
    if _static(config):
        return W8A8StaticLinear.from_linear(lin, act_absmax=st.absmax, alpha=config.alpha, fast_accum=config.fast_accum)
    return W8A8Linear.from_linear(lin, act_absmax=None if st is None else st.absmax, alpha=config.alpha,
                                  dtype=config.dtype, group_size=config.group_size)


def _w4a16_calibration(config: W4A16Config) -> Calibration:
    if config.method == "rtn":
        return Calibration()
    return Calibration(collect=True, required=f"W4A16 method {config.method!r}", hessian=config.method == "gptq",
                       n_samples=config.n_samples if config.method == "awq" else 0)


@register_quantize_module_handler(W4A16Config, calibration=_w4a16_calibration)
def _w4a16(lin: nn.Linear, config: W4A16Config, st) -> nn.Module:
    return W4A16Linear.from_linear(lin, method=config.method, group_size=config.group_size, stats=st,
                                   damp=config.damp, n_grid=config.n_grid, backend=config.backend)


@register_quantize_module_handler(Int8OutlierConfig,
                                  calibration=lambda config: Calibration(collect=config.static_outliers))
def _int8_outlier(lin: nn.Linear, config: Int8OutlierConfig, st) -> nn.Module:
    return Int8OutlierLinear.from_linear(lin, threshold=config.threshold, act_absmax=None if st is None else st.absmax)


# --------------------------------------------------------------------------------------------
# the pass
# --------------------------------------------------------------------------------------------
def quantize_(
    module: nn.Module,
    config: QuantConfig,
    *,
    filter_fn: FilterFn | None = None,
    calibration: Callable[[], Any] | None = None,
    keep_original: bool = False,
) -> QuantizeStats:
    """Replace the targeted ``nn.Linear`` layers of ``module`` (and ``nn.Conv2d`` ones, for a method that converts
    them) in place by quantized modules.

    module: an ``nn.Module`` (e.g. ``pipe.unet``) or a pipeline with ``.unet``.
    config: a config with a registered handler (``sdfast.quantization.registry``): :class:`W8A8Config`,
        :class:`W4A16Config`, :class:`Int8OutlierConfig`, or one registered with
        ``register_quantize_module_handler``.
    filter_fn: ``(module, name) -> bool`` choosing layers (default :func:`default_filter`); only exact
        ``nn.Linear`` (and, where the method takes them, ``nn.Conv2d``) instances are converted, already-quantized
        layers are skipped and counted.
    calibration: callable that runs the model once; pre-hooks collect the statistics the method needs.
    keep_original: keep a CPU copy of each original weight so :func:`dequantize_` restores it exactly
        (otherwise it restores the dequantized weight).

    Returns a :class:`QuantizeStats` (an int: the number of layers converted). When it is 0, warns
    (:class:`NothingQuantizedWarning`) why, before any calibration runs.
    Raises: TypeError (bad module; a config type with no handler, naming the registered ones), ValueError (a
    method that needs calibration, e.g. AWQ / GPTQ, without it).
    """
    root = _root(module)
    handler = handler_for(config, "quantize_")
    filter_fn = filter_fn or default_filter
    targets: dict[str, nn.Module] = {}
    skipped_shape = skipped_already = skipped_convs = 0
    widest_skipped = 0  # the largest min(in, out) among the layers skipped for their shape
    types = handler.module_types(config)
    for name, m in root.named_modules():
        if isinstance(m, _QUANTIZED):
            skipped_already += 1
            continue
        if type(m) not in types or name.endswith(FUSED_PROJECTIONS) or not filter_fn(m, name):
            continue
        if not handler.eligible(config, m):
            skipped_shape += 1
            if type(m) is nn.Linear:
                widest_skipped = max(widest_skipped, min(m.in_features, m.out_features))
            else:
                skipped_convs += 1
            continue
        targets[name] = m
    if not targets:
        _warn_nothing_quantized(config, handler, skipped_shape - skipped_convs, skipped_already, widest_skipped,
                                calibration is not None, skipped_convs)
        return QuantizeStats(0, skipped_shape=skipped_shape, skipped_already=skipped_already)

    need = handler.calibration(config)
    if need.required and calibration is None:
        raise ValueError(f"quantize_: {need.required} needs calibration=<callable running the model>")
    handler.validate(config, targets, None)
    stats = {}
    if need.collect and calibration is not None:
        stats = collect_linear_stats(targets, calibration, hessian=need.hessian, n_samples=need.n_samples)
        missing = [n for n in targets if n not in stats]
        if need.required and missing:
            raise ValueError(f"quantize_: calibration did not run {len(missing)} targeted layers (e.g. {missing[0]})")
        handler.validate(config, targets, stats)

    before = after = 0
    done = []
    for name, lin in targets.items():
        with torch.no_grad():
            q = handler.convert(lin, config, stats.get(name))
        if keep_original and isinstance(q, QuantizedLinear):  # a quantized conv keeps its original weight anyway
            q.keep_original(lin)
        before += lin.weight.numel() * lin.weight.element_size()
        after += q.weight_nbytes()
        _set_submodule(root, name, q)
        done.append(name)
    del stats
    return QuantizeStats(len(done), skipped_shape=skipped_shape, skipped_already=skipped_already,
                         weight_bytes_before=before, weight_bytes_after=after, layers=done)


def _warn_nothing_quantized(config, handler, skipped_shape: int, skipped_already: int, widest_skipped: int,
                            calibration: bool, skipped_convs: int = 0) -> None:
    reasons = []
    if skipped_convs:
        reasons.append(f"{skipped_convs} targeted convolution(s) are not 3x3 stride-1 ones with in_channels a multiple "
                       f"of 32, out_channels of 16 and both >= {type(config).__name__}.min_features="
                       f"{config.min_features}")
    if skipped_shape:
        reasons.append(
            f"{skipped_shape} targeted linear(s) are smaller than {type(config).__name__}.min_features="
            f"{config.min_features} in their in or out features (the largest is {widest_skipped}"
            + handler.shape_rule(config)
            + f"; pass min_features<={max(widest_skipped, 1)} to quantize them, though layers that small rarely run "
            "faster quantized)")
    if skipped_already:
        reasons.append(f"{skipped_already} layer(s) are quantized already")
    if not reasons:
        reasons.append("no nn.Linear of the module matched filter_fn (default: the UNet's transformer-block linears)")
    warnings.warn("quantize_: no layer was quantized: " + "; ".join(reasons)
                  + ("; calibration was not run" if calibration else ""), NothingQuantizedWarning, stacklevel=3)


def dequantize_(module: nn.Module, *, filter_fn: FilterFn | None = None) -> int:
    """Undo :func:`quantize_`: replace every :class:`QuantizedLinear` (passing ``filter_fn`` when given)
    by an ``nn.Linear`` (the kept original weight, else the dequantized one), and every quantized convolution by
    its original ``nn.Conv2d``. ``filter_fn`` sees the quantized modules (``QuantizedLinear``,
    ``W8A8StaticConv2d``: neither is an ``nn.Linear`` / ``nn.Conv2d``). Returns how many."""
    root = _root(module)
    names = [n for n, m in root.named_modules() if isinstance(m, _QUANTIZED) and (filter_fn is None or filter_fn(m, n))]
    for n in names:
        m = root.get_submodule(n)
        _set_submodule(root, n, m.to_conv() if isinstance(m, W8A8StaticConv2d) else m.to_linear())
    return len(names)


__all__ = [
    "quantize_", "dequantize_", "default_filter", "W8A8Config", "W4A16Config", "Int8OutlierConfig", "QuantizeStats",
    "NothingQuantizedWarning",
]

