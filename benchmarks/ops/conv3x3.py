"""3x3 convolution benchmarks, one CLI (GPU only; nothing runs at import):

    python -m benchmarks.ops.conv3x3 sweep [--out DIR] [--models sd15,sdxl]

``sweep``: the paths of a 3x3 convolution against cuDNN, at SD1.5's and SDXL's 3x3 convolution shapes. For each row
of ``benchmarks.sd_shapes.SD_CONV3X3_SHAPES`` (fp16, batch 2, channels_last, no bias: as the UNet's ResNet blocks
run them): cuDNN (``F.conv2d``), cuDNN after ``torch.backends.cudnn.benchmark`` picked its fastest engine, im2col +
cuBLAS (``kernels.conv.conv3x3.gemm_conv3x3``), what ``kernels.conv.conv3x3``'s measured choice picks (from
``kernels.select.decisions()``), and on sm_89+ the FP8 path of ``W8A8Config(convs=True)``
(``sdfast.quantization.W8A8StaticConv2d``: the implicit-GEMM kernels of ``kernels.conv.fp8_conv3x3`` alone, the
pointer kernel and the TMA kernel with their autotuned tiles, the pointer kernel again with fp32-promoted
accumulation (``fast_accum=False``: the TMA kernel takes fast accumulation only);
the faster kernel with the input's quantize pass before it, its relative error against the fp32 convolution of
the unquantized operands), each timed in a CUDA graph (``triton.testing.do_bench_cudagraph``, median) and
checked against the fp32 ``F.conv2d`` (max abs error, cuDNN's beside it). Writes ``DIR/conv.json`` (with the GPU,
versions and date) and ``DIR/conv.md``; prints one line per shape.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _time(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=30) * 1e3


def sweep_rows(models=("sd15", "sdxl")) -> list[dict]:
    """The ``sweep`` subcommand's rows, one per shape of ``models`` (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    from benchmarks.sd_shapes import SD_CONV3X3_SHAPES
    from kernels import select
    from kernels.conv import conv3x3 as cv

    rows = []
    cl = torch.channels_last
    for model, cin, cout, h, w, count in SD_CONV3X3_SHAPES:
        if model not in models:
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(2, cin, h, w, device="cuda", generator=g).half().contiguous(memory_format=cl)
        wt = (torch.randn(cout, cin, 3, 3, device="cuda", generator=g) / (9 * cin) ** 0.5).half()
        wt = wt.contiguous(memory_format=cl)
        ref = F.conv2d(x.float(), wt.float(), None, 1, 1)
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
        if torch.cuda.get_device_capability() >= (8, 9):
            row.update(_fp8_row(x, wt, ref))
        rows.append(row)
        fp8 = (f", FP8 {row['fp8_us']:.1f} us ({gflop / row['fp8_us'] * 1e3:.0f} TFLOP/s, {row['fp8_tile']}), "
               f"FP8 TMA {row['fp8_tma_us']:.1f} us ({gflop / row['fp8_tma_us'] * 1e3:.0f} TFLOP/s, "
               f"{row['fp8_tma_tile']}), pointer promoted {row['fp8_promoted_us']:.1f}, "
               f"faster + quantize {row['fp8_quant_us']:.1f}, rel err {row['fp8_err']:.3f}") if "fp8_us" in row else ""
        print(f"{model} {cin}->{cout} {h}x{w} x{count}: cuDNN {row['cudnn_us']:.1f} us "
              f"({gflop / row['cudnn_us'] * 1e3:.0f} TFLOP/s), cuDNN benchmark {row['cudnn_benchmark_us']:.1f}, "
              f"im2col+cuBLAS {row['gemm_us']:.1f} (err {row['gemm_err']:.2e}), choice {row['measured_choice']}, "
              f"err cudnn {row['cudnn_err']:.2e}{fp8}",
              flush=True)
    return rows


