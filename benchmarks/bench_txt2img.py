"""End-to-end benchmark (txt2img, img2img, inpainting): sdfast against stock diffusers and torch.compile, beside
published reference figures.

For each model (SD1.5 at 512², 50 steps; SDXL at 1024², 30 steps; batch 1, CFG 7.5, the same seed and
the same seeded random weights, or a real model folder with ``--model``) and each system of ``SYSTEMS``:

- ``warmup_s``: load (+ optimize / compile) to the first image, wall clock, synchronised;
- ``unet_ms_step``: median over every UNet call of the timed generations, CUDA events recorded by
  forward pre/post hooks on ``pipe.unet`` (they fire around CUDA-graph replays and around a
  ``torch.compile`` ``OptimizedModule``; wall clock on a CPU);
- ``e2e_s``: prompt to PIL images, median of ``--repeats`` generations, synchronised; ``img_s`` = batch / e2e_s;
- ``loop_ms_step``: the denoising loop's GPU span (``e2e_breakdown``) over its UNet calls: the whole step, with the
  scheduler and, with ``--controlnet``, the ControlNets (which run on a second stream beside the UNet's down blocks:
  their own hook timings, ``controlnet_ms_step``, then see only the main stream);
- ``peak_gib`` / ``peak_reserved_gib``: ``torch.cuda.max_memory_allocated/reserved`` over the timed
  generations (process peak RSS on a CPU);
- ``psnr_db``: PSNR of the system's image against stock fp16's (same seed and prompt; for stock itself,
  a timed image against its first one: run-to-run determinism); with ``--fp32-ref`` (default on) also
  ``fp32_check`` and its figures (``benchmarks.fidelity``): the error of one UNet step and of a few denoising steps
  against stock upcast to fp32, at the same inputs, as a ratio to stock fp16's (pass: at most 1.5x);
- ``second_size_s`` (with ``--second-size``): after the timed runs, the first image at width + 128, wall
  clock: what a new resolution costs an engine that is already warm (its graphs or recompilation).

Tasks (``--task``, a comma list, default txt2img; one row per system, model and task): each system is built and
warmed up once, with a txt2img image (``load_s`` and ``warmup_s`` are that, on each of its rows), then each task
runs on the same loaded system, txt2img first. img2img and inpaint (``TASKS``) take the same init image for every
system (``init_image``: seeded and smooth, at the run's size) and inpaint a centred rectangle mask (``centre_mask``);
``--strength`` (default: the task's, img2img 0.6, inpaint 1.0). Their rows add:

- ``first_image_s``: the first image of this task after the txt2img warm-up, wall clock (the task's pipeline built
  from the loaded one, its new modules' CUDA graphs or compilation);
- ``steps_run`` = ``int(steps * strength)``, the denoising steps that run; ``unet_ms_step`` is over those calls
  only, and ``step_vs_txt2img`` is it over the same system's txt2img ``unet_ms_step`` (issue 31's bar: <= 1.05);
- ``e2e_s`` with the VAE encode of the init image (``vae_encoder_ms`` in ``e2e_breakdown``); peak memory as above;
- ``psnr_db`` against stock diffusers' pipeline of the task (``Task.stock_pipeline``: e.g.
  ``StableDiffusionImg2ImgPipeline.from_pipe(pipe)``, called directly, not through the engine) on the same weights,
  inputs and seed; for stock itself, its engine's image against that pipeline's.

Speed tiers (issue 34): ``--cache-interval 2,3,5`` (with ``--cache-branch``, a comma list too) adds, after each
system's txt2img row, one txt2img row per DeepCache setting (``sdfast.runtime.deep_cache``) on the same loaded
system: ``tier`` names it; ``psnr_vs_exact_db`` and ``ssim_vs_exact`` (SSIM, Wang et al. 2004, Gaussian window, by
torchmetrics: the ``bench`` extra) compare its image with the same system's exact txt2img image, ``speedup_vs_exact``
is that row's e2e over this one's, ``unet_ms_full`` / ``unet_ms_shallow`` split the UNet calls; ``psnr_db`` stays
against stock fp16's exact image. ``--scheduler`` runs every generation on one of ``sdfast.SCHEDULERS`` (few-step
models: lcm, euler_a_trailing). ``--preset`` fills the flags of a named run (``PRESETS``: DeepCache on SD1.5 and
SDXL, the few-step settings); flags given with it win.

``--fp32-ref``, ``--second-size`` and ``--profile`` measure txt2img only. ``--save-images`` writes each row's image,
stock diffusers' reference images, the init image and the mask under ``--out``/images.

A system that fails gives a row with ``error`` filled (a task that fails: that task's row), and the run goes on.
Pipelines are freed between systems. Published figures (``benchmarks.reference``) are printed beside, never mixed
with, measured rows.

    python -m benchmarks.bench_txt2img --out benchmarks/results/h200      # or: sdfast bench ...
    python -m benchmarks.bench_txt2img --models tiny --steps 2 --size 64 --systems stock,sdfast
    python -m benchmarks.bench_txt2img --models sd15 --steps 30 --task txt2img,img2img,inpaint --no-fp32-ref
    python -m benchmarks.bench_txt2img --preset deepcache-sd15 --out benchmarks/results/h200-deepcache
    python -m benchmarks.bench_txt2img --preset turbo-sdxl-512 --out benchmarks/results/h200-fewstep

Adding a system (e.g. an sdfast preset) is one line in ``SYSTEMS``; adding a task is one ``Task`` in ``TASKS``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import statistics
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "a photo of an astronaut riding a horse on mars"
GUIDANCE = 7.5
DEFAULT_STEPS = {"tiny": 20, "sd15": 50, "sd21": 50, "sdxl": 30}
COMPILE_KWARGS = {"mode": "reduce-overhead", "fullgraph": True}

# Short stdout table: (key, header).
TABLE_COLUMNS = [
    ("system", "system"), ("model", "model"), ("size", "size"), ("steps", "steps"), ("warmup_s", "warmup s"),
    ("unet_ms_step", "UNet ms/step"), ("e2e_s", "e2e s"), ("img_s", "img/s"), ("peak_gib", "peak GiB"),
    ("psnr_db", "PSNR dB"), ("second_size_s", "2nd size s"),
]
MEASURED_KEYS = [k for k, _ in TABLE_COLUMNS]
# The speed tiers' table (``--cache-interval``): each against the same system's exact row.
TIER_TABLE_COLUMNS = [
    ("system", "system"), ("model", "model"), ("tier", "tier"), ("size", "size"), ("steps", "steps"),
    ("first_image_s", "first image s"), ("e2e_s", "e2e s"), ("speedup_vs_exact", "speedup"),
    ("unet_ms_full", "UNet full ms"), ("unet_ms_shallow", "UNet shallow ms"), ("psnr_vs_exact_db", "PSNR vs exact dB"),
    ("ssim_vs_exact", "SSIM vs exact"), ("psnr_db", "PSNR vs stock dB"),
]
# The same with a task other than txt2img among the rows: which task, its strength, and its own figures.
TASK_TABLE_COLUMNS = [
    ("system", "system"), ("model", "model"), ("task", "task"), ("strength", "strength"), ("size", "size"),
    ("steps", "steps"), ("steps_run", "steps run"), ("warmup_s", "warmup s"), ("first_image_s", "first image s"),
    ("unet_ms_step", "UNet ms/step"), ("step_vs_txt2img", "step / txt2img's"), ("e2e_s", "e2e s"),
    ("img_s", "img/s"), ("peak_gib", "peak GiB"), ("psnr_db", "PSNR dB"), ("second_size_s", "2nd size s"),
]


# ----------------------------------------------------------------------------- context and models


@dataclass
class Context:
    """Run-wide settings. ``device`` None: CUDA if available, else CPU (fp16 on CUDA, fp32 on CPU)."""

    device: object = None
    weight_seed: int = 0
    image_seed: int = 0
    batch: int = 1
    guidance_scale: float = GUIDANCE
    prompt: str = PROMPT
    repeats: int = 3
    profile: bool = False
    second_size: bool = False  # also time the first image at a second resolution (width + 128)
    strength: float | None = None  # every task's strength (None: each task's own default, ``Task.strength``)
    image_dir: Path | None = None  # where to save the images (``--save-images``), or None
    scheduler: str | None = None  # every generation's scheduler (``--scheduler``; None: the model's own)
    throughput: tuple[int, ...] = ()  # batches of the throughput sweep (``--throughput``), or none

    def __post_init__(self):
        from sdfast.loading import default_device_dtype

        self.device, self.dtype = default_device_dtype(self.device)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)


@dataclass
class ModelSpec:
    """One model to benchmark: ``source`` is what ``sdfast.load`` takes; ``arch`` selects the reference rows."""

    label: str
    source: str
    arch: str
    steps: int
    height: int | None = None  # None: the model's native size
    width: int | None = None
    fp32_ref: bool = False
    controlnet: tuple[str, ...] = ()  # ControlNets loaded with the model (``--controlnet``): every task takes control

    @property
    def side(self) -> int:
        """The model's native side in pixels (its UNet's sample size x 8)."""
        from sdfast.architectures import get_architecture

        return get_architecture(self.arch)["unet"]["sample_size"] * 8


def _detect_arch(source: str) -> str:
    """'sdxl' / 'sd21' / 'sd15' for a model folder or single-file checkpoint (default 'sd15')."""
    path = Path(source).expanduser()
    try:
        if path.is_dir() and (path / "model_index.json").is_file():
            cls = json.loads((path / "model_index.json").read_text()).get("_class_name", "")
            return "sdxl" if "XL" in cls else "sd15"
        if path.is_file():
            from sdfast.loading import _checkpoint_architecture

            return _checkpoint_architecture(path)
    except Exception:
        pass
    return "sdxl" if "xl" in source.lower() else "sd15"


def parse_size(text: str | None) -> tuple[int | None, int | None]:
    """'512' -> (512, 512); '768x512' -> width 768, height 512 (WIDTHxHEIGHT, as ``sdfast txt2img``). Returns (height, width).
    ValueError naming ``--size`` for anything else, or a side the engine refuses (``sdfast.request.check_side``), so
    a bad size fails before any model loads."""
    from sdfast.errors import InvalidRequestError
    from sdfast.request import check_side

    if not text:
        return None, None
    try:
        parts = [int(v) for v in str(text).lower().split("x")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2):
        raise ValueError(f"--size must be N or WIDTHxHEIGHT pixels, got {text!r}")
    width, height = parts * 2 if len(parts) == 1 else parts
    try:
        return check_side("height", height), check_side("width", width)
    except InvalidRequestError as e:
        raise ValueError(f"--size {text}: {e.field} {e.reason}") from None


def model_specs(args, ctx: Context) -> list[ModelSpec]:
    """The models of this run, from ``--model`` (one real model) or ``--models`` (random architectures)."""
    from sdfast.architectures import get_architecture

    height, width = parse_size(getattr(args, "size", None))
    if getattr(args, "model", None):
        pairs = [(Path(args.model).name or args.model, args.model, _detect_arch(args.model))]
    else:
        pairs = []
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            get_architecture(name)  # ValueError naming the known ones
            pairs.append((name, f"random:{name}", name))
    specs = []
    fp32 = getattr(args, "fp32_ref", None)
    controlnet = tuple(getattr(args, "controlnet", None) or ())
    for label, source, arch in pairs:
        specs.append(ModelSpec(
            label=label + "".join(f"+{Path(c).name.removeprefix('random:')}" for c in controlnet),
            source=source, arch=arch, controlnet=controlnet,
            steps=getattr(args, "steps", None) or DEFAULT_STEPS.get(arch, 50),
            height=height, width=width,
            fp32_ref=True if fp32 is None else fp32,
        ))
    return specs


def gen_kwargs(spec: ModelSpec, ctx: Context) -> dict:
    """``Engine.txt2img`` keyword arguments of every generation of this benchmark (with ControlNets: one control
    image each, ``control_image``, at the run's size)."""
    kwargs = dict(prompt=ctx.prompt, negative_prompt=None, num_inference_steps=spec.steps,
                  guidance_scale=ctx.guidance_scale, height=spec.height, width=spec.width, seed=ctx.image_seed,
                  num_images_per_prompt=ctx.batch)
    if ctx.scheduler is not None:
        kwargs["scheduler"] = ctx.scheduler
    if spec.controlnet:
        images = [control_image(spec.width or spec.side, spec.height or spec.side, seed=CONTROL_IMAGE_SEED + i)
                  for i in range(len(spec.controlnet))]
        kwargs["control_image"] = images[0] if len(images) == 1 else images
    return kwargs


# ----------------------------------------------------------------------------- tasks

INIT_IMAGE_SEED = 2024  # the init image's seed: one image for every system, whatever --seed is


def init_image(width: int, height: int, seed: int = INIT_IMAGE_SEED):
    """The init image of img2img and inpainting: RGB, ``width`` x ``height`` pixels, smooth and photo-like, the same
    for every system: a vertical gradient from sky blue to earth brown, plus a seeded 6x6 grid of colour offsets
    (+-48) resized bicubic by PIL (a landscape's low frequencies; no flat or all-zero area)."""
    import numpy as np
    from PIL import Image

    offsets = np.random.default_rng(seed).integers(0, 97, size=(6, 6, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(offsets).resize((width, height), Image.Resampling.BICUBIC), np.float64) - 48
    t = np.linspace(0.0, 1.0, height)[:, None, None]
    gradient = (1 - t) * np.array([135.0, 180.0, 230.0]) + t * np.array([115.0, 90.0, 60.0])
    return Image.fromarray(np.clip(gradient + smooth, 0, 255).round().astype(np.uint8))


CONTROL_IMAGE_SEED = 7  # the control images' seeds (ControlNet i: + i)


def control_image(width: int, height: int, seed: int = CONTROL_IMAGE_SEED):
    """A control image as a canny edge map looks: RGB, ``width`` x ``height``, white one-to-three-pixel strokes
    (seeded rectangles' outlines) on black, the same for every system."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (width, height), 0)
    draw = ImageDraw.Draw(image)
    for _ in range(16):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(width // 16, width // 3)), y0 + int(rng.integers(height // 16, height // 3))
        draw.rectangle([x0, y0, x1, y1], outline=(255, 255, 255), width=int(rng.integers(1, 4)))
    return image


def centre_mask(width: int, height: int):
    """The inpainting mask: ``L`` mode, ``width`` x ``height``, white (repainted) over the centred rectangle of half
    the width and half the height, black (kept) around it."""
    from PIL import Image, ImageDraw

    mask = Image.new("L", (width, height), 0)
    ImageDraw.Draw(mask).rectangle([width // 4, height // 4, width - width // 4 - 1, height - height // 4 - 1],
                                   fill=255)
    return mask


def _from_pipe(sd_class: str, xl_class: str, sd_controlnet_class: str, xl_controlnet_class: str) -> Callable:
    """``pipe -> diffusers.<class>.from_pipe(pipe)``: the XL class for an SDXL pipeline (it has ``text_encoder_2``),
    the ControlNet class for a pipeline with a ``controlnet``. The components are shared, so a torch.compile'd UNet
    stays compiled; ``dtype`` is the UNet's (without one, diffusers' ``from_pipe`` casts every component to fp32)."""
    def build(pipe):
        import diffusers

        xl = getattr(pipe, "text_encoder_2", None) is not None
        classes = ((sd_controlnet_class, xl_controlnet_class) if getattr(pipe, "controlnet", None) is not None
                   else (sd_class, xl_class))
        return getattr(diffusers, classes[xl]).from_pipe(pipe, dtype=pipe.unet.dtype)  # else from_pipe casts to fp32

    return build


@dataclass(frozen=True)
class Task:
    """One workload: ``method`` is the ``Engine`` method that runs it (every system runs it so, on its engine) and
    the task of the pipeline it runs (``Engine.pipeline_for(method)``, whose modules are timed);
    ``stock_pipeline(pipe)`` builds stock diffusers' pipeline of the task from a loaded txt2img pipeline (the fidelity
    reference, called directly); ``inputs(width, height)`` gives the extra call arguments of both (init image, mask,
    a control image), the same for every system; ``strength``: the default strength, None for a task without one.
    ``step_modules``: the pipeline's modules that one denoising step runs, in their order within the step (each timed
    by hooks; ``unet`` is ``unet_ms_step``); ``phases``: extra modules of the breakdown, name -> dotted attribute
    path on the pipeline (e.g. the VAE encoder). ``tier``: a speed tier's label (``deep_cache_task``), whose
    ``inputs`` are engine arguments that change the picture: its fidelity is against the same system's exact
    txt2img image."""

    name: str
    method: str
    stock_pipeline: Callable
    inputs: Callable[[int, int], dict] = lambda width, height: {}
    strength: float | None = None
    step_modules: tuple[str, ...] = ("unet",)
    phases: tuple[tuple[str, str], ...] = ()
    tier: str | None = None

    def steps_run(self, steps: int, strength: float | None) -> int:
        """The denoising steps that run: ``steps``, or ``int(steps * strength)`` (diffusers' ``get_timesteps``)."""
        return steps if strength is None else min(int(steps * strength), steps)


_VAE_ENCODE = (("vae_encoder", "vae.encoder"),)
TASKS: dict[str, Task] = {
    "txt2img": Task("txt2img", "txt2img", lambda pipe: pipe),
    "img2img": Task("img2img", "img2img",
                    _from_pipe("StableDiffusionImg2ImgPipeline", "StableDiffusionXLImg2ImgPipeline",
                               "StableDiffusionControlNetImg2ImgPipeline", "StableDiffusionXLControlNetImg2ImgPipeline"),
                    lambda width, height: {"image": init_image(width, height)}, strength=0.6, phases=_VAE_ENCODE),
    "inpaint": Task("inpaint", "inpaint",
                    _from_pipe("StableDiffusionInpaintPipeline", "StableDiffusionXLInpaintPipeline",
                               "StableDiffusionControlNetInpaintPipeline", "StableDiffusionXLControlNetInpaintPipeline"),
                    lambda width, height: {"image": init_image(width, height), "mask_image": centre_mask(width, height)},
                    strength=1.0, phases=_VAE_ENCODE),
}
SIZE_ARGS = ("height", "width")  # given only to a call that takes them (img2img's size is its image's)


def deep_cache_task(cache_interval: int, cache_branch: int = 0) -> Task:
    """txt2img with DeepCache (``Engine.txt2img(cache_interval=..., cache_branch=...)``): a speed tier."""
    return Task(f"txt2img+deepcache{cache_interval}b{cache_branch}", "txt2img", lambda pipe: pipe,
                lambda width, height: {"cache_interval": cache_interval, "cache_branch": cache_branch},
                tier=f"deepcache {cache_interval}/{cache_branch}")


def parse_ints(text: str | None, flag: str, lo: int) -> list[int]:
    """A comma list of integers >= ``lo`` (``--cache-interval``, ``--cache-branch``); [] for None."""
    if not text:
        return []
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes a comma list of integers, got {text!r}") from None
    if not values or any(v < lo for v in values):
        raise ValueError(f"{flag} takes integers >= {lo}, got {text!r}")
    return list(dict.fromkeys(values))


# Named runs (``--preset``): the flags each sets (flags given beside it win). DeepCache at the settings
# against the exact sdfast pipeline, at skip branch 0 (the shallowest: conv_in and the last up layer) and 2 (the first
# down block's layers and the whole last up block: branch 0 before branches were counted by skip connection); the
# few-step settings of SDXL-Turbo (512², 4 steps, no CFG), SDXL LCM(-LoRA) (1024², 4 steps, CFG at 1.5) and SD1.5
# LCM-LoRA (512², 4 steps, guidance 1: no CFG), stock beside sdfast (and, for SDXL, whose VAE decodes in fp32, sdfast
# with its decoder in bf16: a larger share of a 4-step image); throughput at MLPerf's SDXL setting (1024², 20 Euler
# steps, guidance 8.0) and the same for SD1.5 at 512², fp16 and 8-bit.
PRESETS: dict[str, dict] = {
    "deepcache-sd15": dict(models="sd15", steps=50, systems="sdfast", cache_interval="2,3,5", cache_branch="0,2",
                           fp32_ref=False),
    "deepcache-sdxl": dict(models="sdxl", steps=30, systems="sdfast", cache_interval="2,3,5", cache_branch="0,2",
                           fp32_ref=False),
    "turbo-sdxl-512": dict(models="sdxl", size="512", steps=4, guidance=0.0, scheduler="euler_a_trailing",
                           systems="stock,sdfast,sdfast-vae_bf16", repeats=10, fp32_ref=False),
    "lcm-sdxl-1024": dict(models="sdxl", steps=4, guidance=1.5, scheduler="lcm", systems="stock,sdfast,sdfast-vae_bf16",
                          repeats=10, fp32_ref=False),
    "lcm-sd15-512": dict(models="sd15", steps=4, guidance=1.0, scheduler="lcm", systems="stock,sdfast", repeats=10,
                         fp32_ref=False),
    "throughput-sdxl": dict(models="sdxl", steps=20, guidance=8.0, scheduler="euler", throughput="1,2,4,8",
                            systems="sdfast,sdfast-fp8-static-convs,sdfast-fp8-static-convs-vae_bf16", repeats=2,
                            fp32_ref=False),
    "throughput-sd15": dict(models="sd15", steps=20, guidance=8.0, scheduler="euler", throughput="1,4,8,16",
                            systems="sdfast,sdfast-fp8-static-convs", repeats=2, fp32_ref=False),
}


def parse_tasks(text: str) -> list[str]:
    """``--task``: a comma list of ``TASKS``, duplicates dropped, txt2img first (then in the order given)."""
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise ValueError(f"unknown task(s) {unknown}; known: {', '.join(TASKS)}")
    return sorted(names, key=lambda t: t != "txt2img")


def task_strength(task: Task, ctx: Context) -> float | None:
    return None if task.strength is None else (task.strength if ctx.strength is None else ctx.strength)


def _call(fn, kwargs: dict):
    """``fn(**kwargs)``, less the ``SIZE_ARGS`` that ``fn`` does not take."""
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k not in SIZE_ARGS or k in params})


