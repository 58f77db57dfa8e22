"""The TMA linear GEMM's tile configs against cuBLAS at SD1.5's and SDXL's linear shapes (GPU).

    python -m benchmarks.sweep_linear_tma [--out DIR] [--only sd15]

For each projection of the two UNets (fp16, batch 2 with CFG: M tokens, K in, N out, with its bias): ``cublas``
(``F.linear``) and every config of ``GRID`` of :func:`kernels.gemm.linear_tma.linear_tma`; for the 1x1 ``proj_out``
shapes also with the residual: ``cublas`` is then what the engine runs today (``F.linear`` without bias, then
``bias_residual_add`` on the channels_last residual). Each timed in a CUDA graph (``triton.testing.do_bench_cudagraph``,
median), checked against ``linear_ref`` (max abs error). Writes ``DIR/linear_tma.json`` (GPU, versions, date) and
``DIR/linear_tma.md``; prints one line per shape.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (model, name, M, K, N, residual, count per UNet step)
SHAPES = (
    ("sd15", "l0 proj/out/q", 8192, 320, 320, False, 21), ("sd15", "l0 qkv", 8192, 320, 960, False, 5),
    ("sd15", "l0 ff.out", 8192, 1280, 320, False, 5), ("sd15", "l0 proj_out+res", 8192, 320, 320, True, 5),
    ("sd15", "l1 proj/out/q", 2048, 640, 640, False, 21), ("sd15", "l1 qkv", 2048, 640, 1920, False, 5),
    ("sd15", "l1 ff.out", 2048, 2560, 640, False, 5), ("sd15", "l1 proj_out+res", 2048, 640, 640, True, 5),
    ("sd15", "l2 proj/out/q", 512, 1280, 1280, False, 21), ("sd15", "l2 qkv", 512, 1280, 3840, False, 5),
    ("sd15", "l2 ff.out", 512, 5120, 1280, False, 5),
    ("sdxl", "l1 out/q", 8192, 640, 640, False, 30), ("sdxl", "l1 qkv", 8192, 640, 1920, False, 10),
    ("sdxl", "l1 ff.out", 8192, 2560, 640, False, 10),
    ("sdxl", "l2 out/q", 2048, 1280, 1280, False, 130), ("sdxl", "l2 qkv", 2048, 1280, 3840, False, 70),
    ("sdxl", "l2 ff.out", 2048, 5120, 1280, False, 70),
)


def grid():
    from kernels.gemm.linear_tma import LinearTile

    tiles = [(128, 64, 64, 3, 4), (128, 64, 64, 4, 4), (128, 128, 64, 3, 8), (128, 128, 64, 4, 4), (64, 128, 64, 3, 4),
             (64, 64, 64, 4, 4), (256, 64, 64, 3, 8), (128, 256, 64, 3, 8)]
    return [LinearTile(*t, persistent=p) for t in tiles for p in (True, False)]


def _time(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=40) * 1e3


def run(only: str | None = None) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kernels.elementwise import bias_residual_add
    from kernels.gemm.linear_tma import linear_ref, linear_tma

    rows = []
    for model, name, m, k, n, residual, count in SHAPES:
        if only and only not in model:
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g)
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).half()
        b = (torch.randn(n, device="cuda", generator=g) * 0.1).half()
        r = torch.randn(m, n, device="cuda", dtype=torch.float16, generator=g) if residual else None
        ref = linear_ref(x, w, b, r).float()
        row = dict(model=model, layer=name, M=m, K=k, N=n, residual=residual, count=count)
        if residual:  # the engine's path: bias-free GEMM, then bias + residual in one pass over NHWC memory
            hw = int((m // 2) ** 0.5)
            r4 = r.view(2, hw, hw, n).permute(0, 3, 1, 2)

            def cublas():
                return bias_residual_add(F.linear(x, w).view(2, hw, hw, n).permute(0, 3, 1, 2), b, r4)
            row["cublas_err"] = float((cublas().permute(0, 2, 3, 1).reshape(m, n).float() - ref).abs().max())
        else:
            def cublas():
                return F.linear(x, w, b)
            row["cublas_err"] = float((cublas().float() - ref).abs().max())
        row["cublas_us"] = _time(cublas)
        row["configs"] = {}
        for c in grid():
            try:
                err = float((linear_tma(x, w, b, r, c).float() - ref).abs().max())
                row["configs"][str(c)] = dict(us=_time(lambda c=c: linear_tma(x, w, b, r, c)), err=err)
            except Exception as e:  # noqa: BLE001 - recorded: a config that does not compile or fit here
                row["configs"][str(c)] = dict(us=None, error=f"{type(e).__name__}: {str(e)[:200]}")
        ok = {cfg: v["us"] for cfg, v in row["configs"].items() if v.get("us")}
        row["best"] = min(ok, key=ok.get) if ok else None
        row["best_us"] = ok[row["best"]] if ok else None
        rows.append(row)
        print(f"{model} {name} M={m} K={k} N={n}: cuBLAS {row['cublas_us']:.2f} us, best TMA "
              f"{row['best_us'] and round(row['best_us'], 2)} us {row['best']}", flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| model | layer | M | K | N | cuBLAS µs | best TMA µs | TMA / cuBLAS | config | x per step |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = r["best_us"] / r["cublas_us"] if r["best_us"] else None
        out.append(f"| {r['model']} | {r['layer']} | {r['M']} | {r['K']} | {r['N']} | {r['cublas_us']:.2f} | "
                   f"{r['best_us'] and round(r['best_us'], 2)} | {ratio and round(ratio, 2)} | {r['best']} | {r['count']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    from benchmarks.report import write_sweep

    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep_linear_tma", description=__doc__)
    p.add_argument("--out", default="out/linear_tma")
    p.add_argument("--only", default=None, help="sd15 or sdxl")
    args = p.parse_args(argv)
    rows = run(args.only)
    print(markdown(rows))
    write_sweep(args.out, "linear_tma", rows, markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