def _fp8_row(x, wt, ref) -> dict:
    """The FP8 columns of one shape: the kernel alone, the quantize pass + kernel, the tile, the error."""
    import torch

    from kernels.conv import fp8_conv3x3 as fc
    from sdfast.quantization import W8A8StaticConv2d

    conv = torch.nn.Conv2d(wt.shape[1], wt.shape[0], 3, padding=1, bias=False, device=x.device, dtype=x.dtype)
    with torch.no_grad():
        conv.weight.copy_(wt)
    m = W8A8StaticConv2d.from_conv(conv, input_amax=float(x.abs().max()))
    n, c, h, w = x.shape
    with torch.no_grad():
        xq = (x.float() * m.input_scale_inv).clamp(-448, 448).to(torch.float8_e4m3fn).permute(0, 2, 3, 1).contiguous()
        def kernel(tma, fast=True):
            return lambda: fc.fp8_conv3x3(xq, m.weight_q, m.input_scale, m.w_scale, None, tma=tma, fast_accum=fast)

        row = {}
        kernel(False)()
        row["fp8_us"], row["fp8_tile"] = _time(kernel(False)), fc.autotuned_tile(False, x.device.index or 0)
        kernel(True)()
        row["fp8_tma_us"], row["fp8_tma_tile"] = _time(kernel(True)), fc.autotuned_tile(True, x.device.index or 0)
        kernel(False, False)()
        row["fp8_promoted_us"] = _time(kernel(False, False))
        tma = row["fp8_tma_us"] < row["fp8_us"]
        y = m.fp8_forward(x, tma=tma).float()
        row["fp8_quant_us"] = _time(lambda: m.fp8_forward(x, tma=tma))
        row["fp8_err"] = float((y - ref).norm() / ref.norm())
        return row


def markdown(rows: list[dict]) -> str:
    fp8 = any("fp8_us" in r for r in rows)
    out = ["| model | Cin | Cout | H×W | per step | cuDNN µs | TFLOP/s | cuDNN benchmark µs | im2col + cuBLAS µs | choice |"
           + (" FP8 µs | tile | FP8 promoted µs | FP8 TMA µs | TFLOP/s | tile | faster FP8 + quantize µs | FP8 rel err |"
              if fp8 else ""),
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
           + (" --- | --- | --- | --- | --- | --- | --- | --- |" if fp8 else "")]
    saved_gemm, cudnn_sum, fp8_sum = {}, {}, {}
    for r in rows:
        saved_gemm[r["model"]] = saved_gemm.get(r["model"], 0.0) + r["count"] * max(0.0, r["cudnn_us"] - r["gemm_us"])
        line = (f"| {r['model']} | {r['Cin']} | {r['Cout']} | {r['H']}x{r['W']} | {r['count']} | {r['cudnn_us']:.1f} | "
                f"{r['gflop'] / r['cudnn_us'] * 1e3:.0f} | {r['cudnn_benchmark_us']:.1f} | {r['gemm_us']:.1f} | "
                f"{r['measured_choice']} |")
        if "fp8_us" in r:
            cudnn_sum[r["model"]] = cudnn_sum.get(r["model"], 0.0) + r["count"] * r["cudnn_us"]
            fp8_sum[r["model"]] = fp8_sum.get(r["model"], 0.0) + r["count"] * min(r["cudnn_us"], r["fp8_quant_us"])
            line += (f" {r['fp8_us']:.1f} | {r['fp8_tile']} | {r['fp8_promoted_us']:.1f} | {r['fp8_tma_us']:.1f} | "
                     f"{r['gflop'] / r['fp8_tma_us'] * 1e3:.0f} | {r['fp8_tma_tile']} | "
                     f"{r['fp8_quant_us']:.1f} | {r['fp8_err']:.3f} |")
        out.append(line)
    out.append("")
    out += [f"- {m}: the faster of cuDNN and im2col + cuBLAS at every shape would save {us:.0f} µs per UNet step"
            for m, us in saved_gemm.items()]
    out += [f"- {m}: cuDNN {cudnn_sum[m]:.0f} µs per UNet step over these convolutions; the faster of cuDNN and FP8 + "
            f"quantize at each shape {fp8_sum[m]:.0f} µs" for m in cudnn_sum]
    return "\n".join(out) + "\n"


def sweep(args) -> int:
    """The ``sweep`` subcommand (see the module docstring)."""
    rows = sweep_rows(tuple(args.models))
    print(markdown(rows))
    if args.out:
        from benchmarks.report import write_sweep

        write_sweep(args.out, "conv", rows, markdown(rows))
    return 0


def models() -> list[str]:
    """The models of ``SD_CONV3X3_SHAPES``, in table order."""
    from benchmarks.sd_shapes import SD_CONV3X3_SHAPES

    return list(dict.fromkeys(m for m, *_ in SD_CONV3X3_SHAPES))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ops.conv3x3", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sweep", help="cuDNN, cuDNN benchmark mode, im2col + cuBLAS and the choice at SD's shapes")
    p.add_argument("--out", type=Path, default=None, help="write conv.json/.md here")
    p.add_argument("--models", default="sd15,sdxl", help=f"comma list of {','.join(models())}")
    p.set_defaults(fn=sweep)
    args = ap.parse_args(argv)
    raw, args.models = args.models, [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.models or any(m not in models() for m in args.models):
        p.error(f"--models must be a comma list of {', '.join(models())}, got {raw!r}")
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