def task_kwargs(task: Task, spec: ModelSpec, ctx: Context, inputs: dict) -> dict:
    """The engine method's keyword arguments: ``gen_kwargs`` with the task's inputs and strength."""
    strength = task_strength(task, ctx)
    return {**gen_kwargs(spec, ctx), **inputs, **({} if strength is None else {"strength": strength})}


def generate(engine, task: Task, kwargs: dict) -> list:
    """The task's images on ``engine`` (``Engine.<task.method>``)."""
    return _call(getattr(engine, task.method), kwargs)


def stock_reference(pipe, task: Task, kwargs: dict, size: tuple[int, int]):
    """Stock diffusers' image of ``task``: ``task.stock_pipeline(pipe)`` called directly with the engine call's
    arguments (``task_kwargs``), the size (``(width, height)``, where the pipeline takes it) and the engine's
    generators (image ``i``: a CPU generator seeded ``seed + i``). Returns the first image (PIL)."""
    import torch

    kw = dict(kwargs)
    seed, n = kw.pop("seed"), kw["num_images_per_prompt"]
    scheduler = kw.pop("scheduler", None)  # a scheduler object (``task_reference``)
    kw["width"], kw["height"] = size
    stock = task.stock_pipeline(pipe)
    if scheduler is not None:
        stock.scheduler = scheduler
    stock.set_progress_bar_config(disable=True)
    out = _call(stock, {**kw, "generator": [torch.Generator("cpu").manual_seed(seed + i) for i in range(n)]})
    return out.images[0]


