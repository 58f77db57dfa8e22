"""ControlNet models (Zhang et al. 2023, "Adding Conditional Control to Text-to-Image Diffusion Models") for a loaded
pipeline: what ``sdfast.load(model, controlnet=...)`` names, turned into diffusers ``ControlNetModel`` s, and the
diffusers ControlNet pipeline built around the base pipeline's components.

A ControlNet may be named as: a diffusers ``ControlNetModel`` folder (``config.json`` + weights); a hub id; a
built-in architecture with seeded random weights (``random:controlnet-sd15|controlnet-sd21|controlnet-sdxl|
tiny-controlnet|tiny-v-controlnet|tiny-xl-controlnet``, ``sdfast.architectures.CONTROLNETS``); or a ``ControlNetModel`` object. A
list of them is a multi-ControlNet (diffusers' ``MultiControlNetModel``: their residuals are summed). Each must fit
the base UNet (same cross-attention width, same added-embedding kind), checked at load with a clear error.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from . import architectures
from .errors import ModelNotFoundError

# The diffusers ControlNet pipeline of each base pipeline family: (SD 1.x / 2.x, SDXL).
CONTROLNET_PIPELINES = ("StableDiffusionControlNetPipeline", "StableDiffusionXLControlNetPipeline")


def controlnets_of(pipe) -> list:
    """The ``ControlNetModel`` s of a pipeline, in order: [] without a ControlNet, the nets of a
    ``MultiControlNetModel``."""
    net = getattr(pipe, "controlnet", None)
    if net is None:
        return []
    return list(net.nets) if hasattr(net, "nets") else [net]


def denoising_nets(pipe) -> list:
    """The nets that run at every denoising step: the pipeline's UNet (when it has one), then its ControlNets."""
    return [m for m in (getattr(pipe, "unet", None), *controlnets_of(pipe)) if m is not None]


def build_random_controlnet(name: str, *, device=None, dtype=None, seed: int = 0):
    """The built-in ControlNet ``name`` (``architectures.CONTROLNETS``) with seeded random weights, on ``device`` in
    ``dtype``. Every weight is random, the zero-initialised convolutions too (the control image's embedding output
    and the per-residual 1x1 convolutions; a trained ControlNet has learnt them), and the control image's embedding
    has He-initialised convolutions (He et al. 2015): with PyTorch's default init, or zeros, a random ControlNet
    would barely see its control image and no test could tell. Raises ``ValueError`` for an unknown name."""
    import diffusers

    from .loading import _default_dtype, default_device_dtype

    _, cfg = architectures.get_controlnet(name)
    cfg.pop("_class_name")
    device, dtype = default_device_dtype(device, dtype)
    cuda_devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices), torch.device(device), _default_dtype(dtype):
        torch.manual_seed(seed)
        net = diffusers.ControlNetModel(**cfg)
        for conv in (*net.controlnet_down_blocks, net.controlnet_mid_block):
            conv.reset_parameters()
        for m in net.controlnet_cond_embedding.modules():  # He init: PyTorch's default shrinks each of its eight
            if isinstance(m, torch.nn.Conv2d):  # convolutions' output ~3x, and the control image would not count
                torch.nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
    return net.eval().requires_grad_(False)


def _load_one(spec, unet, *, device, dtype, seed: int):
    import diffusers

    from .loading import _hub_reachable, is_hub_id

    if isinstance(spec, diffusers.ControlNetModel):
        return spec.to(device=device, dtype=dtype)
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"controlnet: a path, a hub id, 'random:<name>' or a diffusers ControlNetModel (or a list of "
                        f"them), not {type(spec).__name__}")
    name = str(spec)
    if name.startswith("random:"):
        check_name(name)
        return build_random_controlnet(name.split(":", 1)[1], device=device, dtype=dtype, seed=seed)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"controlnet {name!r} is not a diffusers ControlNetModel folder: "
                                     f"{path / 'config.json'} is missing")
        try:
            net, info = diffusers.ControlNetModel.from_pretrained(str(path), dtype=dtype, local_files_only=True,
                                                                  output_loading_info=True)
        except Exception as e:  # noqa: BLE001 - a folder of another model, a config value the class cannot take, ...
            raise ModelNotFoundError(f"controlnet folder {name!r} cannot be loaded as a diffusers ControlNetModel "
                                     f"({type(e).__name__}: {_first_line(e)})") from None
        missing = info.get("missing_keys") or []
        if missing:  # e.g. a UNet's folder: its weights do not fill a ControlNet (left on the meta device)
            raise ModelNotFoundError(f"controlnet folder {name!r} cannot be loaded as a diffusers ControlNetModel: "
                                     f"{len(missing)} of its weights are missing ({', '.join(missing[:3])}, ...)")
    elif path.is_file():
        net = _load_single_file(path, unet, dtype=dtype)
    elif is_hub_id(name):
        try:
            net = diffusers.ControlNetModel.from_pretrained(name, dtype=dtype, local_files_only=True)
        except Exception:  # not in the local cache
            if not _hub_reachable():
                raise ModelNotFoundError(
                    f"controlnet {name!r} looks like a Hugging Face Hub id, but the Hub cannot be reached (offline) "
                    f"and it is not in the local cache; download it where there is network (`hf download {name} "
                    "--local-dir DIR`) and pass the folder") from None
            net = diffusers.ControlNetModel.from_pretrained(name, dtype=dtype)
    else:
        raise ModelNotFoundError(f"controlnet {name!r}: no such folder or file (and not a hub id 'owner/name' or "
                                 "'random:<name>')")
    return net.to(device).eval().requires_grad_(False)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def check_name(spec) -> None:
    """What can be checked of a ControlNet name before anything loads (the CLI checks it before the base model's
    load): a ``random:`` name must be built in, a path must exist unless it reads as a hub id. Raises
    ``ModelNotFoundError``; objects and lists pass (``load_controlnets`` checks them)."""
    from .loading import is_hub_id

    if not isinstance(spec, (str, os.PathLike)):
        return
    name = str(spec)
    if name.startswith("random:"):
        try:
            architectures.get_controlnet(name.split(":", 1)[1])
        except ValueError as e:
            raise ModelNotFoundError(f"controlnet: {e}") from None
    elif not Path(name).expanduser().exists() and not is_hub_id(name):
        raise ModelNotFoundError(f"controlnet {name!r}: no such folder or file (and not a hub id 'owner/name' or "
                                 "'random:<name>')")


