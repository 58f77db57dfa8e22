"""The TMA GEGLU GEMM's tile configs against cuBLAS + the GEGLU kernel, at SD1.5's and SDXL's GEGLU shapes (GPU).

    python -m benchmarks.sweep_geglu_tma [--out DIR] [--extra] [--per-tile]

For each feed-forward projection of the two UNets (fp16, batch 2 with CFG: M tokens, K in, weight (2N, K)):
``cublas`` (``F.linear`` then ``kernels.norm.geglu``), ``cublas_gemm`` (the projection alone, for scale) and every
``kernels.gemm.geglu_tma.CONFIGS`` entry (with ``--extra``, also the larger tiles of ``EXTRA``), each timed in a CUDA graph (``triton.testing.do_bench_cudagraph``,
median) and checked against ``geglu_linear_ref`` (max abs error). Also what ``geglu_projection``'s measured choice
picks. Writes ``DIR/geglu_tma.json`` (with the GPU, versions and date) and ``DIR/geglu_tma.md``; prints one line per shape.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# (model, name, M, K, N, count per UNet step)
SHAPES = (("sd15", "l0", 8192, 320, 1280, 5), ("sd15", "l1", 2048, 640, 2560, 5), ("sd15", "l2", 512, 1280, 5120, 5),
          ("sd15", "mid", 128, 1280, 5120, 1), ("sdxl", "l1", 8192, 640, 2560, 10),
          ("sdxl", "l2", 2048, 1280, 5120, 60))


def extra_configs():
    """Tiles beyond the measured candidates: 16 warps (four warpgroups) for 256-row tiles, and BLOCK_K 128."""
    from kernels.gemm.geglu_tma import TileConfig

    return (TileConfig(256, 128, 64, 3, 16, single_dot=True), TileConfig(256, 128, 64, 2, 16, single_dot=True),
            TileConfig(128, 128, 128, 2, 8, single_dot=True), TileConfig(256, 128, 64, 3, 16, group_m=4))


def per_tile_configs():
    """One program per tile (several per SM, so one's epilogue can overlap another's main loop), as the linear GEMM's
    small-K winners run."""
    from kernels.gemm.geglu_tma import TileConfig

    return tuple(TileConfig(bm, bn, 64, st, w, group_m=8, single_dot=sd, persistent=False)
                 for bm, bn, st, w in ((128, 64, 3, 4), (64, 64, 4, 4), (128, 128, 3, 8), (64, 128, 3, 4))
                 for sd in (False, True))


def _time(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=40) * 1e3


def run(extra: bool = False, per_tile: bool = False) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kernels.gemm import geglu_projection as gp
    from kernels.gemm.geglu_tma import CONFIGS, geglu_linear, geglu_linear_ref

    rows = []
    for model, name, m, k, n, count in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g)
        w = (torch.randn(2 * n, k, device="cuda", generator=g) / k**0.5).half()
        b = (torch.randn(2 * n, device="cuda", generator=g) * 0.1).half()
        ref = geglu_linear_ref(x, w, b).float()
        row = dict(model=model, layer=name, M=m, K=k, N=n, count=count)
        row["cublas_us"] = _time(lambda: gp.cublas_geglu(x, w, b))
        row["cublas_gemm_us"] = _time(lambda: F.linear(x, w, b))
        row["cublas_err"] = float((gp.cublas_geglu(x, w, b).float() - ref).abs().max())
        row["configs"] = {}
        for c in CONFIGS + (extra_configs() if extra else ()) + (per_tile_configs() if per_tile else ()):
            try:
                err = float((geglu_linear(x, w, b, c).float() - ref).abs().max())
                row["configs"][str(c)] = dict(us=_time(lambda c=c: geglu_linear(x, w, b, c)), err=err)
            except Exception as e:  # noqa: BLE001 - recorded: a config that does not compile here
                row["configs"][str(c)] = dict(us=None, error=f"{type(e).__name__}: {str(e)[:200]}")
        gp._choices.clear()
        gp.geglu_projection(x, w, b)
        picked = next(iter(gp._choices.values()))
        row["measured_choice"] = "cublas" if picked is None else str(picked)
        ok = {cfg: r["us"] for cfg, r in row["configs"].items() if r.get("us")}
        row["best_tma"] = min(ok, key=ok.get) if ok else None
        row["best_tma_us"] = ok[row["best_tma"]] if ok else None
        rows.append(row)
        print(f"{model} {name} M={m} K={k} N={n}: cuBLAS+GEGLU {row['cublas_us']:.1f} us (GEMM {row['cublas_gemm_us']:.1f}),"
              f" best TMA {row['best_tma_us'] and round(row['best_tma_us'], 1)} us {row['best_tma']}, choice "
              f"{row['measured_choice']}, err tma {min((r.get('err', 9) for r in row['configs'].values()), default=None)}"
              f" cublas {row['cublas_err']:.2e}", flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| model | layer | M | K | N | cuBLAS + GEGLU µs | cuBLAS GEMM µs | best TMA µs | TMA / cuBLAS+GEGLU | config | x per step |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        t = r["best_tma_us"]
        tma, ratio = ("—", "—") if t is None else (f"{t:.1f}", f"{t / r['cublas_us']:.2f}")
        out.append(f"| {r['model']} | {r['layer']} | {r['M']} | {r['K']} | {r['N']} | {r['cublas_us']:.1f} | "
                   f"{r['cublas_gemm_us']:.1f} | {tma} | {ratio} | {r['best_tma']} | {r['count']} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--extra", action="store_true", help="also time the tiles of extra_configs()")
    ap.add_argument("--per-tile", action="store_true", help="also time the per-tile grids of per_tile_configs()")
    args = ap.parse_args(argv)
    rows = run(args.extra, args.per_tile)
    print(markdown(rows))
    if args.out:
        from benchmarks.report import write_sweep

        write_sweep(args.out, "geglu_tma", rows, markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
