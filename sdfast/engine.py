"""``Engine``: one loaded (and optionally optimized) diffusers pipeline, and txt2img on it."""

from __future__ import annotations

import secrets
import time

import numpy as np
import torch

from .errors import NonFiniteOutputError
from .request import check_request
from .schedulers import make_scheduler


class Engine:
    """A diffusers pipeline and what sdfast adds around it.

    ``pipe`` is the underlying diffusers pipeline (``StableDiffusionPipeline`` or
    ``StableDiffusionXLPipeline``): everything diffusers users know still works on it.
    """

    def __init__(self, pipe, *, name: str = "pipeline"):
        self.pipe = pipe
        self.name = name
        self._default_scheduler = pipe.scheduler
        self._schedulers: dict[str, object] = {}
        self.last_timings: dict[str, float] = {}

    @property
    def device(self) -> torch.device:
        return self.pipe.unet.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pipe.unet.dtype

    @property
    def default_size(self) -> int:
        """Native image side in pixels (UNet sample size × VAE scale factor): 512 for SD1.5, 1024 for SDXL."""
        return self.pipe.unet.config.sample_size * self.pipe.vae_scale_factor

    def _scheduler(self, name: str | None):
        if name is None:
            return self._default_scheduler
        if name not in self._schedulers:
            self._schedulers[name] = make_scheduler(name, self._default_scheduler.config)
        return self._schedulers[name]

    def txt2img(
        self,
        prompt,
        *,
        negative_prompt=None,
        num_inference_steps: int = 30,
        guidance_scale: float = 7.5,
        height: int | None = None,
        width: int | None = None,
        seed=None,
        num_images_per_prompt: int = 1,
        scheduler: str | None = None,
        progress: bool = False,
    ):
        """Generate images from text.

        Args:
            prompt: a string or a list of strings (one batch entry each).
            negative_prompt: string or list (as long as ``prompt``), or None.
            num_inference_steps: denoising steps, >= 1.
            guidance_scale: classifier-free guidance (CFG) weight; <= 1 runs the UNet once per step, without CFG.
            height, width: pixels, positive multiples of 8 (default: the model's native size).
            seed: an int, a list of ints (one per image), or None (random). Image ``i`` of the batch uses
                seed ``seed + i`` (with an int), drawn by a CPU ``torch.Generator``, so image ``i`` equals
                the image generated alone with that seed, on any device.
            num_images_per_prompt: images per prompt, >= 1.
            scheduler: one of ``sdfast.schedulers.SCHEDULERS`` (default: the model's own).
            progress: show a progress bar over the denoising steps.

        Returns: a list of ``PIL.Image.Image`` (RGB, ``width``×``height``); each carries ``info["seed"]``.
        Raises: ``InvalidRequestError`` (a ``ValueError`` naming the field) before any step runs;
            ``NonFiniteOutputError`` if the pipeline produced NaN/Inf.
        """
        height = self.default_size if height is None else height
        width = self.default_size if width is None else width
        prompts = check_request(
            prompt=prompt, height=height, width=width, num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale, num_images_per_prompt=num_images_per_prompt,
            scheduler=scheduler, seed=seed,
        )
        n = len(prompts) * num_images_per_prompt
        if seed is None:
            seed = secrets.randbelow(2**31 - n)
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed + i for i in range(n)]
        generators = [torch.Generator("cpu").manual_seed(s) for s in seeds]
        pipe = self.pipe
        pipe.scheduler = self._scheduler(scheduler)
        pipe.set_progress_bar_config(disable=not progress)
        t0 = time.perf_counter()
        out = pipe(
            prompt=prompts,
            negative_prompt=negative_prompt,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            height=height,
            width=width,
            num_images_per_prompt=num_images_per_prompt,
            generator=generators,
            output_type="np",
        )
        images = out.images
        self.last_timings = {"total_s": time.perf_counter() - t0}
        if not np.isfinite(images).all():
            raise NonFiniteOutputError(
                "the pipeline produced NaN/Inf pixels (fp16 overflow or a broken kernel); "
                "try dtype=torch.float32 or report it"
            )
        pil = pipe.image_processor.numpy_to_pil(images)
        for img, s in zip(pil, seeds):
            img.info["seed"] = str(s)
        return pil