def _load_single_file(path: Path, unet, *, dtype):
    """A single-file ``.safetensors`` ControlNet (original ``control_model.*`` keys or diffusers' own), loaded offline
    with the config of a ControlNet for ``unet`` (``architectures.controlnet_config``)."""
    import json
    import tempfile

    import diffusers

    if path.suffix != ".safetensors":
        raise ModelNotFoundError(f"controlnet {str(path)!r}: only .safetensors single-file checkpoints are supported")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(architectures.controlnet_config(unet.config)))
        try:
            return diffusers.ControlNetModel.from_single_file(str(path), config=tmp, local_files_only=True, dtype=dtype)
        except Exception as e:  # noqa: BLE001 - whatever diffusers raises for a file that is not such a checkpoint
            raise ModelNotFoundError(f"controlnet {str(path)!r} cannot be loaded as a ControlNet of this model "
                                     f"({type(e).__name__}: {_first_line(e)})") from None


def check_fits(net, unet, what: str = "controlnet") -> None:
    """Raise ``ValueError`` unless ControlNet ``net`` can steer ``unet``: the same cross-attention width (text
    embedding), added-embedding kind (SDXL's "text_time") and block widths (its residuals are added to the UNet's)."""
    for key in ("cross_attention_dim", "addition_embed_type", "block_out_channels"):
        a, b = net.config.get(key), unet.config.get(key)
        if (list(a) if isinstance(a, (list, tuple)) else a) != (list(b) if isinstance(b, (list, tuple)) else b):
            raise ValueError(f"{what}: this ControlNet was made for another base model ({key} {a!r}, the model's "
                             f"UNet has {b!r}); use a ControlNet of the model's family (SD 1.x, SD 2.x, SDXL)")


def load_controlnets(spec, unet, *, seed: int = 0):
    """``spec`` (see the module docstring; a list for a multi-ControlNet) as ControlNetModel(s) on ``unet``'s device
    in its dtype, checked to fit it (``check_fits``). Returns one model, or a list for a list. A random ControlNet
    ``i`` of a list takes seed ``seed + 1 + i`` (the base model's weights take ``seed``). Raises
    ``ModelNotFoundError``, ``ValueError``, ``TypeError``."""
    from .loading import quiet_loading

    specs = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    if not specs:
        raise ValueError("controlnet: an empty list; give one ControlNet or several")
    nets = []
    with quiet_loading():
        for i, s in enumerate(specs):
            what = "controlnet" if len(specs) == 1 else f"controlnet[{i}]"
            net = _load_one(s, unet, device=unet.device, dtype=unet.dtype, seed=seed + 1 + i)
            check_fits(net, unet, what)
            nets.append(net)
    return nets if isinstance(spec, (list, tuple)) else nets[0]


def attach(pipe, controlnet):
    """The diffusers ControlNet pipeline (``CONTROLNET_PIPELINES``) on ``pipe``'s components (``sdfast.pipelines.derive``:
    no copy of a weight, no dtype cast) and ``controlnet`` (a ``ControlNetModel`` or a list of them)."""
    from .pipelines import derive

    xl = getattr(pipe, "text_encoder_2", None) is not None
    return derive(pipe, CONTROLNET_PIPELINES[xl], controlnet=controlnet)