# ----------------------------------------------------------------------------- systems


@dataclass
class Built:
    """A built system: its engine, the exact config that built it, what to report after the run, and cleanup."""

    engine: object
    config: dict
    info: Callable[[], dict] = dict
    cleanup: Callable[[], None] | None = None


@dataclass(frozen=True)
class System:
    name: str
    build: Callable[[ModelSpec, Context], Built]
    description: str


def _load(spec: ModelSpec, ctx: Context, optimize):
    import sdfast

    controlnet = None if not spec.controlnet else list(spec.controlnet) if len(spec.controlnet) > 1 else spec.controlnet[0]
    return sdfast.load(spec.source, device=ctx.device, seed=ctx.weight_seed, optimize=optimize, controlnet=controlnet)


def build_stock(spec: ModelSpec, ctx: Context) -> Built:
    engine = _load(spec, ctx, False)
    unet = engine.pipe.unet
    procs = {type(p).__name__ for p in unet.attn_processors.values()}
    return Built(engine, {"optimize": False, "dtype": str(engine.dtype), "attn_processors": sorted(procs)})


def build_compile(spec: ModelSpec, ctx: Context) -> Built:
    """Stock + ``pipe.unet = torch.compile(pipe.unet, **COMPILE_KWARGS)`` (diffusers accepts the
    ``OptimizedModule`` as its unet: attribute access is forwarded to the original module)."""
    import torch

    engine = _load(spec, ctx, False)
    engine.pipe.unet = torch.compile(engine.pipe.unet, **COMPILE_KWARGS)
    compiled = ["unet"]
    if len(engine.controlnets) == 1 and not hasattr(engine.pipe.controlnet, "nets"):  # one ControlNet: compiled too
        engine.pipe.controlnet = torch.compile(engine.pipe.controlnet, **COMPILE_KWARGS)
        compiled.append("controlnet")
    return Built(engine, {"optimize": False, "dtype": str(engine.dtype), "torch.compile": dict(COMPILE_KWARGS),
                          "compiled": compiled, "torch": torch.__version__},
                 cleanup=torch.compiler.reset)


def _sdfast_info(pipe) -> dict:
    state = getattr(pipe, "_sdfast", None)
    if state is None:
        return {}
    info = {"counts": dict(state.counts), "vae_upcast": state.vae_upcast}
    if state.graphs is not None:
        info["graphs"] = state.graphs.stats()
    info["attention"] = _attention_choices()
    return info


def _attention_choices() -> list[dict]:
    """What the attention choice picked per shape: ``kernels.select``'s "attention" decisions (key: Lq, Lk, heads,
    head_dim, dtype, mask, upcast and the dispatcher's options, e.g. the fp32 VAE's TF32), how each was made
    (measured, saved, pinned, only) and the µs each backend measured."""
    from kernels import select

    return [{"key": d.key, "picked": d.winner, "source": d.source, "device": d.device,
             "us": {b: round(t, 1) for b, t in sorted(d.times_us.items(), key=lambda x: x[1])}}
            for d in select.decisions("attention")]


