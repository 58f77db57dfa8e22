"""The UNet linear-layer GEMM shapes of SD1.5 (512², batch 1 with CFG -> batch 2) and SDXL (1024²).

Each row: ``(model, name, M, K, N, epilogue, count)``: M tokens (2 × H×W of the latent level, or
2 × 77 text tokens for the cross-attention K/V projections), K = in_features, N = output width
(GEGLU weights have 2N rows), and how many such linears one UNet forward runs. SD1.5's proj_in /
proj_out are 1×1 convolutions (not listed); SDXL's are linear and counted with the K = N rows. The
mid block of SD1.5 (8×8 latent, M = 128) is left out.
"""

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

__all__ = ["SD_LINEAR_SHAPES"]
