"""The built-in architectures: the published diffusers configs of SD 1.5, SD 2.1 and SDXL base 1.0, and a
tiny SD1-shaped one that runs in seconds on a CPU, with a tiny SD 2.x-shaped (``tiny-v``) and a tiny
SDXL-shaped (``tiny-xl``) sibling that exercise the same code paths as the real variants; and the inpainting
checkpoints of SD 1.5, SD 2 and SDXL with their tiny siblings (``*-inpaint``: UNets with 9 input channels).

These dicts are the configs of the public model repos (runwayml/stable-diffusion-v1-5,
stabilityai/stable-diffusion-2-1, stabilityai/stable-diffusion-xl-base-1.0), kept here so that
``random:<name>`` builds the real architecture with seeded random weights, and so that a single-file
``.safetensors`` checkpoint can be loaded offline (``write_config_folder``).
"""

from __future__ import annotations

import json
from pathlib import Path

_SCALED_LINEAR = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000}

_VAE_SD = {
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "sample_size": 512,
}

_CLIP_L = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "max_position_embeddings": 77,
    "vocab_size": 49408,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "pad_token_id": 1,
}

_SD15 = {
    "pipeline": "StableDiffusionPipeline",
    "unet": {
        "act_fn": "silu",
        "attention_head_dim": 8,
        "block_out_channels": [320, 640, 1280, 1280],
        "cross_attention_dim": 768,
        "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
        "downsample_padding": 1,
        "flip_sin_to_cos": True,
        "freq_shift": 0,
        "in_channels": 4,
        "out_channels": 4,
        "layers_per_block": 2,
        "mid_block_scale_factor": 1,
        "norm_eps": 1e-05,
        "norm_num_groups": 32,
        "sample_size": 64,
    },
    "vae": _VAE_SD,
    "text_encoder": {"class": "CLIPTextModel", **_CLIP_L},
    "scheduler": {
        "_class_name": "PNDMScheduler",
        **_SCALED_LINEAR,
        "set_alpha_to_one": False,
        "skip_prk_steps": True,
        "steps_offset": 1,
        "clip_sample": False,
    },
    "tokenizer_pad": "<|endoftext|>",
}

_SD21 = {
    "pipeline": "StableDiffusionPipeline",
    "unet": {
        **_SD15["unet"],
        "attention_head_dim": [5, 10, 20, 20],
        "cross_attention_dim": 1024,
        "use_linear_projection": True,
        "upcast_attention": True,
        "sample_size": 96,
    },
    "vae": {**_VAE_SD, "sample_size": 768},
    "text_encoder": {
        "class": "CLIPTextModel",
        **_CLIP_L,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_attention_heads": 16,
        "num_hidden_layers": 23,
        "hidden_act": "gelu",
        "projection_dim": 512,
    },
    "scheduler": {
        "_class_name": "DDIMScheduler",
        **_SCALED_LINEAR,
        "clip_sample": False,
        "set_alpha_to_one": False,
        "skip_prk_steps": True,
        "steps_offset": 1,
        "prediction_type": "v_prediction",
    },
    "tokenizer_pad": "!",
}

