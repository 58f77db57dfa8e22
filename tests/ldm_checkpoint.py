"""Test helper: a diffusers SD pipeline's weights under the original (CompVis / Stability "LDM") key names,
i.e. what a single-file ``.safetensors`` checkpoint of that model holds.

diffusers' wheel only converts original -> diffusers (``diffusers.loaders.single_file_utils``); this is the
inverse of its ``convert_ldm_unet_checkpoint``, ``convert_ldm_vae_checkpoint``, ``convert_ldm_clip_checkpoint``
and ``convert_open_clip_checkpoint`` for the block types SD 1.x / 2.x / SDXL use, so that a single-file
round trip (diffusers -> original -> ``from_single_file``) can be tested on the tiny architectures.
"""

from __future__ import annotations

import torch

_RESNET = [("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("norm2", "out_layers.0"), ("conv2", "out_layers.3"),
           ("time_emb_proj", "emb_layers.1"), ("conv_shortcut", "skip_connection")]
_UNET_TOP = {
    "time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
    "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
    "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
}


def _resnet_rest(rest: str) -> str:
    for new, old in _RESNET:
        if rest.startswith(new + "."):
            return old + rest[len(new):]
    raise KeyError(rest)


def unet_to_ldm(sd: dict, config) -> dict:
    """UNet2DConditionModel state dict -> ``model.diffusion_model.*`` keys."""
    per = config["layers_per_block"] + 1
    up_has_attn = {i: t.startswith("CrossAttn") for i, t in enumerate(config["up_block_types"])}
    out = {}
    for key, v in sd.items():
        p = key.split(".")
        head = ".".join(p[:-1])
        if head in _UNET_TOP:
            new = f"{_UNET_TOP[head]}.{p[-1]}"
        elif p[0] == "down_blocks":
            b, kind = int(p[1]), p[2]
            if kind == "downsamplers":
                new = f"input_blocks.{(b + 1) * per}.0.op.{p[-1]}"
            else:
                i = b * per + int(p[3]) + 1
                rest = ".".join(p[4:])
                new = f"input_blocks.{i}.0.{_resnet_rest(rest)}" if kind == "resnets" else f"input_blocks.{i}.1.{rest}"
        elif p[0] == "mid_block":
            j, rest = int(p[2]), ".".join(p[3:])
            new = f"middle_block.{2 * j}.{_resnet_rest(rest)}" if p[1] == "resnets" else f"middle_block.1.{rest}"
        elif p[0] == "up_blocks":
            b, kind = int(p[1]), p[2]
            if kind == "upsamplers":
                new = f"output_blocks.{b * per + per - 1}.{2 if up_has_attn[b] else 1}.conv.{p[-1]}"
            else:
                i = b * per + int(p[3])
                rest = ".".join(p[4:])
                new = f"output_blocks.{i}.0.{_resnet_rest(rest)}" if kind == "resnets" else f"output_blocks.{i}.1.{rest}"
        else:
            raise KeyError(f"no original name for UNet key {key}")
        out["model.diffusion_model." + new] = v
    return out


_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def vae_to_ldm(sd: dict, config) -> dict:
    """AutoencoderKL state dict -> ``first_stage_model.*`` keys (attention projections as 1x1 convs)."""
    n_up = len(config["up_block_types"])
    out = {}
    for key, v in sd.items():
        p = key.split(".")
        new = key
        if p[0] in ("encoder", "decoder"):
            side, rest = p[0], p[1:]
            if rest[0] == "conv_norm_out":
                new = f"{side}.norm_out.{rest[-1]}"
            elif rest[0] in ("down_blocks", "up_blocks"):
                b = int(rest[1]) if rest[0] == "down_blocks" else n_up - 1 - int(rest[1])
                name = "down" if rest[0] == "down_blocks" else "up"
                if rest[2] in ("downsamplers", "upsamplers"):
                    new = f"{side}.{name}.{b}.{'downsample' if name == 'down' else 'upsample'}.conv.{rest[-1]}"
                else:
                    inner = ".".join(rest[4:]).replace("conv_shortcut", "nin_shortcut")
                    new = f"{side}.{name}.{b}.block.{rest[3]}.{inner}"
            elif rest[0] == "mid_block":
                if rest[1] == "resnets":
                    inner = ".".join(rest[3:]).replace("conv_shortcut", "nin_shortcut")
                    new = f"{side}.mid.block_{int(rest[2]) + 1}.{inner}"
                else:
                    inner = ".".join(rest[3:-1])
                    new = f"{side}.mid.attn_1.{_VAE_ATTN[inner]}.{rest[-1]}"
                    if v.dim() == 2:
                        v = v[:, :, None, None]
        out["first_stage_model." + new] = v
    return out


def clip_to_ldm(sd: dict, prefix: str) -> dict:
    """transformers CLIPTextModel -> the HF-format keys SD1 / SDXL's first embedder use."""
    return {prefix + (k if k.startswith("text_model.") else "text_model." + k): v for k, v in sd.items()}


def clip_to_open_clip(sd: dict, prefix: str) -> dict:
    """transformers CLIP text model -> OpenCLIP keys (SD 2.x, SDXL's second embedder): fused in_proj, resblocks."""
    sd = {k.removeprefix("text_model."): v for k, v in sd.items()}
    out = {
        prefix + "token_embedding.weight": sd.pop("embeddings.token_embedding.weight"),
        prefix + "positional_embedding": sd.pop("embeddings.position_embedding.weight"),
        prefix + "ln_final.weight": sd.pop("final_layer_norm.weight"),
        prefix + "ln_final.bias": sd.pop("final_layer_norm.bias"),
    }
    if "text_projection.weight" in sd:
        out[prefix + "text_projection"] = sd.pop("text_projection.weight").T.contiguous()
    layers = sorted({int(k.split(".")[2]) for k in sd if k.startswith("encoder.layers.")})
    for i in layers:
        src, dst = f"encoder.layers.{i}.", f"{prefix}transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[dst + f"attn.in_proj_{kind}"] = torch.cat([sd.pop(src + f"self_attn.{n}_proj.{kind}") for n in "qkv"])
            out[dst + f"attn.out_proj.{kind}"] = sd.pop(src + f"self_attn.out_proj.{kind}")
            out[dst + f"ln_1.{kind}"] = sd.pop(src + f"layer_norm1.{kind}")
            out[dst + f"ln_2.{kind}"] = sd.pop(src + f"layer_norm2.{kind}")
            out[dst + f"mlp.c_fc.{kind}"] = sd.pop(src + f"mlp.fc1.{kind}")
            out[dst + f"mlp.c_proj.{kind}"] = sd.pop(src + f"mlp.fc2.{kind}")
    sd.pop("embeddings.position_ids", None)
    if sd:
        raise KeyError(f"unconverted CLIP keys: {sorted(sd)[:5]}")
    return out


def original_state_dict(pipe, family: str) -> dict:
    """All weights of ``pipe`` under original key names. ``family``: "sd1", "sd2" or "sdxl"."""
    out = {}
    out.update(unet_to_ldm(pipe.unet.state_dict(), pipe.unet.config))
    out.update(vae_to_ldm(pipe.vae.state_dict(), pipe.vae.config))
    te = pipe.text_encoder.state_dict()
    if family == "sd1":
        out.update(clip_to_ldm(te, "cond_stage_model.transformer."))
    elif family == "sd2":
        out.update(clip_to_open_clip(te, "cond_stage_model.model."))
    elif family == "sdxl":
        out.update(clip_to_ldm(te, "conditioner.embedders.0.transformer."))
        out.update(clip_to_open_clip(pipe.text_encoder_2.state_dict(), "conditioner.embedders.1.model."))
    else:
        raise ValueError(family)
    return {k: v.detach().contiguous().clone() for k, v in out.items()}
