"""``Engine``: one loaded (and optionally optimized) diffusers pipeline, and txt2img, img2img and inpainting on it.

``txt2img(...)`` builds a ``sdfast.request.Txt2ImgRequest`` (the one validation) and runs it with ``run``;
``request(...)`` builds one with its texts tokenized by this engine. The CLI (built before the load) and the
service (tokenized on its own tokenizer copies) hand theirs to ``run``, which counts the texts' windows, encodes
them from their token ids (``sdfast.prompts``) and calls the pipeline inside a ``runtime.session.CallSession`` (graph checks, host timesteps, finite flag, OOM rollback).
``img2img(...)`` and ``inpaint(...)`` build an ``Img2ImgRequest`` / ``InpaintRequest`` and run them the same way, on
the diffusers pipeline of the request's ``task``, built once from the same (optimized) components (``pipeline_for``,
``sdfast.optimizer.share``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import secrets
import threading
import time
import warnings

import numpy as np
import torch
from PIL import Image

from . import prompts as prompt_policy
from .errors import GenerationCancelled, InvalidRequestError
from .loading import quiet_loading
from .request import Img2ImgRequest, InpaintRequest, Txt2ImgRequest
from .runtime import deep_cache
from .runtime.session import CallSession
from .schedulers import check_steps, make_scheduler

log = logging.getLogger("sdfast")


def _to_uint8(images: torch.Tensor, flags: tuple[torch.Tensor, ...] = ()) -> tuple[np.ndarray, bool]:
    """A pipeline's ``output_type="pt"`` images, (N, C, H, W) in [0, 1] on any device, as C-contiguous (N, H, W, C)
    uint8 on the host, and whether every value was finite and every one-element bool tensor of ``flags`` (e.g. the
    VAE decoder output's own check, still on the GPU) is True. The arithmetic of diffusers' ``pt_to_numpy`` and
    ``numpy_to_pil`` (fp32 ``x * 255``, round half to even, cast), bit for bit, but on the images' device, so the
    host does not run a per-pixel numpy pass (``benchmarks/trace_e2e.py`` times it). From a GPU the pixels and the
    flags come back in one wait, through pinned host memory (``non_blocking`` copies to the CPU land in pinned
    memory; a pageable copy holds the host longer). The pixels are made (N, H, W, C)-contiguous on the device:
    PIL's ``fromarray`` copies a strided array through ``tobytes`` first, on the host, with the GPU idle."""
    x = images.permute(0, 2, 3, 1).float()
    finite = torch.stack([torch.isfinite(x).all(), *(f.reshape(()).to(x.device) for f in flags)]).all()
    pixels = (x * 255).round().to(torch.uint8).contiguous()
    if pixels.device.type != "cuda":
        return pixels.cpu().numpy(), bool(finite)
    host, finite = pixels.to("cpu", non_blocking=True), finite.to("cpu", non_blocking=True)
    torch.cuda.current_stream(pixels.device).synchronize()
    return host.numpy(), bool(finite)


def _chain(callbacks: list):
    """One diffusers ``callback_on_step_end`` that calls each of ``callbacks`` in order."""
    if len(callbacks) == 1:
        return callbacks[0]

    def on_step_end(pipe, i, t, callback_kwargs):
        for callback in callbacks:
            callback_kwargs = callback(pipe, i, t, callback_kwargs)
        return callback_kwargs

    return on_step_end


def _stopper(should_stop):
    """A diffusers ``callback_on_step_end`` that raises ``GenerationCancelled`` when ``should_stop()`` is True."""

    def on_step_end(pipe, i, t, callback_kwargs):
        if should_stop():
            raise GenerationCancelled(i + 1, int(getattr(pipe, "num_timesteps", 0) or i + 1))
        return callback_kwargs

    return on_step_end


# The diffusers pipeline of each task other than txt2img, without and with ControlNets: (SD 1.x/2.x, SDXL), built
# from the engine's components. txt2img runs ``Engine.pipe`` itself (a ControlNet pipeline when loaded with one).
_DERIVED = {
    ("img2img", False): ("StableDiffusionImg2ImgPipeline", "StableDiffusionXLImg2ImgPipeline"),
    ("inpaint", False): ("StableDiffusionInpaintPipeline", "StableDiffusionXLInpaintPipeline"),
    ("img2img", True): ("StableDiffusionControlNetImg2ImgPipeline", "StableDiffusionXLControlNetImg2ImgPipeline"),
    ("inpaint", True): ("StableDiffusionControlNetInpaintPipeline", "StableDiffusionXLControlNetInpaintPipeline"),
}


def _control(control_image, controlnet_conditioning_scale, control_guidance_start, control_guidance_end) -> dict:
    """The ControlNet keyword arguments of a request's ``build``."""
    return dict(control_image=control_image, controlnet_conditioning_scale=controlnet_conditioning_scale,
                control_guidance_start=control_guidance_start, control_guidance_end=control_guidance_end)


class PromptTruncatedWarning(UserWarning):
    """A prompt longer than CLIP's 75 content tokens was truncated (``long_prompt="truncate"``)."""


class Engine:
    """A diffusers pipeline and what sdfast adds around it.

    ``pipe`` is the underlying diffusers pipeline (``StableDiffusionPipeline`` or ``StableDiffusionXLPipeline``,
    or their ``ControlNet`` pipelines when loaded with ControlNets): everything diffusers users know still works on
    it.

    Calls from several threads run one at a time (a lock per engine): one pipeline has one scheduler, one set of
    CUDA graphs and their buffers, so two calls at once would mix their steps (stock diffusers' pipelines fail the
    same way). ``sdfast serve`` batches concurrent requests instead.
    """

    def __init__(self, pipe, *, name: str = "pipeline"):
        self.pipe = pipe
        self.name = name
        self._lock = threading.RLock()  # one call at a time (see the class docstring)
        self._default_scheduler = pipe.scheduler
        self._schedulers: dict[str, object] = {}
        self._derived: dict[str, object] = {}
        self.last_timings: dict[str, float] = {}
        self.last_deep_cache: dict | None = None  # DeepCache's counts of the last call (``runtime.deep_cache``)
        self.last_prompt_report: prompt_policy.PromptReport | None = None

    @property
    def device(self) -> torch.device:
        """Where the pipeline runs: diffusers' ``pipe._execution_device`` (an optimized pipeline answers it from a
        cache, ``runtime.execution_device``; ``pipe.unet.device`` walks every UNet module)."""
        return self.pipe._execution_device

    @property
    def dtype(self) -> torch.dtype:
        return self.pipe.unet.dtype

    @property
    def controlnets(self) -> list:
        """The engine's ``diffusers.ControlNetModel`` s, in the order requests give their control images ([] for
        none)."""
        from .controlnet import controlnets_of

        return controlnets_of(self.pipe)

    @property
    def default_size(self) -> int:
        """Native image side in pixels (UNet sample size × VAE scale factor): 512 for SD1.5, 1024 for SDXL."""
        return self.pipe.unet.config.sample_size * self.pipe.vae_scale_factor

    def scheduler_for(self, name: str | None):
        """The scheduler instance a request with ``scheduler=name`` runs: the model's own for None, else one of
        ``sdfast.schedulers.SCHEDULERS`` built once from the model's scheduler config. Raises
        ``InvalidRequestError`` (field ``scheduler``) for an unknown name."""
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
        long_prompt: str = "chunk",
        should_stop=None,
        control_image=None,
        controlnet_conditioning_scale=None,
        control_guidance_start=0.0,
        control_guidance_end=1.0,
        cache_interval: int = 1,
        cache_branch: int = 0,
    ):
        """Generate images from text.

        Args:
            prompt: a string or a list of strings (one batch entry each).
            negative_prompt: a string (for every prompt), a list (as long as ``prompt``), or None.
            num_inference_steps: denoising steps, >= 1.
            guidance_scale: classifier-free guidance (CFG) weight; <= 1 runs the UNet once per step, without CFG.
            height, width: pixels, positive multiples of 8 (default: the model's native size).
            seed: an int, a list of ints (one per image), or None (random). Image ``i`` of the batch uses
                seed ``seed + i`` (with an int), drawn by a CPU ``torch.Generator``, so image ``i`` equals
                the image generated alone with that seed, on any device.
            num_images_per_prompt: images per prompt, >= 1.
            scheduler: one of ``sdfast.schedulers.SCHEDULERS`` (default: the model's own).
            progress: show a progress bar over the denoising steps.
            long_prompt: what to do with a prompt (or negative prompt) over CLIP's 75 content tokens:
                "chunk" (default) encodes it in 75-token windows and concatenates the embeddings;
                "truncate" drops the tokens after the 75th (stock diffusers) and warns
                (``PromptTruncatedWarning``). See ``sdfast.prompts``. With "chunk", every prompt of a
                batch is padded to the batch's largest window count, so a short prompt batched with a
                long one does not give the image it gives alone (``sdfast.prompts.windows_of``).
            should_stop: None, or a function of no arguments called after every denoising step (through diffusers'
                ``callback_on_step_end``); when it returns True the call stops there, before the next UNet step and
                without decoding, and raises ``GenerationCancelled``. CUDA graphs stay valid: the callback runs
                between graph replays, never during a capture, and each call re-projects its text context.
            control_image: with ControlNets (``sdfast.load(model, controlnet=...)``), required: the control image
                (a PIL image or an (H, W, 3) uint8 array), or a list of one per ControlNet. Without ``height`` and
                ``width``, the images come back at its size (rounded down to multiples of 8); otherwise diffusers
                resizes it. As diffusers' ``StableDiffusion(XL)ControlNetPipeline`` run it (Zhang et al. 2023).
            controlnet_conditioning_scale: each ControlNet's residuals are multiplied by it, in [0, 10]: one value,
                or a list of one per ControlNet; None: diffusers' default for the task (1.0 for txt2img and SDXL
                inpainting, 0.8 for img2img, 0.5 for SD inpainting). CUDA graphs do not depend on it (the scale is
                applied after the ControlNet's replay).
            control_guidance_start, control_guidance_end: the fraction of the steps in which the ControlNets
                apply, in [0, 1], start < end (one value, or one per ControlNet).
            cache_interval: DeepCache (Ma et al., CVPR 2024; ``sdfast.runtime.deep_cache``), an integer in [1, 1000]:
                step ``i`` runs the full UNet when ``i % cache_interval == 0`` and caches its deep feature; the steps
                between run only the UNet's shallow path on it (faster; the image changes a little: README's
                "Speed tiers"). 1 (default): every step full, the exact pipeline. With ControlNets the ControlNets
                still run every step (their shallow residuals are used at the shallow steps).
            cache_branch: with ``cache_interval`` > 1, the skip branch m the shallow steps run: the UNet's skip
                connections 0 to m (conv_in's is 0, then one per down ResNet and downsampler) and the last m + 1
                up ResNets (``sdfast.runtime.deep_cache``): 0 (default, the shallowest and fastest: conv_in and the
                last up layer) to 11 on SD 1.x/2.x, 8 on SDXL (everything but the mid block); a whole down block
                with its up block is 2, 5, 8 (and 11 on SD 1.x/2.x). ``engine.last_deep_cache`` counts the full
                and shallow UNet calls of the last call (None for an exact one).

        Returns: a list of ``PIL.Image.Image`` (RGB, ``width``×``height``). Each carries, as strings,
            ``info["seed"]``, ``info["prompt_tokens"]`` (CLIP content tokens of its prompt),
            ``info["prompt_chunks"]`` (77-token windows used) and ``info["prompt_truncated_tokens"]``
            (tokens dropped from its prompt, plus ``info["negative_prompt_truncated_tokens"]`` with a
            negative prompt). ``engine.last_prompt_report`` holds the same for the whole request.
        Raises: ``InvalidRequestError`` (a ``ValueError`` naming the field, e.g. ``cache_branch`` past the UNet's
            skip branches) before any step runs;
            ``GenerationCancelled`` when ``should_stop`` returned True; ``NonFiniteOutputError`` if the
            pipeline produced NaN/Inf (checked on the VAE's output, before pixels are clamped), never a black
            image; ``torch.OutOfMemoryError`` (a host allocation failure too), after dropping the CUDA graphs
            that the failed call captured (the service answers 503 and goes on).
        """
        request = Txt2ImgRequest.build(
            prompt, negative_prompt=negative_prompt, num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale, height=height, width=width, seed=seed,
            num_images_per_prompt=num_images_per_prompt, scheduler=scheduler, long_prompt=long_prompt,
            cache_interval=cache_interval, cache_branch=cache_branch,
            **_control(control_image, controlnet_conditioning_scale, control_guidance_start, control_guidance_end))
        return self.run(request, progress=progress, should_stop=should_stop, _stacklevel=3)

    def img2img(
        self,
        image,
        prompt,
        *,
        strength: float = 0.8,
        negative_prompt=None,
        num_inference_steps: int = 30,
        guidance_scale: float = 7.5,
        seed=None,
        num_images_per_prompt: int = 1,
        scheduler: str | None = None,
        progress: bool = False,
        long_prompt: str = "chunk",
        should_stop=None,
        control_image=None,
        controlnet_conditioning_scale=None,
        control_guidance_start=0.0,
        control_guidance_end=1.0,
        cache_interval: int = 1,
        cache_branch: int = 0,
    ):
        """Generate images from an init image and text (img2img: SDEdit, Meng et al. 2021, as diffusers'
        ``StableDiffusionImg2ImgPipeline`` / ``StableDiffusionXLImg2ImgPipeline`` run it, on this engine's optimized
        components: the same images as those pipelines on the same weights).

        Args:
            image: the init image: a ``PIL.Image.Image`` (converted to RGB) or an (H, W, 3) uint8 array, each side
                8 to ``sdfast.request.MAX_SIDE`` pixels. The images come back at its size rounded down to multiples
                of 8 (diffusers' image processor resizes it to that).
            strength: in (0, 1]: how far into the schedule the image is noised; ``int(num_inference_steps *
                strength)`` denoising steps run (at least one). 1 keeps only the image's size.
            The others: as ``txt2img``'s (the seed also draws the VAE encoder's latent sample); a control image
                is resized to the init image's size.

        Returns and raises: as ``txt2img`` (``InvalidRequestError`` fields ``image`` and ``strength`` too).
        """
        request = Img2ImgRequest.build(
            image, prompt, strength=strength, negative_prompt=negative_prompt, num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale, seed=seed, num_images_per_prompt=num_images_per_prompt,
            scheduler=scheduler, long_prompt=long_prompt,
            cache_interval=cache_interval, cache_branch=cache_branch,
            **_control(control_image, controlnet_conditioning_scale, control_guidance_start, control_guidance_end))
        return self.run(request, progress=progress, should_stop=should_stop, _stacklevel=3)

    def inpaint(
        self,
        image,
        mask_image,
        prompt,
        *,
        strength: float = 1.0,
        negative_prompt=None,
        num_inference_steps: int = 30,
        guidance_scale: float = 7.5,
        seed=None,
        num_images_per_prompt: int = 1,
        scheduler: str | None = None,
        progress: bool = False,
        long_prompt: str = "chunk",
        should_stop=None,
        control_image=None,
        controlnet_conditioning_scale=None,
        control_guidance_start=0.0,
        control_guidance_end=1.0,
        cache_interval: int = 1,
        cache_branch: int = 0,
    ):
        """Repaint the masked part of an image from text (inpainting, as diffusers' ``StableDiffusionInpaintPipeline``
        / ``StableDiffusionXLInpaintPipeline`` run it, on this engine's optimized components: the same images as
        those pipelines on the same weights). An inpainting checkpoint (a UNet with 9 input channels) takes the mask
        and the masked image as conditioning; a plain one blends the unmasked latents back at every step.

        Args:
            image: as ``img2img``'s.
            mask_image: a PIL image (converted to ``L``) or a uint8 array, of ``image``'s size: white (255) is
                repainted, black kept.
            strength: as ``img2img``'s, default 1.0 (the masked part starts from pure noise).
            The others: as ``txt2img``'s.

        Returns and raises: as ``img2img`` (``InvalidRequestError`` field ``mask_image`` too).
        """
        request = InpaintRequest.build(
            image, mask_image, prompt, strength=strength, negative_prompt=negative_prompt,
            num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, seed=seed,
            num_images_per_prompt=num_images_per_prompt, scheduler=scheduler, long_prompt=long_prompt,
            cache_interval=cache_interval, cache_branch=cache_branch,
            **_control(control_image, controlnet_conditioning_scale, control_guidance_start, control_guidance_end))
        return self.run(request, progress=progress, should_stop=should_stop, _stacklevel=3)

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks this model runs: ``("inpaint",)`` for an inpainting checkpoint (a UNet whose input is the
        latents, the mask and the masked image's latents concatenated: 4 + 1 + 4 = 9 channels, e.g.
        runwayml/stable-diffusion-inpainting), else ``("txt2img", "img2img", "inpaint")``."""
        inpainting = self.pipe.unet.config.in_channels == 2 * self.pipe.vae.config.latent_channels + 1
        return ("inpaint",) if inpainting else ("txt2img", "img2img", "inpaint")

    def pipeline_for(self, task: str):
        """The diffusers pipeline that runs ``task`` (a request's ``task``) on this engine: ``self.pipe`` for
        "txt2img"; for "img2img" and "inpaint", ``StableDiffusionImg2ImgPipeline`` / ``StableDiffusionInpaintPipeline``
        (their ``ControlNet`` ones with ControlNets, the ``XL`` ones for SDXL; ``_DERIVED``) built once from
        ``self.pipe``'s components (``sdfast.pipelines.derive``: no copy of a weight, no dtype cast) and optimized as ``self.pipe`` is
        (``sdfast.optimizer.share``); built again when ``self.pipe`` was optimized or unoptimized since. Raises
        ``ValueError`` for another task, and ``InvalidRequestError`` (field ``model``) for a task the model does not
        run (``tasks``: txt2img or img2img on an inpainting checkpoint), before any step."""
        if task in ("txt2img", "img2img", "inpaint") and task not in self.tasks:
            raise InvalidRequestError("model", (
                f"{self.name!r} is an inpainting checkpoint (its UNet takes {self.pipe.unet.config.in_channels} "
                f"input channels: the latents, the mask and the masked image) and cannot run {task}; it runs "
                "inpainting only (engine.inpaint(image, mask_image, prompt), `sdfast inpaint IMAGE MASK PROMPT`, "
                "POST /v1/inpaint or /v1/images/edits)"))
        if task == "txt2img":
            return self.pipe
        if (task, False) not in _DERIVED:
            raise ValueError(f"pipeline_for: task must be 'txt2img', 'img2img' or 'inpaint', got {task!r}")
        derived = self._derived.get(task)
        if derived is None or getattr(derived, "_sdfast", None) is not getattr(self.pipe, "_sdfast", None):
            # first use, or self.pipe was optimized / unoptimized since: built again on the pipeline as it is now
            from .optimizer import share
            from .pipelines import derive

            xl = getattr(self.pipe, "text_encoder_2", None) is not None
            self._derived[task] = share(self.pipe, derive(self.pipe, _DERIVED[task, bool(self.controlnets)][xl]))
        return self._derived[task]

    def request(self, prompt, **kwargs) -> Txt2ImgRequest:
        """``Txt2ImgRequest.build(prompt, **kwargs)`` (``txt2img``'s keyword arguments) with the texts tokenized
        by this engine's tokenizers, so that ``run`` does not tokenize them again."""
        return Txt2ImgRequest.build(prompt, tokenize=functools.partial(prompt_policy.tokenize, self.pipe), **kwargs)

    def prepare(self, request: Txt2ImgRequest, *, _stacklevel: int = 2) -> PreparedRequest:
        """What ``run`` does to a built request before any model runs, as a ``PreparedRequest``: the model's own
        checks (ControlNet count, the task's pipeline, the scheduler's step limit: ``InvalidRequestError``), the seeds
        (drawn when the request has none), one CPU ``torch.Generator`` per image, CFG on or off, the texts' tokens
        (tokenized here when the request's are not this pipeline's) and their window plan, with the
        ``PromptTruncatedWarning`` of ``long_prompt="truncate"``. ``run`` and the step-level batch
        (``sdfast.runtime.step_batch``) both start here, so a request either would refuse is refused by both, alike.
        Raises ``TypeError`` for anything but a ``Txt2ImgRequest`` (or its img2img / inpainting subclasses)."""
        if not isinstance(request, Txt2ImgRequest):
            raise TypeError(f"run takes an sdfast.request.Txt2ImgRequest (Txt2ImgRequest.build(...) or "
                            f"engine.request(...)), Img2ImgRequest or InpaintRequest, got {type(request).__name__}")
        controlnets = len(self.controlnets)
        if request.control is not None:
            request.control.check_count(controlnets)
        elif controlnets:
            raise InvalidRequestError("control_image", f"this engine was loaded with {controlnets} ControlNet(s): give "
                                                       "control_image (one per ControlNet)")
        height = self.default_size if request.height is None else request.height
        width = self.default_size if request.width is None else request.width
        pipe = self.pipeline_for(request.task)
        sched = self.scheduler_for(request.scheduler)
        check_steps(request.num_inference_steps, sched, request.scheduler)
        deep_cache.check(pipe.unet, request.cache_interval, request.cache_branch)
        prompts = list(request.prompts)
        negatives = None if request.negative_prompts is None else list(request.negative_prompts)
        n = request.num_images
        if request.seeds is not None:
            seeds = list(request.seeds)
        else:
            start = secrets.randbelow(2**31 - n)
            seeds = [start + i for i in range(n)]
        do_cfg = request.guidance_scale > 1 and pipe.unet.config.get("time_cond_proj_dim") is None
        counted = negatives if do_cfg else None  # without CFG the negative prompt is never encoded
        tokens = request.tokens
        if tokens is None or not tokens.fits(pipe, len(prompts), counted is not None):
            tokens = prompt_policy.tokenize(pipe, prompts, counted)
        report = prompt_policy.plan(pipe, prompts, counted, request.long_prompt, tokens=tokens)
        self.last_prompt_report = report
        if report.any_truncated:
            warnings.warn(
                f"prompt truncated to CLIP's {prompt_policy.WINDOW} tokens (long_prompt='truncate'): dropped "
                f"{sum(report.truncated)} token(s) of the prompt(s)"
                + (f" and {sum(report.negative_truncated)} of the negative prompt(s)" if any(report.negative_truncated or ()) else "")
                + "; use long_prompt='chunk' to keep them",
                PromptTruncatedWarning,
                stacklevel=_stacklevel,
            )
        return PreparedRequest(
            request=request, pipe=pipe, scheduler=sched, height=height, width=width, prompts=prompts,
            negatives=negatives, seeds=seeds, generators=[torch.Generator("cpu").manual_seed(s) for s in seeds],
            do_cfg=do_cfg, tokens=tokens, report=report)

    def run(self, request: Txt2ImgRequest, *, progress: bool = False, should_stop=None, _stacklevel: int = 2):
        """Run a built request (``Txt2ImgRequest.build`` or ``Engine.request``): what ``txt2img`` returns and
        raises (see there), without validating the request again. Its ``tokens`` are used when they are this
        pipeline's (same tokenizers and vocabularies), else the texts are tokenized here, once. The model's own
        limits are checked here (``prepare``): the scheduler's step limit, ``InvalidRequestError`` before any step.
        Calls from other threads wait for this one."""
        with self._lock:
            return self._run(request, progress=progress, should_stop=should_stop, _stacklevel=_stacklevel + 1)

    def _run(self, request, *, progress: bool, should_stop, _stacklevel: int):
        prep = self.prepare(request, _stacklevel=_stacklevel + 1)
        pipe, report, n = prep.pipe, prep.report, request.num_images
        height, width = prep.height, prep.width
        session = CallSession(pipe)
        # The texts are encoded here from their tokens (diffusers does not tokenize again): long prompts in
        # windows (stock would truncate); graphed pipelines with prompt and negative prompt in one text-encoder
        # batch, one graph replay per encoder instead of two.
        if report.chunks > 1:
            log.info("sdfast: long prompt encoded in %d windows of %d tokens", report.chunks, prompt_policy.WINDOW)
        session.before_text_encoders()
        text = prompt_policy.encode_chunked(pipe, prep.prompts, prep.negatives, report.chunks, do_cfg=prep.do_cfg,
                                            batch_cfg=session.graphed, tokens=prep.tokens)
        pipe.set_progress_bar_config(disable=not progress)
        cache = None if request.cache_interval == 1 else deep_cache.DeepCache(
            pipe.unet, request.cache_interval, request.cache_branch)
        callbacks = [c for c in (cache and cache.on_step_end, should_stop and _stopper(should_stop)) if c]
        step_end = {"callback_on_step_end": _chain(callbacks)} if callbacks else {}
        self.last_deep_cache = None
        t0 = time.perf_counter()
        with session.call(prep.scheduler, what=lambda: f"{n} image(s) of {width}x{height} on {self.device}") as finite, \
                quiet_loading(), \
                cache or contextlib.nullcontext():
            session.check_denoising_nets()  # host work beside the text encoders' GPU work
            out = pipe(
                **text,
                **step_end,
                **request.pipeline_kwargs(height, width),
                num_inference_steps=request.num_inference_steps,
                guidance_scale=request.guidance_scale,
                num_images_per_prompt=request.num_images_per_prompt,
                generator=prep.generators,
                output_type="pt",
            )
        pixels, all_finite = _to_uint8(out.images, tuple(finite))
        self.last_timings = {"total_s": time.perf_counter() - t0}
        self.last_deep_cache = None if cache is None else cache.report()
        session.check_finite(all_finite, request.guidance_scale)
        return pil_images(pixels, prep.seeds, report, request.num_images_per_prompt)


@dataclasses.dataclass
class PreparedRequest:
    """A request checked against the engine and ready for the models (``Engine.prepare``).

    pipe: the diffusers pipeline of its task; scheduler: the engine's instance for its ``scheduler`` name (shared:
        a caller that steps it on its own copies it first); height, width: pixels, resolved.
    prompts, negatives: the texts (negatives None without); seeds: one per image; generators: one seeded CPU
        ``torch.Generator`` per image, in order. do_cfg: classifier-free guidance runs (``guidance_scale > 1`` and a
        UNet without a guidance embedding). tokens: the texts' ``PromptTokens`` for this pipeline; report: their
        ``PromptReport`` (``report.chunks``: the 77-token windows every text is encoded in).
    """

    request: Txt2ImgRequest
    pipe: object
    scheduler: object
    height: int
    width: int
    prompts: list
    negatives: list | None
    seeds: list
    generators: list
    do_cfg: bool
    tokens: object
    report: prompt_policy.PromptReport


def pil_images(pixels: np.ndarray, seeds: list, report: prompt_policy.PromptReport,
               num_images_per_prompt: int) -> list:
    """(N, H, W, C) uint8 pixels as RGB (or L) ``PIL.Image.Image`` s, each with the ``info`` that ``Engine.txt2img``
    documents (its seed, its prompt's tokens, windows and truncated tokens)."""
    pil = [Image.fromarray(p[..., 0] if p.shape[-1] == 1 else p) for p in pixels]
    for i, (img, s) in enumerate(zip(pil, seeds)):
        p = i // num_images_per_prompt
        img.info["seed"] = str(s)
        img.info["prompt_tokens"] = str(report.tokens[p])
        img.info["prompt_chunks"] = str(report.chunks)
        img.info["prompt_truncated_tokens"] = str(report.truncated[p])
        if report.negative_truncated is not None:
            img.info["negative_prompt_truncated_tokens"] = str(report.negative_truncated[p])
    return pil