def build_sdfast(spec: ModelSpec, ctx: Context, **config_kwargs) -> Built:
    """``sdfast.load(model, optimize=True)``, or ``optimize=OptimizeConfig(**config_kwargs)`` for a preset.
    The row's config is the pipeline's own ``pipe._sdfast.config.as_dict()``."""
    from sdfast import OptimizeConfig

    engine = _load(spec, ctx, OptimizeConfig(**config_kwargs) if config_kwargs else True)
    pipe = engine.pipe
    state = getattr(pipe, "_sdfast", None)
    if state is None:
        raise RuntimeError("sdfast.load(optimize=...) returned a pipeline without pipe._sdfast")
    return Built(engine, {"optimize": True, "dtype": str(engine.dtype), **state.config.as_dict()},
                 info=partial(_sdfast_info, pipe))


# Compressed-linear presets: name -> (sdfast function, config class name, config kwargs).
COMPRESSION = {
    "w8a8": ("quantize_", "W8A8Config", {}),
    "fp8": ("quantize_", "W8A8Config", {"dtype": "fp8"}),
    "fp8-static": ("quantize_", "W8A8Config", {"dtype": "fp8", "activations": "static", "alpha": 0.0}),
    "fp8-static-convs": ("quantize_", "W8A8Config", {"dtype": "fp8", "activations": "static", "alpha": 0.0,
                                                     "convs": True}),
    "w4a16": ("quantize_", "W4A16Config", {"method": "awq"}),
    "w4a16-gptq": ("quantize_", "W4A16Config", {"method": "gptq"}),
    "int8-outlier": ("quantize_", "Int8OutlierConfig", {}),
    "sparse24": ("sparsify_", "Sparse24Config", {"method": "magnitude"}),
    "sparsegpt": ("sparsify_", "Sparse24Config", {"method": "sparsegpt"}),
}
CALIBRATION_PROMPTS = [
    "a photo of a cat sitting on a windowsill, soft morning light",
    "a watercolor painting of a lighthouse on a rocky coast",
    "a portrait of an old fisherman, detailed, 85mm",
    "a futuristic city street at night with neon signs, rain",
]
CALIBRATION_STEPS = 4


def _layer_weight_bytes(unet) -> dict[str, int]:
    """Weight bytes of each plain linear and convolution (what a preset may convert), by module name."""
    import torch

    return {n: m.weight.numel() * m.weight.element_size() for n, m in unet.named_modules()
            if type(m) in (torch.nn.Linear, torch.nn.Conv2d)}


def build_sdfast_compressed(spec: ModelSpec, ctx: Context, *, preset: str, **config_kwargs) -> Built:
    """A preset: the stock pipeline, its UNet linears quantized or 2:4-pruned by ``sdfast.quantize_`` /
    ``sdfast.sparsify_`` with calibration on real prompts (``CALIBRATION_PROMPTS``, eager: the statistics
    are collected by forward hooks, which CUDA graphs would skip), then ``sdfast.optimize``. Reports the
    layers converted and their weight bytes against the original weights (``weight_ratio``; biases excluded,
    scales and metadata included). ``config_kwargs``: ``OptimizeConfig`` fields of the optimize after it."""
    import sdfast

    fn_name, config_name, kwargs = COMPRESSION[preset]
    if spec.arch == "tiny":
        kwargs = {**kwargs, "min_features": 32}  # the tiny UNet's linears are narrower than the default floor
    config = getattr(sdfast, config_name)(**kwargs)
    engine = _load(spec, ctx, False)
    pipe = engine.pipe
    before = _layer_weight_bytes(pipe.unet)

    def calibration():
        engine.txt2img(CALIBRATION_PROMPTS, num_inference_steps=CALIBRATION_STEPS, height=spec.height,
                       width=spec.width, seed=1)

    t0 = time.perf_counter()
    converted = int(getattr(sdfast, fn_name)(pipe.unet, config, calibration=calibration))
    compress_s = time.perf_counter() - t0
    replaced = {n: m for n, m in pipe.unet.named_modules() if n in before and type(m).__name__ not in ("Linear", "Conv2d")}
    after = sum(t.numel() * t.element_size() for m in replaced.values()
                for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)) if t is not getattr(m, "bias", None))
    sdfast.optimize(pipe, sdfast.OptimizeConfig(**config_kwargs) if config_kwargs else None)
    details = {"preset": preset, "layers": converted, "compress_s": compress_s,
               "weight_ratio": after / sum(before[n] for n in replaced) if replaced else None}
    def info():
        out = {**details, **_sdfast_info(pipe)}
        if fn_name == "sparsify_":  # which shapes ran sparse: the "sparse24" choices, per input signature
            out["sparse_shapes"] = [d for d in sdfast.decisions() if d["choice"] == "sparse24"]
            out["sparse_shapes_by_backend"] = dict(Counter(d["winner"].partition(":")[0] for d in out["sparse_shapes"]))
        return out

    return Built(engine, {"optimize": True, "dtype": str(engine.dtype), fn_name: config_name, **kwargs,
                          **pipe._sdfast.config.as_dict()}, info=info)


SYSTEMS: dict[str, System] = {
    "stock": System("stock", build_stock, "stock diffusers, eager, SDPA"),
    "compile": System("compile", build_compile, "stock + torch.compile(unet, mode='reduce-overhead', fullgraph=True)"),
    "sdfast": System("sdfast", build_sdfast, "sdfast.load(optimize=True): default OptimizeConfig"),
    # A/B of single OptimizeConfig flags against the default, in the same run
    "sdfast-no_fuse_qkv": System("sdfast-no_fuse_qkv", partial(build_sdfast, fuse_qkv=False),
                                 "sdfast, OptimizeConfig(fuse_qkv=False)"),
    "sdfast-kv_every_step": System("sdfast-kv_every_step", partial(build_sdfast, cross_kv_once=False),
                                   "sdfast, OptimizeConfig(cross_kv_once=False)"),
    "sdfast-control_embedding_every_step": System(
        "sdfast-control_embedding_every_step", partial(build_sdfast, control_embedding_once=False),
        "sdfast, OptimizeConfig(control_embedding_once=False)"),
    "sdfast-no_controlnet_overlap": System(
        "sdfast-no_controlnet_overlap", partial(build_sdfast, controlnet_overlap=False),
        "sdfast, OptimizeConfig(controlnet_overlap=False): the ControlNets on the UNet's stream"),
    "sdfast-vae_bf16": System("sdfast-vae_bf16", partial(build_sdfast, vae_decoder_dtype="bfloat16"),
                              "sdfast, OptimizeConfig(vae_decoder_dtype='bfloat16')"),
    "sdfast-vae_fp32_attention": System("sdfast-vae_fp32_attention", partial(build_sdfast, vae_tf32=False),
                                        "sdfast, OptimizeConfig(vae_tf32=False)"),
    "sdfast-no_upsample": System("sdfast-no_upsample", partial(build_sdfast, upsample=False),
                                 "sdfast, OptimizeConfig(upsample=False)"),
    "sdfast-no_batch_temb": System("sdfast-no_batch_temb", partial(build_sdfast, batch_temb=False),
                                   "sdfast, OptimizeConfig(batch_temb=False)"),
    "sdfast-no_skip_concat": System("sdfast-no_skip_concat", partial(build_sdfast, skip_concat=False),
                                    "sdfast, OptimizeConfig(skip_concat=False)"),
    "sdfast-no_conv_bias": System("sdfast-no_conv_bias", partial(build_sdfast, conv_bias=False),
                                  "sdfast, OptimizeConfig(conv_bias=False)"),
    "sdfast-serial_compile": System("sdfast-serial_compile", partial(build_sdfast, parallel_compile=False),
                                    "sdfast, OptimizeConfig(parallel_compile=False) (warm-up A/B: run it first, on a "
                                    "cold Triton cache)"),
    **{f"sdfast-{name}": System(f"sdfast-{name}", partial(build_sdfast_compressed, preset=name),
                                f"sdfast + {COMPRESSION[name][0]}({COMPRESSION[name][1]}"
                                f"({', '.join(f'{k}={v!r}' for k, v in COMPRESSION[name][2].items())}))")
       for name in COMPRESSION},
    "sdfast-fp8-static-convs-vae_bf16": System(
        "sdfast-fp8-static-convs-vae_bf16",
        partial(build_sdfast_compressed, preset="fp8-static-convs", vae_decoder_dtype="bfloat16"),
        "sdfast-fp8-static-convs with OptimizeConfig(vae_decoder_dtype='bfloat16'): everything 8-bit that pays, and "
        "the SDXL decoder in bf16 instead of fp32"),
}
DEFAULT_SYSTEMS = ("stock", "compile", "sdfast")


