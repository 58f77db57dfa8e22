"""Quantized linears at UNet level, one CLI (GPU only; nothing runs at import):

    python -m benchmarks.ops.quant bench [--quick] [--out DIR]
    python -m benchmarks.ops.quant report [--models sd15,sdxl] [--out DIR]

``bench``: each method of ``sdfast.passes.quantize`` on the real SD1.5 / SDXL UNet architectures with seeded random
weights (fp16, batch 2 = batch 1 with CFG); the ``quant`` section of ``benchmarks.bench_kernels`` (``run``), written
here to ``quant_bench.json`` / ``.md`` in ``--out``. (The quantized GEMM kernels alone, per linear shape, are rows of
``python -m benchmarks.ops.gemm bench``.) One row per (model, method):

- ``ms_step``: one UNet forward replayed in a CUDA graph (median of 20 replays; stock diffusers UNet with
  SDPA attention and only the quantization pass applied, so the other sdfast passes are not in it);
  ``x_fp16``: fp16 ms / method ms (> 1: faster).
- ``weight_ratio``: bytes of the quantized layers' weights after / before (fp16); targets <= 0.55 for
  8-bit and <= 0.3 for 4-bit. ``quantized`` / ``skipped_shape``: layer counts.
- ``psnr_db`` / ``rel_err``: the UNet output (noise prediction, fixed inputs) against the fp16 UNet:
  PSNR with the fp16 output's max |value| as peak, and relative L2 error. (The image-level PSNR of the
  30-step pipeline is measured by the pipeline benchmark.)
- ``quantize_s``: calibration (3 UNet calls on random latents / text states at t = 999, 500, 50) +
  quantization time.

Methods: fp16 baseline, W8A8 int8 (SmoothQuant alpha 0.5), W8A8 FP8 (sm_89+), W8A8 int8 with
ZeroQuant group-wise weights (128), W4A16 AWQ (Triton and CUDA C++ main loops), W4A16 GPTQ (SD1.5
only: Hessians of every layer), W4A16 RTN, LLM.int8() (static outlier columns from calibration,
threshold 6). A method that fails gives a row whose ``note`` starts with ``error:``.

``report``: the per-layer quantization error of the preset "everything 8-bit that pays"
(``W8A8Config(dtype="fp8", activations="static", alpha=0.0, convs=True)``) on each UNet: calibrated as ``bench``
does, then :func:`sdfast.layer_report` over three other calls (seeds 21-23 at t = 999, 500, 50): every quantized
layer's SQNR against its original weights, worst first. Writes ``quant_report_<model>.json`` / ``.md`` (the md: the 25
worst layers and the distribution) in ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

_LEAD = ("model", "method", "ms_step", "x_fp16", "weight_ratio", "psnr_db", "rel_err", "quantized", "skipped_shape",
         "quantize_s", "note")


def _build_unet(model: str):
    import diffusers
    import torch

    from sdfast.architectures import get_architecture

    cfg = get_architecture(model)["unet"]
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device("cuda"):
            unet = diffusers.UNet2DConditionModel(**cfg)
    finally:
        torch.set_default_dtype(prev)
    return unet.eval().requires_grad_(False)


def _inputs(unet, model: str, seed: int, t: int) -> dict:
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    side = 128 if model == "sdxl" else 64
    cross = unet.config.cross_attention_dim
    kw = dict(sample=torch.randn(2, 4, side, side, device="cuda", generator=g).half(),
              timestep=torch.tensor([t, t], device="cuda"),
              encoder_hidden_states=torch.randn(2, 77, cross, device="cuda", generator=g).half())
    if unet.config.addition_embed_type == "text_time":
        kw["added_cond_kwargs"] = dict(
            text_embeds=torch.randn(2, 1280, device="cuda", generator=g).half(),
            time_ids=torch.tensor([[1024.0, 1024.0, 0.0, 0.0, 1024.0, 1024.0]] * 2, device="cuda").half())
    return kw


def _graph_ms(unet, inputs: dict, reps: int = 20) -> float:
    import torch

    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):  # autotuning and first-call work before capture
                unet(**inputs)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            unet(**inputs)
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        del g
    return sorted(times)[len(times) // 2]


def _methods(model: str, quick: bool) -> list[tuple[str, object]]:
    import torch

    from sdfast.passes.quantize import Int8OutlierConfig, W4A16Config, W8A8Config

    m = [("w8a8_int8", W8A8Config(alpha=0.5))]
    if torch.cuda.get_device_capability() >= (8, 9):
        m.append(("w8a8_fp8", W8A8Config(alpha=0.5, dtype="fp8")))
    m.append(("w4a16_awq", W4A16Config(method="awq", group_size=128)))
    m.append(("int8_outlier", Int8OutlierConfig(threshold=6.0)))
    if not quick:
        m.insert(1, ("w8a8_int8_zeroquant_g128", W8A8Config(alpha=0.5, group_size=128)))
        m.append(("w4a16_awq_csrc", W4A16Config(method="awq", group_size=128, backend="csrc")))
        m.append(("w4a16_rtn", W4A16Config(method="rtn", group_size=128)))
        if model == "sd15":
            m.append(("w4a16_gptq", W4A16Config(method="gptq", group_size=128)))
    return m


def _meta() -> dict:
    import torch
    import triton

    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                triton=triton.__version__, dtype="float16", batch=2)


def run(quick: bool = False) -> list[dict]:
    """The ``quant`` section of the kernel suite: quantize the SD1.5 (and, unless ``quick``, SDXL) UNet with each
    method; returns rows (see the module docstring); one skip row without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return [{"bench": "quant", "note": "skipped: needs a CUDA GPU"}]
    from sdfast.passes.quantize import quantize_

    meta = _meta()
    rows: list[dict] = []
    for model in (["sd15"] if quick else ["sd15", "sdxl"]):
        t0 = time.perf_counter()
        base = _build_unet(model)
        fixed = _inputs(base, model, 1, 500)
        with torch.no_grad():
            ref = base(**fixed).sample.float()
        fp16_ms = _graph_ms(base, fixed)
        rows.append(dict(bench="quant", model=model, method="fp16", ms_step=fp16_ms, x_fp16=1.0, weight_ratio=1.0,
                         psnr_db=None, rel_err=0.0, quantized=0, skipped_shape=0,
                         note=f"UNet built in {time.perf_counter() - t0:.0f} s", **meta))
        for name, config in _methods(model, quick):
            row = dict(bench="quant", model=model, method=name, config=repr(config))
            u = None
            try:
                u = copy.deepcopy(base)

                def calibration(u=u):
                    for seed, t in ((11, 999), (12, 500), (13, 50)):
                        u(**_inputs(u, model, seed, t))

                t1 = time.perf_counter()
                stats = quantize_(u, config, calibration=calibration)
                torch.cuda.synchronize()
                row["quantize_s"] = time.perf_counter() - t1
                with torch.no_grad():
                    out = u(**fixed).sample.float()
                err = (out - ref).pow(2).mean().sqrt().item()
                row.update(quantized=int(stats), skipped_shape=stats.skipped_shape, weight_ratio=stats.weight_ratio,
                           rel_err=((out - ref).norm() / ref.norm()).item(),
                           psnr_db=(20 * torch.log10(ref.abs().max() / max(err, 1e-12))).item(),
                           finite=bool(torch.isfinite(out).all()))
                ms = _graph_ms(u, fixed)
                row.update(ms_step=ms, x_fp16=fp16_ms / ms)
            except Exception as e:  # noqa: BLE001 - one row per failure
                row["note"] = f"error: {type(e).__name__}: {e}"[:500]
            finally:
                del u
                torch.cuda.empty_cache()
            row.update(meta)
            rows.append(row)
        del base
        torch.cuda.empty_cache()
    return rows


