"""sdfast: a Stable Diffusion inference engine.

    import sdfast
    engine = sdfast.load("random:tiny")           # or a model folder, a .safetensors file, a hub id
    images = engine.txt2img("a photo of a cat", seed=0)
    images = sdfast.txt2img("a photo of a cat", model="random:tiny", seed=0)

Importing sdfast does no GPU work.
"""

from __future__ import annotations

from .engine import Engine
from .errors import HubOfflineError, InvalidRequestError, ModelNotFoundError, NonFiniteOutputError
from .schedulers import SCHEDULERS

__all__ = [
    "Engine", "load", "txt2img", "SCHEDULERS",
    "InvalidRequestError", "ModelNotFoundError", "HubOfflineError", "NonFiniteOutputError",
]
__version__ = "0.1.0"

_ENGINES: dict[tuple, Engine] = {}


def load(model, *, device=None, dtype=None, seed: int = 0) -> Engine:
    """Load ``model`` into an ``Engine``.

    ``model``: a diffusers pipeline folder, a single-file ``.safetensors`` checkpoint, a hub id
    (``owner/name``), ``random:tiny|sd15|sd21|sdxl`` (real architecture, weights seeded by ``seed``),
    or a diffusers pipeline object. ``device``/``dtype`` default to CUDA+fp16 with a GPU, else CPU+fp32.
    Raises ``ModelNotFoundError``, ``HubOfflineError``, ``ValueError``, ``TypeError`` (see ``sdfast.loading``).
    """
    from .loading import load_pipeline

    pipe = load_pipeline(model, device=device, dtype=dtype, seed=seed)
    return Engine(pipe, name=model if isinstance(model, str) else type(model).__name__)


def txt2img(prompt, *, model: str = "random:tiny", device=None, dtype=None, **kwargs):
    """``load(model).txt2img(prompt, **kwargs)``, keeping one engine per (model, device, dtype)."""
    key = (model, str(device), str(dtype))
    if key not in _ENGINES:
        _ENGINES[key] = load(model, device=device, dtype=dtype)
    return _ENGINES[key].txt2img(prompt, **kwargs)
