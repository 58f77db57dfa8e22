"""sdfast: a Stable Diffusion inference engine.

    import sdfast
    engine = sdfast.load("random:tiny")           # or a model folder, a .safetensors file, a hub id
    images = engine.txt2img("a photo of a cat", seed=0)
    images = sdfast.txt2img("a photo of a cat", model="random:tiny", seed=0)

Importing sdfast does no GPU work and imports neither torch nor diffusers (they load on first use).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .errors import (GenerationCancelled, HubOfflineError, InvalidRequestError, ModelNotFoundError,
                     NonFiniteOutputError)

__all__ = [
    "Engine", "load", "txt2img", "optimize", "unoptimize", "OptimizeConfig", "SCHEDULERS",
    "InvalidRequestError", "ModelNotFoundError", "HubOfflineError", "NonFiniteOutputError", "PromptTruncatedWarning",
    "GenerationCancelled", "NothingQuantizedWarning",
    "quantize_", "dequantize_", "sparsify_", "W8A8Config", "W4A16Config", "Int8OutlierConfig", "Sparse24Config",
    "layer_report",
]

# Imported on first use, so that ``import sdfast`` (and the CLI's ``--help``) does not import torch, diffusers or
# the Triton kernels: name -> module.
_LAZY = {
    "Engine": ".engine", "PromptTruncatedWarning": ".engine",
    "OptimizeConfig": ".config", "KernelPolicy": ".config", "KERNEL_DTYPES": ".config",
    "SCHEDULERS": ".schedulers", "Txt2ImgRequest": ".request",
    "W8A8Config": ".passes.quantize", "NothingQuantizedWarning": ".passes.quantize", "W4A16Config": ".passes.quantize", "Int8OutlierConfig": ".passes.quantize",
    "Sparse24Config": ".passes.sparsity", "layer_report": ".quantization.report",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # once: later lookups are plain attribute reads
        return value
    raise AttributeError(f"module 'sdfast' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # for the annotations below; at run time these load lazily (``__getattr__``)
    from .config import OptimizeConfig
    from .engine import Engine

__version__ = "0.1.0"

_ENGINES: dict[tuple, "Engine"] = {}


def optimize(pipe, config: "OptimizeConfig | None" = None):
    """Optimize a diffusers SD/SDXL pipeline in place (see ``sdfast.optimizer``); returns it."""
    from .optimizer import optimize as _optimize

    return _optimize(pipe, config)


def decisions() -> list[dict]:
    """The kernel choices made (or read from the saved-choices file) in this process, in order: one dict per
    choice and key with ``choice``, ``key``, ``winner``, ``times_us`` (µs per candidate measured), ``source``
    ("measured", "saved", "pinned", "only"), ``reasons`` (why a candidate could not run) and ``device`` (the GPU's
    name). See ``kernels.select``."""
    from kernels import select

    return [d.as_dict() for d in select.decisions()]


def unoptimize(pipe):
    """Undo ``optimize`` on ``pipe``; returns it."""
    from .optimizer import unoptimize as _unoptimize

    return _unoptimize(pipe)


def quantize_(module, config, *, filter_fn=None, calibration=None, **kwargs):
    """Quantize the linear layers of ``module`` in place: W8A8 (SmoothQuant, int8 or FP8), W4A16 (AWQ,
    GPTQ) or LLM.int8 outliers, by ``config`` (``sdfast.W8A8Config`` / ``W4A16Config`` /
    ``Int8OutlierConfig``). See ``sdfast.passes.quantize.quantize_`` for arguments, returns and errors."""
    from .passes.quantize import quantize_ as _quantize

    return _quantize(module, config, filter_fn=filter_fn, calibration=calibration, **kwargs)


def dequantize_(module, *, filter_fn=None) -> int:
    """Undo ``quantize_``: every quantized linear of ``module`` (passing ``filter_fn``) becomes an ``nn.Linear``
    again. See ``sdfast.passes.quantize.dequantize_``."""
    from .passes.quantize import dequantize_ as _dequantize

    return _dequantize(module, filter_fn=filter_fn)


def sparsify_(module, config=None, *, filter_fn=None, calibration=None):
    """Prune the linear layers of ``module`` to 2:4 (magnitude or SparseGPT) and run them as sparse linears,
    in place, by ``config`` (``sdfast.Sparse24Config``, default magnitude). See
    ``sdfast.passes.sparsity.sparsify_`` for arguments, returns and errors."""
    from .passes.sparsity import Sparse24Config, sparsify_ as _sparsify

    return _sparsify(module, config if config is not None else Sparse24Config(), filter_fn=filter_fn,
                     calibration=calibration)


def load(model, *, device=None, dtype=None, seed: int = 0, optimize: "bool | OptimizeConfig" = True,
         controlnet=None) -> "Engine":
    """Load ``model`` into an ``Engine``.

    ``model``: a diffusers pipeline folder, a single-file ``.safetensors`` checkpoint, a hub id
    (``owner/name``), ``random:<arch>`` (a built-in architecture, ``sdfast.architectures.ARCHITECTURES``: tiny, tiny-v,
    tiny-xl, sd15, sd21, sdxl and their ``-inpaint`` checkpoints; weights seeded by ``seed``),
    or a diffusers pipeline object. ``device``/``dtype`` default to CUDA+fp16 with a GPU, else CPU+fp32.
    ``optimize``: True (default ``OptimizeConfig``), an ``OptimizeConfig``, or False for the stock pipeline.
    ``controlnet``: None, or a ControlNet (a ``ControlNetModel`` folder, a ``.safetensors`` file, a hub id,
    ``random:controlnet-sd15|controlnet-sd21|controlnet-sdxl|tiny-controlnet|tiny-v-controlnet|tiny-xl-controlnet``, a
    ``diffusers.ControlNetModel``), or a list of them (multi-ControlNet): the engine's pipeline is then diffusers'
    ControlNet pipeline of the model's family, optimized with its ControlNets, and every request takes
    ``control_image`` (see ``sdfast.controlnet``).
    Raises ``ModelNotFoundError``, ``HubOfflineError``, ``ValueError``, ``TypeError`` (see ``sdfast.loading``).
    """
    import torch

    from .config import KERNEL_DTYPES, OptimizeConfig
    from .engine import Engine
    from .loading import default_device_dtype, load_pipeline

    if not isinstance(optimize, (bool, OptimizeConfig)):
        raise TypeError(f"optimize must be True, False or an sdfast.OptimizeConfig, got {optimize!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"seed (of the random weights) must be an integer in [0, 2**63), got {seed!r}")
    if optimize and isinstance(dtype, torch.dtype) and dtype not in KERNEL_DTYPES:
        raise TypeError(f"dtype: the fused kernels take float16, bfloat16 or float32, not {dtype}; "
                        "pass optimize=False for the stock pipeline in that dtype")
    if optimize and torch.cuda.is_available():
        from .runtime import warm_start

        warm_start.start(*default_device_dtype(device, dtype))  # CUDA libraries load while the weights do
    pipe = load_pipeline(model, device=device, dtype=dtype, seed=seed)
    if controlnet is not None:
        from . import controlnet as _controlnet

        pipe = _controlnet.attach(pipe, _controlnet.load_controlnets(controlnet, pipe.unet, seed=seed))
    if optimize:
        from .optimizer import optimize as _optimize
        from .runtime import warm_start

        _optimize(pipe, optimize if isinstance(optimize, OptimizeConfig) else None)
        warm_start.wait()
    return Engine(pipe, name=str(model) if isinstance(model, (str, os.PathLike)) else type(model).__name__)


def txt2img(prompt, *, model: str = "random:tiny", device=None, dtype=None, optimize=True, **kwargs):
    """``load(model).txt2img(prompt, **kwargs)``, keeping one engine per (model, device, dtype, optimize)."""
    from .config import OptimizeConfig

    if not isinstance(optimize, (bool, OptimizeConfig)):
        raise TypeError(f"optimize must be True, False or an sdfast.OptimizeConfig, got {optimize!r}")
    key = (model, str(device), str(dtype), optimize)
    if key not in _ENGINES:
        _ENGINES[key] = load(model, device=device, dtype=dtype, optimize=optimize)
    return _ENGINES[key].txt2img(prompt, **kwargs)