def parse_systems(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    return names


def free(built: Built | None) -> None:
    """Drop a built system's pipeline and give its GPU memory back before the next one is built."""
    import torch

    if built is not None:
        built.engine = None
        built.info = dict
        if built.cleanup is not None:
            try:
                built.cleanup()
            except Exception as e:  # cleanup must not hide the results
                print(f"warning: cleanup failed: {type(e).__name__}: {e}", file=sys.stderr)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- measuring


class UnetTimer:
    """Times every call of ``unet`` with forward pre/post hooks: CUDA events (``cuda=True``) or wall clock.

    The hooks live on the module the pipeline calls (``pipe.unet``): they fire around a forward that an
    instance attribute replaced (sdfast's CUDA-graph runner) and around a ``torch.compile``
    ``OptimizedModule`` (outside the compiled region). ``capture=True`` keeps a copy of the first call's
    inputs (``captured = (args, kwargs)``) for ``unet_profile.profile_unet_step``.
    """

    def __init__(self, unet, *, cuda: bool, capture: bool = False):
        self.unet = unet
        self.cuda = cuda
        self.capture = capture
        self.captured = None
        self.pairs: list = []
        self._start = None
        self._handles: list = []

    def _pre(self, module, args, kwargs):
        if self.capture and self.captured is None:
            from benchmarks.unet_profile import clone_inputs

            self.captured = (clone_inputs(tuple(args)), clone_inputs(dict(kwargs)))
        if self.cuda:
            import torch

            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def _post(self, module, args, kwargs, output):
        if self.cuda:
            import torch

            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self.pairs.append((self._start, end))
        self._start = None

    def __enter__(self):
        from sdfast.runtime.control_overlap import stream_safe

        # CUDA events only: a ControlNet may run on its own stream meanwhile; copying the inputs (capture) reads them
        pre = self._pre if self.capture else stream_safe(self._pre)
        self._handles = [self.unet.register_forward_pre_hook(pre, with_kwargs=True),
                         self.unet.register_forward_hook(stream_safe(self._post), with_kwargs=True)]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        return False

    def times_ms(self) -> list[float]:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in self.pairs]
        return [(e - s) * 1e3 for s, e in self.pairs]


def _phase_modules(pipe, extra: tuple[tuple[str, str], ...] = ()) -> dict:
    """The modules whose calls make up one image besides the denoising step: text encoder(s), VAE decoder, and
    ``extra`` (name, dotted attribute path on ``pipe``: a task's ``Task.phases``, e.g. the VAE encoder)."""
    mods = {name: getattr(pipe, name, None) for name in ("text_encoder", "text_encoder_2")}
    vae = getattr(pipe, "vae", None)
    mods["vae_decoder"] = getattr(vae, "decoder", None)
    for name, path in extra:
        mods[name] = _attribute(pipe, path)
    return {k: m for k, m in mods.items() if m is not None}


