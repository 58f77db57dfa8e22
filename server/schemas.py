"""Request and response bodies of the HTTP service (pydantic v2).

Every request model forbids unknown fields, so a client can never pass a model path, a file or any
other engine argument the service does not expose. Range checks live here, before a request reaches
the queue; each failure becomes a 422 whose message starts with the field's name (see
``server.app``). The limits:

- ``width``/``height``: multiples of 8 in [64, 2048] pixels (the VAE downsamples by 8; 2048 bounds memory);
- ``num_inference_steps``: [1, 150];
- ``num_images`` / ``n``: [1, 8];
- ``guidance_scale``: [0, 30] (classifier-free guidance, CFG; <= 1 runs the UNet without CFG);
- ``prompt``: non-empty, at most 1000 characters (CLIP's encoder sees 77 tokens, about 300 characters
  of English, at a time: longer text costs extra 77-token windows in every denoising step);
- ``seed``: an integer in [0, 2**32 - 1] or null (the service draws one and returns it);
- ``scheduler``: one of ``sdfast.SCHEDULERS`` or null (the model's own).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MIN_SIDE, MAX_SIDE = 64, 2048
MAX_STEPS = 150
MAX_IMAGES = 8
MAX_GUIDANCE = 30.0
MAX_PROMPT_CHARS = 1000
MAX_SEED = 2**32 - 1
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


class Txt2ImgRequest(BaseModel):
    """``POST /v1/txt2img``. Defaults: the model's native size, 30 steps, guidance 7.5, a random seed."""

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

    _prompt = field_validator("prompt")(staticmethod(check_prompt))
    _negative = field_validator("negative_prompt")(staticmethod(check_text))

    _scheduler = field_validator("scheduler")(staticmethod(check_scheduler))

    _sides = field_validator("width", "height")(staticmethod(check_side))

    _steps = field_validator("num_inference_steps")(staticmethod(check_steps))
    _guidance = field_validator("guidance_scale")(staticmethod(check_guidance))
    _num_images = field_validator("num_images")(staticmethod(check_images))
    _seed = field_validator("seed")(staticmethod(check_seed))


_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


class ImagesGenerationsRequest(BaseModel):
    """``POST /v1/images/generations``: the OpenAI Images API request.

    ``model``, ``user``, ``quality`` and ``style`` are accepted so that OpenAI clients work unchanged,
    and ignored: the service serves the one model it was started with and never opens a path a client
    names; its images have one quality and no style presets.
    ``response_format`` ``url`` is refused (the service stores no files). sdfast extensions, all
    optional: ``negative_prompt``, ``num_inference_steps``, ``guidance_scale``, ``seed`` (as in
    ``Txt2ImgRequest``).
    """

    model_config = ConfigDict(extra="forbid")

    prompt: str
    n: int = Field(1, strict=True, description="images, 1 to 8")
    size: str | None = Field(None, description="'WIDTHxHEIGHT', e.g. '512x512'; default: the model's native size")
    response_format: str = Field("b64_json", description="only 'b64_json'")
    model: str | None = Field(None, description="ignored (OpenAI compatibility)")
    user: str | None = Field(None, description="ignored (OpenAI compatibility)")
    quality: str | None = Field(None, max_length=32, description="ignored (OpenAI compatibility)")
    style: str | None = Field(None, max_length=32, description="ignored (OpenAI compatibility)")
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description="sdfast extension")
    num_inference_steps: int = Field(30, strict=True, description="sdfast extension: 1 to 150")
    guidance_scale: float = Field(7.5, strict=True, description="sdfast extension: 0 to 30")
    seed: int | None = Field(None, strict=True, description="sdfast extension: image i uses seed + i")

    _prompt = field_validator("prompt")(staticmethod(check_prompt))
    _negative = field_validator("negative_prompt")(staticmethod(check_text))

    _steps = field_validator("num_inference_steps")(staticmethod(check_steps))
    _guidance = field_validator("guidance_scale")(staticmethod(check_guidance))
    _seed = field_validator("seed")(staticmethod(check_seed))

    _n = field_validator("n")(staticmethod(check_images))

    @field_validator("size")
    @classmethod
    def _size(cls, v):
        if v is None:
            return v
        m = _SIZE.match(v)
        if not m:
            raise ValueError(f"must look like 'WIDTHxHEIGHT', e.g. '512x512' (got {v!r})")
        for side in (int(m[1]), int(m[2])):
            check_side(side)
        return f"{int(m[1])}x{int(m[2])}"

    @field_validator("response_format")
    @classmethod
    def _format(cls, v):
        if v != "b64_json":
            raise ValueError(f"only 'b64_json' is supported (got {v!r}); 'url' is not: this service stores no files")
        return v

    def dimensions(self) -> tuple[int | None, int | None]:
        """(width, height) in pixels, or (None, None) for the model's default."""
        if self.size is None:
            return None, None
        w, h = self.size.split("x")
        return int(w), int(h)


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
    b64_json: str


class ImagesGenerationsResponse(BaseModel):
    created: int
    data: list[OpenAIImage]


class Health(BaseModel):
    status: Literal["ok", "degraded"]
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
