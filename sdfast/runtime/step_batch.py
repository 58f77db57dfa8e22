"""Step-level batching of txt2img requests: in-flight requests of one image size advance one denoising step at a
time through one UNet call; a request joins at a step boundary and leaves at one (finished, cancelled, failed).

This is iteration-level scheduling (Orca: Yu et al., "Orca: A Distributed Serving System for Transformer-Based
Generative Models", OSDI 2022) and vLLM's continuous batching (Kwon et al., SOSP 2023), applied to a diffusion
model's denoising loop: the unit of work is one UNet step, not one request.

Each request in flight is a ``Slot`` holding what diffusers' ``StableDiffusionPipeline`` /
``StableDiffusionXLPipeline`` hold for one call, made by the pipeline's own methods: its own scheduler (a copy of
the engine's instance for its name, its timesteps from diffusers' ``retrieve_timesteps``), its latents
(``prepare_latents``: its seeded CPU generators, ``init_noise_sigma``), the scheduler's extra step arguments
(``prepare_extra_step_kwargs``: its generators when the scheduler is stochastic, ``eta`` 0), its guidance scale
(CFG on or off), its prompt embeddings (``encode_prompt`` on the engine's windowed encodings, ``sdfast.prompts``),
and for SDXL its ``text_embeds`` and ``time_ids`` (``_get_add_time_ids``); for a UNet with a guidance embedding (LCM
distillations) its ``timestep_cond`` (``get_guidance_scale_embedding``). One ``StepBatch.step`` is, per slot, the
pipeline's loop body:

1. ``x = cat([latents] * 2)`` with CFG, then ``scheduler.scale_model_input(x, t)``;
2. one UNet call on every slot's rows concatenated (a CFG slot: its uncond rows, then its cond rows, as diffusers
   orders them), with per-row timesteps (a ``(B,)`` float32 tensor: diffusers' UNet takes one timestep per sample),
   the slots' text embeddings (and SDXL's added conditions) concatenated, padded to a row bucket with copies of the
   first row when the UNet runs in CUDA graphs, so that one graph per bucket is reused
   (``runtime.cuda_graphs.GraphedForward`` captures one graph per input signature);
3. ``uncond + guidance_scale * (cond - uncond)`` with CFG, then ``scheduler.step(noise, t, latents, **extra)``.

So each request gets the image the pipeline gives it alone, up to the rounding of batched kernels at another batch
size (at most 1/255 on the CPU's uint8 pixels, measured by the tests). Requests with different step counts, guidance
scales (CFG on and off) and schedulers share the UNet call; they must share the image size and the number of
77-token text windows (``StepKey``: the UNet's input shapes). Finished requests are decoded together
(``decode``: one VAE call, the pipeline's decode, safety checker / watermark and ``image_processor.postprocess``).

The concatenated text conditioning is built once per membership and kept (the same tensor object from step to
step), so the CUDA-graph runner's cross-attention K/V projection (``runtime.cross_kv``) is replayed only when the
batch's membership changed.

Supported: txt2img on ``StableDiffusionPipeline`` and ``StableDiffusionXLPipeline`` (SD 1.x, 2.x, SDXL) of an
``sdfast.Engine`` without ControlNets (``supports``). img2img, inpainting and ControlNet requests run through
``Engine.run``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import logging

import torch

from ..engine import Engine, PreparedRequest, _to_uint8, pil_images
from ..errors import NonFiniteOutputError
from ..request import Txt2ImgRequest
from . import host_timesteps
from .session import CallSession, before_denoising, oom_guard

log = logging.getLogger("sdfast.runtime")

BUCKETS = (1, 2, 4, 8, 16, 32)  # UNet rows a graphed step batch is padded to (then multiples of the largest)


@dataclasses.dataclass(frozen=True)
class StepKey:
    """What requests must share to be stepped in one UNet call: the image size in pixels and the 77-token windows
    their texts are encoded in (the UNet's ``sample`` and ``encoder_hidden_states`` shapes)."""

    width: int
    height: int
    windows: int = 1


def _pipeline_classes():
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    return StableDiffusionPipeline, StableDiffusionXLPipeline


def supports(engine, request) -> bool:
    """Whether ``request`` can be stepped by a ``StepBatch`` of ``engine``: an ``sdfast.Engine`` whose pipeline is
    ``StableDiffusionPipeline`` or ``StableDiffusionXLPipeline`` (no ControlNet), that runs txt2img (not an
    inpainting checkpoint), and a plain ``Txt2ImgRequest`` (not img2img or inpainting) without control images and
    without DeepCache (``cache_interval`` 1: a shallow step of one member would skip the deep blocks of all)."""
    if not isinstance(engine, Engine) or type(request) is not Txt2ImgRequest or request.control is not None:
        return False
    if request.cache_interval != 1:
        return False
    return isinstance(engine.pipe, _pipeline_classes()) and "txt2img" in engine.tasks and not engine.controlnets


def group_key(engine: Engine, request: Txt2ImgRequest) -> StepKey:
    """The ``StepKey`` of a request that ``supports`` takes: its size (the model's native size when it has none) and
    the windows ``Engine.prepare`` will plan for its texts (from the request's tokens when they are this pipeline's,
    else tokenized here: call it on the thread that runs the engine). No check, no warning, no seed is drawn."""
    from .. import prompts as prompt_policy

    pipe = engine.pipe
    width = engine.default_size if request.width is None else request.width
    height = engine.default_size if request.height is None else request.height
    if request.long_prompt != "chunk":
        return StepKey(width, height, 1)
    prompts = list(request.prompts)
    do_cfg = request.guidance_scale > 1 and pipe.unet.config.get("time_cond_proj_dim") is None
    counted = list(request.negative_prompts) if do_cfg and request.negative_prompts is not None else None
    tokens = request.tokens
    if tokens is None or not tokens.fits(pipe, len(prompts), counted is not None):
        tokens = prompt_policy.tokenize(pipe, prompts, counted)
    return StepKey(width, height, prompt_policy.plan(pipe, prompts, counted, "chunk", tokens=tokens).chunks)


def bucket_rows(rows: int, buckets=BUCKETS) -> int:
    """The padded row count of a step of ``rows`` UNet rows: the smallest bucket that holds them, past the largest a
    multiple of it."""
    for b in buckets:
        if rows <= b:
            return b
    top = buckets[-1]
    return -(-rows // top) * top


@dataclasses.dataclass(eq=False)
class Slot:
    """One request in flight in a ``StepBatch``.

    prep: the engine's ``PreparedRequest`` (seeds, generators, prompt report); scheduler: this request's own scheduler
    instance; timesteps: its timesteps (``scheduler.timesteps``; on the host when the UNet runs in CUDA graphs);
    step: denoising iterations done; latents: (n, C, h, w) in the UNet's dtype; embeds: (rows, 77·k, D) text
    embeddings, uncond rows first with CFG; added: SDXL's ``text_embeds`` (rows, D2) and ``time_ids`` (rows, 6), or
    None; timestep_cond: (rows, D) or None; extra: the scheduler step's extra keyword arguments. tag: the caller's.
    """

    prep: PreparedRequest
    scheduler: object
    timesteps: torch.Tensor
    latents: torch.Tensor
    embeds: torch.Tensor
    added: dict | None
    timestep_cond: torch.Tensor | None
    extra: dict
    tag: object = None
    step: int = 0
    serial: int = 0

    @property
    def request(self) -> Txt2ImgRequest:
        return self.prep.request

    @property
    def images(self) -> int:
        """Images this request makes (its latents' batch)."""
        return self.latents.shape[0]

    @property
    def rows(self) -> int:
        """UNet rows it takes per step: 2 per image with CFG, else 1."""
        return self.images * (2 if self.prep.do_cfg else 1)

    @property
    def steps(self) -> int:
        """Denoising iterations it runs (``len(scheduler.timesteps)``: PNDM runs one more than its step count)."""
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.step >= self.steps


@dataclasses.dataclass
class StepResult:
    """What one ``StepBatch.step`` did: ``finished``, the slots that ran their last step (still in the batch, to be
    decoded); ``failed``, (slot, exception) for slots whose own scheduler step raised (already out of the batch)."""

    finished: list
    failed: list


@contextlib.contextmanager
def _scheduler_of(pipe, scheduler):
    """``pipe.scheduler`` is ``scheduler`` inside (the pipeline's ``prepare_latents`` and ``prepare_extra_step_kwargs``
    read it), and what it was afterwards."""
    before = pipe.scheduler
    pipe.scheduler = scheduler
    try:
        yield
    finally:
        pipe.scheduler = before


class StepBatch:
    """The in-flight txt2img requests of one ``StepKey`` on ``engine``, stepped together (see the module docstring).

    ``buckets``: UNet row counts a step is padded to; "auto" (default): ``BUCKETS`` when the UNet runs in CUDA
    graphs (the engine was optimized with them), else None: no padding (an eager UNet gains nothing from it).
    Not thread-safe: one thread (the one that owns the engine) calls every method.
    """

    def __init__(self, engine: Engine, key: StepKey, *, buckets="auto"):
        self.engine = engine
        self.key = key
        self.pipe = engine.pipe
        self.session = CallSession(self.pipe)
        self.xl = isinstance(self.pipe, _pipeline_classes()[1])
        self.buckets = (BUCKETS if self.session.graphed else None) if buckets == "auto" else (
            tuple(buckets) if buckets else None)
        self.slots: list[Slot] = []
        self._serials = itertools.count(1)
        self._cond = None  # (slot serials, padded rows) -> the concatenated conditioning, kept while unchanged

    # -- state ---------------------------------------------------------------------------------------------------
    @property
    def images(self) -> int:
        """Images in flight."""
        return sum(s.images for s in self.slots)

    @property
    def rows(self) -> int:
        """UNet rows of a step of every slot (before padding)."""
        return sum(s.rows for s in self.slots)

    def _what(self, images: int):
        """The words ``oom_guard`` puts in a host out-of-memory error, formatted only if one happens."""
        return lambda: f"{images} image(s) of {self.key.width}x{self.key.height} on {self.engine.device}"

    # -- joining -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def join(self, requests: list, tags=None) -> list:
        """Admit ``requests`` (``Txt2ImgRequest`` s of this batch's key) at this step boundary. Their texts are encoded
        in one text-encoder batch per kind (window count, CFG, with or without negative prompts).

        Returns one entry per request, in order: its new ``Slot`` (in ``self.slots``, ``slot.tag`` the matching entry
        of ``tags``), or the exception that refused it alone: what ``Engine.prepare`` raises (``InvalidRequestError``
        naming the field, as ``Engine.run`` would), or ``ValueError`` for a request of another key or that
        ``supports`` does not take. Raises ``torch.OutOfMemoryError`` (host allocation failures too) with no request
        admitted."""
        from .. import prompts as prompt_policy
        from ..prompts import PromptTokens

        tags = list(tags) if tags is not None else [None] * len(requests)
        out: list = [None] * len(requests)
        preps: list[tuple[int, PreparedRequest]] = []
        for i, request in enumerate(requests):
            try:
                if not supports(self.engine, request):
                    raise ValueError("step_batch: only plain txt2img requests on a StableDiffusion(XL)Pipeline engine "
                                     "without ControlNets are stepped (others run through Engine.run)")
                prep = self.engine.prepare(request, _stacklevel=3)
                got = StepKey(prep.width, prep.height, prep.report.chunks)
                if got != self.key:
                    raise ValueError(f"step_batch: a request of {got} joined the batch of {self.key}")
                preps.append((i, prep))
            except (ValueError, TypeError) as e:  # InvalidRequestError is a ValueError
                out[i] = e
        if not preps:
            return out
        pipe, device = self.pipe, self.pipe._execution_device
        made = []
        with oom_guard(self.session.graphs, what=self._what(sum(p.request.num_images for _, p in preps))):
            self.session.before_text_encoders()
            kinds: dict[tuple, list[tuple[int, PreparedRequest]]] = {}
            for i, prep in preps:
                kind = (prep.do_cfg, prep.negatives is None, prep.tokens.negatives is None)
                kinds.setdefault(kind, []).append((i, prep))
            for group in kinds.values():
                texts = self._encode(prompt_policy, PromptTokens, [p for _, p in group])
                for (i, prep), text in zip(group, texts):
                    made.append((i, self._slot(prep, text, device, tags[i])))
            if self.session.graphed:  # what a pipeline call does first: time-embedding refresh, graph check
                before_denoising(pipe, self.session.graphs)
        for i, slot in made:
            self.slots.append(slot)
            out[i] = slot
        self._cond = None
        return out

    def _encode(self, prompt_policy, PromptTokens, preps: list[PreparedRequest]) -> list[dict]:
        """The pipeline's text keyword arguments of each of ``preps`` (one kind: same CFG and negative-prompt
        presence), encoded in one batch by ``sdfast.prompts.encode_chunked``."""
        first = preps[0]
        prompts = [p for prep in preps for p in prep.prompts]
        negatives = None if first.negatives is None else [p for prep in preps for p in prep.negatives]
        tokens = PromptTokens.concat([prep.tokens for prep in preps])  # None: tokenized again by encode_chunked
        text = prompt_policy.encode_chunked(self.pipe, prompts, negatives, self.key.windows, do_cfg=first.do_cfg,
                                            batch_cfg=self.session.graphed, tokens=tokens)
        out, at = [], 0
        for prep in preps:
            n = len(prep.prompts)
            out.append({k: v[at:at + n] for k, v in text.items()})
            at += n
        return out

    def _slot(self, prep: PreparedRequest, text: dict, device, tag) -> Slot:
        """What the pipeline's ``__call__`` sets up for one request before its denoising loop, in its order."""
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps

        pipe, request = self.pipe, prep.request
        per_prompt, do_cfg = request.num_images_per_prompt, prep.do_cfg
        n = request.num_images
        scheduler = copy.deepcopy(prep.scheduler)  # its own state (step index, multistep history, PNDM's ets)
        if self.session.graphed:  # as CallSession.call: the graph runner takes a host timestep by value
            host_timesteps.keep_on_host(scheduler)
        else:
            host_timesteps.release(scheduler)
        if self.xl:
            embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
                prompt=None, device=device, num_images_per_prompt=per_prompt, do_classifier_free_guidance=do_cfg,
                negative_prompt=None, prompt_embeds=text["prompt_embeds"],
                negative_prompt_embeds=text.get("negative_prompt_embeds"),
                pooled_prompt_embeds=text["pooled_prompt_embeds"],
                negative_pooled_prompt_embeds=text.get("negative_pooled_prompt_embeds"))
        else:
            embeds, negative = pipe.encode_prompt(
                None, device, per_prompt, do_cfg, None, prompt_embeds=text["prompt_embeds"],
                negative_prompt_embeds=text.get("negative_prompt_embeds"))
            if do_cfg:
                embeds = torch.cat([negative, embeds])
        timesteps, _ = retrieve_timesteps(scheduler, request.num_inference_steps, device)
        with _scheduler_of(pipe, scheduler):
            latents = pipe.prepare_latents(n, pipe.unet.config.in_channels, prep.height, prep.width, embeds.dtype,
                                           device, prep.generators)
            extra = pipe.prepare_extra_step_kwargs(prep.generators, 0.0)
        added = None
        if self.xl:
            if pipe.text_encoder_2 is None:
                projection_dim = int(pooled.shape[-1])
            else:
                projection_dim = pipe.text_encoder_2.config.projection_dim
            size = (prep.height, prep.width)
            time_ids = pipe._get_add_time_ids(size, (0, 0), size, dtype=embeds.dtype,
                                              text_encoder_projection_dim=projection_dim)
            text_embeds = pooled
            if do_cfg:
                embeds = torch.cat([negative, embeds], dim=0)
                text_embeds = torch.cat([negative_pooled, text_embeds], dim=0)
                time_ids = torch.cat([time_ids, time_ids], dim=0)
            embeds = embeds.to(device)
            added = {"text_embeds": text_embeds.to(device), "time_ids": time_ids.to(device).repeat(n, 1)}
        timestep_cond = None
        if pipe.unet.config.time_cond_proj_dim is not None:
            w = torch.tensor(request.guidance_scale - 1).repeat(n)
            timestep_cond = pipe.get_guidance_scale_embedding(
                w, embedding_dim=pipe.unet.config.time_cond_proj_dim).to(device=device, dtype=latents.dtype)
        if self.xl and hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        return Slot(prep=prep, scheduler=scheduler, timesteps=timesteps, latents=latents, embeds=embeds, added=added,
                    timestep_cond=timestep_cond, extra=extra, tag=tag, serial=next(self._serials))

    # -- leaving -------------------------------------------------------------------------------------------------
    def leave(self, slot: Slot) -> None:
        """Take ``slot`` out of the batch (finished and decoded, cancelled, failed): its memory goes with it."""
        if slot in self.slots:
            self.slots.remove(slot)
            self._cond = None

    # -- one step ------------------------------------------------------------------------------------------------
    def _conditioning(self, slots: list[Slot], padded: int):
        """(encoder_hidden_states, added_cond_kwargs, timestep_cond) of ``slots`` concatenated and padded to
        ``padded`` rows; the same tensors while the slots are the same."""
        key = (tuple(s.serial for s in slots), padded)
        if self._cond is not None and self._cond[0] == key:
            return self._cond[1]

        def cat(parts):
            x = torch.cat(parts) if len(parts) > 1 else parts[0]
            pad = padded - x.shape[0]
            return x if pad <= 0 else torch.cat([x, x[:1].expand(pad, *x.shape[1:])])

        embeds = cat([s.embeds for s in slots])
        added = None
        if slots[0].added is not None:
            added = {name: cat([s.added[name] for s in slots]) for name in slots[0].added}
        tcond = cat([s.timestep_cond for s in slots]) if slots[0].timestep_cond is not None else None
        self._cond = (key, (embeds, added, tcond))
        return self._cond[1]

    def _timesteps(self, slots: list[Slot], padded: int, device) -> torch.Tensor:
        """The (padded,) float32 timesteps of the UNet's rows: each slot's current one, once per row."""
        ts = [s.timesteps[s.step] for s in slots]
        if all(t.device.type == "cpu" for t in ts):
            values = [float(t) for s, t in zip(slots, ts) for _ in range(s.rows)]
            values += values[:1] * (padded - len(values))
            host = torch.tensor(values, dtype=torch.float32)
            if device.type == "cuda":  # by value, without waiting for the GPU
                return host.pin_memory().to(device, non_blocking=True)
            return host.to(device)
        rows = [t.reshape(1).to(device=device, dtype=torch.float32).expand(s.rows) for s, t in zip(slots, ts)]
        x = torch.cat(rows)
        return torch.cat([x, x[:1].expand(padded - x.shape[0])]) if padded > x.shape[0] else x

    @torch.no_grad()
    def step(self, slots: list[Slot] | None = None) -> StepResult:
        """Advance ``slots`` (default: every slot; each must be in the batch and not done) by one denoising step in
        one UNet call (see the module docstring). UNet input: ``sample`` (B, C, h, w), ``timestep`` (B,) float32,
        ``encoder_hidden_states`` (B, 77·k, D), B the slots' rows padded to a bucket.

        Raises ``torch.OutOfMemoryError`` (host allocation failures too; graphs captured by the call are dropped) from
        the UNet call, with no slot advanced, so the caller may retry the slots in smaller groups (``slots=``). An
        exception of one slot's own scheduler step takes that slot out of the batch and is reported in
        ``StepResult.failed``; the others go on."""
        slots = list(self.slots) if slots is None else list(slots)
        if not slots:
            return StepResult([], [])
        pipe, device = self.pipe, self.pipe._execution_device
        rows = sum(s.rows for s in slots)
        padded = rows if self.buckets is None else bucket_rows(rows, self.buckets)
        with oom_guard(self.session.graphs, what=self._what(sum(s.images for s in slots))):
            inputs = []
            for s in slots:
                t = s.timesteps[s.step]
                x = torch.cat([s.latents] * 2) if s.prep.do_cfg else s.latents
                if hasattr(s.scheduler, "scale_model_input"):
                    x = s.scheduler.scale_model_input(x, t)
                inputs.append(x)
            sample = torch.cat(inputs) if len(inputs) > 1 else inputs[0]
            if padded > rows:
                sample = torch.cat([sample, sample[:1].expand(padded - rows, *sample.shape[1:])])
            embeds, added, tcond = self._conditioning(slots, padded)
            noise = pipe.unet(sample, self._timesteps(slots, padded, device), encoder_hidden_states=embeds,
                              timestep_cond=tcond, cross_attention_kwargs=None, added_cond_kwargs=added,
                              return_dict=False)[0]
        finished, failed, at = [], [], 0
        for s in slots:
            pred = noise[at:at + s.rows]
            at += s.rows
            try:
                if s.prep.do_cfg:
                    uncond, cond = pred.chunk(2)
                    pred = uncond + s.request.guidance_scale * (cond - uncond)
                s.latents = s.scheduler.step(pred, s.timesteps[s.step], s.latents, **s.extra, return_dict=False)[0]
            except Exception as e:  # noqa: BLE001 - this slot's scheduler state is unknown now: it leaves, alone
                self.leave(s)
                failed.append((s, e))
                continue
            s.step += 1
            if s.done:
                finished.append(s)
        return StepResult(finished, failed)

    # -- decoding ------------------------------------------------------------------------------------------------
    def _decode_xl(self, latents: torch.Tensor) -> torch.Tensor:
        """``StableDiffusionXLPipeline``'s decode: the VAE in fp32 while it decodes when it is fp16 and asks for it
        (``force_upcast``), the latents denormalized with the VAE's mean and std when it has them."""
        vae = self.pipe.vae
        upcast = vae.dtype == torch.float16 and vae.config.force_upcast
        if upcast:
            vae.to(dtype=torch.float32)  # what the pipeline's upcast_vae does
            latents = latents.to(next(iter(vae.post_quant_conv.parameters())).dtype)
        try:
            mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
            if mean is not None and std is not None:
                mean = torch.tensor(mean).view(1, 4, 1, 1).to(latents.device, latents.dtype)
                std = torch.tensor(std).view(1, 4, 1, 1).to(latents.device, latents.dtype)
                latents = latents * std / vae.config.scaling_factor + mean
            else:
                latents = latents / vae.config.scaling_factor
            return vae.decode(latents, return_dict=False)[0]
        finally:
            if upcast:
                vae.to(dtype=torch.float16)

    @torch.no_grad()
    def decode(self, slots: list[Slot]) -> list:
        """Decode finished ``slots`` in one VAE call. Returns one entry per slot: its images (``PIL.Image.Image`` s
        with ``Engine.txt2img``'s ``info``), or ``NonFiniteOutputError`` when any of its pixels was NaN/Inf (checked on
        the decoder's output, before clamping, and on the images). The slots stay in the batch (``leave`` them).
        Raises ``torch.OutOfMemoryError`` (host allocation failures too), nothing decoded."""
        if not slots:
            return []
        pipe = self.pipe
        latents = torch.cat([s.latents for s in slots]) if len(slots) > 1 else slots[0].latents
        with oom_guard(self.session.graphs, what=self._what(latents.shape[0])):
            if self.xl:
                image = self._decode_xl(latents)
                finite = torch.isfinite(image.flatten(1)).all(1)
                if getattr(pipe, "watermark", None) is not None:
                    image = pipe.watermark.apply_watermark(image)
                images = pipe.image_processor.postprocess(image, output_type="pt")
            else:
                generators = [g for s in slots for g in s.prep.generators]
                image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False,
                                        generator=generators)[0]
                finite = torch.isfinite(image.flatten(1)).all(1)
                image, nsfw = pipe.run_safety_checker(image, pipe._execution_device, slots[0].embeds.dtype)
                denormalize = [True] * image.shape[0] if nsfw is None else [not x for x in nsfw]
                images = pipe.image_processor.postprocess(image, output_type="pt", do_denormalize=denormalize)
            finite = finite & torch.isfinite(images.flatten(1)).all(1)
            pixels, _ = _to_uint8(images)
        finite = finite.tolist()
        out, at = [], 0
        for s in slots:
            n = s.images
            if all(finite[at:at + n]):
                out.append(pil_images(pixels[at:at + n], s.prep.seeds, s.prep.report, s.request.num_images_per_prompt))
            else:
                try:
                    self.session.check_finite(False, s.request.guidance_scale)
                except NonFiniteOutputError as e:
                    out.append(e)
            at += n
        return out
