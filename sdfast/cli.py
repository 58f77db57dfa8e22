"""The ``sdfast`` command: ``sdfast txt2img``, ``sdfast serve``, ``sdfast bench``.

``txt2img`` builds one ``sdfast.request.Txt2ImgRequest`` from its flags (validated once, before the model loads)
and hands it to ``Engine.run``. ``serve`` and ``bench`` import ``server`` and ``benchmarks`` only when they run, so
the library never imports them.

Bad input (an argument out of range, a missing model, an unknown scheduler) prints one line
``sdfast: error: ...`` and exits with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

RANDOM_NOTE = (
    "note: {model} has random weights, so the image is noise. For real images point --model at a "
    "diffusers model folder, a .safetensors checkpoint or a hub id (e.g. --model ./stable-diffusion-v1-5)."
)


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must look like WIDTHxHEIGHT, e.g. 512x512 (got {text!r})") from None
    return w, h


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be an integer in [0, 65535] (got {text!r})")
    return port


def default_model() -> str:
    """``random:sd15`` on a GPU, ``random:tiny`` on a CPU."""
    import torch

    return "random:sd15" if torch.cuda.is_available() else "random:tiny"


def _add_generation_flags(p, *, size: bool) -> None:
    """The flags txt2img and img2img share (``--size`` only for txt2img: img2img's size is its image's)."""
    from sdfast.schedulers import SCHEDULERS

    p.add_argument("--model", default=None, help="model folder, .safetensors file, hub id or random:<arch> (default: random:sd15 on a GPU, random:tiny on a CPU)")
    p.add_argument("--steps", type=int, default=30, help="denoising steps (default: 30)")
    p.add_argument("--guidance", type=float, default=7.5, help="guidance_scale; <= 1 turns CFG off (default: 7.5)")
    if size:
        p.add_argument("--size", type=_size, default=None, help="WIDTHxHEIGHT in pixels (default: the model's native size)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: a random one, printed)")
    p.add_argument("--n", type=int, default=1, help="images to generate")
    p.add_argument("--negative", default=None, help="negative prompt")
    p.add_argument("--scheduler", default=None,
                   help=f"{', '.join(SCHEDULERS)} (default: the model's own; few-step models: lcm for LCM / LCM-LoRA, "
                        "euler_a_trailing for SDXL-Turbo, euler_trailing for SDXL-Lightning)")
    p.add_argument("--out", default="sdfast.png",
                   help="output file: .png, .jpg/.jpeg or .webp (the format follows the extension; the parameters go "
                        "into the file), or a folder (ending in /) for sdfast.png in it; with --n > 1, _0, _1, ... are "
                        "appended")
    p.add_argument("--quality", type=int, default=None,
                   help="JPEG / WebP quality, 0 to 100 (default: 90); not for PNG, which is lossless")
    p.add_argument("--cache-interval", type=int, default=1, metavar="N",
                   help="DeepCache: the full UNet runs every N-th step, the steps between only its shallow branch on "
                        "the cached deep features (faster; the image changes a little); 1 (default): the exact "
                        "pipeline")
    p.add_argument("--cache-branch", type=int, default=0, metavar="B",
                   help="DeepCache's skip branch, with --cache-interval > 1: the shallow steps run the UNet's skip "
                        "connections 0 to B and the last B + 1 up layers; 0 (default, the shallowest and fastest) to "
                        "11 on SD 1.x/2.x, 8 on SDXL (everything but the mid block)")
    p.add_argument("--no-optimize", action="store_true", help="run the stock diffusers pipeline")
    p.add_argument("--vae-decoder-dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="keep the VAE's decoder in this dtype (OptimizeConfig.vae_decoder_dtype; e.g. bfloat16 for "
                        "SDXL, whose config asks for an fp32 VAE: faster, a little less exact; default: the model's)")
    p.add_argument("--controlnet", action="append", default=None, metavar="MODEL",
                   help="a ControlNet: a ControlNetModel folder, a .safetensors file, a hub id or random:<name> "
                        "(e.g. random:controlnet-sd15); repeat it for several (multi-ControlNet)")
    p.add_argument("--control-image", action="append", default=None, metavar="FILE",
                   help="the control image of each --controlnet, in the same order (e.g. a canny edge map)")
    p.add_argument("--controlnet-scale", action="append", type=float, default=None, metavar="S",
                   help="controlnet_conditioning_scale: once for all, or once per --controlnet (default: "
                        "diffusers' for the task: 1.0 txt2img, 0.8 img2img, 0.5 SD inpainting)")
    p.add_argument("--control-start", action="append", type=float, default=None, metavar="F",
                   help="control_guidance_start: the fraction of the steps before the ControlNets apply; once for "
                        "all, or once per --controlnet (default: 0)")
    p.add_argument("--control-end", action="append", type=float, default=None, metavar="F",
                   help="control_guidance_end: the fraction of the steps after which they stop; once for all, or "
                        "once per --controlnet (default: 1)")


def _add_txt2img(sub) -> None:
    p = sub.add_parser("txt2img", help="generate images from a prompt")
    p.add_argument("prompt")
    _add_generation_flags(p, size=True)
    p.set_defaults(func=cmd_generate)


def _add_img2img(sub) -> None:
    p = sub.add_parser("img2img", help="generate images from an init image and a prompt",
                       usage="sdfast img2img [IMAGE] PROMPT [--image IMAGE] [options]")
    p.add_argument("positional", nargs="+", metavar="[IMAGE] PROMPT",
                   help="the init image file (PNG, JPEG, WebP, ...; or give it with --image) and the prompt; the "
                        "images come back at its size, rounded down to multiples of 8")
    p.add_argument("--image", dest="image_flag", default=None, metavar="IMAGE", help="the init image file")
    p.add_argument("--strength", type=float, default=0.8,
                   help="how far the image is noised, in (0, 1]: int(steps x strength) steps run (default: 0.8)")
    _add_generation_flags(p, size=False)
    p.set_defaults(func=cmd_generate)


def _add_inpaint(sub) -> None:
    p = sub.add_parser("inpaint", help="repaint the masked part of an image from a prompt",
                       usage="sdfast inpaint [IMAGE MASK] PROMPT [--image IMAGE --mask MASK] [options]")
    p.add_argument("positional", nargs="+", metavar="[IMAGE MASK] PROMPT",
                   help="the image file (the images come back at its size, rounded down to multiples of 8), the mask "
                        "file (the image's size: white is repainted, black kept) and the prompt; or give the two files "
                        "with --image and --mask")
    p.add_argument("--image", dest="image_flag", default=None, metavar="IMAGE", help="the image file")
    p.add_argument("--mask", dest="mask_flag", default=None, metavar="MASK", help="the mask file")
    p.add_argument("--strength", type=float, default=1.0,
                   help="how far the masked part is noised, in (0, 1]: int(steps x strength) steps run (default: 1.0)")
    _add_generation_flags(p, size=False)
    p.set_defaults(func=cmd_generate)


def _out_paths(out: str, n: int) -> list[Path]:
    """The file of each image: ``out`` (``.png`` added when it has no extension), with ``_0``, ``_1``, ...
    before the extension when n > 1. Raises ValueError for an extension other than .png, .jpg/.jpeg and .webp or a
    folder that cannot be written, before anything is generated."""
    from sdfast.png import format_for_path

    path = Path(out)
    if out.endswith(("/", "\\")) or path.is_dir():  # a folder: the image goes inside it
        path = path / "sdfast.png"
    if not path.suffix:
        path = path.with_suffix(".png")
    try:
        format_for_path(path)
    except ValueError as e:
        raise ValueError(f"--out: {e}") from None
    blocker = next((p for p in (path.parent, *path.parent.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise ValueError(f"--out: {blocker} is a file, not a folder")
    try:  # a real write: permission bits do not tell (root, read-only mounts, /proc)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as e:
        raise ValueError(f"--out: cannot create a file in {path.parent} ({e.strerror or e})") from None
    if n == 1:
        return [path]
    return [path.with_name(f"{path.stem}_{i}{path.suffix}") for i in range(n)]


def _check_steps_before_load(steps: int, scheduler: str | None) -> None:
    """The step limit of the SD family's schedulers (1000 training timesteps, steps_offset 1: 999; LCM 50), before
    the slow load. The engine checks again against the loaded model's own scheduler config."""
    from sdfast.schedulers import check_steps, make_scheduler

    sd_config = {"num_train_timesteps": 1000, "steps_offset": 1}
    check_steps(steps, make_scheduler(scheduler or "pndm", sd_config), scheduler or "model's")