_SDXL = {
    "pipeline": "StableDiffusionXLPipeline",
    "unet": {
        "act_fn": "silu",
        "addition_embed_type": "text_time",
        "addition_embed_type_num_heads": 64,
        "addition_time_embed_dim": 256,
        "attention_head_dim": [5, 10, 20],
        "block_out_channels": [320, 640, 1280],
        "cross_attention_dim": 2048,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        "downsample_padding": 1,
        "flip_sin_to_cos": True,
        "freq_shift": 0,
        "in_channels": 4,
        "out_channels": 4,
        "layers_per_block": 2,
        "mid_block_scale_factor": 1,
        "norm_eps": 1e-05,
        "norm_num_groups": 32,
        "projection_class_embeddings_input_dim": 2816,
        "sample_size": 128,
        "transformer_layers_per_block": [1, 2, 10],
        "use_linear_projection": True,
    },
    "vae": {**_VAE_SD, "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True},
    "text_encoder": {"class": "CLIPTextModel", **_CLIP_L},
    "text_encoder_2": {
        "class": "CLIPTextModelWithProjection",
        **_CLIP_L,
        "hidden_size": 1280,
        "intermediate_size": 5120,
        "num_attention_heads": 20,
        "num_hidden_layers": 32,
        "hidden_act": "gelu",
        "projection_dim": 1280,
    },
    "scheduler": {
        "_class_name": "EulerDiscreteScheduler",
        **_SCALED_LINEAR,
        "interpolation_type": "linear",
        "prediction_type": "epsilon",
        "steps_offset": 1,
        "timestep_spacing": "leading",
        "use_karras_sigmas": False,
        # Keys Euler ignores but the schedulers built from this config read (``sdfast.schedulers``), as in
        # SDXL's published scheduler_config.json: without them DDIM takes its class defaults (clip_sample,
        # set_alpha_to_one: True) and PNDM runs PRK steps, which SDXL's own config turns off.
        "clip_sample": False,
        "sample_max_value": 1.0,
        "set_alpha_to_one": False,
        "skip_prk_steps": True,
    },
    "tokenizer_pad": "<|endoftext|>",
    "tokenizer_2_pad": "!",
    "force_zeros_for_empty_prompt": True,
}

_TINY = {
    "pipeline": "StableDiffusionPipeline",
    "unet": {
        "act_fn": "silu",
        "attention_head_dim": 8,
        "block_out_channels": [32, 64],
        "cross_attention_dim": 32,
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
        "in_channels": 4,
        "out_channels": 4,
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "sample_size": 8,
    },
    "vae": {
        **_VAE_SD,
        "block_out_channels": [16, 16, 32, 32],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "sample_size": 64,
    },
    "text_encoder": {
        "class": "CLIPTextModel",
        **_CLIP_L,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "projection_dim": 32,
    },
    "scheduler": _SD15["scheduler"],
    "tokenizer_pad": "<|endoftext|>",
}

# A tiny SD 2.x-shaped model: linear projections in the transformers, attention computed in fp32
# (``upcast_attention``), v-prediction, a GELU text encoder and a tokenizer padding with "!" (id 0).
_TINY_V = {
    "pipeline": "StableDiffusionPipeline",
    "unet": {
        **_TINY["unet"],
        "attention_head_dim": [2, 4],
        "use_linear_projection": True,
        "upcast_attention": True,
    },
    "vae": _TINY["vae"],
    "text_encoder": {**_TINY["text_encoder"], "hidden_act": "gelu"},
    "scheduler": _SD21["scheduler"],
    "tokenizer_pad": "!",
}

# A tiny SDXL-shaped model (close to diffusers' own SDXL pipeline tests): two text encoders of different
# widths (as CLIP-L and OpenCLIP bigG are, which single-file loading relies on) whose penultimate hidden
# states are concatenated (32 + 48 = 80 = cross_attention_dim), the second one's pooled projection and six
# time ids as the "text_time" added embedding (6 * 8 + 48 = 96 inputs), and a VAE whose config asks for
# fp32 decoding (``force_upcast``).
_TINY_XL = {
    "pipeline": "StableDiffusionXLPipeline",
    "unet": {
        "act_fn": "silu",
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 8,
        "attention_head_dim": [2, 4],
        "block_out_channels": [32, 64],
        "cross_attention_dim": 80,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
        "in_channels": 4,
        "out_channels": 4,
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "projection_class_embeddings_input_dim": 96,
        "sample_size": 8,
        "transformer_layers_per_block": [1, 2],
        "use_linear_projection": True,
    },
    "vae": {**_TINY["vae"], "scaling_factor": 0.13025, "force_upcast": True},
    "text_encoder": _TINY["text_encoder"],
    "text_encoder_2": {
        **_TINY["text_encoder"],
        "class": "CLIPTextModelWithProjection",
        "hidden_size": 48,
        "intermediate_size": 96,
        "projection_dim": 48,
        "hidden_act": "gelu",
    },
    "scheduler": _SDXL["scheduler"],
    "tokenizer_pad": "<|endoftext|>",
    "tokenizer_2_pad": "!",
    "force_zeros_for_empty_prompt": True,
}

# Inpainting checkpoints: the published configs of runwayml/stable-diffusion-inpainting,
# stabilityai/stable-diffusion-2-inpainting and diffusers/stable-diffusion-xl-1.0-inpainting-0.1. Each is its base
# model's config but for a UNet of 9 input channels (4 noisy latents + 1 mask + 4 latents of the masked image,
# concatenated by diffusers' inpaint pipelines), the pipeline class their model_index.json names, and: SD 1.5's has
# a DDIM scheduler (DDIM's class defaults clip x0 and set alpha_0 = 1: the published config turns both off) and a
# VAE config of sample_size 256; SD 2's was resumed from stable-diffusion-2-base, so it is 512-pixel
# (sample_size 64), epsilon-prediction, without upcast_attention, with SD 1.5's PNDM scheduler config. SDXL's
# differs from SDXL base only by its 9 input channels. The tiny ones are tiny and tiny-xl with 9 input channels.
_SD15_INPAINT = {
    **_SD15,
    "pipeline": "StableDiffusionInpaintPipeline",
    "unet": {**_SD15["unet"], "in_channels": 9},
    "vae": {**_VAE_SD, "sample_size": 256},
    "scheduler": {**_SD15["scheduler"], "_class_name": "DDIMScheduler"},
}

_SD2_INPAINT = {
    **_SD21,
    "pipeline": "StableDiffusionInpaintPipeline",
    "unet": {**_SD21["unet"], "in_channels": 9, "sample_size": 64, "upcast_attention": False},
    "vae": _VAE_SD,
    "scheduler": _SD15["scheduler"],
}

_SDXL_INPAINT = {**_SDXL, "pipeline": "StableDiffusionXLInpaintPipeline", "unet": {**_SDXL["unet"], "in_channels": 9}}

_TINY_INPAINT = {**_TINY, "pipeline": "StableDiffusionInpaintPipeline", "unet": {**_TINY["unet"], "in_channels": 9}}

_TINY_XL_INPAINT = {**_TINY_XL, "pipeline": "StableDiffusionXLInpaintPipeline",
                    "unet": {**_TINY_XL["unet"], "in_channels": 9}}

ARCHITECTURES: dict[str, dict] = {
    "tiny": _TINY,
    "tiny-v": _TINY_V,
    "tiny-xl": _TINY_XL,
    "sd15": _SD15,
    "sd21": _SD21,
    "sdxl": _SDXL,
    "tiny-inpaint": _TINY_INPAINT,
    "tiny-xl-inpaint": _TINY_XL_INPAINT,
    "sd15-inpaint": _SD15_INPAINT,
    "sd2-inpaint": _SD2_INPAINT,
    "sdxl-inpaint": _SDXL_INPAINT,
}


def get_architecture(name: str) -> dict:
    """The config dict of a built-in architecture. Raises ``ValueError`` listing the known names."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown built-in architecture 'random:{name}'; known: " + ", ".join(f"random:{n}" for n in ARCHITECTURES))
    return ARCHITECTURES[name]


def write_config_folder(name: str, path: str | Path) -> Path:
    """Write a diffusers config folder (model_index.json + each component's config, no weights) for
    ``name`` under ``path``: what ``from_single_file(..., config=path)`` needs to load a checkpoint offline."""
    arch = get_architecture(name)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    index = {"_class_name": arch["pipeline"], "_diffusers_version": "0.42.1"}
    components = {
        "unet": ("diffusers", "UNet2DConditionModel"),
        "vae": ("diffusers", "AutoencoderKL"),
        "text_encoder": ("transformers", arch["text_encoder"]["class"]),
        "tokenizer": ("transformers", "CLIPTokenizer"),
        "scheduler": ("diffusers", arch["scheduler"]["_class_name"]),
    }
    if "text_encoder_2" in arch:
        components["text_encoder_2"] = ("transformers", arch["text_encoder_2"]["class"])
        components["tokenizer_2"] = ("transformers", "CLIPTokenizer")
    else:
        components.update(safety_checker=(None, None), feature_extractor=(None, None))
        index["requires_safety_checker"] = False
    index.update({k: list(v) for k, v in components.items()})
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    for key in ("unet", "vae", "scheduler"):
        (root / key).mkdir(exist_ok=True)
        fname = "scheduler_config.json" if key == "scheduler" else "config.json"
        (root / key / fname).write_text(json.dumps(arch[key], indent=2))
    for key in ("text_encoder", "text_encoder_2"):
        if key in arch:
            cfg = {k: v for k, v in arch[key].items() if k != "class"}
            (root / key).mkdir(exist_ok=True)
            (root / key / "config.json").write_text(json.dumps({"architectures": [arch[key]["class"]], "model_type": "clip_text_model", **cfg}, indent=2))
    return root


# -- ControlNet (Zhang et al. 2023, "Adding Conditional Control to Text-to-Image Diffusion Models") -------------
# A ControlNet is a trainable copy of its base UNet's encoder half (conv_in, down blocks, mid block) plus a small
# convolutional encoder of the control image (``conditioning_embedding_out_channels``: three stride-2 steps, the
# VAE's 8x) and one zero-initialised 1x1 convolution per residual. Its config is the base UNet's, restricted to the
# keys ``diffusers.ControlNetModel`` takes (what ``ControlNetModel.from_unet`` copies): the published configs of
# lllyasviel/sd-controlnet-canny (SD 1.5), thibaud/controlnet-sd21-canny-diffusers (SD 2.1) and
# diffusers/controlnet-canny-sdxl-1.0 (SDXL) are those of their bases this way.

_CONTROLNET_KEYS = (
    "act_fn", "addition_embed_type", "addition_embed_type_num_heads", "addition_time_embed_dim",
    "attention_head_dim", "block_out_channels", "class_embed_type", "cross_attention_dim", "down_block_types",
    "downsample_padding", "encoder_hid_dim", "encoder_hid_dim_type", "flip_sin_to_cos", "freq_shift",
    "layers_per_block", "mid_block_scale_factor", "norm_eps", "norm_num_groups", "num_attention_heads",
    "num_class_embeds", "only_cross_attention", "projection_class_embeddings_input_dim", "resnet_time_scale_shift",
    "transformer_layers_per_block", "upcast_attention", "use_linear_projection",
)


def controlnet_config(unet_config, *, conditioning_embedding_out_channels=(16, 32, 96, 256)) -> dict:
    """The ``diffusers.ControlNetModel`` config of a ControlNet for a UNet with config ``unet_config`` (a dict or a
    diffusers ``FrozenDict``): its encoder half's keys, 4 latent input channels (an inpainting UNet's ControlNet
    still reads the 4-channel latents), a 3-channel (RGB) control image."""
    cfg = {k: unet_config[k] for k in _CONTROLNET_KEYS if k in unet_config}
    cfg.update(_class_name="ControlNetModel", in_channels=4, conditioning_channels=3,
               controlnet_conditioning_channel_order="rgb",
               conditioning_embedding_out_channels=list(conditioning_embedding_out_channels))
    return cfg


# ``random:<name>`` ControlNets: name -> (the built-in base architecture they attach to, their config).
CONTROLNETS: dict[str, tuple[str, dict]] = {
    "controlnet-sd15": ("sd15", controlnet_config(_SD15["unet"])),
    "controlnet-sd21": ("sd21", controlnet_config(_SD21["unet"])),
    "controlnet-sdxl": ("sdxl", controlnet_config(_SDXL["unet"])),
    # the tiny ones keep the 8x downsampling of the control image (four embedding widths) at a CPU test's cost
    "tiny-controlnet": ("tiny", controlnet_config(_TINY["unet"], conditioning_embedding_out_channels=(8, 8, 16, 16))),
    "tiny-v-controlnet": ("tiny-v", controlnet_config(_TINY_V["unet"], conditioning_embedding_out_channels=(8, 8, 16, 16))),
    "tiny-xl-controlnet": ("tiny-xl", controlnet_config(_TINY_XL["unet"],
                                                        conditioning_embedding_out_channels=(8, 8, 16, 16))),
}


def get_controlnet(name: str) -> tuple[str, dict]:
    """(base architecture, ``ControlNetModel`` config) of a built-in ControlNet. Raises ``ValueError`` listing the
    known names."""
    if name not in CONTROLNETS:
        raise ValueError(f"unknown built-in ControlNet 'random:{name}'; known: "
                         + ", ".join(f"random:{n}" for n in CONTROLNETS))
    base, cfg = CONTROLNETS[name]
    return base, dict(cfg)
