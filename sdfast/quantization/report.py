"""Per-layer quantization error: the SQNR of every quantized layer's output against its original weights, worst first.

A layer whose output error stands out (real checkpoints have activation and weight outliers that seeded random weights
lack) can be seen here and kept in 16 bits with ``quantize_``'s ``filter_fn``. :func:`layer_report` hooks every
quantized module of a model, runs ``calibration`` (any callable that runs the model, as ``quantize_`` takes), and for
each call of a layer compares the quantized output with the output of the layer's original weight on the same input:

    SQNR (dB) = 10 log10( sum ref^2 / sum (out - ref)^2 )        summed over every call and element, in float64

so the figure includes both the weight's and the activation's quantization (and an input's saturation beyond the
calibrated range). Method: the signal-to-quantization-noise ratio per layer, as NVIDIA TensorRT Model Optimizer's and
PyTorch AO's numeric debuggers report it.

The reference weights: a quantized linear needs the CPU copy ``quantize_(..., keep_original=True)`` keeps; a
:class:`~sdfast.quantization.conv.W8A8StaticConv2d` keeps its 16-bit weight. Hooks see module calls only: sdfast's fused
paths run a hooked module as a module (they check for hooks), but CUDA graphs replay without calling modules, so run
the report on the quantized model before ``sdfast.optimize`` (or on an engine without graphs). A layer never called
reports ``calls == 0`` and a NaN SQNR.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from sdfast.quantization.conv import W8A8StaticConv2d
from sdfast.quantization.modules import QuantizedLinear


@dataclass(frozen=True)
class LayerError:
    """One layer's row: ``name`` (its module path), ``kind`` (its class), ``sqnr_db`` (float; inf for an exact
    output, NaN when never called), ``rel_err`` (``||out - ref|| / ||ref||``), ``calls`` and ``elements`` (output
    elements compared)."""

    name: str
    kind: str
    sqnr_db: float
    rel_err: float
    calls: int
    elements: int

    def as_dict(self) -> dict:
        return asdict(self)


def _reference(module: nn.Module, name: str) -> Callable[..., torch.Tensor]:
    """The layer's output on its original weights, in fp32: ``ref(x, **call_kwargs)``."""
    if isinstance(module, W8A8StaticConv2d):
        def conv(x, bias: bool = True):
            b = module.bias.float() if bias and module.bias is not None else None
            return F.conv2d(x.float(), module.weight.float(), b, 1, 1)
        return conv
    if isinstance(module, QuantizedLinear):
        if module._original is None:
            raise ValueError(f"layer_report: {name} ({type(module).__name__}) has no original weight to compare with; "
                             "quantize with sdfast.quantize_(..., keep_original=True)")
        w, b = module._original

        def linear(x):
            dev = x.device
            return F.linear(x.float(), w.to(dev).float(), None if b is None else b.to(dev).float())
        return linear
    raise TypeError(f"layer_report: {name} is a {type(module).__name__}, not a quantized layer")


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every quantized module of ``model`` (sdfast's quantized linears and convolutions), by module path."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (QuantizedLinear, W8A8StaticConv2d))}


@torch.no_grad()
def layer_report(model: nn.Module, calibration: Callable[[], Any], *,
                 filter_fn: Callable[[nn.Module, str], bool] | None = None) -> list[LayerError]:
    """The quantization error of each quantized layer of ``model`` over the calls ``calibration()`` makes, worst
    (lowest SQNR) first; layers never called come last.

    Args: model: a module holding sdfast's quantized layers (e.g. a UNet after ``sdfast.quantize_``, before
    ``sdfast.optimize``); calibration: a callable that runs it; filter_fn(module, name): report only these.
    Returns: a list of :class:`LayerError`. Raises ValueError when ``model`` has no quantized layer, or a quantized
    linear has no kept original weight (``quantize_(..., keep_original=True)``). The hooks are removed on return,
    also when ``calibration`` raises.
    """
    layers = {n: m for n, m in quantized_layers(model).items() if filter_fn is None or filter_fn(m, n)}
    if not layers:
        raise ValueError("layer_report: the model has no quantized layer (run sdfast.quantize_ first)")
    refs = {n: _reference(m, n) for n, m in layers.items()}
    sums = {n: [0.0, 0.0, 0, 0] for n in layers}  # signal, noise, calls, elements

    def hook(name):
        def record(module, args, kwargs, out):
            ref = refs[name](*args, **kwargs)
            o = out.double()
            r = ref.double()
            acc = sums[name]
            acc[0] += float((r * r).sum())
            acc[1] += float(((o - r) ** 2).sum())
            acc[2] += 1
            acc[3] += r.numel()
        return record

    handles = [m.register_forward_hook(hook(n), with_kwargs=True) for n, m in layers.items()]
    try:
        calibration()
    finally:
        for h in handles:
            h.remove()
    rows = []
    for name, (signal, noise, calls, elements) in sums.items():
        if calls == 0:
            sqnr = rel = math.nan
        else:
            sqnr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
            rel = math.sqrt(noise / signal) if signal > 0 else math.inf
        rows.append(LayerError(name, type(layers[name]).__name__, sqnr, rel, calls, elements))
    return sorted(rows, key=lambda r: (r.calls == 0, r.sqnr_db if not math.isnan(r.sqnr_db) else 0.0))


def format_report(rows: list[LayerError], limit: int | None = None) -> str:
    """A markdown table of :func:`layer_report`'s rows (the first ``limit`` of them: the worst)."""
    out = ["| layer | kind | SQNR dB | relative error | calls |", "| --- | --- | --- | --- | --- |"]
    for r in rows[:limit]:
        out.append(f"| {r.name} | {r.kind} | {r.sqnr_db:.1f} | {r.rel_err:.2e} | {r.calls} |")
    return "\n".join(out) + "\n"


__all__ = ["LayerError", "format_report", "layer_report", "quantized_layers"]