# The txt2img / img2img flag of each engine argument, for the error messages (``--steps: must be ...``).
_FLAGS = {"num_inference_steps": "--steps", "guidance_scale": "--guidance", "height": "--size", "width": "--size",
          "seed": "--seed", "num_images_per_prompt": "--n", "negative_prompt": "--negative", "scheduler": "--scheduler",
          "strength": "--strength", "image": "image", "mask_image": "mask", "control_image": "--control-image",
          "controlnet_conditioning_scale": "--controlnet-scale", "control_guidance_start": "--control-start",
          "control_guidance_end": "--control-end", "cache_interval": "--cache-interval",
          "cache_branch": "--cache-branch"}


def _flag_error(e) -> str:
    """An ``InvalidRequestError`` worded with the CLI's flag: ``--size: height must be ...``, ``--steps: ...``."""
    flag = _FLAGS.get(e.field)
    if flag is None:
        return str(e)
    return f"{flag}: {e.field} {e.reason}" if e.field in ("height", "width") else f"{flag}: {e.reason}"


def _files_and_prompt(args) -> None:
    """img2img / inpaint: ``args.image``, ``args.mask`` and ``args.prompt`` from the positional arguments and the
    ``--image`` / ``--mask`` flags (either spelling: ``sdfast img2img IN.png PROMPT`` or ``sdfast img2img PROMPT
    --image IN.png``). ValueError for another count."""
    files = ("image",) if args.command == "img2img" else ("image", "mask")
    flags = {f: getattr(args, f"{f}_flag", None) for f in files}
    given = [f for f in files if flags[f] is not None]
    if given and len(given) != len(files):
        raise ValueError(f"--{(set(files) - set(given)).pop()}: give it with --{given[0]} (or both as positionals)")
    expected = 1 if given else len(files) + 1
    if len(args.positional) != expected:
        want = "PROMPT" if given else " ".join(f.upper() for f in files) + " PROMPT"
        raise ValueError(f"{args.command} takes {want} as positional arguments, got {len(args.positional)}: "
                         f"{args.positional!r} (quote a prompt with spaces)")
    values = [flags[f] for f in files] if given else args.positional[:-1]
    for f, v in zip(files, values):
        setattr(args, f, v)
    args.prompt = args.positional[-1]


