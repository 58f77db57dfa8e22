"""The normalization shapes Stable Diffusion actually runs (for GPU tests and benchmarks).

Derived once (diffusers 0.42.1, 2026-11-29) with forward hooks on every ``nn.GroupNorm`` /
``nn.LayerNorm`` of the real architectures built on the meta device from the configs in
``sdfast/architectures.py``: SD1.5 UNet at 512² (latents 64², batch 2 = CFG), SD1.5 VAE at 512²
(batch 1; decode, plus the encoder for img2img), SDXL base UNet at 1024² (latents 128², batch 2).
Kept as data because the GPU machine has no diffusers. ``silu`` says whether the norm is followed by
SiLU at that site: ResnetBlock2D's norm1/norm2 and ``conv_norm_out`` are (eps 1e-5 in the UNets,
1e-6 in the VAE); Transformer2DModel's ``norm`` (eps 1e-6) and the VAE attention's ``group_norm``
are not. The VAE attention norm runs on (1, 512, 4096) and is listed as (1, 512, 64, 64).
"""

from __future__ import annotations

# (model, shape (B, C, H, W), eps, silu, calls per forward); num_groups is 32 everywhere.
GROUP_NORM_SITES: list[tuple[str, tuple[int, int, int, int], float, bool, int]] = [
    # SD1.5 UNet, 512², batch 2
    ("sd15-unet", (2, 320, 64, 64), 1e-5, True, 8),
    ("sd15-unet", (2, 320, 64, 64), 1e-6, False, 5),
    ("sd15-unet", (2, 320, 32, 32), 1e-5, True, 1),
    ("sd15-unet", (2, 640, 64, 64), 1e-5, True, 2),
    ("sd15-unet", (2, 640, 32, 32), 1e-5, True, 6),
    ("sd15-unet", (2, 640, 32, 32), 1e-6, False, 5),
    ("sd15-unet", (2, 640, 16, 16), 1e-5, True, 1),
    ("sd15-unet", (2, 960, 64, 64), 1e-5, True, 1),
    ("sd15-unet", (2, 960, 32, 32), 1e-5, True, 1),
    ("sd15-unet", (2, 1280, 32, 32), 1e-5, True, 1),
    ("sd15-unet", (2, 1280, 16, 16), 1e-5, True, 6),
    ("sd15-unet", (2, 1280, 16, 16), 1e-6, False, 5),
    ("sd15-unet", (2, 1280, 8, 8), 1e-5, True, 11),
    ("sd15-unet", (2, 1280, 8, 8), 1e-6, False, 1),
    ("sd15-unet", (2, 1920, 32, 32), 1e-5, True, 1),
    ("sd15-unet", (2, 1920, 16, 16), 1e-5, True, 1),
    ("sd15-unet", (2, 2560, 16, 16), 1e-5, True, 2),
    ("sd15-unet", (2, 2560, 8, 8), 1e-5, True, 3),
    # SD1.5 VAE decoder, 512², batch 1
    ("sd15-vae-decode", (1, 512, 64, 64), 1e-6, True, 10),
    ("sd15-vae-decode", (1, 512, 64, 64), 1e-6, False, 1),
    ("sd15-vae-decode", (1, 512, 128, 128), 1e-6, True, 6),
    ("sd15-vae-decode", (1, 512, 256, 256), 1e-6, True, 1),
    ("sd15-vae-decode", (1, 256, 256, 256), 1e-6, True, 5),
    ("sd15-vae-decode", (1, 256, 512, 512), 1e-6, True, 1),
    ("sd15-vae-decode", (1, 128, 512, 512), 1e-6, True, 6),
    # SD1.5 VAE encoder, 512², batch 1 (img2img)
    ("sd15-vae-encode", (1, 128, 512, 512), 1e-6, True, 4),
    ("sd15-vae-encode", (1, 128, 256, 256), 1e-6, True, 1),
    ("sd15-vae-encode", (1, 256, 256, 256), 1e-6, True, 3),
    ("sd15-vae-encode", (1, 256, 128, 128), 1e-6, True, 1),
    ("sd15-vae-encode", (1, 512, 128, 128), 1e-6, True, 3),
    ("sd15-vae-encode", (1, 512, 64, 64), 1e-6, True, 9),
    ("sd15-vae-encode", (1, 512, 64, 64), 1e-6, False, 1),
    # SDXL base UNet, 1024², batch 2
    ("sdxl-unet", (2, 320, 128, 128), 1e-5, True, 8),
    ("sdxl-unet", (2, 320, 64, 64), 1e-5, True, 1),
    ("sdxl-unet", (2, 640, 128, 128), 1e-5, True, 2),
    ("sdxl-unet", (2, 640, 64, 64), 1e-5, True, 6),
    ("sdxl-unet", (2, 640, 64, 64), 1e-6, False, 5),
    ("sdxl-unet", (2, 640, 32, 32), 1e-5, True, 1),
    ("sdxl-unet", (2, 960, 128, 128), 1e-5, True, 1),
    ("sdxl-unet", (2, 960, 64, 64), 1e-5, True, 1),
    ("sdxl-unet", (2, 1280, 64, 64), 1e-5, True, 1),
    ("sdxl-unet", (2, 1280, 32, 32), 1e-5, True, 10),
    ("sdxl-unet", (2, 1280, 32, 32), 1e-6, False, 6),
    ("sdxl-unet", (2, 1920, 64, 64), 1e-5, True, 1),
    ("sdxl-unet", (2, 1920, 32, 32), 1e-5, True, 1),
    ("sdxl-unet", (2, 2560, 32, 32), 1e-5, True, 2),
]

# (model, shape (B, T, D), calls per forward); eps 1e-5, affine. BasicTransformerBlock norm1/2/3.
LAYER_NORM_SITES: list[tuple[str, tuple[int, int, int], int]] = [
    ("sd15-unet", (2, 4096, 320), 15),
    ("sd15-unet", (2, 1024, 640), 15),
    ("sd15-unet", (2, 256, 1280), 15),
    ("sd15-unet", (2, 64, 1280), 3),
    ("sdxl-unet", (2, 4096, 640), 30),
    ("sdxl-unet", (2, 1024, 1280), 180),
]

# (model, GEGLU input shape (B, T, 2 * 4 * dim)): the FeedForward's GEGLU after its projection.
GEGLU_SITES: list[tuple[str, tuple[int, int, int]]] = [
    ("sd15-unet", (2, 4096, 2560)),
    ("sd15-unet", (2, 1024, 5120)),
    ("sd15-unet", (2, 256, 10240)),
    ("sd15-unet", (2, 64, 10240)),
    ("sdxl-unet", (2, 4096, 5120)),
    ("sdxl-unet", (2, 1024, 10240)),
]


def unique_group_norm_cases() -> list[tuple[tuple[int, int, int, int], bool, float]]:
    """Distinct (shape, silu, eps) GroupNorm cases over all models, in first-seen order."""
    seen: dict = {}
    for _, shape, eps, silu, _ in GROUP_NORM_SITES:
        seen.setdefault((shape, silu), eps)
    return [(shape, silu, eps) for (shape, silu), eps in seen.items()]


def unique_layer_norm_shapes() -> list[tuple[int, int, int]]:
    return list(dict.fromkeys(shape for _, shape, _ in LAYER_NORM_SITES))


def unique_geglu_shapes() -> list[tuple[int, int, int]]:
    return list(dict.fromkeys(shape for _, shape in GEGLU_SITES))
