"""Turning what a user names into a diffusers pipeline.

``model`` may be: a local diffusers pipeline folder (SD 1.x, 2.x, SDXL); a single-file ``.safetensors``
/ ``.ckpt`` checkpoint (loaded offline with the configs that ship with sdfast); a hub id; a built-in
architecture with seeded random weights (``random:tiny|tiny-v|tiny-xl|sd15|sd21|sdxl``, and the inpainting
checkpoints ``random:tiny-inpaint|tiny-xl-inpaint|sd15-inpaint|sd2-inpaint|sdxl-inpaint``); or a pipeline object.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from . import architectures
from .errors import HubOfflineError, ModelNotFoundError

log = logging.getLogger("sdfast")

ASSETS = Path(__file__).parent / "assets"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


class _DropMessages(logging.Filter):
    """A logging filter dropping records whose message contains one of ``fragments``."""

    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(f in record.getMessage() for f in self.fragments)


@contextlib.contextmanager
def quiet_loading():
    """While loading: drop transformers' "`CLIPImageProcessor` requires torchvision (not installed); falling back to
    `CLIPImageProcessorPil`" messages (logged when diffusers' pipeline modules import the image processors that SD's
    safety checker uses; sdfast never runs them). Only those messages, only inside the block: the filter sits on the
    one logger that emits them and is removed afterwards. Likewise diffusers' "There are modules in UNet2DConditionModel
    that should be kept in float32: []" of a single-file load, with its empty list (no module is concerned), which
    SDXL's img2img and inpaint pipelines also log at every call of an unoptimized engine (they cast the VAE with
    ``.to()`` for ``force_upcast``): ``Engine.run`` calls the pipeline inside this block too."""
    filters = [(logging.getLogger("transformers.utils.import_utils"),
                _DropMessages("requires torchvision (not installed); falling back to")),
               (logging.getLogger("diffusers.models.modeling_utils"), _DropMessages("that should be kept in float32: []."))]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)


def default_device_dtype(device=None, dtype=None) -> tuple[torch.device, torch.dtype]:
    """CUDA and fp16 when a GPU is present, else CPU and fp32 (each overridable; ``dtype`` may also be a
    name: "float16", "bfloat16", "float32"). Raises ValueError for an unknown or unavailable device and
    TypeError for a dtype that is not a floating-point type."""
    try:
        dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {device!r} is not a torch device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} asked for, but this torch has no usable CUDA GPU")
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in _DTYPES:
            raise TypeError(f"dtype: {dtype!r} is not one of {', '.join(_DTYPES)}")
        dtype = _DTYPES[dtype.removeprefix("torch.")]
    if dtype is None:
        dtype = torch.float16 if dev.type == "cuda" else torch.float32
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: must be a floating-point torch.dtype such as torch.float16, got {dtype!r}")
    return dev, dtype


@lru_cache(maxsize=4)
def clip_tokenizer(pad_token: str = "<|endoftext|>"):
    """The CLIP BPE tokenizer SD uses, from sdfast's package data (no network).

    SD 1.x and SDXL's first tokenizer pad with ``<|endoftext|>``; SD 2.x and SDXL's second with ``!`` (id 0).
    """
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(str(ASSETS / "clip"), pad_token=pad_token, model_max_length=77)


def _text_encoder(cfg: dict):
    import transformers

    cfg = dict(cfg)
    cls = getattr(transformers, cfg.pop("class"))
    config = transformers.CLIPTextConfig(**cfg)
    config._attn_implementation = "sdpa"
    return cls(config)


def build_random_pipeline(name: str, *, device=None, dtype=None, seed: int = 0):
    """The real architecture ``name`` with seeded random weights, built directly on ``device``.

    The same (name, seed, device) gives the same weights. Raises ``ValueError`` for an unknown name.
    """
    import diffusers

    arch = architectures.get_architecture(name)
    device, dtype = default_device_dtype(device, dtype)
    # Seeded in a fork of the RNGs: the caller's global random state is left as it was.
    cuda_devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    # Built directly in ``dtype`` on ``device``: fast for SDXL's 2.6B parameters, and no later cast.
    with torch.random.fork_rng(devices=cuda_devices), torch.device(device), _default_dtype(dtype):
        torch.manual_seed(seed)
        parts = {
            "unet": diffusers.UNet2DConditionModel(**arch["unet"]),
            "vae": diffusers.AutoencoderKL(**arch["vae"]),
            "text_encoder": _text_encoder(arch["text_encoder"]),
        }
        if "text_encoder_2" in arch:
            parts["text_encoder_2"] = _text_encoder(arch["text_encoder_2"])
    sched_cfg = dict(arch["scheduler"])
    parts["scheduler"] = getattr(diffusers, sched_cfg.pop("_class_name")).from_config(sched_cfg)
    parts["tokenizer"] = clip_tokenizer(arch["tokenizer_pad"])
    pipe_cls = getattr(diffusers, arch["pipeline"])
    if "text_encoder_2" in arch:
        parts["tokenizer_2"] = clip_tokenizer(arch["tokenizer_2_pad"])
        pipe = pipe_cls(**parts, force_zeros_for_empty_prompt=arch.get("force_zeros_for_empty_prompt", True))
    else:
        pipe = pipe_cls(**parts, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    for m in (pipe.unet, pipe.vae, pipe.text_encoder, getattr(pipe, "text_encoder_2", None)):
        if m is not None:
            m.eval().requires_grad_(False)
    return pipe


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _check_pipeline_folder(path: Path) -> None:
    index = path / "model_index.json"
    if not index.is_file():
        raise ModelNotFoundError(f"{path} is not a diffusers pipeline folder: {index} is missing")
    import json

    try:
        entries = json.loads(index.read_text())
    except (ValueError, OSError) as e:  # a truncated download, an editor's leftovers, undecodable bytes
        raise ModelNotFoundError(f"{index} is not a valid pipeline index ({type(e).__name__}: {e})") from None
    if not isinstance(entries, dict) or "_class_name" not in entries:
        raise ModelNotFoundError(f"{index} is not a valid pipeline index: expected a JSON object with a "
                                 f"'_class_name', got {type(entries).__name__}")
    for key, value in entries.items():  # components are [library, class] lists; other keys are pipeline options
        if key.startswith("_") or not isinstance(value, list) or (len(value) == 2 and value[0] is None):
            continue
        if not (len(value) == 2 and all(isinstance(v, str) for v in value)):
            raise ModelNotFoundError(f"{index} is not a valid pipeline index: component {key!r} must be "
                                     f"[library, class], got {value!r}")
        if not (path / key).is_dir():
            raise ModelNotFoundError(f"{path} is not a complete pipeline folder: component folder {path / key} is missing")
        _check_component_configs(path / key, key, value[1])


def _config_name(class_name: str) -> str:
    """The config file diffusers / transformers read for a component of class ``class_name``."""
    if class_name.endswith("Scheduler"):
        return "scheduler_config.json"
    if "Tokenizer" in class_name:
        return "tokenizer_config.json"
    if class_name.endswith(("FeatureExtractor", "ImageProcessor")):
        return "preprocessor_config.json"
    return "config.json"


def _check_component_configs(folder: Path, name: str, class_name: str) -> None:
    """The component's config file exists, and every JSON file of the folder is a JSON object: else a
    ``ModelNotFoundError`` naming the component and the file (diffusers' own message names neither, or, for a text
    encoder without its config, fails later on every weight's shape)."""
    import json

    config = folder / _config_name(class_name)
    if not config.is_file():
        raise ModelNotFoundError(f"component {name!r} ({class_name}) of the pipeline folder is incomplete: {config} is missing")
    for file in sorted(folder.glob("*.json")):
        try:
            data = json.loads(file.read_text())
        except (ValueError, OSError) as e:
            raise ModelNotFoundError(f"component {name!r} ({class_name}): {file} is not valid JSON "
                                     f"({type(e).__name__}: {e})") from None
        if not isinstance(data, dict):
            raise ModelNotFoundError(f"component {name!r} ({class_name}): {file} must hold a JSON object, "
                                     f"got {type(data).__name__}")


def _failed_component(tb) -> str | None:
    """The pipeline component diffusers was loading when it raised (``load_sub_model``'s ``name`` argument, read
    from the traceback), or None."""
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "load_sub_model" and isinstance(frame.f_locals.get("name"), str):
            return frame.f_locals["name"]
        tb = tb.tb_next
    return None


# Built-in architectures per original-format family, told apart by the UNet's conv_in: its width (output channels)
# and its input channels (4 latents, or 9 for an inpainting checkpoint: latents, mask and masked-image latents).
_FAMILIES = {"sdxl": ("sdxl", "tiny-xl", "sdxl-inpaint", "tiny-xl-inpaint"), "sd2": ("sd21", "tiny-v", "sd2-inpaint"),
             "sd1": ("sd15", "tiny", "sd15-inpaint", "tiny-inpaint")}
_CONV_IN = "model.diffusion_model.input_blocks.0.0.weight"


def _conv_in_channels(name: str) -> tuple[int, int]:
    """(output, input) channels of the UNet ``conv_in`` of built-in architecture ``name``."""
    unet = architectures.get_architecture(name)["unet"]
    return unet["block_out_channels"][0], unet["in_channels"]


def _checkpoint_architecture(path: Path) -> str:
    """The built-in architecture of a single-file checkpoint (original SD key names): the family from the
    text-encoder keys (SD 1.x: CLIP ``cond_stage_model.transformer``; SD 2.x: OpenCLIP ``cond_stage_model.model``;
    SDXL: ``conditioner.embedders.1``), then the member whose UNet ``conv_in`` weight (Cout, Cin, 3, 3) matches: its
    width Cout and its input channels Cin (9 for an inpainting checkpoint, e.g. ``sd-v1-5-inpainting``).

    Raises ``ModelNotFoundError`` for a non-``.safetensors`` file, a file that is not an SD checkpoint, or an
    SD checkpoint whose shapes match no built-in config.
    """
    from safetensors import safe_open

    if path.suffix != ".safetensors":
        raise ModelNotFoundError(f"{path}: only .safetensors single-file checkpoints are supported (got {path.suffix})")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            width, in_channels = f.get_slice(_CONV_IN).get_shape()[:2] if _CONV_IN in keys else (None, None)
    except Exception as e:  # not a safetensors file at all
        raise ModelNotFoundError(f"{path}: cannot be read as a .safetensors checkpoint ({type(e).__name__}: {e})") from e
    if any(k.startswith("conditioner.embedders.1") for k in keys):
        family = "sdxl"
    elif any(k.startswith("cond_stage_model.model.") for k in keys):
        family = "sd2"
    elif any(k.startswith("cond_stage_model.transformer") for k in keys):
        family = "sd1"
    elif _CONV_IN in keys:  # a UNet without any text encoder
        raise ModelNotFoundError(
            f"checkpoint {str(path)!r} is incomplete: it has a Stable Diffusion UNet but no weights for the text "
            f"encoder (cond_stage_model.* or conditioner.embedders.*); {_INCOMPLETE_ADVICE}")
    else:
        raise ModelNotFoundError(f"{path}: not a Stable Diffusion checkpoint (no known text-encoder keys)")
    if width is None:
        raise ModelNotFoundError(f"{path}: not a Stable Diffusion checkpoint (no UNet key {_CONV_IN})")
    for name in _FAMILIES[family]:
        if _conv_in_channels(name) == (width, in_channels):
            return name
    shapes = [(n, *_conv_in_channels(n)) for n in _FAMILIES[family]]
    raise ModelNotFoundError(
        f"{path}: a {family} checkpoint whose UNet has {width} conv_in channels and {in_channels} input channels; "
        "sdfast ships configs only for "
        + ", ".join(f"{n} ({w})" if c == 4 else f"{n} ({w}, {c} input channels)" for n, w, c in shapes)
    )


# The original key prefixes of each component of a single-file checkpoint, per family.
_COMPONENT_PREFIXES = {
    "sd1": {"UNet": ("model.diffusion_model.",), "VAE": ("first_stage_model.",),
            "text encoder (CLIP)": ("cond_stage_model.transformer.",)},
    "sd2": {"UNet": ("model.diffusion_model.",), "VAE": ("first_stage_model.",),
            "text encoder (OpenCLIP)": ("cond_stage_model.model.",)},
    "sdxl": {"UNet": ("model.diffusion_model.",), "VAE": ("first_stage_model.",),
             "first text encoder (CLIP)": ("conditioner.embedders.0.transformer.",),
             "second text encoder (OpenCLIP)": ("conditioner.embedders.1.model.",)},
}
_ARCH_FAMILY = {name: family for family, names in _FAMILIES.items() for name in names}
_INCOMPLETE_ADVICE = ("use a checkpoint that includes it (or the model's diffusers folder, which has one folder per "
                      "component)")


def _checkpoint_keys(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def _check_components(path: Path, family: str, keys: set[str]) -> None:
    """Raise ``ModelNotFoundError`` naming each component of ``family`` that has no weights in ``keys``."""
    missing = [f"the {what} ({prefixes[0]}*)" for what, prefixes in _COMPONENT_PREFIXES[family].items()
               if not any(k.startswith(prefixes) for k in keys)]
    if missing:
        raise ModelNotFoundError(f"checkpoint {str(path)!r} is incomplete: it has no weights for "
                                 f"{' and '.join(missing)}; {_INCOMPLETE_ADVICE}")


def load_single_file(path: Path, *, dtype, architecture: str | None = None):
    """Load an original-format SD checkpoint offline, with the configs sdfast ships for its architecture.

    Raises ``ModelNotFoundError`` for a file that is not a supported SD checkpoint (see ``_checkpoint_architecture``)
    or that lacks a component's weights (the VAE's ``first_stage_model.*``, a text encoder's), naming the component.
    """
    import diffusers
    from diffusers.loaders.single_file_utils import SingleFileComponentError

    arch_name = architecture or _checkpoint_architecture(path)
    _check_components(path, _ARCH_FAMILY.get(arch_name, "sd1"), _checkpoint_keys(path))
    arch = architectures.get_architecture(arch_name)
    cls = getattr(diffusers, arch["pipeline"])
    extra = {"tokenizer": clip_tokenizer(arch["tokenizer_pad"])}
    if "tokenizer_2_pad" in arch:
        extra["tokenizer_2"] = clip_tokenizer(arch["tokenizer_2_pad"])
    else:
        extra.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    with tempfile.TemporaryDirectory() as tmp:
        config = architectures.write_config_folder(arch_name, tmp)
        try:
            pipe = cls.from_single_file(str(path), config=str(config), local_files_only=True, dtype=dtype, **extra)
        except SingleFileComponentError as e:  # a component the checks above did not foresee
            raise ModelNotFoundError(f"checkpoint {str(path)!r} is incomplete: {str(e).splitlines()[0]} "
                                     f"({_INCOMPLETE_ADVICE})") from None
        except NotImplementedError as e:  # diffusers/accelerate moving weights the file did not have
            if "meta tensor" not in str(e):
                raise
            raise ModelNotFoundError(f"model {str(path)!r} is incomplete: weight tensors of the {arch_name} "
                                     "architecture are missing from the checkpoint") from None
    return pipe


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a Hugging Face Hub id (``owner/name``), not a relative or absolute path."""
    return bool(_HUB_ID.match(name)) and not name.startswith((".", "/", "~"))


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_hub(model_id: str, *, dtype):
    import diffusers

    try:
        return diffusers.DiffusionPipeline.from_pretrained(model_id, dtype=dtype, local_files_only=True)
    except Exception:  # not in the local cache
        pass
    if not _hub_reachable():
        raise HubOfflineError(
            f"{model_id!r} looks like a Hugging Face Hub id, but the Hub cannot be reached (offline) and the model "
            "is not in the local cache. Download it where there is network (`hf download "
            f"{model_id} --local-dir DIR`) and pass the local folder (`sdfast.load('DIR')`; on the CLI `--model DIR`)."
        )
    return diffusers.DiffusionPipeline.from_pretrained(model_id, dtype=dtype)


def load_pipeline(model, *, device=None, dtype=None, seed: int = 0):
    """Resolve ``model`` (see module docstring) to a diffusers pipeline on ``device`` in ``dtype``.

    Raises ``ModelNotFoundError`` (missing path or file, naming it; unknown ``random:`` architecture, listing
    the known ones; a folder or checkpoint missing a component, naming it), ``HubOfflineError``, ``TypeError``
    (unsupported object).
    """
    with quiet_loading():
        return _load_pipeline(model, device=device, dtype=dtype, seed=seed)


def _load_pipeline(model, *, device, dtype, seed: int):
    if not isinstance(model, (str, os.PathLike)):
        if hasattr(model, "unet") and hasattr(model, "vae"):
            # a pipeline object is used as it is, moved or cast only when asked to
            if dtype is not None:
                model = model.to(dtype)
            return model.to(device) if device is not None else model
        raise TypeError(f"model must be a path, a hub id, 'random:<arch>' or a diffusers pipeline, not {type(model).__name__}")
    name = str(model)
    if not name.strip():
        raise ModelNotFoundError("model is empty: give a model folder, a .safetensors file, a hub id or random:<arch>")
    device, dtype = default_device_dtype(device, dtype)
    if name.startswith("random:"):
        arch = name.split(":", 1)[1]
        try:
            architectures.get_architecture(arch)
        except ValueError as e:  # a built-in model that does not exist is a missing model, like a bad path
            raise ModelNotFoundError(str(e)) from None
        return build_random_pipeline(arch, device=device, dtype=dtype, seed=seed)
    path = Path(name).expanduser()
    if path.is_dir():
        import diffusers

        _check_pipeline_folder(path)
        try:
            pipe = diffusers.DiffusionPipeline.from_pretrained(str(path), dtype=dtype, local_files_only=True)
        except OSError as e:  # a component folder without its weights file, and kin
            component = _failed_component(e.__traceback__)
            where = f" (component {component!r})" if component else ""
            raise ModelNotFoundError(f"model folder {name!r} is incomplete{where}: {str(e).splitlines()[0]}") from None
        except (ValueError, TypeError, KeyError, RuntimeError) as e:  # a config value the class cannot take, and kin
            component = _failed_component(e.__traceback__)
            if component is None:
                raise
            raise ModelNotFoundError(f"model folder {name!r}: component {component!r} ({path / component}) cannot "
                                     f"be loaded: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    elif path.is_file():
        pipe = load_single_file(path, dtype=dtype)
    elif is_hub_id(name):
        pipe = load_hub(name, dtype=dtype)
    else:
        raise ModelNotFoundError(f"model {name!r}: no such folder or file (and not a hub id 'owner/name' or 'random:<arch>')")
    return pipe.to(device)