def cmd_generate(args) -> int:
    from sdfast.errors import InvalidRequestError

    if args.command in ("img2img", "inpaint"):
        _files_and_prompt(args)
    try:
        return _generate(args)
    except InvalidRequestError as e:  # the engine names its argument: name the flag
        raise ValueError(_flag_error(e)) from None


def _generate(args) -> int:
    import sdfast
    from sdfast.png import check_quality, format_for_path, save_image
    from sdfast.request import Img2ImgRequest, InpaintRequest, Txt2ImgRequest

    if args.model is not None and not args.model.strip():
        raise ValueError("--model is empty")
    model = args.model or default_model()
    # The request, validated once, before the (slow) load, so bad input answers at once; the engine runs it as is.
    common = dict(negative_prompt=args.negative, num_inference_steps=args.steps, guidance_scale=args.guidance,
                  seed=args.seed, num_images_per_prompt=args.n, scheduler=args.scheduler,
                  cache_interval=args.cache_interval, cache_branch=args.cache_branch, **_control_flags(args))
    if args.command == "img2img":
        request = Img2ImgRequest.build(_read_image(args.image), args.prompt, strength=args.strength, **common)
    elif args.command == "inpaint":
        request = InpaintRequest.build(_read_image(args.image), _read_image(args.mask, "mask"), args.prompt,
                                       strength=args.strength, **common)
    else:
        width, height = args.size or (None, None)
        request = Txt2ImgRequest.build(args.prompt, height=height, width=width, **common)
    _check_steps_before_load(args.steps, args.scheduler)
    paths = _out_paths(args.out, args.n)
    fmt = format_for_path(paths[0])
    if fmt == "png" and args.quality is not None:
        raise ValueError(f"--quality: only for .jpg/.jpeg and .webp files; PNG ({paths[0].name}) is lossless")
    try:
        check_quality(fmt, args.quality)
    except ValueError as e:  # "quality: ..."
        raise ValueError(f"--{e}") from None
    if model.startswith("random:"):
        from sdfast.architectures import get_architecture

        get_architecture(model.split(":", 1)[1])
        print(RANDOM_NOTE.format(model=model), file=sys.stderr)
    t0 = time.perf_counter()
    controlnet = None if not args.controlnet else args.controlnet[0] if len(args.controlnet) == 1 else args.controlnet
    if args.no_optimize and args.vae_decoder_dtype:
        raise ValueError("--vae-decoder-dtype is an optimization: it does not go with --no-optimize")
    optimize = (not args.no_optimize) if args.vae_decoder_dtype is None else sdfast.OptimizeConfig(
        vae_decoder_dtype=args.vae_decoder_dtype)
    engine = sdfast.load(model, optimize=optimize, controlnet=controlnet)
    print(f"loaded {model} on {engine.device} ({str(engine.dtype).replace('torch.', '')}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    t1 = time.perf_counter()
    images = engine.run(request, progress=True)
    took = time.perf_counter() - t1
    for img, path in zip(images, paths):
        path.parent.mkdir(parents=True, exist_ok=True)
        params = {"prompt": args.prompt, "negative_prompt": args.negative, "seed": int(img.info["seed"]),
                  "steps": args.steps, "guidance_scale": args.guidance, "scheduler": args.scheduler,
                  "width": img.width, "height": img.height, "model": model}
        if args.command in ("img2img", "inpaint"):
            params.update(init_image=str(args.image), strength=args.strength)
        if args.command == "inpaint":
            params.update(mask_image=str(args.mask))
        if args.cache_interval != 1:
            params.update(cache_interval=args.cache_interval, cache_branch=args.cache_branch)
        if args.controlnet:
            params.update(controlnet=args.controlnet, control_image=args.control_image,
                          controlnet_conditioning_scale=args.controlnet_scale,
                          control_guidance_start=args.control_start, control_guidance_end=args.control_end)
        save_image(img, path, format=fmt, quality=args.quality, parameters=params)
        print(f"saved {path} ({img.width}x{img.height}, seed {img.info['seed']}) in {took:.2f} s")
    return 0


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="run the HTTP image-generation service")
    p.add_argument("--model", default=None, help="as for txt2img (default: random:sd15 on a GPU, random:tiny on a CPU)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (default: 8000)")
    p.add_argument("--max-batch", type=int, default=4,
                   help="at most this many images in one engine call, and per request (default: 4)")
    p.add_argument("--queue", type=int, default=64, help="requests waiting at most; more get 429 (default: 64)")
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="continuous (default): txt2img requests join and leave the running batch at every denoising "
                        "step; static: compatible requests queued together run as one engine call to completion")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="a request's deadline, queue and generation: past it the answer is 504 and its generation "
                        "stops at the next step (default: $SDFAST_REQUEST_TIMEOUT, else 300)")
    p.add_argument("--read-timeout", type=float, default=None, metavar="SECONDS",
                   help="a client that has not sent its complete request (headers and body) this long after "
                        "connecting is disconnected (default: 30)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections at most; past it the oldest without a complete request is closed "
                        "(default: 256)")
    p.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="comma-separated Host header names accepted, '*.example.com' for subdomains, '*' for any "
                        "(default: localhost, 127.0.0.1, [::1] when --host is loopback, else any)")
    p.add_argument("--controlnet", action="append", default=None, metavar="MODEL",
                   help="load the model with this ControlNet (as for txt2img); repeat it for several: every request "
                        "then sends one control_image per ControlNet, in this order")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    try:
        from server.app import serve
    except ImportError as e:
        raise SystemExit(f"sdfast: error: the service needs the server extra (pip install 'sdfast[server]'): {e}")
    return serve(model=args.model or default_model(), host=args.host, port=args.port,
                 max_batch=args.max_batch, queue_size=args.queue, request_timeout_s=args.request_timeout,
                 read_timeout_s=args.read_timeout, max_connections=args.max_connections,
                 allowed_hosts=args.allowed_hosts, controlnet=args.controlnet, batching=args.batching) or 0


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmark against stock diffusers and torch.compile", add_help=False)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args, rest: list[str]) -> int:
    try:
        from benchmarks.bench_txt2img import main as bench_main
    except ImportError as e:
        raise SystemExit(f"sdfast: error: the benchmark needs sdfast's benchmarks package (a source checkout): {e}")

    return bench_main(rest) or 0


