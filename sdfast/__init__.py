"""sdfast: a Stable Diffusion inference engine.

    import sdfast
    engine = sdfast.load("random:tiny")           # or a model folder, a .safetensors file, a hub id
    images = engine.txt2img("a photo of a cat", seed=0)
    images = sdfast.txt2img("a photo of a cat", model="random:tiny", seed=0)

Importing sdfast does no GPU work.
"""

from __future__ import annotations

from .config import OptimizeConfig
from .engine import Engine
from .errors import HubOfflineError, InvalidRequestError, ModelNotFoundError, NonFiniteOutputError
from .schedulers import SCHEDULERS

__all__ = [
    "Engine", "load", "txt2img", "optimize", "unoptimize", "OptimizeConfig", "SCHEDULERS",
    "InvalidRequestError", "ModelNotFoundError", "HubOfflineError", "NonFiniteOutputError",
]
__version__ = "0.1.0"

_ENGINES: dict[tuple, Engine] = {}


def optimize(pipe, config: OptimizeConfig | None = None):
    """Optimize a diffusers SD/SDXL pipeline in place (see ``sdfast.optimizer``); returns it."""
    from .optimizer import optimize as _optimize

    return _optimize(pipe, config)


def unoptimize(pipe):
    """Undo ``optimize`` on ``pipe``; returns it."""
    from .optimizer import unoptimize as _unoptimize

    return _unoptimize(pipe)


def load(model, *, device=None, dtype=None, seed: int = 0, optimize: bool | OptimizeConfig = True) -> Engine:
    """Load ``model`` into an ``Engine``.

    ``model``: a diffusers pipeline folder, a single-file ``.safetensors`` checkpoint, a hub id
    (``owner/name``), ``random:tiny|sd15|sd21|sdxl`` (real architecture, weights seeded by ``seed``),
    or a diffusers pipeline object. ``device``/``dtype`` default to CUDA+fp16 with a GPU, else CPU+fp32.
    ``optimize``: True (default ``OptimizeConfig``), an ``OptimizeConfig``, or False for the stock pipeline.
    Raises ``ModelNotFoundError``, ``HubOfflineError``, ``ValueError``, ``TypeError`` (see ``sdfast.loading``).
    """
    from .loading import load_pipeline

    pipe = load_pipeline(model, device=device, dtype=dtype, seed=seed)
    if optimize:
        from .optimizer import optimize as _optimize

        _optimize(pipe, optimize if isinstance(optimize, OptimizeConfig) else None)
    return Engine(pipe, name=model if isinstance(model, str) else type(model).__name__)


def txt2img(prompt, *, model: str = "random:tiny", device=None, dtype=None, optimize=True, **kwargs):
    """``load(model).txt2img(prompt, **kwargs)``, keeping one engine per (model, device, dtype, optimize)."""
    key = (model, str(device), str(dtype), optimize)
    if key not in _ENGINES:
        _ENGINES[key] = load(model, device=device, dtype=dtype, optimize=optimize)
    return _ENGINES[key].txt2img(prompt, **kwargs)
