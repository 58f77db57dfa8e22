"""Image files with the generation parameters in them (PNG, JPEG, WebP), for the CLI and the HTTP service.

The parameters (prompt, negative prompt, seed, steps, guidance_scale, scheduler, size, model) go as JSON:

- PNG: into a ``tEXt`` chunk named ``sdfast`` (``json.loads(PIL.Image.open(path).text["sdfast"])``; a PNG viewer
  lists them);
- JPEG and WebP: into the EXIF ``UserComment`` tag (Exif IFD, tag 0x9286), as ASCII JSON after the 8-byte
  ``ASCII\\0\\0\\0`` character-code prefix that the EXIF standard gives that tag (``exiftool -UserComment`` shows it).

``read_parameters(PIL.Image.open(path))`` gives them back from any of the three.
"""

from __future__ import annotations

import io
import json
import numbers
from pathlib import Path

TEXT_KEY = "sdfast"
# Canonical format name -> PIL's name, and the file extensions / media types of each.
FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
EXTENSIONS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
DEFAULT_QUALITY = 90  # JPEG / WebP quality when none is given (PIL's own defaults: 75 and 80)
_EXIF_IFD, _USER_COMMENT = 0x8769, 0x9286
_ASCII_PREFIX = b"ASCII\0\0\0"


def image_format(name: str) -> str:
    """The canonical format name (``"png"``, ``"jpeg"``, ``"webp"``) of ``name`` (any case; ``"jpg"`` is ``"jpeg"``).
    Raises ValueError for any other."""
    key = str(name).lower().removeprefix(".")
    key = "jpeg" if key == "jpg" else key
    if key not in FORMATS:
        raise ValueError(f"image format must be png, jpeg or webp (got {name!r})")
    return key


def format_for_path(path: str | Path) -> str:
    """The canonical format of a file name by its extension (.png, .jpg/.jpeg, .webp). Raises ValueError for another
    extension (or none)."""
    suffix = Path(path).suffix.lower()
    if suffix not in EXTENSIONS:
        raise ValueError(f"sdfast writes .png, .jpg/.jpeg or .webp files (got {suffix or 'no extension'!r})")
    return EXTENSIONS[suffix]


def check_quality(fmt: str, quality) -> int | None:
    """The quality ``encode_image`` uses for format ``fmt`` (canonical name): ``quality``, or the default for JPEG /
    WebP. Raises ValueError (message starting ``quality:``) for a quality given for PNG or outside [0, 100]."""
    if quality is None:
        return DEFAULT_QUALITY if fmt != "png" else None
    if fmt == "png":
        raise ValueError("quality: PNG is lossless and takes no quality (give None)")
    if not isinstance(quality, numbers.Integral) or isinstance(quality, bool) or not 0 <= quality <= 100:
        raise ValueError(f"quality: must be an integer in [0, 100] (got {quality!r})")
    return int(quality)


def _exif(parameters: dict):
    from PIL import Image

    exif = Image.Exif()
    comment = json.dumps(parameters, sort_keys=True, ensure_ascii=True).encode("ascii")
    exif.get_ifd(_EXIF_IFD)[_USER_COMMENT] = _ASCII_PREFIX + comment
    return exif


def encode_image(image, format: str = "png", *, quality: int | None = None, parameters: dict | None = None) -> bytes:
    """The bytes of a PIL image as a ``format`` file: ``"png"``, ``"jpeg"`` (or ``"jpg"``) or ``"webp"``.

    quality: JPEG / WebP quality, an integer in [0, 100] (default ``DEFAULT_QUALITY``, 90); must be None for PNG.
    parameters: a JSON-serializable dict stored in the file (PNG ``sdfast`` text chunk; JPEG / WebP EXIF
        ``UserComment``), or None.
    Raises ValueError for an unknown format or a bad quality, and what PIL raises (e.g. OSError for an image mode
    that JPEG cannot hold, such as RGBA).
    """
    fmt = image_format(format)
    quality = check_quality(fmt, quality)
    buf = io.BytesIO()
    if fmt == "png":
        image.save(buf, format="PNG", pnginfo=_png_info(parameters), compress_level=4)
    else:
        kwargs = {"exif": _exif(parameters).tobytes()} if parameters else {}
        image.save(buf, format=FORMATS[fmt], quality=quality, **kwargs)
    return buf.getvalue()


def save_image(image, path: str | Path, *, format: str | None = None, quality: int | None = None,
               parameters: dict | None = None) -> None:
    """Write ``encode_image(image, format, quality=..., parameters=...)`` to ``path``; ``format`` defaults to the one
    of the extension (``format_for_path``). Raises ValueError (format, quality), OSError (an unwritable path)."""
    data = encode_image(image, format or format_for_path(path), quality=quality, parameters=parameters)
    Path(path).write_bytes(data)


def read_parameters(image) -> dict | None:
    """The generation parameters stored by ``encode_image`` in an opened PIL image (PNG, JPEG or WebP), or None."""
    text = getattr(image, "text", None) if image.format == "PNG" else None
    if text and TEXT_KEY in text:
        return json.loads(text[TEXT_KEY])
    comment = image.getexif().get_ifd(_EXIF_IFD).get(_USER_COMMENT)
    if isinstance(comment, bytes) and comment.startswith(_ASCII_PREFIX):
        return json.loads(comment[len(_ASCII_PREFIX):].decode("ascii"))
    return None


def _png_info(params: dict | None):
    from PIL.PngImagePlugin import PngInfo

    if not params:
        return None
    info = PngInfo()
    info.add_text(TEXT_KEY, json.dumps(params, sort_keys=True))
    return info


def encode_png(image, params: dict | None = None) -> bytes:
    """PNG bytes of a PIL image; ``params`` (JSON-serializable) go into the ``sdfast`` text chunk."""
    return encode_image(image, "png", parameters=params)


def save_png(image, path: str | Path, params: dict | None = None) -> None:
    """Write ``image`` to ``path`` as PNG with ``params`` in the ``sdfast`` text chunk. Raises what PIL raises (OSError
    for an unwritable path)."""
    image.save(path, format="PNG", pnginfo=_png_info(params))


__all__ = ["TEXT_KEY", "FORMATS", "EXTENSIONS", "MEDIA_TYPES", "DEFAULT_QUALITY", "image_format", "check_quality", "format_for_path",
           "encode_image", "save_image", "read_parameters", "encode_png", "save_png"]
