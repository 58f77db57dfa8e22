"""Published figures for other inference systems (not measured here), with their GPU, size, steps and source.

Each row keeps the published wording in ``model_size_steps``, ``figure`` and ``source`` (the page it comes from;
a source that gave two models, "SD1.5 512² / SDXL 1024²", is split into one row per model with that model's figure).
The numeric columns only serve the chart and the table's comparisons:

- ``e2e_s``: end-to-end seconds where the source gives them;
- ``unet_ms_step``: UNet (or denoising-loop) milliseconds per step, where the source gives it or it
  follows directly: 1000 / (it/s) for it/s figures (``unit == 'it/s'``), UNet total / steps otherwise;
- ``unit == 'images/s per GPU'``: a throughput figure (``bench_txt2img --throughput``'s rows compare with it);
- ``arch``: which of our architectures the row is comparable with ('sd15' for SD 1.x at 512², 'sdxl').

They were measured on other GPUs (A100, H100, A800), sizes and step counts: never compare them with a
measured row without saying so. Every row carries ``label = "published, not measured here"``.
"""

from __future__ import annotations

LABEL = "published, not measured here"

_FAL = "fal-ai/stable-diffusion-benchmarks README"
_SAI = "stabilityai/stable-diffusion-xl-1.0-tensorrt model card"
_SF = "chengzeyi/stable-fast README"


def _row(system, gpu, model_size_steps, figure, *, arch, size, steps, unit, value, e2e_s=None, unet_ms_step=None,
         source, note=""):
    return {
        "label": LABEL,
        "system": system,
        "gpu": gpu,
        "model_size_steps": model_size_steps,
        "figure": figure,
        "unit": unit,
        "value": value,
        "arch": arch,
        "size": size,
        "steps": steps,
        "e2e_s": e2e_s,
        "unet_ms_step": unet_ms_step,
        "source": source,
        "note": note,
    }


REFERENCE: list[dict] = [
    _row("TensorRT 9.0 (static shapes, CUDA graph)", "A100-80G SXM", "SD1.5 512², 50", "0.819 s e2e",
         arch="sd15", size="512x512", steps="50", unit="s e2e", value=0.819, e2e_s=0.819, source=_FAL),
    _row("TensorRT 9.0", "A100-80G SXM", "SDXL 1024², 50", "4.102 s e2e",
         arch="sdxl", size="1024x1024", steps="50", unit="s e2e", value=4.102, e2e_s=4.102, source=_FAL),
    _row("TensorRT", "H100", "SDXL 1024², 30", "1.471 s e2e (PyTorch 2.496 s)",
         arch="sdxl", size="1024x1024", steps="30", unit="s e2e", value=1.471, e2e_s=1.471, source=_SAI),
    _row("TensorRT", "A100", "SDXL 1024², 30", "2.742 s e2e (PyTorch 3.704 s)",
         arch="sdxl", size="1024x1024", steps="30", unit="s e2e", value=2.742, e2e_s=2.742, source=_SAI),
    _row("TensorRT, UNet only", "H100", "SDXL 1024², 40", "1772 ms (about 44 ms/step)",
         arch="sdxl", size="1024x1024", steps="40", unit="ms UNet total", value=1772.0, unet_ms_step=1772.0 / 40,
         source=_SAI + ", earlier revision"),
    _row("TensorRT 8.5", "(not stated)", "SD1.5 512², 50", "UNet 792 ms + CLIP 4 + VAE 19 = 815 ms",
         arch="sd15", size="512x512", steps="50", unit="ms e2e", value=815.0, e2e_s=0.815, unet_ms_step=792.0 / 50,
         source="NVIDIA talk slides on SD inference"),
    _row("stable-fast", "H100", "SD1.5 512²", "104.6 it/s",
         arch="sd15", size="512x512", steps="not stated", unit="it/s", value=104.6, unet_ms_step=1000 / 104.6,
         source=_SF, note="ms/step = 1000 / (it/s)"),
    _row("stable-fast", "H100", "SDXL 1024²", "21.6 it/s",
         arch="sdxl", size="1024x1024", steps="not stated", unit="it/s", value=21.6, unet_ms_step=1000 / 21.6,
         source=_SF, note="ms/step = 1000 / (it/s)"),
    _row("torch.compile max-autotune", "H100", "SD1.5 512²", "66.0 it/s",
         arch="sd15", size="512x512", steps="not stated", unit="it/s", value=66.0, unet_ms_step=1000 / 66.0,
         source=_SF, note="ms/step = 1000 / (it/s)"),
    _row("torch.compile max-autotune", "H100", "SDXL 1024²", "18.5 it/s",
         arch="sdxl", size="1024x1024", steps="not stated", unit="it/s", value=18.5, unet_ms_step=1000 / 18.5,
         source=_SF, note="ms/step = 1000 / (it/s)"),
    _row("Paddle Inference (flash attention, norm fusion, mixed layout)", "A100-80G", "SD 512², ~50",
         "0.76 s e2e, 68.2 it/s, 7.9% ahead of TensorRT",
         arch="sd15", size="512x512", steps="~50", unit="s e2e", value=0.76, e2e_s=0.76, unet_ms_step=1000 / 68.2,
         source="the seed blog's post, Baidu article", note="ms/step = 1000 / 68.2 it/s"),
    _row("TensorRT (MLPerf Inference v4.1, NVIDIA's submission, FP8 UNet, INT8 VAE)", "8x H200 SXM",
         "SDXL 1024², 20 (Euler, guidance 8.0)", "17.42 samples/s offline on 8 GPUs: 2.18 images/s per GPU",
         arch="sdxl", size="1024x1024", steps="20", unit="images/s per GPU", value=17.42 / 8,
         source="MLPerf Inference v4.1 results (datacenter, closed, stable-diffusion-xl offline)",
         note="inside MLPerf's FID / CLIP-score window; per GPU = 17.42 / 8"),
    _row("OneDiff (nexfort)", "A800", "SD1.5 512², 20", "76.0 it/s",
         arch="sd15", size="512x512", steps="20", unit="it/s", value=76.0, unet_ms_step=1000 / 76.0,
         source="siliconflow/onediff examples", note="ms/step = 1000 / (it/s)"),
]

# Columns of the printed reference table.
COLUMNS = [("system", "system"), ("gpu", "GPU"), ("model_size_steps", "model, size, steps"),
           ("figure", "figure"), ("source", "source")]


def reference_rows(arch: str | None = None) -> list[dict]:
    """Copies of the reference rows, optionally only those comparable with ``arch`` ('sd15' / 'sdxl')."""
    return [dict(r) for r in REFERENCE if arch is None or r["arch"] == arch]
