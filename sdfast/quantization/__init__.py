"""Post-training quantization for the UNet's linear layers and 3x3 convolutions (the pass is
``sdfast.passes.quantize``).

* ``calibration``: forward pre-hooks collecting per-input-channel absmax / mean |x|, X^T X, input rows.
* ``awq``: AWQ scale search (Lin et al. 2023); ``gptq``: GPTQ (Frantar et al. 2022).
* ``modules``: ``W8A8Linear`` (SmoothQuant int8 / FP8, ZeroQuant groups), ``W8A8StaticLinear`` (FP8,
  static per-tensor scales, cuBLASLt), ``W4A16Linear`` (AWQ / GPTQ / RTN), ``Int8OutlierLinear`` (LLM.int8()).
* ``conv``: ``W8A8StaticConv2d`` (FP8 3x3 convolutions, static activation scale, per-channel weights).
* ``shared_input``: one quantize pass for the linears that read the same input (Q/K/V).
* ``report``: :func:`layer_report`, each quantized layer's SQNR against its original weights, worst first.
"""

from .calibration import LinearStats, collect_linear_stats
from .conv import W8A8StaticConv2d
from .modules import Int8OutlierLinear, QuantizedLinear, W4A16Linear, W8A8Linear, W8A8StaticLinear
from .report import LayerError, format_report, layer_report
from .shared_input import SharedInputQuantization

__all__ = ["LinearStats", "collect_linear_stats", "QuantizedLinear", "W8A8Linear", "W8A8StaticLinear", "W4A16Linear",
           "Int8OutlierLinear", "SharedInputQuantization", "W8A8StaticConv2d", "LayerError", "format_report", "layer_report"]