def _attribute(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def e2e_breakdown(step_timers, phase_timers: dict, e2e_s: list[float], repeats: int) -> dict:
    """Where one image's wall time goes, per image (ms): text encoder(s), VAE decoder (and a task's phases, e.g.
    the VAE encoder: their forwards' spans), the denoising loop's span from the first step module's first call's
    start to the last step module's last call's end, the UNet calls' sum inside it (``unet_sum_ms``; another step
    module's sum ``<name>_sum_ms``, e.g. a ControlNet's), ``loop_gaps_ms`` = span - those sums (scheduler steps,
    input copies and idle GPU), and ``rest_ms`` = e2e - the spans (host work before/after, image conversion).
    ``step_timers``: the UNet's ``UnetTimer``, or a dict name -> ``UnetTimer`` of the step modules in their order
    within a step (``Task.step_modules``). CUDA-event spans are GPU-timeline spans, so they include any idle GPU
    time between their two events."""
    if isinstance(step_timers, UnetTimer):
        step_timers = {"unet": step_timers}
    timers = list(step_timers.values())
    if not repeats or any(not t.pairs or len(t.pairs) % repeats for t in timers):
        return {}
    first, last = timers[0], timers[-1]
    spans = []
    for i in range(repeats):
        start = first.pairs[i * (len(first.pairs) // repeats)][0]
        end = last.pairs[(i + 1) * (len(last.pairs) // repeats) - 1][1]
        spans.append(start.elapsed_time(end) if first.cuda else (end - start) * 1e3)
    out = {"e2e_ms": statistics.median(e2e_s) * 1e3, "denoise_loop_ms": statistics.median(spans)}
    for name, t in step_timers.items():
        per, times = len(t.pairs) // repeats, t.times_ms()
        out[f"{name}_sum_ms"] = statistics.median(sum(times[i * per:(i + 1) * per]) for i in range(repeats))
    out["loop_gaps_ms"] = out["denoise_loop_ms"] - sum(out[f"{n}_sum_ms"] for n in step_timers)
    for name, t in phase_timers.items():
        out[f"{name}_ms"] = sum(t.times_ms()) / repeats
    out["rest_ms"] = out["e2e_ms"] - out["denoise_loop_ms"] - sum(out[f"{n}_ms"] for n in phase_timers)
    return out


def _pixels(img):
    import numpy as np

    return np.asarray(img.convert("RGB"), dtype=np.float64)


def psnr(a, b) -> float:
    """PSNR in dB of two 8-bit images (inf when identical)."""
    import numpy as np

    x, y = _pixels(a), _pixels(b)
    if x.shape != y.shape:
        raise ValueError(f"images differ in size: {x.shape} vs {y.shape}")
    mse = float(np.mean((x - y) ** 2))
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def ssim(a, b) -> tuple[float | None, str | None]:
    """SSIM of two 8-bit RGB images (Wang et al. 2004: 11-pixel Gaussian window, sigma 1.5, K1 0.01, K2 0.03,
    data range 255, the mean over the channels) by torchmetrics' ``structural_similarity_index_measure``, and None;
    or (None, why) when torchmetrics is not installed (``pip install 'sdfast[bench]'``)."""
    try:
        from torchmetrics.functional.image import structural_similarity_index_measure
    except ImportError as e:
        log(f"SSIM not computed: {e} (install the bench extra: pip install 'sdfast[bench]')")
        return None, f"torchmetrics not installed ({e})"
    import torch

    x, y = (torch.from_numpy(_pixels(im)).permute(2, 0, 1)[None] for im in (a, b))
    if x.shape != y.shape:
        raise ValueError(f"images differ in size: {tuple(x.shape)} vs {tuple(y.shape)}")
    return float(structural_similarity_index_measure(x, y, data_range=255.0)), None


def _full_and_shallow(unet_ms: list[float], repeats: int, interval: int) -> dict:
    """Median ms of the full and of the shallow UNet calls of DeepCache generations: call j of an image (0-based)
    is full iff ``j % interval == 0``."""
    per = len(unet_ms) // repeats if repeats else 0
    if not per:
        return {}
    full = [t for k, t in enumerate(unet_ms) if (k % per) % interval == 0]
    shallow = [t for k, t in enumerate(unet_ms) if (k % per) % interval != 0]
    return {"unet_ms_full": statistics.median(full) if full else None,
            "unet_ms_shallow": statistics.median(shallow) if shallow else None}


def mean_abs_error(a, b) -> float:
    """Mean |a − b| over all pixels and channels, in 8-bit units."""
    import numpy as np

    return float(np.mean(np.abs(_pixels(a) - _pixels(b))))


def _peak_memory(ctx: Context) -> tuple[float, float, str]:
    if ctx.cuda:
        import torch

        return (torch.cuda.max_memory_allocated(ctx.device) / 2**30, torch.cuda.max_memory_reserved(ctx.device) / 2**30,
                "torch.cuda.max_memory_allocated/reserved")
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return rss, rss, "process peak RSS (CPU run)"


def base_row(system: System, spec: ModelSpec, ctx: Context, task: Task | None = None) -> dict:
    task = task or TASKS["txt2img"]
    strength = task_strength(task, ctx)
    return {
        "system": system.name, "model": spec.label, "arch": spec.arch, "source": spec.source,
        "size": None if spec.height is None else f"{spec.width}x{spec.height}",
        "steps": spec.steps, "batch": ctx.batch, "guidance_scale": ctx.guidance_scale, "device": str(ctx.device),
        "dtype": str(ctx.dtype).replace("torch.", ""), "description": system.description,
        "task": task.name, "strength": strength, "steps_run": task.steps_run(spec.steps, strength),
        "scheduler": ctx.scheduler, "tier": task.tier, "cache_interval": None, "cache_branch": None,
        "psnr_vs_exact_db": None, "ssim_vs_exact": None, "speedup_vs_exact": None, "unet_ms_full": None,
        "unet_ms_shallow": None,
        "warmup_s": None, "load_s": None, "first_image_s": None, "unet_ms_step": None, "step_vs_txt2img": None,
        "unet_calls_per_image": None, "loop_ms_step": None, "e2e_s": None,
        "img_s": None, "peak_gib": None, "peak_reserved_gib": None, "psnr_db": None, "fp32_check": None,
        "err_fp32_step": None, "err_fp32_step_ratio": None, "err_fp32_steps": None, "err_fp32_steps_ratio": None,
        "e2e_all_s": None, "unet_timing": None, "memory_source": None,
        "config": None, "info": None, "error": None,
    }


def run_system(system: System, spec: ModelSpec, ctx: Context, refs: dict, tasks: list[Task] | None = None) -> list[dict]:
    """Build, warm up (one txt2img image), then time and check each task of ``tasks`` (default: txt2img) on one
    model; returns one row per task (``error`` set on failure: every row when the build or the warm-up failed,
    else the row of the task that failed).

    ``refs``: the images to compare with, by task: stock fp16's txt2img image (``"fp16"``), the fp32 reference
    (``"fp32"``) and stock diffusers' image of every other task (its name); the stock system fills them. Frees the
    pipeline before returning.
    """
    tasks = tasks or [TASKS["txt2img"]]
    rows = [base_row(system, spec, ctx, task) for task in tasks]
    kw = gen_kwargs(spec, ctx)
    built = engine = None
    stage = "build"
    free(None)  # whatever a previous system left must not count in this one's memory
    t_start = time.perf_counter()
    try:
        ctx.sync()
        t0 = time.perf_counter()
        built = system.build(spec, ctx)
        for row in rows:
            row["config"] = built.config
        ctx.sync()
        load_s = time.perf_counter() - t0
        engine = built.engine
        stage = "warm-up"
        first = engine.txt2img(**kw)
        ctx.sync()
        warmup_s = time.perf_counter() - t0
        w, h = first[0].size
        for row in rows:
            row.update(load_s=load_s, warmup_s=warmup_s, size=f"{w}x{h}")
        log(f"[{spec.label}/{system.name}] load {load_s:.1f} s, first image after {warmup_s:.1f} s")
        for task, row in zip(tasks, rows):
            _run_task(task, row, engine, system, spec, ctx, refs, first[0])
        info = built.info()
        for row in rows:
            row["info"] = info
    except Exception as e:  # a failed build or warm-up gives every row of this system the error; the run goes on
        for row in rows:
            row["error"] = row["error"] or f"{stage}: {type(e).__name__}: {e}".strip()[:500]
        log(f"[{spec.label}/{system.name}] FAILED in {stage}:\n{traceback.format_exc()}")
    finally:
        engine = None  # drop every local reference to the pipeline before freeing it
        free(built)
        built = None
    wall_s = time.perf_counter() - t_start
    base = next((r for r in rows if r["task"] == "txt2img"), None)
    for row in rows:
        row["wall_s"] = wall_s
        if row is not base and base is not None and row["unet_ms_step"] and base["unet_ms_step"]:
            row["step_vs_txt2img"] = row["unet_ms_step"] / base["unet_ms_step"]
        if row["tier"] and base is not None and row["e2e_s"] and base["e2e_s"]:
            row["speedup_vs_exact"] = base["e2e_s"] / row["e2e_s"]
    return rows


def _run_task(task: Task, row: dict, engine, system: System, spec: ModelSpec, ctx: Context, refs: dict,
              warmup_image) -> None:
    """Time and check one task on a warmed-up engine, into ``row`` (``error`` set when a stage fails)."""
    import torch

    label = f"{spec.label}/{system.name}" + ("" if task.name == "txt2img" else f"/{task.name}")
    w, h = warmup_image.size
    inputs = task.inputs(w, h)
    kw = task_kwargs(task, spec, ctx, inputs)
    timer = None
    stage = "first image"
    try:
        if task.name == "txt2img":
            first = warmup_image
        else:
            ctx.sync()
            t = time.perf_counter()
            first = generate(engine, task, kw)[0]
            ctx.sync()
            row["first_image_s"] = time.perf_counter() - t
            log(f"[{label}] first image after the txt2img warm-up: {row['first_image_s']:.2f} s")

        stage = "timed generations"
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        pipe = engine.pipeline_for(task.method)  # the diffusers pipeline the method runs: its modules are timed
        timer = UnetTimer(pipe.unet, cuda=ctx.cuda, capture=ctx.profile and task.name == "txt2img")
        step_modules = (("controlnet",) if getattr(pipe, "controlnet", None) is not None else ()) + task.step_modules
        steps = {name: timer if name == "unet" else UnetTimer(getattr(pipe, name), cuda=ctx.cuda,
                                                              capture=ctx.profile and task.name == "txt2img")
                 for name in step_modules}
        phases = {k: UnetTimer(m, cuda=ctx.cuda) for k, m in _phase_modules(pipe, task.phases).items()}
        e2e = []
        with contextlib.ExitStack() as stack:
            for tm in (*steps.values(), *phases.values()):
                stack.enter_context(tm)
            for _ in range(ctx.repeats):
                ctx.sync()
                t = time.perf_counter()
                images = generate(engine, task, kw)
                ctx.sync()
                e2e.append(time.perf_counter() - t)
        unet_ms = timer.times_ms()
        row["peak_gib"], row["peak_reserved_gib"], row["memory_source"] = _peak_memory(ctx)
        row["e2e_all_s"] = e2e
        row["e2e_s"] = statistics.median(e2e)
        row["img_s"] = ctx.batch / row["e2e_s"]
        row["unet_ms_step"] = statistics.median(unet_ms) if unet_ms else None
        row["unet_calls_per_image"] = len(unet_ms) / ctx.repeats
        if task.tier:
            interval = inputs["cache_interval"]
            row["cache_interval"], row["cache_branch"] = interval, inputs["cache_branch"]
            row.update(_full_and_shallow(unet_ms, ctx.repeats, interval))
        for name, t in steps.items():
            if name != "unet" and t.times_ms():
                row[f"{name}_ms_step"] = statistics.median(t.times_ms())
        row["unet_timing"] = "cuda events (hooks)" if ctx.cuda else "wall clock (hooks, CPU)"
        row["e2e_breakdown"] = e2e_breakdown(steps, phases, e2e, ctx.repeats)
        if row["e2e_breakdown"] and row["unet_calls_per_image"]:  # the step as a whole: ControlNets on a second
            row["loop_ms_step"] = row["e2e_breakdown"]["denoise_loop_ms"] / row["unet_calls_per_image"]  # stream too
        log(f"[{label}] e2e {row['e2e_s']:.3f} s, UNet {row['unet_ms_step']:.2f} ms/step")

        stage = "fidelity"
        image = images[0]
        if ctx.image_dir is not None:
            _save(ctx, f"{spec.label}-{system.name}-{task.name}", image)
        if task.tier:
            if refs.get("fp16") is not None:
                row["psnr_db"] = psnr(image, refs["fp16"])
            exact = refs.get(f"exact:{system.name}")
            if exact is not None:
                row["psnr_vs_exact_db"] = psnr(image, exact)
                row["ssim_vs_exact"], note = ssim(image, exact)
                if note:
                    row["ssim_note"] = note
        elif task.name == "txt2img":
            refs[f"exact:{system.name}"] = image  # the speed tiers' reference: this system's exact image
            if system.name == "stock":
                refs["fp16"] = first
            if refs.get("fp16") is not None:
                row["psnr_db"] = psnr(image, refs["fp16"])
            if spec.fp32_ref and system.name == "stock":
                refs["fp32"] = fidelity_reference(engine, spec, ctx)
            if refs.get("fp32") is not None:
                from benchmarks import fidelity

                row.update(fidelity.compare(engine, refs["fp32"]))
        else:
            if system.name == "stock":
                task_reference(engine, task, spec, ctx, refs, (w, h))
            if refs.get(task.name) is not None:
                row["psnr_db"] = psnr(image, refs[task.name])

        if ctx.second_size and task.name == "txt2img":
            stage = "second size"
            kw2 = dict(kw, width=w + 128, height=h)
            ctx.sync()
            t = time.perf_counter()
            engine.txt2img(**kw2)
            ctx.sync()
            row["second_size_s"] = time.perf_counter() - t
            row["second_size"] = f"{w + 128}x{h}"
            log(f"[{label}] first image at {row['second_size']}: {row['second_size_s']:.2f} s")

        if ctx.throughput and task.name == "txt2img":
            stage = "throughput"
            row.update(measure_throughput(engine, kw, ctx, label))

        if ctx.profile and timer.captured is not None:
            stage = "profile"
            from benchmarks.unet_profile import profile_unet_step

            row["profile"] = profile_unet_step(engine.pipe.unet, *timer.captured)
            for name, t in steps.items():  # the ControlNet's step too (one ControlNet; several run in one module)
                if name != "unet" and t.captured is not None and not hasattr(getattr(pipe, name), "nets"):
                    row[f"profile_{name}"] = profile_unet_step(getattr(pipe, name), *t.captured)
    except Exception as e:  # one failing task gives an error row; the other tasks go on
        row["error"] = f"{stage}: {type(e).__name__}: {e}".strip()[:500]
        log(f"[{label}] FAILED in {stage}:\n{traceback.format_exc()}")
    finally:
        timer = None


def measure_throughput(engine, kw: dict, ctx: Context, label: str) -> dict:
    """Images per second at each batch of ``ctx.throughput`` (``num_images_per_prompt``; the UNet runs twice that
    with CFG), in ascending order: one untimed generation per batch (its CUDA graphs), then ``min(ctx.repeats, 3)``
    timed ones, their median. Returns ``throughput`` ([{batch, e2e_s, img_s}] or an ``error`` per batch: an out-of-memory batch ends
    the sweep), ``best_img_s`` and ``best_batch``."""
    import torch

    points = []
    for batch in sorted(ctx.throughput):  # ascending: an out-of-memory batch ends the sweep, the larger ones would too
        kwb = dict(kw, num_images_per_prompt=batch)
        try:
            engine.txt2img(**kwb)
            times = []
            for _ in range(min(ctx.repeats, 3)):
                ctx.sync()
                t = time.perf_counter()
                engine.txt2img(**kwb)
                ctx.sync()
                times.append(time.perf_counter() - t)
        except torch.cuda.OutOfMemoryError as e:
            points.append(dict(batch=batch, error=f"OutOfMemoryError: {str(e)[:200]}"))
            log(f"[{label}] throughput: batch {batch} ran out of memory; the sweep stops there")
            break
        e2e = statistics.median(times)
        points.append(dict(batch=batch, e2e_s=e2e, img_s=batch / e2e))
        log(f"[{label}] throughput: batch {batch}: {e2e:.3f} s, {batch / e2e:.2f} images/s")
    ok = [p for p in points if "img_s" in p]
    best = max(ok, key=lambda p: p["img_s"]) if ok else None
    return dict(throughput=points, best_img_s=best and best["img_s"], best_batch=best and best["batch"])


def task_reference(engine, task: Task, spec: ModelSpec, ctx: Context, refs: dict, size: tuple[int, int]) -> None:
    """``refs[task.name]``: stock diffusers' image of ``task`` (``stock_reference``) on a stock engine's pipeline,
    with the task's inputs at ``size`` (width, height)."""
    kw = task_kwargs(task, spec, ctx, task.inputs(*size))
    if kw.get("scheduler") is not None:
        kw["scheduler"] = engine.scheduler_for(kw["scheduler"])
    refs[task.name] = stock_reference(engine.pipe, task, kw, size)
    if ctx.image_dir is not None:
        _save(ctx, f"{spec.label}-stock_diffusers-{task.name}", refs[task.name])
        for name, value in kw.items():
            if name in ("image", "mask_image"):
                _save(ctx, f"{spec.label}-{task.name}-{name}", value)


def _save(ctx: Context, name: str, image) -> None:
    ctx.image_dir.mkdir(parents=True, exist_ok=True)
    image.save(ctx.image_dir / f"{name}.png")


def fidelity_reference(engine, spec: ModelSpec, ctx: Context):
    """The fp32 reference of ``benchmarks.fidelity`` from a stock engine, at this run's prompt, guidance and size."""
    from benchmarks import fidelity

    return fidelity.reference(engine, prompt=ctx.prompt, guidance_scale=ctx.guidance_scale, height=spec.height,
                              width=spec.width, batch=ctx.batch)


def reference_only(spec: ModelSpec, ctx: Context, refs: dict, tasks: list[Task] | None = None) -> None:
    """Stock fp16 (and fp32) reference images when 'stock' is not among the measured systems: its txt2img image,
    and stock diffusers' image of every other task of ``tasks``."""
    built = None
    try:
        built = build_stock(spec, ctx)
        refs["fp16"] = built.engine.txt2img(**gen_kwargs(spec, ctx))[0]
        if spec.fp32_ref:
            refs["fp32"] = fidelity_reference(built.engine, spec, ctx)
        for task in tasks or []:
            if task.name != "txt2img" and not task.tier:
                task_reference(built.engine, task, spec, ctx, refs, refs["fp16"].size)
    except Exception as e:
        log(f"[{spec.label}] stock reference image failed: {type(e).__name__}: {e}")
    finally:
        free(built)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- output


def _task(row: dict) -> str:
    return row.get("task") or "txt2img"  # result files from before --task have no task: txt2img


def _label(row: dict) -> str:
    """'model/system', and '/task' for a task other than txt2img ('/' and the tier for a speed tier)."""
    if row.get("tier"):
        return f"{row['model']}/{row['system']}/{row['tier']}"
    return f"{row['model']}/{row['system']}" + ("" if _task(row) == "txt2img" else f"/{_task(row)}")


def render(rows: list[dict], env: dict, *, profile: bool = False) -> str:
    """The stdout report: measured table, failures, fidelity vs fp32, TensorRT note, published rows."""
    from benchmarks import reference
    from benchmarks.fidelity import FEW_STEPS as FEW, MAX_RATIO as MAX
    from benchmarks.report import fmt, markdown_table, tensorrt_note

    gpu = env.get("gpu") or f"CPU ({env.get('platform', '')})"
    tiers = [r for r in rows if r.get("tier")]
    rows = [r for r in rows if not r.get("tier")]
    tasks = any(_task(r) != "txt2img" for r in rows)
    out = [f"## Measured here: {gpu}, torch {env.get('torch')}, diffusers {env.get('diffusers')}, "
           f"{rows[0]['dtype'] if rows else ''}, batch {rows[0]['batch'] if rows else ''}, CFG "
           f"{rows[0]['guidance_scale'] if rows else ''}"
           + (f", scheduler {rows[0]['scheduler']}" if rows and rows[0].get("scheduler") else ""), "",
           markdown_table(rows, TASK_TABLE_COLUMNS if tasks else TABLE_COLUMNS), "",
           "warmup: load (+ optimize/compile/capture) to the first image; UNet ms/step: median over every UNet call "
           "of the timed generations; e2e: prompt to PIL, median; peak: max allocated over the timed generations; "
           "PSNR: against stock fp16's image, same seed (stock: a timed image against its first, inf = deterministic)."]
    if tasks:
        out.append("Tasks other than txt2img: warmup is the system's txt2img warm-up; first image: the task's first "
                   "image after it; steps run: int(steps x strength), the UNet calls the median is over; step / "
                   "txt2img's: UNet ms/step over the same system's txt2img one; e2e includes the VAE encode of the "
                   "init image; PSNR: against stock diffusers' pipeline of the task (from_pipe, called directly), same "
                   "inputs and seed (stock: its engine's image against that pipeline's).")
    if tiers:
        out += ["", "### Speed tiers: the same system's exact image and e2e as the reference", "",
                markdown_table(tiers, TIER_TABLE_COLUMNS), "",
                "tier: DeepCache cache_interval/cache_branch; speedup: the same system's exact e2e over this one; "
                "PSNR / SSIM vs exact: against that system's exact txt2img image (same seed); PSNR vs stock: against "
                "stock fp16's exact image; UNet full / shallow: median ms of each kind of call."]
    failed = [r for r in rows + tiers if r.get("error")]
    for r in failed:
        out.append(f"- {_label(r)} failed: {r['error']}")
    for model in dict.fromkeys(r["model"] for r in rows):
        fp32 = [r for r in rows if r["model"] == model and r.get("fp32_check") is not None]
        if fp32:
            parts = [f"{r['system']} {r['fp32_check']} (1 step {fmt(r['err_fp32_step'])}, "
                     f"{fmt(r['err_fp32_step_ratio'])}x; {FEW} steps {fmt(r['err_fp32_steps'])}, "
                     f"{fmt(r['err_fp32_steps_ratio'])}x)" for r in fp32]
            out.append(f"- {model} error vs stock fp32 at the same inputs, relative, and its ratio to stock fp16's "
                       f"(pass: both ratios <= {MAX}x): " + "; ".join(parts))
    for r in rows:
        info = r.get("info") or {}
        if info.get("preset"):
            out.append(f"- {r['model']}/{r['system']}: {info['layers']} layers converted in "
                       f"{fmt(info['compress_s'])} s (calibration on {len(CALIBRATION_PROMPTS)} prompts, "
                       f"{CALIBRATION_STEPS} steps), their weights {fmt(info['weight_ratio'])}x the original bytes")
    swept = [r for r in rows if r.get("throughput")]
    if swept:
        batches = list(dict.fromkeys(p["batch"] for r in swept for p in r["throughput"]))
        table = [dict(system=_label(r), **{f"batch {p['batch']}": fmt(p.get("img_s")) if "img_s" in p else "OOM"
                                            for p in r["throughput"]},
                      best=f"{fmt(r['best_img_s'])} (batch {r['best_batch']})" if r.get("best_img_s") else "—")
                 for r in swept]
        out += ["", "### Throughput: images/s per GPU at each batch (images per prompt; the UNet runs 2x with CFG)", "",
                markdown_table(table, ["system", *[f"batch {b}" for b in batches], "best"]), "",
                "Median of the timed generations at each batch, after one untimed generation (its CUDA graphs)."]
        for model in dict.fromkeys(r["model"] for r in swept):
            for ref in reference.reference_rows(model):
                if ref["unit"] == "images/s per GPU":
                    out.append(f"- {ref['label']}: {ref['system']}, {ref['gpu']}, {ref['model_size_steps']}: "
                               f"{ref['figure']} ({ref['source']})")
    split = [r for r in rows + tiers if r.get("e2e_breakdown")]
    if split:
        keys = list(dict.fromkeys(k for r in split for k in r["e2e_breakdown"]))
        table = [dict(system=_label(r), **{k: r["e2e_breakdown"].get(k) for k in keys}) for r in split]
        out += ["", "### Where one image's time goes (ms, per image; see `e2e_breakdown`)", "",
                markdown_table(table, ["system", *keys])]
    if profile:
        from benchmarks.unet_profile import format_breakdown

        for r in rows:
            for key, what in (("profile", "UNet"), ("profile_controlnet", "ControlNet")):
                if r.get(key):
                    out += ["", f"### {what} step breakdown: " + f"{r['model']}/{r['system']}", "",
                            format_breakdown(r[key])]
    out += ["", tensorrt_note(), "",
            f"## Reference ({reference.LABEL}: other GPUs, sizes and steps; figures as published)", "",
            markdown_table(reference.REFERENCE, reference.COLUMNS)]
    return "\n".join(out)


def write_outputs(out_dir, rows: list[dict], env: dict, args: dict, text: str) -> list[Path]:
    """txt2img.csv / .json / .png / .md (and profile.csv with --profile) in ``out_dir``."""
    from benchmarks import reference
    from benchmarks.report import flatten_env, plot_txt2img, tensorrt_note, write_csv, write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    csv_rows = [{**{k: v for k, v in r.items() if not k.startswith("profile")}, **flatten_env(env)} for r in rows]
    csv_rows += [{"system": r["system"], "model": r["model_size_steps"], "arch": r["arch"], "size": r["size"],
                  "steps": r["steps"], "e2e_s": r["e2e_s"], "unet_ms_step": r["unet_ms_step"], "gpu": r["gpu"],
                  "figure": r["figure"], "source": r["source"], "published": reference.LABEL}
                 for r in reference.REFERENCE]
    paths.append(write_csv(out / "txt2img.csv", csv_rows))
    paths.append(write_json(out / "txt2img.json", {
        "env": env, "args": args, "tensorrt": tensorrt_note(), "rows": [{**r, "env": env} for r in rows],
        "reference": reference.REFERENCE,
    }))
    measured = [r for r in rows]
    paths.append(plot_txt2img(out / "txt2img.png", measured, reference.REFERENCE))
    (out / "txt2img.md").write_text(text + "\n")
    paths.append(out / "txt2img.md")
    prof = [{"model": r["model"], "system": r["system"], "module": module, "category": c, "us_per_step": v["us"],
             "kernels_per_step": v["kernels"]}
            for r in rows for key, module in (("profile", "unet"), ("profile_controlnet", "controlnet"))
            if r.get(key) for c, v in r[key]["categories"].items()]
    if prof:
        paths.append(write_csv(out / "profile.csv", prof))
    return paths


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sdfast bench", description="end-to-end benchmark (txt2img, img2img, inpainting): "
                                                          "sdfast vs stock diffusers vs torch.compile")
    p.add_argument("--model", default=None, help="a real model (folder, .safetensors, hub id); else --models random archs")
    p.add_argument("--controlnet", action="append", default=None, metavar="MODEL",
                   help="load every model with this ControlNet (repeat for several; e.g. random:controlnet-sd15): "
                        "every task then runs diffusers' ControlNet pipeline of the task with a control image, and "
                        "the step time adds the ControlNets' (controlnet_ms_step)")
    p.add_argument("--models", default="sd15,sdxl", help="random architectures: tiny, sd15, sd21, sdxl (default sd15,sdxl)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default 50 for SD1.x/2.x, 30 for SDXL)")
    p.add_argument("--size", default=None, help="N or WIDTHxHEIGHT pixels (default: the model's native size)")
    p.add_argument("--batch", type=int, default=1, help="images per prompt (the UNet runs 2x that with CFG)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--repeats", type=int, default=3, help="timed generations per system (e2e median)")
    p.add_argument("--guidance", type=float, default=GUIDANCE)
    p.add_argument("--seed", type=int, default=0, help="image seed (weights of random archs use seed 0)")
    p.add_argument("--fp32-ref", dest="fp32_ref", action=argparse.BooleanOptionalAction, default=None,
                   help="also check the error against stock fp32 at the same inputs (benchmarks.fidelity; default: on)")
    p.add_argument("--out", default=None, help="write txt2img.csv/.json/.png/.md here")
    p.add_argument("--profile", action="store_true", help="per-kernel-category breakdown of one UNet step per system")
    p.add_argument("--device", default=None, help="cuda / cuda:1 / cpu (default: cuda if available)")
    p.add_argument("--task", default="txt2img",
                   help=f"comma list of {', '.join(TASKS)} (default txt2img): each runs on the same loaded systems, "
                        "after one txt2img warm-up; txt2img first")
    p.add_argument("--strength", type=float, default=None,
                   help="strength of every task that takes one (default: img2img "
                        f"{TASKS['img2img'].strength}, inpaint {TASKS['inpaint'].strength})")
    p.add_argument("--save-images", action="store_true",
                   help="with --out: save each row's image, stock diffusers' reference images, the init image and the "
                        "mask under OUT/images")
    p.add_argument("--scheduler", default=None,
                   help="every generation's scheduler, one of sdfast.SCHEDULERS (default: the model's own; few-step "
                        "runs: lcm, euler_a_trailing)")
    p.add_argument("--cache-interval", default=None, metavar="N[,N...]",
                   help="speed tiers: after each system's txt2img row, one row per DeepCache cache_interval (>= 2, "
                        "e.g. 2,3,5) on the same system, with PSNR / SSIM against its exact image and its speedup")
    p.add_argument("--cache-branch", default="0", metavar="B[,B...]",
                   help="DeepCache's cache_branch of those rows (default 0, the shallowest; SD 1.x/2.x 0-11, SDXL "
                        "0-8; a comma list runs every pair)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="a named run: sets the flags of PRESETS[name] (flags given beside it win)")
    p.add_argument("--throughput", default=None, metavar="B[,B...]",
                   help="after each system's timed txt2img images, images/s at each of these batches (e.g. 1,2,4,8): "
                        "best_img_s and best_batch, beside the published MLPerf figure (preset throughput-sdxl: "
                        "MLPerf's setting, 20 Euler steps at guidance 8.0)")
    p.add_argument("--second-size", action="store_true",
                   help="after the timed runs, time the first image at a second resolution (width + 128): what a new "
                        "shape costs once warmed up (graph capture / recompilation)")
    return p


def main(argv=None) -> int:
    """Run the benchmark (see the module docstring); returns 0, or 1 when every measured row failed."""
    from benchmarks.report import env_metadata

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.preset is not None:  # the preset's values as defaults: the flags given beside it win
        parser.set_defaults(**PRESETS[args.preset])
        args = parser.parse_args(argv)
    try:
        systems = parse_systems(args.systems)
        tasks = [TASKS[t] for t in parse_tasks(args.task)]
        if args.scheduler is not None:
            from sdfast.schedulers import SCHEDULERS

            if args.scheduler not in SCHEDULERS:
                raise ValueError(f"--scheduler: unknown scheduler {args.scheduler!r}; known: {', '.join(SCHEDULERS)}")
        intervals = parse_ints(args.cache_interval, "--cache-interval", 2)
        branches = parse_ints(args.cache_branch, "--cache-branch", 0) or [0]
        throughput = tuple(parse_ints(args.throughput, "--throughput", 1))
        tasks += [deep_cache_task(n, b) for n in intervals for b in branches]
        if args.repeats < 1 or args.batch < 1 or (args.steps is not None and args.steps < 1):
            raise ValueError("--repeats, --batch and --steps must be >= 1")
        if args.strength is not None and not 0 < args.strength <= 1:
            raise ValueError(f"--strength must be in (0, 1], got {args.strength}")
        ctx = Context(device=args.device, image_seed=args.seed, batch=args.batch, guidance_scale=args.guidance,
                      repeats=args.repeats, profile=args.profile, second_size=args.second_size,
                      strength=args.strength, scheduler=args.scheduler, throughput=throughput,
                      image_dir=Path(args.out) / "images" if args.out and args.save_images else None)
        specs = model_specs(args, ctx)
        for spec in specs:
            for task in tasks:
                if task.steps_run(spec.steps, task_strength(task, ctx)) < 1:
                    raise ValueError(f"--task {task.name}: {spec.steps} steps at strength {task_strength(task, ctx)} "
                                     "run no denoising step (int(steps * strength) = 0)")
    except ValueError as e:
        parser.error(str(e))
    t_run = time.perf_counter()
    env = env_metadata()
    order = sorted(systems, key=lambda s: s != "stock")  # stock first: the others compare with its image
    rows = []
    for spec in specs:
        refs: dict = {}
        if "stock" not in order:
            reference_only(spec, ctx, refs, tasks)
        for name in order:
            rows.extend(run_system(SYSTEMS[name], spec, ctx, refs, tasks))
            if args.out:  # after every row: a run cut by a time limit keeps what it measured
                write_outputs(args.out, rows, env, {**vars(args), "partial": True}, render(rows, env, profile=args.profile))
    text = render(rows, env, profile=args.profile)
    print(text)
    total = time.perf_counter() - t_run
    print(f"\ntotal benchmark time {total:.0f} s", flush=True)
    if args.out:
        for path in write_outputs(args.out, rows, env, {**vars(args), "total_s": total}, text):
            log(f"wrote {path}")
    return 0 if any(not r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
