"""PNG files with the generation parameters in them, for the CLI and the HTTP service.

The parameters (prompt, negative prompt, seed, steps, guidance_scale, scheduler, size, model) go as JSON into a
``tEXt`` chunk named ``sdfast``: ``json.loads(PIL.Image.open(path).text["sdfast"])`` gives them back, and a PNG
viewer lists them.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

TEXT_KEY = "sdfast"


def _png_info(params: dict | None):
    from PIL.PngImagePlugin import PngInfo

    if not params:
        return None
    info = PngInfo()
    info.add_text(TEXT_KEY, json.dumps(params, sort_keys=True))
    return info


def encode_png(image, params: dict | None = None) -> bytes:
    """PNG bytes of a PIL image; ``params`` (JSON-serializable) go into the ``sdfast`` text chunk."""
    buf = io.BytesIO()
    image.save(buf, format="PNG", pnginfo=_png_info(params), compress_level=4)
    return buf.getvalue()


def save_png(image, path: str | Path, params: dict | None = None) -> None:
    """Write ``image`` to ``path`` as PNG with ``params`` in the ``sdfast`` text chunk. Raises what PIL raises (OSError
    for an unwritable path)."""
    image.save(path, format="PNG", pnginfo=_png_info(params))


__all__ = ["TEXT_KEY", "encode_png", "save_png"]
