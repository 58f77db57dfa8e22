"""The 3x3, stride-1 convolutions of SD1.5's UNet (512², batch 1 with CFG -> batch 2) and SDXL's (1024²).

Each row: ``(model, Cin, Cout, H, W, count)``: the input's channels and size, the output's channels, and how many
such convolutions one UNet forward runs (recorded with forward hooks on the real architectures, diffusers 0.42).
The upsamplers' convolutions are the rows at the larger size of their level (SD1.5: 640x640 at 64², 1280x1280 at
32²). ``conv_in`` and ``conv_out`` (4 channels) are left out. GFLOP per row: 2 * 2 * H * W * Cin * Cout * 9 / 1e9.
"""

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

__all__ = ["SD_CONV3X3_SHAPES"]