class _LogFormat(logging.Formatter):
    """``logger: message``, without repeating the name when the message already starts with "sdfast"."""

    def format(self, record: logging.LogRecord) -> str:
        msg = super().format(record)
        return msg if msg.startswith("sdfast") else f"{record.name}: {msg}"


class _Parser(argparse.ArgumentParser):
    """argparse with the one-line error of the rest of the CLI (``sdfast: error: ...``, exit code 2)."""

    def error(self, message):
        self.exit(2, f"sdfast: error: {message} (see: {self.prog} --help)\n")


def _control_flags(args) -> dict:
    """The request's ControlNet arguments from ``--controlnet`` / ``--control-image`` / ``--controlnet-scale`` /
    ``--control-start`` / ``--control-end``; ValueError (before the load) unless there is one control image per
    ControlNet."""
    nets, images = args.controlnet or [], args.control_image or []
    if len(images) != len(nets):
        raise ValueError(f"--control-image: one per --controlnet, in the same order (got {len(nets)} ControlNet(s) "
                         f"and {len(images)} image(s))")
    if not nets:
        for flag, value in (("--controlnet-scale", args.controlnet_scale), ("--control-start", args.control_start),
                            ("--control-end", args.control_end)):
            if value is not None:
                raise ValueError(f"{flag}: only with --controlnet")
        return {}
    from sdfast.controlnet import check_name

    for name in nets:  # an unknown random: name or a missing path, before the base model loads
        try:
            check_name(name)
        except Exception as e:  # ModelNotFoundError: worded with the flag
            raise ValueError(f"--controlnet: {str(e).removeprefix('controlnet: ')}") from None
    read = [_read_image(path, "--control-image") for path in images]

    def value(values, default):  # once for all (a number), or one per ControlNet (a list)
        return default if values is None else values[0] if len(values) == 1 else values

    return dict(control_image=read[0] if len(read) == 1 else read,
                controlnet_conditioning_scale=value(args.controlnet_scale, None),
                control_guidance_start=value(args.control_start, 0.0), control_guidance_end=value(args.control_end, 1.0))


