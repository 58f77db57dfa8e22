"""Request and response bodies of the HTTP service (pydantic v2).

Every request model forbids unknown fields, so a client can never pass a model path, a file or any
other engine argument the service does not expose. Range checks live here, before a request reaches
the queue; each failure becomes a 422 whose message starts with the field's name (see
``server.app``). The limits are a subset of the engine's (``sdfast.request``: ``MIN_SIDE``, ``MAX_SIDE``,
``MAX_IMAGES``, ``MAX_GUIDANCE``, ``MAX_SEED``; the scheduler's step limit): each is one of the service's
settings below (``SERVICE_*``), checked at import to be within the engine's, so a request these schemas
accept always builds an ``sdfast.request.Txt2ImgRequest`` (``server.app``) without another error. The limits:

- ``width``/``height``: multiples of 8 in [64, 2048] pixels (the VAE downsamples by 8; 2048 bounds memory);
- ``num_inference_steps``: [1, 150];
- ``num_images`` / ``n``: [1, 8];
- ``guidance_scale``: [0, 30] (classifier-free guidance, CFG; <= 1 runs the UNet without CFG);
- ``prompt``: non-empty, at most 1000 characters (CLIP's encoder sees 77 tokens, about 300 characters
  of English, at a time: longer text costs extra 77-token windows in every denoising step);
- ``seed``: an integer in [0, 2**32 - 1] or null (the service draws one and returns it); image i uses
  seed + i, so with n images the seed is at most 2**32 - n (checked by ``server.app``: every seed the
  service returns is one it accepts);
- ``scheduler``: one of ``sdfast.SCHEDULERS`` or null (the model's own);
- ``cache_interval`` (DeepCache): [1, ``SERVICE_MAX_CACHE_INTERVAL``] (1, the default: the exact pipeline);
  ``cache_branch``: [0, ``SERVICE_MAX_CACHE_BRANCH``], and below the model's UNet skip tensors (checked by
  ``server.app`` before the request is queued: SD 1.x/2.x 0-11, SDXL 0-8);
- ``output_compression`` (OpenAI endpoint): [0, 100];
- ``strength`` (img2img, inpainting): in (0, 1] (the engine's range), and ``int(num_inference_steps * strength)``
  at least 1 (checked when the engine's request is built);
- ControlNet (a service started with ``--controlnet``): ``control_image``, one image per ControlNet (a list for
  several, at most ``MAX_CONTROL_IMAGES``), uploaded as the other images; ``controlnet_conditioning_scale`` in
  [0, ``MAX_CONTROLNET_SCALE``] and ``control_guidance_start`` / ``control_guidance_end`` in [0, 1], each one number or
  one per control image (the engine's ranges, ``sdfast.request.check_control``, which also checks the counts and
  start < end when the request is built, before it is queued);
- uploaded images (``image``, ``mask_image``, ``mask``, ``control_image``): PNG, JPEG or WebP files of at most ``MAX_UPLOAD_PIXELS``
  pixels (4096 x 4096) and sides of at most ``MAX_UPLOAD_SIDE`` (the engine's ``MAX_SIDE``), read from the file's
  header before any pixel is decoded; 8-bit modes only (``UPLOAD_MODES``); the image the engine gets (resized, or
  its own size rounded down to multiples of 8) has sides in [64, 2048] like ``width``/``height``. A request body
  with images may be ``MAX_UPLOAD_BYTES`` (32 MiB) long (other endpoints: 1 MiB); longer is a 413.

Numbers: a JSON integer of more than ``MAX_INT_DIGITS`` digits is out of every range above; the body parser
(``server.parse``) turns it into an ``OversizedInt``, refused naming its field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationInfo, WithJsonSchema, field_validator

from sdfast import request as engine_limits

# The service's own settings: each tightens one of the engine's limits (``sdfast.request``).
SERVICE_MIN_SIDE, SERVICE_MAX_SIDE = 64, 2048  # 2048 bounds a request's memory; 64: below it SD draws nothing useful
SERVICE_MAX_STEPS = 150  # the schedulers take up to 999 (LCM 50, checked by the service against the model's)
SERVICE_MAX_IMAGES = 8  # per request; the worker's --max-batch bounds one engine call too
SERVICE_MAX_GUIDANCE = 30.0  # SD is used at 1-20
SERVICE_MAX_SEED = 2**32 - 1  # a 32-bit seed, as most SD front ends take
SERVICE_MAX_CACHE_INTERVAL = 20  # DeepCache: the paper's schedules use 2-20; the engine takes up to 1000
SERVICE_MAX_CACHE_BRANCH = 11  # DeepCache: SD 1.x/2.x UNets have skip branches 0-11, SDXL 0-8


def _within(name: str, service: float, lowest: float, highest: float) -> float:
    """``service`` when it lies in the engine's [lowest, highest]; else ``ValueError`` at import: a looser service
    limit would let a request through the schema that the engine then refuses."""
    if not lowest <= service <= highest:
        raise ValueError(f"server.schemas: {name} = {service} is outside the engine's [{lowest}, {highest}] "
                         "(sdfast.request); a service limit may only tighten the engine's")
    return service


MIN_SIDE = _within("SERVICE_MIN_SIDE", SERVICE_MIN_SIDE, engine_limits.MIN_SIDE, engine_limits.MAX_SIDE)
MAX_SIDE = _within("SERVICE_MAX_SIDE", SERVICE_MAX_SIDE, MIN_SIDE, engine_limits.MAX_SIDE)
MAX_STEPS = SERVICE_MAX_STEPS  # the engine's bound is the scheduler's: ``server.app`` checks it before queueing
MAX_IMAGES = _within("SERVICE_MAX_IMAGES", SERVICE_MAX_IMAGES, 1, engine_limits.MAX_IMAGES)
MAX_GUIDANCE = _within("SERVICE_MAX_GUIDANCE", SERVICE_MAX_GUIDANCE, 0.0, engine_limits.MAX_GUIDANCE)
MAX_SEED = _within("SERVICE_MAX_SEED", SERVICE_MAX_SEED, 0, engine_limits.MAX_SEED)
MAX_CACHE_INTERVAL = _within("SERVICE_MAX_CACHE_INTERVAL", SERVICE_MAX_CACHE_INTERVAL, 1,
                             engine_limits.MAX_CACHE_INTERVAL)
MAX_CACHE_BRANCH = _within("SERVICE_MAX_CACHE_BRANCH", SERVICE_MAX_CACHE_BRANCH, 0, engine_limits.MAX_CACHE_BRANCH)
SERVICE_MAX_UPLOAD_PIXELS = 4096 * 4096  # an uploaded image, before resizing: 64 MiB as RGBA, a 12-megapixel photo fits
MAX_UPLOAD_PIXELS = _within("SERVICE_MAX_UPLOAD_PIXELS", SERVICE_MAX_UPLOAD_PIXELS, MAX_SIDE**2, engine_limits.MAX_SIDE**2)
MAX_UPLOAD_SIDE = engine_limits.MAX_SIDE  # an uploaded image's longest side (a 8192 x 2048 panorama fits)
MAX_UPLOAD_BYTES = 32 << 20  # a body with images: a 2048 x 2048 photo as PNG or base64 JPEG, and a mask
UPLOAD_FORMATS = ("PNG", "JPEG", "WEBP")  # the decoders an upload may reach (PIL knows dozens more)
# 8-bit modes, converted to RGB (images) or L (masks) as the engine does; 16-bit ("I;16", "I") and float ("F")
# images are refused: PIL's conversion clips them to 8 bits, a silently wrong picture.
UPLOAD_MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr")
SERVICE_MAX_CONTROLNETS = 8  # control images per request (the service's ControlNets bound it further)
MAX_CONTROL_IMAGES = _within("SERVICE_MAX_CONTROLNETS", SERVICE_MAX_CONTROLNETS, 1, engine_limits.MAX_CONTROLNETS)
MAX_CONTROLNET_SCALE = engine_limits.MAX_CONTROLNET_SCALE  # controlnet_conditioning_scale: used at 0-2
MAX_PROMPT_CHARS = 1000  # the engine takes any length (in 77-token windows); this bounds a request's work
MAX_INT_DIGITS = 20  # every integer field's range is far below 10**20
# Why the prompt limit exists, quoted in the 422 message.
PROMPT_LIMIT_WHY = (
    "CLIP's text encoder sees 77 tokens (about 300 characters of English) at a time, so longer text is "
    "encoded in extra 77-token windows that slow every step; 1000 characters bounds that"
)


def check_side(v: int | None) -> int | None:
    if v is None:
        return v
    if v % 8 or not MIN_SIDE <= v <= MAX_SIDE:
        raise ValueError(f"must be a multiple of 8 in [{MIN_SIDE}, {MAX_SIDE}] pixels (got {v})")
    return v


def check_text(v: str | None) -> str | None:
    """Text the tokenizer can take (``sdfast.request.text_problem``)."""
    from sdfast.request import text_problem

    problem = None if v is None else text_problem(v)
    if problem:
        raise ValueError(problem)
    return v


def check_prompt(v: str) -> str:
    if not v.strip():
        raise ValueError("must be a non-empty string")
    if len(v) > MAX_PROMPT_CHARS:
        raise ValueError(f"must be at most {MAX_PROMPT_CHARS} characters (got {len(v)}): {PROMPT_LIMIT_WHY}")
    return check_text(v)


def check_scheduler(v: str | None) -> str | None:
    from sdfast.schedulers import SCHEDULERS

    if v is not None and v not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {v!r}; known: {', '.join(sorted(SCHEDULERS))}")
    return v


class OversizedInt:
    """A JSON integer with more than ``MAX_INT_DIGITS`` digits, kept as its digit count: converting it to an
    ``int`` costs time quadratic in its length (Python refuses past 4300 digits), and no field takes it."""

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"a {self.digits}-digit integer"


def _in_range(v, lo, hi, what: str):
    if not lo <= v <= hi:
        raise ValueError(f"must be {what} in [{lo}, {hi}] (got {v})")
    return v


def check_steps(v: int) -> int:
    return _in_range(v, 1, MAX_STEPS, "an integer")


def check_guidance(v: float) -> float:
    if v != v:
        raise ValueError("must be a number, not NaN")
    return _in_range(v, 0.0, MAX_GUIDANCE, "a number")


def check_images(v: int) -> int:
    return _in_range(v, 1, MAX_IMAGES, "an integer")


def check_seed(v: int | None) -> int | None:
    return v if v is None else _in_range(v, 0, MAX_SEED, "an integer")


def check_cache_interval(v: int) -> int:
    return _in_range(v, 1, MAX_CACHE_INTERVAL, "an integer")


def check_cache_branch(v: int) -> int:
    return _in_range(v, 0, MAX_CACHE_BRANCH, "an integer")


CACHE_INTERVAL_DOC = (f"DeepCache, 1 to {MAX_CACHE_INTERVAL}: the full UNet runs every cache_interval-th step, the "
                      "steps between only its shallow branch on the cached deep features (faster; the image changes "
                      "a little); 1 (default): the exact pipeline")
CACHE_BRANCH_DOC = (f"DeepCache's skip branch, 0 to {MAX_CACHE_BRANCH} and below the number of the model's UNet skip "
                    "connections (SD 1.x/2.x: 0-11, SDXL: 0-8): the shallow steps run the skip connections 0 to "
                    "cache_branch; 0 (default): the shallowest and fastest")


def check_strength(v: float) -> float:
    """The engine's range, (0, 1] (``sdfast.request.Img2ImgRequest``)."""
    if not 0 < v <= 1:  # NaN fails too
        raise ValueError(f"must be a number in (0, 1] (got {v}): the fraction of the schedule the image is noised to")
    return v