def bench(args) -> int:
    """The ``bench`` subcommand (see the module docstring)."""
    from benchmarks.report import markdown_table, write_rows

    rows = run(args.quick)
    md = "\n".join(["# Quantized UNet (fp16 base, batch 2)", "", markdown_table(rows, _LEAD)])
    if args.out is not None:
        write_rows(args.out, "quant_bench", rows, md + "\n")
    print(md)
    return 0


REPORT_CONFIG = dict(dtype="fp8", activations="static", alpha=0.0, convs=True)  # W8A8Config.fp8_static()


def report_rows(model: str) -> tuple[list[dict], dict]:
    """``layer_report`` rows of one UNet (random weights, seed 0) under ``REPORT_CONFIG``, and a summary."""
    import statistics

    import torch

    from sdfast.passes.quantize import W8A8Config, quantize_
    from sdfast.quantization import layer_report

    unet = _build_unet(model)

    def calls(seeds):
        def run():
            for seed, t in zip(seeds, (999, 500, 50)):
                unet(**_inputs(unet, model, seed, t))
        return run

    with torch.no_grad():
        n = quantize_(unet, W8A8Config.fp8_static(), calibration=calls((11, 12, 13)), keep_original=True)
        rows = [r.as_dict() for r in layer_report(unet, calls((21, 22, 23)))]
    called = [r["sqnr_db"] for r in rows if r["calls"]]
    summary = dict(model=model, layers=int(n), reported=len(rows), worst_db=min(called), median_db=statistics.median(called),
                   best_db=max(called), below_20_db=sum(v < 20 for v in called), **_meta())
    return rows, summary


def report(args) -> int:
    """The ``report`` subcommand (see the module docstring)."""
    from benchmarks.report import write_sweep
    from sdfast.quantization import LayerError, format_report

    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        rows, summary = report_rows(model)
        kinds = {}
        for r in rows:
            kinds.setdefault(r["kind"], []).append(r["sqnr_db"])
        md = "\n".join([
            f"# Per-layer quantization error, {model} UNet, W8A8Config({', '.join(f'{k}={v!r}' for k, v in REPORT_CONFIG.items())})",
            "", f"{summary['reported']} quantized layers ({summary['layers']} converted); SQNR against the original weights "
            f"over 3 UNet calls: worst {summary['worst_db']:.1f} dB, median {summary['median_db']:.1f} dB, best "
            f"{summary['best_db']:.1f} dB; {summary['below_20_db']} below 20 dB.", "",
            *[f"- {k}: {len(v)} layers, {min(v):.1f}-{max(v):.1f} dB" for k, v in kinds.items()], "",
            "## The 25 worst", "", format_report([LayerError(**r) for r in rows], limit=25)])
        print(md)
        if args.out is not None:
            write_sweep(args.out, f"quant_report_{model}", rows, md + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ops.quant", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("bench", help="each quantization method on the SD1.5 / SDXL UNet: speed, bytes, error")
    p.add_argument("--quick", action="store_true", help="SD1.5 only, the four main methods")
    p.add_argument("--out", type=Path, default=None, help="write quant_bench.json/.md here")
    p.set_defaults(fn=bench)
    p = sub.add_parser("report", help="per-layer SQNR of the static FP8 preset (linears and convolutions), worst first")
    p.add_argument("--models", default="sd15,sdxl", help="comma list of sd15, sdxl")
    p.add_argument("--out", type=Path, default=None, help="write quant_report_<model>.json/.md here")
    p.set_defaults(fn=report)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
