"""The paths of a 3x3 convolution against cuDNN, at SD1.5's and SDXL's 3x3 convolution shapes (GPU).

    python -m benchmarks.sweep_conv [--out DIR] [--tma] [--extra] [--models sd15,sdxl]

For each row of ``kernels.conv.sd_shapes.SD_CONV3X3_SHAPES`` (fp16, batch 2, channels_last, no bias: as the UNet's
ResNet blocks run them): cuDNN (``F.conv2d``), cuDNN after ``torch.backends.cudnn.benchmark`` picked its fastest
engine, im2col + cuBLAS (``kernels.conv.conv3x3.gemm_conv3x3``), what ``kernels.conv.conv3x3``'s measured choice
picks, and with ``--tma`` every ``kernels.conv.conv3x3_tma.CONFIGS`` entry (with ``--extra``, also ``extra_configs()``),
each timed in a CUDA graph (``triton.testing.do_bench_cudagraph``, median) and checked against ``conv3x3_ref`` (max
abs error, cuDNN's beside it). Writes ``DIR/conv.json`` (with the GPU, versions and date) and ``DIR/conv.md``;
prints one line per shape.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def extra_configs():
    """Tiles beyond the candidates: other stage counts, 64-row and 256-wide tiles, BLOCK_K 128."""
    from kernels.conv.conv3x3_tma import ConvConfig

    return (ConvConfig(128, 128, 64, 3, 8), ConvConfig(128, 64, 64, 3, 4), ConvConfig(128, 64, 64, 5, 4),
            ConvConfig(64, 64, 64, 4, 4), ConvConfig(64, 128, 64, 3, 4), ConvConfig(128, 256, 64, 3, 8),
            ConvConfig(256, 128, 64, 3, 8), ConvConfig(128, 128, 128, 2, 8))


def _time(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=30) * 1e3


def run(tma: bool = False, extra: bool = False, models=("sd15", "sdxl")) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kernels import select
    from kernels.conv import conv3x3 as cv
    from kernels.conv.conv3x3_tma import CONFIGS, conv3x3_ref, tma_conv3x3
    from kernels.conv.sd_shapes import SD_CONV3X3_SHAPES

    rows = []
    cl = torch.channels_last
    for model, cin, cout, h, w, count in SD_CONV3X3_SHAPES:
        if model not in models:
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(2, cin, h, w, device="cuda", generator=g).half().contiguous(memory_format=cl)
        wt = (torch.randn(cout, cin, 3, 3, device="cuda", generator=g) / (9 * cin) ** 0.5).half()
        wt = wt.contiguous(memory_format=cl)
        ref = conv3x3_ref(x, wt).float()
        gflop = 2 * 2 * h * w * cin * cout * 9 / 1e9
        row = dict(model=model, Cin=cin, Cout=cout, H=h, W=w, count=count, gflop=gflop)
        row["cudnn_us"] = _time(lambda: F.conv2d(x, wt, None, 1, 1))
        row["cudnn_err"] = float((F.conv2d(x, wt, None, 1, 1).float() - ref).abs().max())
        torch.backends.cudnn.benchmark = True
        row["cudnn_benchmark_us"] = _time(lambda: F.conv2d(x, wt, None, 1, 1))
        torch.backends.cudnn.benchmark = False
        row["gemm_us"] = _time(lambda: cv.gemm_conv3x3(x, wt, None))
        row["gemm_err"] = float((cv.gemm_conv3x3(x, wt, None).float() - ref).abs().max())
        select.clear("conv3x3")
        cv.conv3x3(x, wt, None)
        row["measured_choice"] = select.decisions("conv3x3")[0].winner
        row["configs"] = {}
        for c in (CONFIGS + (extra_configs() if extra else ())) if tma else ():
            try:
                err = float((tma_conv3x3(x, wt, None, c).float() - ref).abs().max())
                row["configs"][str(c)] = dict(us=_time(lambda c=c: tma_conv3x3(x, wt, None, c)), err=err)
            except Exception as e:  # noqa: BLE001 - recorded: a config that does not compile here
                row["configs"][str(c)] = dict(us=None, error=f"{type(e).__name__}: {str(e)[:200]}")
        ok = {cfg: r["us"] for cfg, r in row["configs"].items() if r.get("us")}
        row["best_tma"] = min(ok, key=ok.get) if ok else None
        row["best_tma_us"] = ok[row["best_tma"]] if ok else None
        rows.append(row)
        best = row["best_tma_us"]
        print(f"{model} {cin}->{cout} {h}x{w} x{count}: cuDNN {row['cudnn_us']:.1f} us "
              f"({gflop / row['cudnn_us'] * 1e3:.0f} TFLOP/s), cuDNN benchmark {row['cudnn_benchmark_us']:.1f}, "
              f"im2col+cuBLAS {row['gemm_us']:.1f} (err {row['gemm_err']:.2e}), choice {row['measured_choice']}, best TMA {best and round(best, 1)} us "
              f"({best and round(gflop / best * 1e3)} TFLOP/s) {row['best_tma']}, err tma "
              f"{min((r.get('err', 9) for r in row['configs'].values()), default=9):.2e} cudnn {row['cudnn_err']:.2e}",
              flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| model | Cin | Cout | H×W | per step | cuDNN µs | TFLOP/s | cuDNN benchmark µs | im2col + cuBLAS µs | choice "
           "| best TMA µs | TFLOP/s | TMA / cuDNN | config |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    saved, saved_gemm = {}, {}
    for r in rows:
        t = r["best_tma_us"]
        tma, tf, ratio = ("—", "—", "—") if t is None else (f"{t:.1f}", f"{r['gflop'] / t * 1e3:.0f}",
                                                              f"{t / r['cudnn_us']:.2f}")
        if t is not None:
            saved[r["model"]] = saved.get(r["model"], 0.0) + r["count"] * max(0.0, r["cudnn_us"] - t)
        saved_gemm[r["model"]] = saved_gemm.get(r["model"], 0.0) + r["count"] * max(0.0, r["cudnn_us"] - r["gemm_us"])
        out.append(f"| {r['model']} | {r['Cin']} | {r['Cout']} | {r['H']}x{r['W']} | {r['count']} | {r['cudnn_us']:.1f} | "
                   f"{r['gflop'] / r['cudnn_us'] * 1e3:.0f} | {r['cudnn_benchmark_us']:.1f} | {r['gemm_us']:.1f} | "
                   f"{r['measured_choice']} | {tma} | {tf} | {ratio} | {r['best_tma']} |")
    out.append("")
    out += [f"- {m}: the faster of cuDNN and the TMA kernel at every shape would save {us:.0f} µs per UNet step"
            for m, us in saved.items()]
    out += [f"- {m}: the faster of cuDNN and im2col + cuBLAS at every shape would save {us:.0f} µs per UNet step"
            for m, us in saved_gemm.items()]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tma", action="store_true", help="also time the TMA kernel's CONFIGS")
    ap.add_argument("--extra", action="store_true", help="with --tma, also the tiles of extra_configs()")
    ap.add_argument("--models", default="sd15,sdxl")
    args = ap.parse_args(argv)
    rows = run(args.tma, args.extra, tuple(args.models.split(",")))
    print(markdown(rows))
    if args.out:
        from benchmarks.report import write_sweep

        write_sweep(args.out, "conv", rows, markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
