"""Stable Diffusion's real layer shapes, for the GPU tests and the benchmarks (fixtures: no kernel reads them).

Normalization (``GROUP_NORM_SITES``, ``LAYER_NORM_SITES``, ``GEGLU_SITES``): derived once (diffusers 0.42.1, 2026-11-29) with forward hooks on every ``nn.GroupNorm`` /
``nn.LayerNorm`` of the real architectures built on the meta device from the configs in
``sdfast/architectures.py``: SD1.5 UNet at 512² (latents 64², batch 2 = CFG), SD1.5 VAE at 512²
(batch 1; decode, plus the encoder for img2img), SDXL base UNet at 1024² (latents 128², batch 2).
Kept as data because the GPU machine has no diffusers. ``silu`` says whether the norm is followed by
SiLU at that site: ResnetBlock2D's norm1/norm2 and ``conv_norm_out`` are (eps 1e-5 in the UNets,
1e-6 in the VAE); Transformer2DModel's ``norm`` (eps 1e-6) and the VAE attention's ``group_norm``
are not. The VAE attention norm runs on (1, 512, 4096) and is listed as (1, 512, 64, 64).

3x3 convolutions (``SD_CONV3X3_SHAPES``) and UNet linears (``SD_LINEAR_SHAPES``): see the comments above each
table.
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


# ----------------------------------------------------------------------------------------------------
# The 3x3, stride-1 convolutions of SD1.5's UNet (512², batch 1 with CFG -> batch 2) and SDXL's (1024²).
#
# Each row: ``(model, Cin, Cout, H, W, count)``: the input's channels and size, the output's channels, and how many
# such convolutions one UNet forward runs (recorded with forward hooks on the real architectures, diffusers 0.42).
# The upsamplers' convolutions are the rows at the larger size of their level (SD1.5: 640x640 at 64², 1280x1280 at
# 32²). ``conv_in`` and ``conv_out`` (4 channels) are left out. GFLOP per row: 2 * 2 * H * W * Cin * Cout * 9 / 1e9.
SD_CONV3X3_SHAPES = (
    ("sd15", 320, 320, 64, 64, 7),
    ("sd15", 640, 320, 64, 64, 2),
    ("sd15", 640, 640, 64, 64, 1),
    ("sd15", 960, 320, 64, 64, 1),
    ("sd15", 320, 640, 32, 32, 1),
    ("sd15", 640, 640, 32, 32, 6),
    ("sd15", 960, 640, 32, 32, 1),
    ("sd15", 1280, 640, 32, 32, 1),
    ("sd15", 1280, 1280, 32, 32, 1),
    ("sd15", 1920, 640, 32, 32, 1),
    ("sd15", 640, 1280, 16, 16, 1),
    ("sd15", 1280, 1280, 16, 16, 7),
    ("sd15", 1920, 1280, 16, 16, 1),
    ("sd15", 2560, 1280, 16, 16, 2),
    ("sd15", 1280, 1280, 8, 8, 11),
    ("sd15", 2560, 1280, 8, 8, 3),
    ("sdxl", 320, 320, 128, 128, 7),
    ("sdxl", 640, 320, 128, 128, 2),
    ("sdxl", 640, 640, 128, 128, 1),
    ("sdxl", 960, 320, 128, 128, 1),
    ("sdxl", 320, 640, 64, 64, 1),
    ("sdxl", 640, 640, 64, 64, 6),
    ("sdxl", 960, 640, 64, 64, 1),
    ("sdxl", 1280, 640, 64, 64, 1),
    ("sdxl", 1280, 1280, 64, 64, 1),
    ("sdxl", 1920, 640, 64, 64, 1),
    ("sdxl", 640, 1280, 32, 32, 1),
    ("sdxl", 1280, 1280, 32, 32, 10),
    ("sdxl", 1920, 1280, 32, 32, 1),
    ("sdxl", 2560, 1280, 32, 32, 2),
)


# ----------------------------------------------------------------------------------------------------
# The UNet linear-layer GEMM shapes of SD1.5 (512², batch 1 with CFG -> batch 2) and SDXL (1024²).
#
# Each row: ``(model, name, M, K, N, epilogue, count)``: M tokens (2 × H×W of the latent level, or
# 2 × 77 text tokens for the cross-attention K/V projections), K = in_features, N = output width
# (GEGLU weights have 2N rows), and how many such linears one UNet forward runs. SD1.5's proj_in /
# proj_out are 1×1 convolutions (not listed); SDXL's are linear and counted with the K = N rows. The
# mid block of SD1.5 (8×8 latent, M = 128) is left out.
SD_LINEAR_SHAPES = [
    # SD1.5: 5 transformer blocks per level (2 down + 3 up); per block attn1 q/k/v/out + attn2 q/out,
    # attn2 k/v on the 77 text tokens (768 wide), GEGLU proj (N -> 2*4N) and ff out (4N -> N)
    ("sd15", "l0.attn_qkvo", 8192, 320, 320, None, 30),
    ("sd15", "l0.cross_kv", 154, 768, 320, None, 10),
    ("sd15", "l0.ff_geglu", 8192, 320, 1280, "geglu", 5),
    ("sd15", "l0.ff_out", 8192, 1280, 320, None, 5),
    ("sd15", "l1.attn_qkvo", 2048, 640, 640, None, 30),
    ("sd15", "l1.cross_kv", 154, 768, 640, None, 10),
    ("sd15", "l1.ff_geglu", 2048, 640, 2560, "geglu", 5),
    ("sd15", "l1.ff_out", 2048, 2560, 640, None, 5),
    ("sd15", "l2.attn_qkvo", 512, 1280, 1280, None, 30),
    ("sd15", "l2.cross_kv", 154, 768, 1280, None, 10),
    ("sd15", "l2.ff_geglu", 512, 1280, 5120, "geglu", 5),
    ("sd15", "l2.ff_out", 512, 5120, 1280, None, 5),
    # SDXL: level 1 (64², 640): 10 blocks + 5 transformers' proj_in/out; level 2 (32², 1280) incl. mid:
    # 60 blocks + 11 transformers' proj_in/out; text states 2048 wide
    ("sdxl", "l1.attn_qkvo_proj", 8192, 640, 640, None, 70),
    ("sdxl", "l1.cross_kv", 154, 2048, 640, None, 20),
    ("sdxl", "l1.ff_geglu", 8192, 640, 2560, "geglu", 10),
    ("sdxl", "l1.ff_out", 8192, 2560, 640, None, 10),
    ("sdxl", "l2.attn_qkvo_proj", 2048, 1280, 1280, None, 382),
    ("sdxl", "l2.cross_kv", 154, 2048, 1280, None, 120),
    ("sdxl", "l2.ff_geglu", 2048, 1280, 5120, "geglu", 60),
    ("sdxl", "l2.ff_out", 2048, 5120, 1280, None, 60),
]


__all__ = [
    "GROUP_NORM_SITES",
    "LAYER_NORM_SITES",
    "GEGLU_SITES",
    "SD_CONV3X3_SHAPES",
    "SD_LINEAR_SHAPES",
    "unique_group_norm_cases",
    "unique_layer_norm_shapes",
    "unique_geglu_shapes",
]
