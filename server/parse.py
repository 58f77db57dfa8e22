"""Request bodies: JSON parsing and validation off the event loop, with bounded work and bounded errors.

FastAPI parses a JSON body and validates it on the event loop, and its 422 lists every error. A 1 MiB body of
100,000 unknown keys then costs seconds of pydantic work (while every other request, ``/health`` included, waits)
and a 20 MB answer. Here (``image_body(Model)``, a FastAPI dependency, for every POST endpoint):

- the body is parsed (``json.loads``) and validated in a worker thread (``starlette.concurrency.run_in_threadpool``);
- pydantic sees at most ``MAX_UNKNOWN_KEYS`` of the unknown top-level keys (the others are only counted), so the
  validation errors are at most the model's fields plus that;
- a JSON integer of more than ``MAX_INT_DIGITS`` digits becomes an ``OversizedInt`` (refused by the field's type
  check, so the 422 names the field; Python's ``int`` refuses past 4300 digits, which named only ``body``).

The 422 itself (``server.app``) lists at most ``MAX_DETAIL`` errors and counts the rest.

Bodies with images (``image_body(Model)``: ``/v1/img2img``, ``/v1/inpaint``, ``/v1/images/edits``, and the ControlNet
fields' ``control_image`` on ``/v1/txt2img`` and ``/v1/images/generations``) come as JSON (each image a base64 string
or a data URL; a list of them for ``control_image``) or as ``multipart/form-data`` (each image a file; the other
fields text, read as pydantic reads strings), all in a worker thread too, with bounded work:

- JSON: at most ``MAX_JSON_TOKENS`` commas, colons and brackets, counted before ``json.loads`` (which holds the GIL:
  30 MB of small keys took 4.5 s, while base64 images of that size parse in 0.1 s); on the endpoints whose bodies
  usually hold no image (txt2img, generations), only past ``MAX_PLAIN_JSON_BYTES``, the size every JSON body may
  have;
- multipart (python-multipart's parser): at most ``MAX_FORM_PARTS`` parts, no name twice (but ``image[]``, the
  list form of ``image`` that OpenAI's client sends, and the per-ControlNet fields: ``control_image`` files, and
  ``controlnet_conditioning_scale`` / ``control_guidance_start`` / ``control_guidance_end`` values, repeated once per
  control image);
- each image (``decode_image``): a PNG, JPEG or WebP file (``schemas.UPLOAD_FORMATS``) whose size, read from its
  header before any pixel is decoded, is within ``schemas.MAX_UPLOAD_PIXELS`` and ``MAX_UPLOAD_SIDE``, in an 8-bit
  mode (``schemas.UPLOAD_MODES``), then decoded and turned upright (its EXIF orientation, as diffusers'
  ``load_image`` does). The fields are validated first (and the endpoint's own ``check`` runs, e.g. the service's
  count of control images against its ControlNets), so a request with a bad field decodes nothing.

The body's size is bounded before it is read (``server.app.BodyLimitMiddleware``: 413).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from python_multipart import create_form_parser
from python_multipart.exceptions import FormParserError
from starlette.concurrency import run_in_threadpool

from . import schemas
from .schemas import MAX_INT_DIGITS, OversizedInt

MAX_UNKNOWN_KEYS = 4  # unknown top-level keys that reach pydantic (and the 422); the rest are counted
MAX_DETAIL = 8  # errors listed in a 422's ``detail``; ``detail_omitted`` counts the rest
MAX_JSON_TOKENS = 10_000  # a body with images: its fields and two 1000-character prompts need about 2,100
MAX_FORM_PARTS = 64  # multipart parts of a body with images (its model has about 30 fields)
MAX_PLAIN_JSON_BYTES = 1 << 20  # a JSON body up to this size is parsed without counting its tokens first


class BodyValidationError(RequestValidationError):
    """A ``RequestValidationError`` that also counts the errors not listed (``omitted``)."""

    def __init__(self, errors, *, omitted: int = 0):
        super().__init__(errors)
        self.omitted = omitted


def _parse_int(digits: str):
    n = len(digits.lstrip("-"))
    return OversizedInt(n) if n > MAX_INT_DIGITS else int(digits)


def _json_error(message: str) -> BodyValidationError:
    return BodyValidationError([{"type": "json_invalid", "loc": ("body",), "msg": message, "ctx": {"error": message}}])


def _load_json(body: bytes):
    try:
        return json.loads(body, parse_int=_parse_int)
    except RecursionError:
        raise _json_error("nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise _json_error(str(e)[:200]) from None


def _drop_unknown(model: type[BaseModel], data):
    """``data`` with at most ``MAX_UNKNOWN_KEYS`` of its unknown top-level keys, and how many were dropped."""
    omitted = 0
    if isinstance(data, dict):
        fields = model.model_fields  # a property: read it once
        unknown = [k for k in data if k not in fields]
        if len(unknown) > MAX_UNKNOWN_KEYS:
            omitted = len(unknown) - MAX_UNKNOWN_KEYS
            drop = set(unknown[MAX_UNKNOWN_KEYS:])
            data = {k: v for k, v in data.items() if k not in drop}
    return data, omitted


def openapi_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` for a route whose body is JSON only (``image_body(model, json_only=True)``)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# -- bodies with images ------------------------------------------------------------------------------

UPLOAD = "<upload>"  # what pydantic sees in place of an image: the images are decoded once the fields validate
_LONG_INT = re.compile(r"-?[0-9]{%d,}" % (MAX_INT_DIGITS + 1))


@dataclass
class ImageBody:
    """A validated body with images: ``fields`` (the model, its image fields holding ``UPLOAD``) and ``images``, the
    decoded uploads by field name (``PIL.Image.Image`` as decoded: any of ``schemas.UPLOAD_MODES``, upright)."""

    fields: BaseModel
    images: dict = field(default_factory=dict)


def _field_error(name: str, message: str) -> BodyValidationError:
    """A 422 naming ``name`` (``body`` for the body as a whole) with ``message``."""
    return BodyValidationError([{"type": "value_error", "loc": (name,), "msg": message}])


def _count_json_tokens(body: bytes) -> int:
    """Commas, colons and opening brackets in ``body``: a bound on its JSON values and keys, counted in 1 MiB slices
    (each ``count`` holds the GIL; between slices the event loop may run)."""
    n, step = 0, 1 << 20
    for i in range(0, len(body), step):
        chunk = body[i:i + step]
        n += chunk.count(b",") + chunk.count(b":") + chunk.count(b"[") + chunk.count(b"{")
    return n


def _form_parts(body: bytes, content_type: str) -> list[tuple[str, bytes, bool]]:
    """The parts of a ``multipart/form-data`` body: (name, bytes, is a file), in order (python-multipart)."""
    parts: list[tuple[str, bytes, bool]] = []

    def add(name: bytes | None, value: bytes, is_file: bool) -> None:
        if len(parts) >= MAX_FORM_PARTS:
            raise _field_error("body", f"at most {MAX_FORM_PARTS} form fields (this endpoint has fewer)")
        parts.append(((name or b"").decode("utf-8", "replace"), value, is_file))

    def on_field(f) -> None:
        add(f.field_name, f.value or b"", False)

    def on_file(f) -> None:
        add(f.field_name, f.file_object.getvalue(), True)

    try:
        parser = create_form_parser({"Content-Type": content_type.encode("latin-1")}, on_field, on_file,
                                    config={"MAX_MEMORY_FILE_SIZE": float("inf")})  # the body is in memory already
        parser.write(body)
        parser.finalize()
    except (FormParserError, ValueError, UnicodeEncodeError) as e:
        raise _field_error("body", f"not valid multipart/form-data ({str(e)[:200]})") from None
    return parts


def _form_fields(model: type[BaseModel], parts) -> dict:
    """Form parts as a dict: the image fields' files as bytes (or text: base64), the other fields as text; each
    name once, but ``image[]`` (OpenAI's client sends a list of images so) collected as a list, and the fields of
    ``model.image_lists`` / ``model.list_fields`` (one value per control image) collected as a list when repeated
    (or sent as ``name[]``); a repeated ``list_fields`` value is joined with commas, its form-text list."""
    data: dict = {}
    lists = (*getattr(model, "image_lists", ()), *getattr(model, "list_fields", ()))
    listed: set[str] = set()  # the names sent as ``name[]``
    for name, value, is_file in parts:
        key = name[:-2] if name.endswith("[]") and (name == "image[]" or name[:-2] in lists) else name
        if key in model.image_fields:
            item = value if is_file else value.decode("latin-1")  # text: base64 is ASCII
        elif key not in model.model_fields:  # unknown: left to the schema's own "unknown field" answer (a file too)
            item = "(a file)" if is_file else value.decode("utf-8", "replace")
        else:
            try:
                item = value.decode("utf-8")
            except UnicodeDecodeError:
                raise _field_error(key, "is not UTF-8 text") from None
        if name == "image[]" or (key in lists and (key in data or name != key)):
            if key in data and (name != key) != (key in listed):
                raise _field_error(key, f"send {key} or {key}[], not both")
            if name != key:
                listed.add(key)
            if key in data and not isinstance(data[key], list):
                data[key] = [data[key]]
            data.setdefault(key, []).append(item)
            continue
        if key in data:
            raise _field_error(key, "given more than once")
        data[key] = item
    for key in getattr(model, "list_fields", ()):
        if isinstance(data.get(key), list):
            data[key] = ",".join(data[key])
    return data


def parse_image_request(model: type[BaseModel], body: bytes, content_type: str | None, *,
                        multipart_only: bool = False, json_only: bool = False, count_tokens_above: int = 0,
                        check=None) -> ImageBody:
    """``model`` (one with ``image_fields``) and its decoded images from a JSON or ``multipart/form-data`` body
    (``multipart_only`` / ``json_only``: that one only). A JSON body longer than ``count_tokens_above`` bytes has its
    tokens counted first (at most ``MAX_JSON_TOKENS``). ``check``: None, or a function ``(fields, uploads)`` called
    on the validated fields and the undecoded uploads by field name (bytes or base64 text; a list for a field of
    ``model.image_lists`` sent as a list), before any image is decoded; what it raises goes to the client.
    Raises ``BodyValidationError``: the fields first (nothing is decoded while one is wrong), then each image
    (``decode_image``; an image of a list named ``name[i]``)."""
    ct = (content_type or "").lower()
    multipart = not json_only and ct.startswith("multipart/form-data")
    if multipart:
        data = _form_fields(model, _form_parts(body, content_type))
    elif not multipart_only and (not ct or "json" in ct):
        if len(body) > count_tokens_above and _count_json_tokens(body) > MAX_JSON_TOKENS:
            raise _field_error("body", f"more than {MAX_JSON_TOKENS} JSON values and keys (this endpoint has about "
                                       "30 fields)")
        data = _load_json(body)
    elif multipart_only:
        raise _field_error("body", "send multipart/form-data (images as files)")
    else:
        raise _field_error("body", "send a JSON object with the header 'content-type: application/json'" + (
            "" if json_only else " (images as base64) or multipart/form-data (images as files)"))
    data, omitted = _drop_unknown(model, data)
    raw: dict = {}
    if isinstance(data, dict):
        lists = getattr(model, "image_lists", ())
        for name in model.image_fields:
            value = data.get(name)
            if isinstance(value, list) and all(isinstance(v, (bytes, str)) for v in value):
                if name in lists:
                    if not 1 <= len(value) <= schemas.MAX_CONTROL_IMAGES:
                        raise _field_error(name, f"1 to {schemas.MAX_CONTROL_IMAGES} images, one per ControlNet (got "
                                                 f"{len(value)})")
                    # JSON keeps the list's length for the model; form text cannot hold a list
                    raw[name], data[name] = value, UPLOAD if multipart else [UPLOAD] * len(value)
                    continue
                if len(value) != 1:
                    raise _field_error(name, f"one image per request (got {len(value)}): this model edits one image")
                value = value[0]
            if isinstance(value, (bytes, str)):
                raw[name], data[name] = value, UPLOAD
    try:
        fields = model.model_validate_strings(data) if multipart else model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        for err in errors:  # as the JSON parser does: a huge integer is named, not echoed
            if isinstance(err.get("input"), str) and _LONG_INT.fullmatch(err["input"]):
                err["input"] = OversizedInt(len(err["input"].lstrip("-")))
        raise BodyValidationError(errors, omitted=omitted) from None
    if check is not None:
        check(fields, raw)
    images = {}
    for name, value in raw.items():
        images[name] = ([decode_image(v, f"{name}[{i}]") for i, v in enumerate(value)] if isinstance(value, list)
                        else decode_image(value, name))
    return ImageBody(fields, images)


def _from_base64(text: str, name: str) -> bytes:
    if text.startswith("data:"):
        head, comma, text = text.partition(",")
        if not comma or not head.lower().endswith(";base64"):
            raise _field_error(name, "a data URL must hold base64: data:image/png;base64,...")
    try:
        return base64.b64decode("".join(text.split()), validate=True)  # line breaks allowed, nothing else
    except (binascii.Error, ValueError) as e:
        raise _field_error(name, f"is not a file in base64 ({e})") from None


def decode_image(data: bytes | str, name: str = "image"):
    """The image of an uploaded file (``bytes``) or of base64 text / a data URL (``str``), decoded and upright.

    Before any pixel is decoded, its header must say a PNG, JPEG or WebP image (``schemas.UPLOAD_FORMATS``) of at
    most ``schemas.MAX_UPLOAD_PIXELS`` pixels and sides of at most ``MAX_UPLOAD_SIDE``, in an 8-bit mode
    (``schemas.UPLOAD_MODES``). Raises ``BodyValidationError`` naming ``name``; never anything else for bad data."""
    from PIL import Image, ImageOps

    if isinstance(data, str):
        data = _from_base64(data, name)
    if not data:
        raise _field_error(name, "is empty: send a PNG, JPEG or WebP file")
    try:
        image = Image.open(io.BytesIO(data), formats=schemas.UPLOAD_FORMATS)
    except Image.DecompressionBombError:
        raise _field_error(name, f"has more than {schemas.MAX_UPLOAD_PIXELS} pixels (the limit)") from None
    except Exception:  # noqa: BLE001 - PIL raises many types on a file it cannot read
        raise _field_error(name, "is not a PNG, JPEG or WebP image (its header could not be read)") from None
    width, height = image.size
    if width * height > schemas.MAX_UPLOAD_PIXELS or max(width, height) > schemas.MAX_UPLOAD_SIDE:
        raise _field_error(name, f"is {width}x{height} = {width * height} pixels; at most {schemas.MAX_UPLOAD_PIXELS} "
                                 f"pixels (4096 x 4096), sides at most {schemas.MAX_UPLOAD_SIDE}, are decoded")
    if image.mode not in schemas.UPLOAD_MODES:
        raise _field_error(name, f"has mode {image.mode!r}, which is not supported: send an 8-bit image (modes "
                                 f"{', '.join(schemas.UPLOAD_MODES)}); 16-bit and floating-point images are not")
    try:
        image.load()
        ImageOps.exif_transpose(image, in_place=True)
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file: PIL raises OSError, SyntaxError, ...
        raise _field_error(name, f"could not be decoded: a truncated or corrupt {image.format} file "
                                 f"({type(e).__name__}: {str(e)[:100]})") from None
    return image


def prepare_images(image, mask=None, *, width: int | None = None, height: int | None = None, image_field="image",
                   mask_field="mask_image", resize_fields="width and height"):
    """The RGB image and the L mask (or None) the engine gets: ``mask`` must be ``image``'s size; both are resized
    to ``width`` x ``height`` when one is given (a side left out keeps the image's; Lanczos, as diffusers' image
    processor resizes); the size rounded down to multiples of 8 (what the engine runs) must have sides in the
    service's [``MIN_SIDE``, ``MAX_SIDE``]. Raises ``BodyValidationError`` naming ``image_field`` / ``mask_field``."""
    from PIL import Image

    if mask is not None and mask.size != image.size:
        raise _field_error(mask_field, f"must be the image's size, {image.width}x{image.height} (got "
                                       f"{mask.width}x{mask.height})")
    image = image.convert("RGB")
    mask = None if mask is None else mask.convert("L")
    if width is not None or height is not None:
        size = (width or image.width, height or image.height)
        if size != image.size:
            image = image.resize(size, Image.Resampling.LANCZOS)
            mask = None if mask is None else mask.resize(size, Image.Resampling.LANCZOS)
    w, h = image.width // 8 * 8, image.height // 8 * 8
    if not (schemas.MIN_SIDE <= w <= schemas.MAX_SIDE and schemas.MIN_SIDE <= h <= schemas.MAX_SIDE):
        raise _field_error(image_field, f"is {image.width}x{image.height}: its sides, rounded down to multiples of 8, "
                                        f"must be in [{schemas.MIN_SIDE}, {schemas.MAX_SIDE}] pixels; "
                                        f"send {resize_fields} to resize it")
    return image, mask


def transparent_mask(image, name: str, *, also: str = ""):
    """OpenAI's mask convention as diffusers' (``L``: white = repaint): 255 where ``image``'s alpha is 0, else 0.
    Raises ``BodyValidationError`` naming ``name`` when ``image`` has no alpha channel or no fully transparent pixel
    (``also``: what else is missing, e.g. " and no mask was sent")."""
    has_alpha = image.mode in ("LA", "La", "PA", "RGBA", "RGBa") or "transparency" in image.info
    if not has_alpha:
        raise _field_error(name, f"has no alpha channel{also}: its fully transparent pixels (alpha 0) mark the "
                                 "region to repaint")
    mask = image.convert("RGBA").getchannel("A").point([255] + [0] * 255)
    if mask.getextrema()[1] == 0:
        raise _field_error(name, f"has no fully transparent pixel (alpha 0){also}: nothing to repaint")
    return mask


def image_body(model: type[BaseModel], **options):
    """A FastAPI dependency: the request's body as an ``ImageBody`` of ``model``, parsed, validated and decoded in a
    worker thread (``parse_image_request`` with ``options``: ``multipart_only``, ``json_only``,
    ``count_tokens_above``, ``check``). Declare the body in the route's OpenAPI with ``openapi_image_body``."""

    async def dependency(request: Request) -> ImageBody:
        body = await request.body()
        return await run_in_threadpool(
            lambda: parse_image_request(model, body, request.headers.get("content-type"), **options))

    return dependency


def openapi_image_body(model: type[BaseModel], *, multipart_only: bool = False) -> dict:
    """``openapi_extra`` for a route whose body comes from ``image_body(model)``: multipart (images as files) and,
    unless ``multipart_only``, JSON (images as base64)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    form = json.loads(json.dumps(schema))
    for name in model.image_fields:
        if name in form["properties"]:
            file = {"type": "string", "format": "binary"}
            if name in getattr(model, "image_lists", ()):  # one part per image
                file = {"type": "array", "items": file, "maxItems": schemas.MAX_CONTROL_IMAGES}
            form["properties"][name] = {**file, "description": schema["properties"][name].get("description", "")}
    content = {"multipart/form-data": {"schema": form}}
    if not multipart_only:
        content["application/json"] = {"schema": schema}
    return {"requestBody": {"required": True, "content": content}}
