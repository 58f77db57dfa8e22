"""Validation of one txt2img request, done before any denoising step (shared by the API, CLI and service)."""

from __future__ import annotations

import math
import numbers

from .errors import InvalidRequestError
from .schedulers import check_scheduler_name

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
MAX_SIDE = 8192  # pixels: 8x SD1.5's and 4x SDXL's native side (a 64x larger latent than SDXL's)
MAX_IMAGES = 64  # images per call (prompts x num_images_per_prompt); loop for more
MAX_GUIDANCE = 100.0  # guidance_scale: SD is used at 1-20 (the HTTP service takes 0-30); 1e308 overflows to Inf/NaN


def check_request(
    *,
    prompt,
    height: int,
    width: int,
    num_inference_steps: int,
    guidance_scale: float,
    num_images_per_prompt: int,
    scheduler: str | None,
    seed,
) -> list[str]:
    """Validate and normalise; returns the prompt as a list. Raises ``InvalidRequestError`` naming the field."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt) if isinstance(prompt, (list, tuple)) else None
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise InvalidRequestError("prompt", f"must be a string or a non-empty list of strings (got {type(prompt).__name__})")
    _check_text("prompt", prompts)
    height, width, num_inference_steps, num_images_per_prompt = (
        _as_int(v) for v in (height, width, num_inference_steps, num_images_per_prompt))
    for field, v in (("height", height), ("width", width)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise InvalidRequestError(field, f"must be an integer, a positive multiple of 8 (got {type(v).__name__} {v!r})")
        if v <= 0 or v % 8:
            raise InvalidRequestError(field, f"must be a positive multiple of 8 (got {v!r})")
        if v > MAX_SIDE:
            raise InvalidRequestError(field, f"must be at most {MAX_SIDE} pixels (got {v})")
    if not isinstance(num_inference_steps, int) or isinstance(num_inference_steps, bool) or num_inference_steps < 1:
        raise InvalidRequestError("num_inference_steps", f"must be an integer >= 1 (got {num_inference_steps!r})")
    if (not isinstance(guidance_scale, numbers.Real) or isinstance(guidance_scale, bool)
            or not math.isfinite(guidance_scale) or not 0 <= guidance_scale <= MAX_GUIDANCE):
        raise InvalidRequestError("guidance_scale", f"must be a number in [0, {MAX_GUIDANCE:g}] (got {guidance_scale!r})")
    if not isinstance(num_images_per_prompt, int) or isinstance(num_images_per_prompt, bool) or num_images_per_prompt < 1:
        raise InvalidRequestError("num_images_per_prompt", f"must be an integer >= 1 (got {num_images_per_prompt!r})")
    if scheduler is not None:
        if not isinstance(scheduler, str):
            raise InvalidRequestError("scheduler", f"must be a scheduler name (a string) or None, got {type(scheduler).__name__}")
        check_scheduler_name(scheduler)
    n = len(prompts) * num_images_per_prompt
    if n > MAX_IMAGES:
        raise InvalidRequestError(
            "num_images_per_prompt", f"{len(prompts)} prompt(s) x {num_images_per_prompt} = {n} images; at most "
            f"{MAX_IMAGES} per call (call again for more)")
    if isinstance(seed, (list, tuple)):
        if len(seed) != n or not all(_is_seed(_as_int(s)) for s in seed):
            raise InvalidRequestError("seed", f"a list of seeds needs {n} integers in [0, 2**63 - 1] (one per image)")
    elif seed is not None and not _is_seed(_as_int(seed), n):
        raise InvalidRequestError("seed", f"must be an integer in [0, 2**63 - {n}] (image i uses seed + i; got {seed!r})")
    return prompts


def _as_int(v):
    """numpy / other integral scalars as a Python int; anything else unchanged (rejected by the checks)."""
    return int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool) else v


def _is_seed(s, n: int = 1) -> bool:
    return isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_SEED - (n - 1)


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot go to the tokenizer, or None: it must be encodable as UTF-8 (a lone UTF-16
    surrogate, e.g. from a JSON ``"\\ud800"``, is not; the tokenizer would fail deep inside with a TypeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"is not valid Unicode text ({e.reason} at character {e.start})"
    return None


def _check_text(field: str, texts: list[str]) -> None:
    for t in texts:
        problem = text_problem(t)
        if problem:
            raise InvalidRequestError(field, problem)


def check_negative_prompt(negative_prompt, n_prompts: int) -> list[str] | None:
    """Normalise ``negative_prompt`` to None or a list of ``n_prompts`` strings (a string applies to every
    prompt). Raises ``InvalidRequestError`` (field ``negative_prompt``) on another type or length."""
    if negative_prompt is None:
        return None
    if isinstance(negative_prompt, str):
        _check_text("negative_prompt", [negative_prompt])
        return [negative_prompt] * n_prompts
    if isinstance(negative_prompt, (list, tuple)) and all(isinstance(p, str) for p in negative_prompt):
        _check_text("negative_prompt", list(negative_prompt))
        if len(negative_prompt) != n_prompts:
            raise InvalidRequestError(
                "negative_prompt", f"a list of negative prompts needs {n_prompts} strings (one per prompt), got {len(negative_prompt)}"
            )
        return list(negative_prompt)
    raise InvalidRequestError("negative_prompt", f"must be None, a string or a list of strings (got {type(negative_prompt).__name__})")


def check_long_prompt(policy: str) -> str:
    """Validate the long-prompt policy (see ``sdfast.prompts``): "chunk" or "truncate"."""
    from .prompts import POLICIES

    if policy not in POLICIES:
        raise InvalidRequestError("long_prompt", f"must be one of {', '.join(POLICIES)} (got {policy!r})")
    return policy