# -- ControlNet fields (every generation endpoint) ---------------------------------------------------

CONTROL_VALUE_FIELDS = ("controlnet_conditioning_scale", "control_guidance_start", "control_guidance_end")
CONTROL_FIELDS = ("control_image", *CONTROL_VALUE_FIELDS)


def _check_control_image(v):
    """``control_image`` as the model sees it: ``server.parse`` has put a placeholder (``UPLOAD``) in place of each
    uploaded image; one string, or a list of 1 to ``MAX_CONTROL_IMAGES`` of them."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        if not 1 <= len(v) <= MAX_CONTROL_IMAGES:
            raise ValueError(f"1 to {MAX_CONTROL_IMAGES} control images, one per ControlNet (got {len(v)})")
        return v
    raise ValueError("must be an image (JSON: base64 or a data URL; multipart: a file), or a list of them, one per "
                     "ControlNet")


def _per_controlnet(lo: float, hi: float, *, nullable: bool):
    """The validator of a per-ControlNet number: one number (for every ControlNet) or a list of 1 to
    ``MAX_CONTROL_IMAGES`` (one per control image), each in [lo, hi] (so finite); null (when ``nullable``) for the
    engine's default.
    JSON: numbers only (no strings, no booleans). multipart/form-data (``model_validate_strings``): the text of a
    number, or numbers separated by commas (``server.parse`` joins a field's repeated parts so)."""

    def check(v, info: ValidationInfo):
        if v is None and nullable:
            return None
        many = isinstance(v, list)
        values = v if many else [v]
        if info.mode != "python" and isinstance(v, str):  # a form field's text
            many = "," in v
            try:
                values = [float(x) for x in v.split(",")]
            except ValueError:
                raise ValueError(f"must be a number, or numbers separated by commas, one per control image "
                                 f"(got {v[:40]!r})") from None
        if many and not 1 <= len(values) <= MAX_CONTROL_IMAGES:
            raise ValueError(f"a list of 1 to {MAX_CONTROL_IMAGES} numbers, one per control image (got {len(values)})")
        for x in values:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not lo <= x <= hi:  # NaN and inf too
                raise ValueError(f"must be a number in [{lo:g}, {hi:g}], or a list of one per control image "
                                 f"(got {x!r})")
        values = [float(x) for x in values]
        return values if many else values[0]

    return check


def _per_controlnet_schema(lo: float, hi: float, *, nullable: bool) -> dict:
    number = {"type": "number", "minimum": lo, "maximum": hi}
    return {"anyOf": [number, {"type": "array", "items": number, "minItems": 1, "maxItems": MAX_CONTROL_IMAGES},
                      *([{"type": "null"}] if nullable else [])]}


ControlImage = Annotated[Any, PlainValidator(_check_control_image), WithJsonSchema({"anyOf": [
    {"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_CONTROL_IMAGES},
    {"type": "null"}]})]
ControlScale = Annotated[Any, PlainValidator(_per_controlnet(0.0, MAX_CONTROLNET_SCALE, nullable=True)),
                         WithJsonSchema(_per_controlnet_schema(0.0, MAX_CONTROLNET_SCALE, nullable=True))]
ControlFraction = Annotated[Any, PlainValidator(_per_controlnet(0.0, 1.0, nullable=False)),
                            WithJsonSchema(_per_controlnet_schema(0.0, 1.0, nullable=False))]

CONTROL_IMAGE_DOC = ("ControlNet (a service started with --controlnet; required there, refused elsewhere): one control "
                     "image per ControlNet, in their order, a list for several. JSON: base64 or a data URL; "
                     "multipart/form-data: a file (repeat the part for several). PNG, JPEG or WebP; without width and "
                     "height (txt2img), the images come at the first one's size rounded down to multiples of 8")
CONTROL_SCALE_DOC = (f"ControlNet: each ControlNet's residuals are multiplied by it, 0 to {MAX_CONTROLNET_SCALE:g}: "
                     "one number, or one per control image (multipart: repeat the field, or separate by commas); "
                     "null: diffusers' default for the task (txt2img 1.0, img2img 0.8, SD inpainting 0.5)")
CONTROL_START_DOC = ("ControlNet: the fraction of the denoising steps before the ControlNets apply, 0 to 1 (one number "
                     "or one per control image)")
CONTROL_END_DOC = ("ControlNet: the fraction of the denoising steps after which the ControlNets stop, 0 to 1, above "
                   "control_guidance_start (one number or one per control image)")


class Txt2ImgRequest(BaseModel):
    """``POST /v1/txt2img``, as JSON or (for control images as files) ``multipart/form-data``. Defaults: the model's
    native size (with a control image, its size rounded down to multiples of 8), 30 steps, guidance 7.5, a random
    seed. The ControlNet fields (``CONTROL_FIELDS``) are every generation endpoint's."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(description="what to draw; 1 to 1000 characters")
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description="what to avoid (CFG)")
    num_inference_steps: int = Field(30, strict=True, description="denoising steps, 1 to 150")
    guidance_scale: float = Field(7.5, strict=True, description="CFG weight, 0 to 30")
    width: int | None = Field(None, strict=True, description="pixels, a multiple of 8 in [64, 2048]; default: native")
    height: int | None = Field(None, strict=True, description="pixels, a multiple of 8 in [64, 2048]; default: native")
    seed: int | None = Field(None, strict=True, description="0 to 2**32-1; image i uses seed + i; null: random")
    num_images: int = Field(1, strict=True, description="images for this prompt, 1 to 8")
    scheduler: str | None = Field(None, description="a name from sdfast.SCHEDULERS; default: the model's")
    response_format: Literal["png", "b64_json"] = Field(
        "png", description="png: the image itself (num_images must be 1); b64_json: JSON with every image"
    )
    # response_format 'png' with num_images > 1 is refused by the endpoint (422 naming num_images).
    control_image: ControlImage = Field(None, description=CONTROL_IMAGE_DOC)
    controlnet_conditioning_scale: ControlScale = Field(None, description=CONTROL_SCALE_DOC)
    control_guidance_start: ControlFraction = Field(0.0, description=CONTROL_START_DOC)
    control_guidance_end: ControlFraction = Field(1.0, description=CONTROL_END_DOC)
    cache_interval: int = Field(1, strict=True, description=CACHE_INTERVAL_DOC)
    cache_branch: int = Field(0, strict=True, description=CACHE_BRANCH_DOC)

    # The uploads, decoded by ``server.parse``: each a file, a list of files for ``image_lists``; ``list_fields``
    # may be repeated in a multipart body (one value per control image).
    image_fields: ClassVar[tuple[str, ...]] = ("control_image",)
    image_lists: ClassVar[tuple[str, ...]] = ("control_image",)
    list_fields: ClassVar[tuple[str, ...]] = CONTROL_VALUE_FIELDS

    _prompt = field_validator("prompt")(staticmethod(check_prompt))
    _negative = field_validator("negative_prompt")(staticmethod(check_text))

    _scheduler = field_validator("scheduler")(staticmethod(check_scheduler))

    _sides = field_validator("width", "height")(staticmethod(check_side))

    _steps = field_validator("num_inference_steps")(staticmethod(check_steps))
    _guidance = field_validator("guidance_scale")(staticmethod(check_guidance))
    _num_images = field_validator("num_images")(staticmethod(check_images))
    _seed = field_validator("seed")(staticmethod(check_seed))
    _cache_interval = field_validator("cache_interval")(staticmethod(check_cache_interval))
    _cache_branch = field_validator("cache_branch")(staticmethod(check_cache_branch))


IMAGE_INPUT = ("JSON: the file as base64 or a data URL (data:image/png;base64,...); multipart/form-data: the file. "
               f"PNG, JPEG or WebP, at most {MAX_UPLOAD_PIXELS} pixels")


class Img2ImgRequest(Txt2ImgRequest):
    """``POST /v1/img2img``, as JSON or as ``multipart/form-data``: ``Txt2ImgRequest``'s fields, the init ``image``
    and ``strength``. The images come back at ``width`` x ``height``: the image is resized to them first (a side
    left out keeps the image's); by default the image's own size rounded down to multiples of 8 (diffusers' image
    processor resizes it to that)."""

    image: str = Field(description="the init image; " + IMAGE_INPUT)
    strength: float = Field(0.8, strict=True, description="how far into the schedule the image is noised, in (0, 1]; "
                            "int(num_inference_steps * strength) steps run")
    width: int | None = Field(None, strict=True, description="pixels, a multiple of 8 in [64, 2048]: the image is "
                              "resized to it; default: the image's width rounded down to a multiple of 8")
    height: int | None = Field(None, strict=True, description="pixels, a multiple of 8 in [64, 2048]: the image is "
                               "resized to it; default: the image's height rounded down to a multiple of 8")

    _strength = field_validator("strength")(staticmethod(check_strength))

    image_fields: ClassVar[tuple[str, ...]] = ("image", "control_image")


class InpaintRequest(Img2ImgRequest):
    """``POST /v1/inpaint``: ``Img2ImgRequest``'s fields and ``mask_image`` (diffusers' convention: white is
    repainted, black kept; any mode is converted to L, grey levels are binarized at 50 %), of the image's size
    (both are resized together)."""

    mask_image: str = Field(description="white = repaint, black = keep; the image's size; " + IMAGE_INPUT)
    strength: float = Field(1.0, strict=True, description="how far into the schedule the masked part is noised, in "
                            "(0, 1]; 1: it starts from pure noise")

    _strength = field_validator("strength")(staticmethod(check_strength))

    image_fields: ClassVar[tuple[str, ...]] = ("image", "mask_image", "control_image")


_SIZE = re.compile(r"^ *([0-9]+) *[xX] *([0-9]+) *$")  # ASCII digits only: "６４x６４" is not a size


QUALITIES = ("auto", "low", "medium", "high", "xhigh", "max", "standard", "hd")
OUTPUT_FORMATS = ("png", "jpeg", "webp")


def _must_be_absent(v, why: str):
    """For an OpenAI parameter whose only value this service can honour is null (or false, or 0)."""
    if v not in (None, False, 0):
        raise ValueError(why)
    return v


class ImagesGenerationsRequest(BaseModel):
    """``POST /v1/images/generations``: the OpenAI Images API request (DALL-E's and the GPT image models').

    Honoured: ``prompt``, ``n``, ``size`` (``WIDTHxHEIGHT``, or ``auto``: the model's native size),
    ``output_format`` (png, jpeg, webp), ``output_compression`` (the jpeg/webp encoder's quality, 0 to 100,
    default 100; PNG is lossless, so it leaves PNG unchanged), ``background`` ``auto``/``opaque`` (every
    image is opaque).

    Accepted and ignored, so that OpenAI clients work unchanged: ``model`` (the service serves the one
    model it was started with and never opens a path a client names), ``quality`` (the work per image is
    ``num_inference_steps``), ``style``, ``moderation`` (the service does no moderation), ``complexity``,
    ``user``, ``safety_identifier``.

    Refused with a 422 saying why: ``background: "transparent"`` (Stable Diffusion makes no alpha channel),
    ``response_format: "url"`` (the service stores no files), ``stream: true`` and ``partial_images`` > 0
    (no streaming), ``output_format`` gif/svg and the parameters that go with them.

    sdfast extensions, all optional: ``negative_prompt``, ``num_inference_steps``, ``guidance_scale``,
    ``seed`` and, on a service with ControlNets, ``control_image`` (base64 or a data URL, a list for several; a
    size left out or ``auto``: the first control image's size rounded down to multiples of 8),
    ``controlnet_conditioning_scale``, ``control_guidance_start``, ``control_guidance_end``, and DeepCache's
    ``cache_interval`` / ``cache_branch`` (as in ``Txt2ImgRequest``; OpenAI has no such fields).
    """

    model_config = ConfigDict(extra="forbid")

    prompt: str
    n: int = Field(1, strict=True, description="images, 1 to 8")
    size: str | None = Field(
        None, description="'WIDTHxHEIGHT', e.g. '512x512', or 'auto'; default (and 'auto'): the model's native size")
    response_format: str | None = Field("b64_json", description="only 'b64_json' (the default)")
    output_format: str | None = Field("png", description="png (default), jpeg or webp")
    output_compression: int | None = Field(
        None, strict=True, description="jpeg/webp quality, 0 to 100; default 100; no effect on png")
    background: str | None = Field(None, description="'auto' or 'opaque'; 'transparent' is refused (no alpha)")
    model: str | None = Field(None, description="ignored (OpenAI compatibility)")
    quality: str | None = Field(None, description=f"ignored (OpenAI compatibility): one of {', '.join(QUALITIES)}")
    style: Literal["vivid", "natural"] | None = Field(None, description="ignored (OpenAI compatibility)")
    moderation: Literal["auto", "low"] | None = Field(None, description="ignored: the service does no moderation")
    complexity: Literal["low", "medium", "high"] | None = Field(None, description="ignored (OpenAI compatibility)")
    user: str | None = Field(None, max_length=256, description="ignored (OpenAI compatibility)")
    safety_identifier: str | None = Field(None, max_length=256, description="ignored (OpenAI compatibility)")
    stream: bool | None = Field(None, description="only false: streaming is not supported")
    partial_images: int | None = Field(None, description="only 0: partial images need streaming, not supported")
    frame_count: int | None = Field(None, description="refused: GIF output is not supported")
    frame_duration_ms: int | None = Field(None, description="refused: GIF output is not supported")
    svg: dict | None = Field(None, description="refused: SVG output is not supported")
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description="sdfast extension")
    num_inference_steps: int = Field(30, strict=True, description="sdfast extension: 1 to 150")
    guidance_scale: float = Field(7.5, strict=True, description="sdfast extension: 0 to 30")
    seed: int | None = Field(None, strict=True, description="sdfast extension: image i uses seed + i")
    control_image: ControlImage = Field(None, description="sdfast extension: " + CONTROL_IMAGE_DOC)
    controlnet_conditioning_scale: ControlScale = Field(None, description="sdfast extension: " + CONTROL_SCALE_DOC)
    control_guidance_start: ControlFraction = Field(0.0, description="sdfast extension: " + CONTROL_START_DOC)
    control_guidance_end: ControlFraction = Field(1.0, description="sdfast extension: " + CONTROL_END_DOC)
    cache_interval: int = Field(1, strict=True, description="sdfast extension: " + CACHE_INTERVAL_DOC)
    cache_branch: int = Field(0, strict=True, description="sdfast extension: " + CACHE_BRANCH_DOC)

    image_fields: ClassVar[tuple[str, ...]] = ("control_image",)
    image_lists: ClassVar[tuple[str, ...]] = ("control_image",)
    list_fields: ClassVar[tuple[str, ...]] = CONTROL_VALUE_FIELDS

    _prompt = field_validator("prompt")(staticmethod(check_prompt))
    _negative = field_validator("negative_prompt")(staticmethod(check_text))

    _steps = field_validator("num_inference_steps")(staticmethod(check_steps))
    _guidance = field_validator("guidance_scale")(staticmethod(check_guidance))
    _seed = field_validator("seed")(staticmethod(check_seed))
    _cache_interval = field_validator("cache_interval")(staticmethod(check_cache_interval))
    _cache_branch = field_validator("cache_branch")(staticmethod(check_cache_branch))

    _n = field_validator("n")(staticmethod(check_images))

    @field_validator("size")
    @classmethod
    def _size(cls, v):
        if v is None or v == "auto":
            return None
        m = _SIZE.fullmatch(v)
        if not m:
            raise ValueError(f"must look like 'WIDTHxHEIGHT' (ASCII digits), e.g. '512x512', or 'auto' (got {v!r})")
        for side in (int(m[1]), int(m[2])):
            check_side(side)
        return f"{int(m[1])}x{int(m[2])}"

    @field_validator("response_format")
    @classmethod
    def _format(cls, v):
        if v is not None and v != "b64_json":
            raise ValueError(f"only 'b64_json' is supported (got {v!r}); 'url' is not: this service stores no files")
        return v

    @field_validator("output_format")
    @classmethod
    def _output_format(cls, v):
        if v is not None and v not in OUTPUT_FORMATS:
            raise ValueError(f"must be one of {', '.join(OUTPUT_FORMATS)} (got {v!r}): the service encodes still "
                             "raster images only")
        return v

    @field_validator("output_compression")
    @classmethod
    def _compression(cls, v):
        return v if v is None else _in_range(v, 0, 100, "an integer")

    @field_validator("background")
    @classmethod
    def _background(cls, v):
        if v == "transparent":
            raise ValueError("'transparent' is not supported: Stable Diffusion makes opaque RGB images (no alpha "
                             "channel); use 'auto' or 'opaque'")
        if v not in (None, "auto", "opaque"):
            raise ValueError(f"must be 'auto' or 'opaque' (got {v!r})")
        return v

    @field_validator("quality")
    @classmethod
    def _quality(cls, v):
        if v is not None and v not in QUALITIES:
            raise ValueError(f"must be one of {', '.join(QUALITIES)} (got {v!r}); it is ignored: "
                             "num_inference_steps sets the work per image")
        return v

    @field_validator("stream")
    @classmethod
    def _stream(cls, v):
        return _must_be_absent(v, "streaming is not supported: the images come in one response; send stream: false "
                                  "or leave it out")

    @field_validator("partial_images")
    @classmethod
    def _partial(cls, v):
        return _must_be_absent(v, "partial images are not supported: they need streaming, which this service does not "
                                  "do; send 0 or leave it out")

    @field_validator("frame_count", "frame_duration_ms")
    @classmethod
    def _gif(cls, v):
        return _must_be_absent(v, "GIF output is not supported (output_format: png, jpeg or webp)")

    @field_validator("svg")
    @classmethod
    def _svg(cls, v):
        return _must_be_absent(v, "SVG output is not supported (output_format: png, jpeg or webp)")

    def dimensions(self) -> tuple[int | None, int | None]:
        """(width, height) in pixels, or (None, None) for the model's default."""
        if self.size is None:
            return None, None
        w, h = self.size.split("x")
        return int(w), int(h)

    @property
    def image_format(self) -> str:
        return self.output_format or "png"

    @property
    def image_quality(self) -> int | None:
        """``sdfast.png.encode_image``'s quality: None for PNG (lossless), else ``output_compression`` (default 100)."""
        if self.image_format == "png":
            return None
        return 100 if self.output_compression is None else self.output_compression


class ImagesEditsRequest(ImagesGenerationsRequest):
    """``POST /v1/images/edits``: the OpenAI Images API edit request, ``multipart/form-data`` (as the official
    client sends it). It runs inpainting: OpenAI's mask convention, the fully transparent pixels (alpha 0) of
    ``mask`` (a PNG with an alpha channel, the image's size) are repainted, the others kept; without ``mask``, the
    image's own fully transparent pixels are the mask. An image with no fully transparent pixel and no mask is
    refused (422 naming ``image``), as OpenAI refuses it: there is nothing to edit. ``image`` is one file (the
    client's ``image`` or a one-element ``image[]``; several images are refused). ``size`` (``WIDTHxHEIGHT``)
    resizes the image and mask to it; ``auto`` or none: the image's size rounded down to multiples of 8.

    The other fields are ``ImagesGenerationsRequest``'s, honoured, ignored or refused as there; ``input_fidelity``
    is accepted and ignored; ``markup`` is refused. sdfast extensions: ``strength`` (default 1.0) and the ControlNet
    fields (``control_image`` files, repeated for several)."""

    image: str = Field(description="the image to edit: a PNG, JPEG or WebP file (one)")
    mask: str | None = Field(None, description="a PNG whose fully transparent pixels (alpha 0) mark what to repaint")
    strength: float = Field(1.0, strict=True, description="sdfast extension: (0, 1], how far the masked part is noised")
    input_fidelity: Literal["high", "low"] | None = Field(None, description="ignored (OpenAI compatibility)")
    markup: str | None = Field(None, description="refused: use mask")

    _strength = field_validator("strength")(staticmethod(check_strength))

    @field_validator("markup")
    @classmethod
    def _markup(cls, v):
        return _must_be_absent(v, "markup images are not supported: send a mask whose fully transparent pixels mark "
                                  "what to repaint")

    image_fields: ClassVar[tuple[str, ...]] = ("image", "mask", "markup", "control_image")


class Timings(BaseModel):
    """Seconds: ``queue_s`` waiting for the worker, ``generate_s`` the engine call (shared by the
    batch), ``total_s`` from arrival to answer; ``batch_images`` images in that engine call."""

    queue_s: float
    generate_s: float
    total_s: float
    batch_images: int


class ImageOut(BaseModel):
    b64_json: str = Field(description="the PNG file, base64")
    seed: int
    width: int
    height: int


class Txt2ImgResponse(BaseModel):
    images: list[ImageOut]
    timings: Timings
    model: str


class OpenAIImage(BaseModel):
    b64_json: str = Field(description="the image file (output_format), base64")


class ImagesGenerationsResponse(BaseModel):
    created: int
    data: list[OpenAIImage]
    output_format: str
    size: str
    background: Literal["opaque"] = "opaque"


class HealthStatus(BaseModel):
    """What ``/health`` tells a client without the API key (when one is set)."""

    status: Literal["ok", "degraded"]


class Health(HealthStatus):
    """``/health`` without an API key set, or with the key."""

    model: str
    model_loaded: bool
    device: str
    gpu: str | None
    dtype: str
    default_size: int
    queue_depth: int
    queue_size: int
    max_batch: int
    busy: bool
    worker_alive: bool
    schedulers: list[str]
    controlnets: list[str] = Field(description="the ControlNets loaded, in the order requests give their control "
                                               "images ([] for none)")
    tasks: list[str] = Field(description="what the model runs: txt2img, img2img and inpaint, or inpaint alone (an "
                             "inpainting checkpoint: /v1/inpaint and /v1/images/edits)")
    batching: str = Field(default="static", description="continuous (requests join and leave the running batch at "
                          "denoising steps) or static (a batch of compatible requests runs to completion)")
    in_flight_images: int = Field(default=0, description="images being denoised now (continuous batching)")