def _read_image(path: str, what: str = "image"):
    """An image file (the init image, a mask or a control image: ``what``) as a PIL image, turned upright by its EXIF
    orientation (as diffusers' ``load_image`` and the service do), in its own mode: the request converts it, and
    refuses the modes whose conversion to 8 bits would clip (16-bit, float). ValueError naming it when it is missing or
    not an image."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            return ImageOps.exif_transpose(image)  # a copy either way: usable after the file closes
    except (OSError, UnidentifiedImageError) as e:
        raise ValueError(f"{what}: cannot read {path!r} as an image ({e})") from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sdfast", description="Fast Stable Diffusion inference")
    parser.add_argument("-v", "--verbose", action="store_true", help="log sdfast's decisions (kernel choices, fallbacks)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_txt2img(sub)
    _add_img2img(sub)
    _add_inpaint(sub)
    _add_serve(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(_LogFormat())
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, handlers=[handler])
    if args.command == "bench":
        return cmd_bench(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from sdfast.errors import HubOfflineError, InvalidRequestError, ModelNotFoundError, NonFiniteOutputError

    try:
        return args.func(args)
    except (InvalidRequestError, ModelNotFoundError, HubOfflineError, ValueError, TypeError) as e:
        print(f"sdfast: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteOutputError as e:
        print(f"sdfast: error: {e}", file=sys.stderr)
        return 1
    except MemoryError as e:
        print(f"sdfast: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # torch.OutOfMemoryError (CUDA or host memory) is a RuntimeError
        if type(e).__name__ != "OutOfMemoryError":
            raise
        print(f"sdfast: error: out of memory: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
