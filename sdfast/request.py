"""One txt2img request: ``Txt2ImgRequest``, validated once by its one constructor (``build``), before any
denoising step, and carried as it is from the Python API, the CLI or the HTTP service to ``Engine.run``.

The limits here are the engine's. The HTTP service (``server.schemas``) takes these constants and only tightens
them (smaller images, fewer steps and images, 32-bit seeds, shorter prompts), so every request its schemas accept
builds here without an error.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import TYPE_CHECKING

from .errors import InvalidRequestError
from .schedulers import check_scheduler_name

if TYPE_CHECKING:
    from .prompts import PromptTokens

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
MIN_SIDE = 8  # pixels: the VAE downsamples by 8, so a side is a positive multiple of 8
MAX_SIDE = 8192  # pixels: 8x SD1.5's and 4x SDXL's native side (a 64x larger latent than SDXL's)
MAX_IMAGES = 64  # images per call (prompts x num_images_per_prompt); loop for more
MAX_GUIDANCE = 100.0  # guidance_scale: SD is used at 1-20 (the HTTP service takes 0-30); 1e308 overflows to Inf/NaN
MAX_CONTROLNETS = 8  # control images per request (one per ControlNet of a multi-ControlNet)
MAX_CONTROLNET_SCALE = 10.0  # controlnet_conditioning_scale: used at 0-2; the residuals are multiplied by it
MAX_CACHE_INTERVAL = 1000  # DeepCache's cache_interval: 1 (exact) to past the longest schedule (999 steps)
MAX_CACHE_BRANCH = 15  # DeepCache's cache_branch: below the UNet's skip tensors (SD 1.x/2.x: 0-11, SDXL: 0-8), which
# the engine checks against the loaded model (``sdfast.runtime.deep_cache.check``)
# num_inference_steps: at least 1; the upper bound is the scheduler's (``sdfast.schedulers.check_steps``: 999 for
# SD's 1000 training timesteps, 50 for LCM), checked by the engine against the loaded model's scheduler.


@dataclasses.dataclass(frozen=True)
class Txt2ImgRequest:
    """A validated txt2img request, normalised. Make one with ``Txt2ImgRequest.build`` (or ``Engine.request``,
    which also tokenizes); the plain constructor does not validate. Run it with ``Engine.run``.

    prompts: the prompts, one batch entry each; negative_prompts: one per prompt, or None.
    height, width: pixels, or None for the model's native size (``Engine.default_size``).
    seeds: one per image (image ``i`` of prompt ``p`` is ``p * num_images_per_prompt + i``), or None: the engine
        draws a random seed at each run.
    tokens: the texts' CLIP token ids (``sdfast.prompts.PromptTokens``), or None: ``Engine.run`` tokenizes.
    cache_interval, cache_branch: DeepCache (``sdfast.runtime.deep_cache``): the full UNet runs every
        ``cache_interval``-th step, the steps between only skip branch ``cache_branch``; 1 (default): the exact
        pipeline, every step full.
    """

    prompts: tuple[str, ...]
    negative_prompts: tuple[str, ...] | None = None
    height: int | None = None
    width: int | None = None
    num_inference_steps: int = 30
    guidance_scale: float = 7.5
    num_images_per_prompt: int = 1
    seeds: tuple[int, ...] | None = None
    scheduler: str | None = None
    long_prompt: str = "chunk"
    tokens: PromptTokens | None = None
    control: ControlInputs | None = None
    cache_interval: int = 1
    cache_branch: int = 0

    task = "txt2img"  # the pipeline that runs it (``Engine.pipeline_for``); a class attribute, not a field

    @property
    def num_images(self) -> int:
        return len(self.prompts) * self.num_images_per_prompt

    def pipeline_kwargs(self, height: int, width: int) -> dict:
        """What this request gives the diffusers pipeline call besides the texts, steps, guidance, batch and
        generators (which ``Engine.run`` passes for every task): here the size, ``height`` x ``width`` pixels, and
        the ControlNet inputs (diffusers' ControlNet txt2img pipelines name the control image ``image``)."""
        return dict(height=height, width=width, **self._control_kwargs("image"))

    def _control_kwargs(self, image_arg: str) -> dict:
        return {} if self.control is None else self.control.pipeline_kwargs(image_arg)

    @classmethod
    def build(cls, prompt, *, negative_prompt=None, num_inference_steps: int = 30, guidance_scale: float = 7.5,
              height: int | None = None, width: int | None = None, seed=None, num_images_per_prompt: int = 1,
              scheduler: str | None = None, long_prompt: str = "chunk", control_image=None,
              controlnet_conditioning_scale=None, control_guidance_start=0.0, control_guidance_end=1.0,
              cache_interval: int = 1, cache_branch: int = 0, tokenize=None) -> Txt2ImgRequest:
        """Validate ``Engine.txt2img``'s arguments (see there) and return the request. Raises
        ``InvalidRequestError`` (a ``ValueError``) naming the field. ``tokenize``: None, or a function
        ``(prompts, negative_prompts) -> PromptTokens`` (``sdfast.prompts.tokenize`` bound to a pipeline) called
        once on the validated texts. With a ``control_image``, a side not given (``height`` or ``width`` None) is the
        (first) control image's, rounded down to a multiple of 8 (as diffusers' ControlNet pipelines do)."""
        control = check_control(control_image, controlnet_conditioning_scale, control_guidance_start,
                                control_guidance_end)
        if control is not None:  # a side not given is the control image's (diffusers' ControlNet pipelines)
            first = control.images[0]
            height = (first.height // MIN_SIDE) * MIN_SIDE if height is None else height
            width = (first.width // MIN_SIDE) * MIN_SIDE if width is None else width
        prompts = check_request(
            prompt=prompt, height=height, width=width, num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale, num_images_per_prompt=num_images_per_prompt, scheduler=scheduler,
            seed=seed)
        negatives = check_negative_prompt(negative_prompt, len(prompts))
        check_long_prompt(long_prompt)
        cache_interval, cache_branch = check_deep_cache(cache_interval, cache_branch)
        # checked integral (numpy scalars included): plain ints from here on
        steps, per_prompt = int(num_inference_steps), int(num_images_per_prompt)
        n = len(prompts) * per_prompt
        seeds = None if seed is None else tuple(
            int(s) for s in seed) if isinstance(seed, (list, tuple)) else tuple(int(seed) + i for i in range(n))
        return cls(
            prompts=tuple(prompts), negative_prompts=None if negatives is None else tuple(negatives),
            height=None if height is None else int(height), width=None if width is None else int(width),
            num_inference_steps=steps, guidance_scale=float(guidance_scale), num_images_per_prompt=per_prompt,
            seeds=seeds, scheduler=scheduler, long_prompt=long_prompt, control=control,
            cache_interval=cache_interval, cache_branch=cache_branch,
            tokens=None if tokenize is None else tokenize(list(prompts), negatives))

    def as_kwargs(self) -> dict:
        """``Engine.txt2img``'s (and ``build``'s) keyword arguments that make this request again (without its
        tokens): ``Txt2ImgRequest.build(**r.as_kwargs())`` equals ``r`` with ``tokens=None``. The ControlNet and
        DeepCache arguments only when set."""
        return dict(
            prompt=list(self.prompts), negative_prompt=None if self.negative_prompts is None else list(self.negative_prompts),
            num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale, height=self.height,
            width=self.width, seed=None if self.seeds is None else list(self.seeds),
            num_images_per_prompt=self.num_images_per_prompt, scheduler=self.scheduler, long_prompt=self.long_prompt,
            **({} if (self.cache_interval, self.cache_branch) == (1, 0) else
               dict(cache_interval=self.cache_interval, cache_branch=self.cache_branch)),
            **({} if self.control is None else self.control.as_kwargs()))

    @classmethod
    def concat(cls, requests: list[Txt2ImgRequest]) -> Txt2ImgRequest:
        """Requests batched into one engine call (the HTTP service's batches): their prompts, negative prompts,
        seeds and tokens in order. Each must have its seeds, one image per prompt, and the same settings
        (size, steps, guidance, scheduler, long-prompt policy, DeepCache settings, with or without negative
        prompts); raises ``ValueError`` otherwise, and ``InvalidRequestError`` (field ``num_images_per_prompt``) past
        ``MAX_IMAGES`` images in all."""
        from .prompts import PromptTokens

        if not requests:
            raise ValueError("concat needs at least one request")
        first = requests[0]

        def settings(r):
            return (r.height, r.width, r.num_inference_steps, r.guidance_scale, r.scheduler, r.long_prompt,
                    r.negative_prompts is None, r.num_images_per_prompt, r.control is None, r.cache_interval,
                    r.cache_branch)

        if (any(r.seeds is None or settings(r) != settings(first) for r in requests) or first.num_images_per_prompt != 1
                or first.control is not None):
            raise ValueError("concat: requests batched into one call need their seeds, one image per prompt, no "
                             "control image and the same size, steps, guidance, scheduler, long-prompt policy, "
                             "DeepCache settings and negative-prompt presence")
        prompts = tuple(p for r in requests for p in r.prompts)
        if len(prompts) > MAX_IMAGES:
            raise InvalidRequestError(
                "num_images_per_prompt", f"{len(prompts)} prompt(s) x 1 = {len(prompts)} images; at most "
                f"{MAX_IMAGES} per call (call again for more)")
        negatives = None if first.negative_prompts is None else tuple(p for r in requests for p in r.negative_prompts)
        return dataclasses.replace(first, prompts=prompts, negative_prompts=negatives,
                                   seeds=tuple(s for r in requests for s in r.seeds),
                                   tokens=PromptTokens.concat([r.tokens for r in requests]))


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
    """Validate and normalise; returns the prompt as a list. Raises ``InvalidRequestError`` naming the field.
    ``height``/``width`` None: the model's native size (always valid). ``Txt2ImgRequest.build`` calls it."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt) if isinstance(prompt, (list, tuple)) else None
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise InvalidRequestError("prompt", f"must be a string or a non-empty list of strings (got {type(prompt).__name__})")
    _check_text("prompt", prompts)
    height, width, num_inference_steps, num_images_per_prompt = (
        _as_int(v) for v in (height, width, num_inference_steps, num_images_per_prompt))
    for field, v in (("height", height), ("width", width)):
        if v is not None:  # None: the model's native size
            check_side(field, v)
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


def check_side(field: str, v) -> int:
    """An image side (``height`` / ``width``) in pixels: an integer, a positive multiple of 8, at most ``MAX_SIDE``.
    Returns it; raises ``InvalidRequestError`` naming ``field``."""
    if not isinstance(v, int) or isinstance(v, bool):
        raise InvalidRequestError(field, f"must be an integer, a positive multiple of 8 (got {type(v).__name__} {v!r})")
    if v <= 0 or v % 8:
        raise InvalidRequestError(field, f"must be a positive multiple of 8 (got {v!r})")
    if v > MAX_SIDE:
        raise InvalidRequestError(field, f"must be at most {MAX_SIDE} pixels (got {v})")
    return v


def check_deep_cache(cache_interval, cache_branch) -> tuple[int, int]:
    """Validate DeepCache's settings (``sdfast.runtime.deep_cache``): ``cache_interval`` an integer in [1,
    ``MAX_CACHE_INTERVAL``] (1: the exact pipeline; above the steps: only the first step runs the full UNet),
    ``cache_branch`` an integer in [0, ``MAX_CACHE_BRANCH``] (the engine checks it against the model's UNet, which
    has fewer: 12 skip branches on SD 1.x/2.x, 9 on SDXL; with ``cache_interval`` 1 the branch is not used, as
    diffusers ignores what a setting does not use). Returns them as ints. Raises ``InvalidRequestError`` naming the
    field."""
    cache_interval, cache_branch = _as_int(cache_interval), _as_int(cache_branch)
    if not isinstance(cache_interval, int) or isinstance(cache_interval, bool) \
            or not 1 <= cache_interval <= MAX_CACHE_INTERVAL:
        raise InvalidRequestError("cache_interval", f"must be an integer in [1, {MAX_CACHE_INTERVAL}] (1: every step "
                                                    f"runs the full UNet, the exact pipeline; got {cache_interval!r})")
    if not isinstance(cache_branch, int) or isinstance(cache_branch, bool) or not 0 <= cache_branch <= MAX_CACHE_BRANCH:
        raise InvalidRequestError("cache_branch", f"must be an integer in [0, {MAX_CACHE_BRANCH}], a skip branch of the "
                                                  f"UNet (0: the shallowest; the loaded UNet may have fewer: SD 1.x/2.x "
                                                  f"0-11, SDXL 0-8; got {cache_branch!r})")
    return cache_interval, cache_branch


def check_long_prompt(policy: str) -> str:
    """Validate the long-prompt policy (see ``sdfast.prompts``): "chunk" or "truncate"."""
    from .prompts import POLICIES

    if policy not in POLICIES:
        raise InvalidRequestError("long_prompt", f"must be one of {', '.join(POLICIES)} (got {policy!r})")
    return policy


@dataclasses.dataclass(frozen=True)
class Img2ImgRequest(Txt2ImgRequest):
    """A validated img2img request (SDEdit, Meng et al. 2021, as diffusers' ``StableDiffusionImg2ImgPipeline`` and
    ``StableDiffusionXLImg2ImgPipeline`` run it): the init ``image`` is encoded by the VAE, noised to the timestep
    ``strength`` of the way into the schedule, and denoised for the last ``int(num_inference_steps * strength)``
    steps. Make one with ``Img2ImgRequest.build``; run it with ``Engine.run``.

    image: the init image, RGB (``PIL.Image.Image``), as given (after ``concat``: a list, one per output image);
    height, width: its size in pixels rounded down to multiples of 8 (the size of the images that come back:
    diffusers' image processor resizes to it).
    strength: in (0, 1]; 1 ignores the image's content (but not its size).
    """

    image: object = None
    strength: float = 0.8

    task = "img2img"
    image_fields = ("image",)  # what ``concat`` lists per output image; a class attribute, not a field

    def pipeline_kwargs(self, height: int, width: int) -> dict:
        """The image and strength (the image sets the size: diffusers resizes it to ``height`` x ``width``); with
        ControlNet inputs, those and the size (a ControlNet pipeline would take the control image's own size)."""
        if self.control is None:
            return dict(image=self.image, strength=self.strength)
        return dict(image=self.image, strength=self.strength, height=height, width=width,
                    **self._control_kwargs("control_image"))

    @property
    def denoising_steps(self) -> int:
        """The steps that run: ``int(num_inference_steps * strength)`` (diffusers' ``get_timesteps``)."""
        return min(int(self.num_inference_steps * self.strength), self.num_inference_steps)

    @classmethod
    def build(cls, image, prompt, *, strength: float = 0.8, negative_prompt=None, num_inference_steps: int = 30,
              guidance_scale: float = 7.5, seed=None, num_images_per_prompt: int = 1, scheduler: str | None = None,
              long_prompt: str = "chunk", cache_interval: int = 1, cache_branch: int = 0, tokenize=None,
              **control) -> Img2ImgRequest:
        """Validate ``Engine.img2img``'s arguments (see there) and return the request. Raises
        ``InvalidRequestError`` (a ``ValueError``) naming the field: ``image`` (not a PIL image or an (H, W, 3)
        uint8 array, or a side under 8 or over ``MAX_SIDE`` pixels), ``strength`` (not a number in (0, 1], or so
        small that no step would run), and the fields ``Txt2ImgRequest.build`` checks. ``control``: its ControlNet
        arguments (``control_image`` resized by diffusers to the image's size)."""
        pil = check_image(image)
        width, height = (pil.width // MIN_SIDE) * MIN_SIDE, (pil.height // MIN_SIDE) * MIN_SIDE
        base = Txt2ImgRequest.build(
            prompt, negative_prompt=negative_prompt, num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale, height=height, width=width, seed=seed,
            num_images_per_prompt=num_images_per_prompt, scheduler=scheduler, long_prompt=long_prompt,
            cache_interval=cache_interval, cache_branch=cache_branch, tokenize=tokenize, **control)
        if isinstance(strength, bool) or not isinstance(strength, numbers.Real) or not 0 < float(strength) <= 1:
            raise InvalidRequestError("strength", f"must be a number in (0, 1], got {strength!r}")
        if int(base.num_inference_steps * float(strength)) < 1:
            raise InvalidRequestError(
                "strength", f"{float(strength):g} x {base.num_inference_steps} steps runs no step "
                f"(int(num_inference_steps * strength) = 0); raise strength or num_inference_steps")
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(Txt2ImgRequest)},
                   image=pil, strength=float(strength))

    def as_kwargs(self) -> dict:
        """``Engine.img2img``'s keyword arguments that make this request again (with ``image`` first)."""
        kwargs = super().as_kwargs()
        del kwargs["height"], kwargs["width"]
        return dict(image=self.image, **kwargs, strength=self.strength)

    @classmethod
    def concat(cls, requests):
        """Requests batched into one engine call (the HTTP service's batches): ``Txt2ImgRequest.concat``'s texts,
        seeds and tokens, and each of ``image_fields`` as a list of one image per output image, in order. diffusers
        then encodes image ``i`` with generator ``i`` (the VAE's latent sample before the noise), so each output
        image is its seed's image alone; a request of n prompts gets n copies of its image. Raises ``ValueError``
        unless the requests have the same strength (and ``Txt2ImgRequest.concat``'s settings, the size included)."""
        base = super().concat(requests)
        if any(r.strength != base.strength for r in requests):
            raise ValueError("concat: img2img requests batched into one call need the same strength")
        return dataclasses.replace(base, **{name: [im for r in requests for im in _per_image(r, name)]
                                            for name in cls.image_fields})


def _per_image(request, name: str) -> list:
    """The image field ``name`` of ``request`` as one image per output image (a concatenated request has its list)."""
    value = getattr(request, name)
    return list(value) if isinstance(value, (list, tuple)) else [value] * request.num_images


def check_image(image, field: str = "image"):
    """``image`` as an RGB ``PIL.Image.Image``: a PIL image (any mode is converted) or an (H, W, 3) uint8 array.
    Raises ``InvalidRequestError`` naming ``field`` for anything else, or a side under 8 or over ``MAX_SIDE``."""
    import numpy as np
    from PIL import Image

    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise InvalidRequestError(field, f"an array must be (H, W, 3) uint8, got {image.shape} {image.dtype}")
        image = Image.fromarray(image)
    if not isinstance(image, Image.Image):
        raise InvalidRequestError(field, f"must be a PIL.Image.Image or an (H, W, 3) uint8 array, got "
                                         f"{type(image).__name__}")
    if min(image.size) < MIN_SIDE or max(image.size) > MAX_SIDE:
        raise InvalidRequestError(field, f"sides must be {MIN_SIDE} to {MAX_SIDE} pixels, got {image.width}x{image.height}")
    _check_8bit(image, field)
    return image if image.mode == "RGB" else image.convert("RGB")


def _check_8bit(image, field: str) -> None:
    """Raise ``InvalidRequestError`` for a PIL image whose mode PIL's conversion to 8-bit clips (16-bit and 32-bit
    integer ``I;16`` / ``I``, float ``F``): a 16-bit photo would come out almost white, a float mask in [0, 1] all
    black, with no error (the HTTP service refuses such files too)."""
    if image.mode in ("I", "F") or image.mode.startswith("I;"):
        raise InvalidRequestError(field, f"mode {image.mode} images are clipped by the conversion to 8 bits per "
                                         "channel; convert it to 8-bit (RGB, or L for a mask) first")


@dataclasses.dataclass(frozen=True)
class InpaintRequest(Img2ImgRequest):
    """A validated inpainting request (as diffusers' ``StableDiffusionInpaintPipeline`` and
    ``StableDiffusionXLInpaintPipeline`` run it): the masked part of ``image`` is repainted, the rest kept (with an
    inpainting UNet, 9 input channels: mask and masked image go in as conditioning; with a plain 4-channel UNet the
    unmasked latents are blended back at every step). Make one with ``InpaintRequest.build``.

    mask_image: ``L`` mode ``PIL.Image.Image`` of ``image``'s size; white (255) is repainted, black kept (after
    ``concat``: a list, as ``image``).
    strength: as img2img's, default 1.0 (the masked part starts from noise).
    """

    mask_image: object = None

    task = "inpaint"
    image_fields = ("image", "mask_image")

    def pipeline_kwargs(self, height: int, width: int) -> dict:
        """The image, mask, strength and size (and the ControlNet inputs). With several output images, the image and
        mask once per output image: diffusers' inpaint pipelines VAE-encode one image with the first generator only
        and repeat its latents, so image ``i`` would not be its seed's image alone."""
        image, mask = (self.image, self.mask_image) if self.num_images == 1 else (
            _per_image(self, "image"), _per_image(self, "mask_image"))
        return dict(image=image, mask_image=mask, strength=self.strength, height=height, width=width,
                    **self._control_kwargs("control_image"))

    @classmethod
    def build(cls, image, mask_image, prompt, *, strength: float = 1.0, **kwargs) -> InpaintRequest:
        """Validate ``Engine.inpaint``'s arguments (see there): ``mask_image`` a PIL image or an (H, W) / (H, W, 1)
        / (H, W, 3) uint8 array of ``image``'s size (``InvalidRequestError`` field ``mask_image``), and what
        ``Img2ImgRequest.build`` checks."""
        base = Img2ImgRequest.build(image, prompt, strength=strength, **kwargs)
        mask = check_mask(mask_image, base.image.size)
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(Img2ImgRequest)}, mask_image=mask)

    def as_kwargs(self) -> dict:
        """``Engine.inpaint``'s keyword arguments that make this request again."""
        kwargs = super().as_kwargs()
        return dict(image=kwargs.pop("image"), mask_image=self.mask_image, **kwargs)


def check_mask(mask, size: tuple[int, int], field: str = "mask_image"):
    """``mask`` as an ``L`` mode ``PIL.Image.Image`` of ``size`` (width, height): a PIL image (converted to ``L``) or
    an (H, W), (H, W, 1) or (H, W, 3) uint8 array. Raises ``InvalidRequestError`` naming ``field``."""
    import numpy as np
    from PIL import Image

    if isinstance(mask, np.ndarray):
        if mask.dtype != np.uint8 or not (mask.ndim == 2 or (mask.ndim == 3 and mask.shape[2] in (1, 3))):
            raise InvalidRequestError(field, f"an array must be (H, W), (H, W, 1) or (H, W, 3) uint8, got "
                                             f"{mask.shape} {mask.dtype}")
        mask = Image.fromarray(mask[..., 0] if mask.ndim == 3 and mask.shape[2] == 1 else mask)
    if not isinstance(mask, Image.Image):
        raise InvalidRequestError(field, f"must be a PIL.Image.Image or a uint8 array, got {type(mask).__name__}")
    _check_8bit(mask, field)
    if mask.size != tuple(size):
        raise InvalidRequestError(field, f"must be the image's size, {size[0]}x{size[1]}, got {mask.width}x{mask.height}")
    return mask if mask.mode == "L" else mask.convert("L")


@dataclasses.dataclass(frozen=True)
class ControlInputs:
    """A request's ControlNet inputs (as diffusers' ControlNet pipelines take them), one entry per ControlNet of the
    engine, in order. Made by ``check_control``; the count is checked against the engine by ``Engine.run``.

    images: RGB ``PIL.Image.Image`` s (diffusers resizes each to the generated size).
    conditioning_scale: each ControlNet's residuals are multiplied by it (``controlnet_conditioning_scale``), or
        None: the diffusers pipeline's default (1.0 for txt2img and SDXL inpainting, 0.8 for img2img, 0.5 for SD
        inpainting).
    guidance_start, guidance_end: the fraction of the denoising steps in which each ControlNet is applied, in
        [0, 1], start < end (``control_guidance_start`` / ``control_guidance_end``).
    """

    images: tuple
    conditioning_scale: tuple[float, ...] | None
    guidance_start: tuple[float, ...]
    guidance_end: tuple[float, ...]

    def pipeline_kwargs(self, image_arg: str) -> dict:
        """The diffusers call arguments: one value each for one ControlNet, lists for a multi-ControlNet; the
        control images under ``image_arg`` ("image" for the txt2img ControlNet pipelines, else "control_image")."""
        def value(t):
            return t[0] if len(self.images) == 1 else list(t)

        kwargs = {image_arg: value(self.images), "control_guidance_start": value(self.guidance_start),
                  "control_guidance_end": value(self.guidance_end)}
        if self.conditioning_scale is not None:
            kwargs["controlnet_conditioning_scale"] = value(self.conditioning_scale)
        return kwargs

    def as_kwargs(self) -> dict:
        """The ``control_image=...`` keyword arguments that make these inputs again."""
        value = (lambda t: t[0]) if len(self.images) == 1 else list
        scale = None if self.conditioning_scale is None else value(self.conditioning_scale)
        return dict(control_image=value(self.images), controlnet_conditioning_scale=scale,
                    control_guidance_start=value(self.guidance_start), control_guidance_end=value(self.guidance_end))

    def check_count(self, controlnets: int) -> None:
        """Raise ``InvalidRequestError`` (field ``control_image``) unless there is one image per ControlNet."""
        if not controlnets:
            raise InvalidRequestError("control_image", "the model has no ControlNet; load one with "
                                                       "sdfast.load(model, controlnet=...) (or leave control_image out)")
        if len(self.images) != controlnets:
            raise InvalidRequestError("control_image", f"one control image per ControlNet: the model has "
                                                       f"{controlnets}, got {len(self.images)}")


def _per_controlnet(field: str, value, n: int, lo: float, hi: float) -> tuple[float, ...]:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(values) != n:
        raise InvalidRequestError(field, f"one value, or a list of one per control image ({n}), got {len(values)}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not lo <= v <= hi:
            raise InvalidRequestError(field, f"must be a number in [{lo:g}, {hi:g}] (or a list of them), got {v!r}")
    return tuple(float(v) for v in values)


def check_control(control_image, conditioning_scale=None, guidance_start=0.0, guidance_end=1.0) -> ControlInputs | None:
    """Validate the ControlNet arguments of a request: None without a ``control_image``; else ``ControlInputs`` with
    ``control_image`` (a PIL image / (H, W, 3) uint8 array, or a list of 1 to ``MAX_CONTROLNETS`` of them) and the
    three per-ControlNet values (one value for all, or one per image; a scale of None: the pipeline's default). Raises ``InvalidRequestError`` naming the
    field (``control_image``, ``controlnet_conditioning_scale``, ``control_guidance_start``,
    ``control_guidance_end``; a start not below its end)."""
    if control_image is None:
        given = [name for name, value, default in (("controlnet_conditioning_scale", conditioning_scale, None),
                                                   ("control_guidance_start", guidance_start, 0.0),
                                                   ("control_guidance_end", guidance_end, 1.0)) if value != default]
        if given:
            raise InvalidRequestError(given[0], "only with control_image (the ControlNet inputs it sets apply to "
                                                "the control images)")
        return None
    many = isinstance(control_image, (list, tuple))
    raw = list(control_image) if many else [control_image]
    if not 1 <= len(raw) <= MAX_CONTROLNETS:
        raise InvalidRequestError("control_image", f"1 to {MAX_CONTROLNETS} control images, got {len(raw)}")
    images = tuple(check_image(im, f"control_image[{i}]" if many else "control_image") for i, im in enumerate(raw))
    n = len(images)
    scale = None if conditioning_scale is None else _per_controlnet(
        "controlnet_conditioning_scale", conditioning_scale, n, 0.0, MAX_CONTROLNET_SCALE)
    start = _per_controlnet("control_guidance_start", guidance_start, n, 0.0, 1.0)
    end = _per_controlnet("control_guidance_end", guidance_end, n, 0.0, 1.0)
    if any(a >= b for a, b in zip(start, end)):
        raise InvalidRequestError("control_guidance_start", f"must be below control_guidance_end (got {list(start)} "
                                                            f"and {list(end)})")
    return ControlInputs(images, scale, start, end)
