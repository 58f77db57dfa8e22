"""GEGLU benchmarks, one CLI (GPU only; nothing runs at import):

    python -m benchmarks.ops.geglu bench [--quick] [--no-compile] [--out DIR]
    python -m benchmarks.ops.geglu sweep [--out DIR]
    python -m benchmarks.ops.geglu tma [--out DIR] [--extra] [--per-tile]
    python -m benchmarks.ops.geglu fp8 [--out DIR] [--extra]

``bench``: the activation kernel (:func:`kernels.geglu.geglu`) at every GEGLU input SD runs
(``benchmarks.sd_shapes.GEGLU_SITES``; fp16), against eager PyTorch (diffusers' ``a * F.gelu(g)``) and
``torch.compile`` of it. These are the ``geglu`` rows of the ``norm`` section of ``benchmarks.bench_kernels`` (same
timing machinery: ``benchmarks.ops._vs_eager``, whose docstring lists the columns), written here to
``geglu_bench.json`` / ``.md`` in ``--out``.

``sweep``: the activation kernel's tile configs. For each (M rows, 2D input columns) of the UNets' feed-forwards
(batch 2, CFG, fp16; ``GEGLU_SITES``) and each config (ROWS x BLOCK_D tile, warps), the kernel
``kernels.geglu.triton_elementwise._geglu_kernel`` is timed in a CUDA graph (``triton.testing.do_bench_cudagraph``,
median; calls back to back, as in the UNet's graph, where the input was just written by the projection GEMM) and
checked against ``geglu_ref``. ``frac`` is the achieved bytes per second (2D read + D written per row) over the
measured copy ceiling (``CEILING_TBS``). The current choice (``geglu_config``) is marked. Writes ``DIR/geglu.json``
and prints, per shape, the best five and the current one.

``tma``: the TMA GEGLU GEMM's tile configs against cuBLAS + the activation kernel. For each feed-forward projection
of the two UNets (``TMA_SHAPES``; fp16, batch 2 with CFG: M tokens, K in, weight (2N, K)): ``cublas`` (``F.linear``
then ``kernels.geglu.geglu``), ``cublas_gemm`` (the projection alone, for scale) and every
``kernels.geglu.triton_tma_gemm.CONFIGS`` entry (with ``--extra``, also the larger tiles of :func:`extra_configs`;
with ``--per-tile``, the per-tile grids of :func:`per_tile_configs`), each timed in a CUDA graph
(``do_bench_cudagraph``, median) and checked against ``geglu_linear_ref`` (max abs error). Also what
``geglu_projection``'s measured choice picks (``measured_choice``, from ``kernels.select.decisions()``). Writes
``DIR/geglu_tma.json`` (with the GPU, versions and date) and ``DIR/geglu_tma.md``; prints one line per shape.

``fp8``: the same projections on FP8 operands (static per-tensor scales) with an E4M3 output (the next FP8 layer's
input), what the static-FP8 feed-forward runs: ``scaled_mm`` (``torch._scaled_mm`` writing the 2N-wide product, the
GEGLU kernel, the quantize kernel: ``kernels.geglu.projection.scaled_mm_geglu``), ``scaled_mm_gemm`` (the GEMM alone)
and every ``kernels.geglu.triton_tma_gemm.FP8_CONFIGS`` entry (with ``--extra``, :func:`fp8_extra_configs` too), each
in a CUDA graph, with its E4M3 output's disagreement with the float64 reference (the share of elements more than one
grid step off) and the FP8 floor (the FLOPs at the H200's dense FP8 peak, ``FP8_PEAK_TFLOPS``). The per-step total
weighs each shape by its count. Writes ``DIR/geglu_fp8.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BENCH_OPS = ("geglu",)
CEILING_TBS = 4.05
FP8_PEAK_TFLOPS = 1979.0  # H200 SXM dense FP8 (NVIDIA's datasheet)
# (model, layer, M, K, N, count per UNet step): the feed-forward projections (weight (2N, K)) of one UNet step
TMA_SHAPES = (("sd15", "l0", 8192, 320, 1280, 5), ("sd15", "l1", 2048, 640, 2560, 5),
              ("sd15", "l2", 512, 1280, 5120, 5), ("sd15", "mid", 128, 1280, 5120, 1),
              ("sdxl", "l1", 8192, 640, 2560, 10), ("sdxl", "l2", 2048, 1280, 5120, 60))


# --------------------------------------------------------------------------------------------
# bench: the activation kernel against eager and torch.compile
# --------------------------------------------------------------------------------------------
def bench_cases(quick: bool = False) -> list[dict]:
    """The GEGLU cases of the kernel suite (plain picklable descriptions), in the suite's order (the same with
    ``quick``)."""
    from benchmarks import sd_shapes

    return [dict(op="geglu", shape=shape, layout="rows", eps=0.0, model=model)
            for model, shape in sd_shapes.GEGLU_SITES]


def make_bench_case(case: dict, device="cuda", dtype=None):
    """(sdfast_fn, eager_fn, bytes, config) for one GEGLU case, with seeded random inputs."""
    import torch
    import torch.nn.functional as F

    from kernels.geglu import geglu

    if case["op"] not in BENCH_OPS:
        raise ValueError(f"unknown op {case['op']!r}")
    dtype = dtype or torch.float16
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(*case["shape"], device=device, dtype=dtype, generator=g)
    e = h.element_size()

    def ours():
        return geglu(h)

    def eager():
        a, gate = h.chunk(2, dim=-1)
        return a * F.gelu(gate)

    return ours, eager, (h.numel() + h.numel() // 2) * e, ""


def bench(args) -> int:
    """The ``bench`` subcommand: the kernel suite's machinery (``benchmarks.ops._vs_eager``) on the GEGLU cases
    only."""
    from benchmarks.ops import _vs_eager

    return _vs_eager.bench(args, bench_cases, "GEGLU activation (fp16)", "geglu_bench")


# --------------------------------------------------------------------------------------------
# sweep: the activation kernel's tile configs
# --------------------------------------------------------------------------------------------
def sweep_shapes() -> list[tuple[str, int, int]]:
    """(model, M, 2D): the GEGLU inputs of one UNet step (tokens x 2 images), from ``sd_shapes.GEGLU_SITES``."""
    from benchmarks import sd_shapes

    return [(model.removesuffix("-unet"), b * t, two_d) for model, (b, t, two_d) in sd_shapes.GEGLU_SITES]


def sweep_configs():
    """The activation kernel's launch configs tried: tiles of 1024 to 16384 elements, 2 to 8 warps."""
    for block_d, rows, warps in itertools.product((256, 512, 1024, 2048), (1, 2, 4, 8, 16, 32), (2, 4, 8)):
        if 1024 <= block_d * rows <= 16384:
            yield {"ROWS": rows, "BLOCK_D": block_d, "num_warps": warps}


def sweep_rows() -> list[dict]:
    import torch
    import triton
    from triton.testing import do_bench_cudagraph

    from kernels.geglu.ref import geglu_ref
    from kernels.geglu.triton_elementwise import _geglu_kernel, geglu_config

    rows_out = []
    for model, m, two_d in sweep_shapes():
        d = two_d // 2
        h = torch.randn(m, two_d, device="cuda", dtype=torch.float16)
        ref = geglu_ref(h)
        out = torch.empty(m, d, device="cuda", dtype=torch.float16)
        current = geglu_config(m, d)
        for cfg in sweep_configs():
            if d % cfg["BLOCK_D"]:
                continue
            grid = (triton.cdiv(m, cfg["ROWS"]), triton.cdiv(d, cfg["BLOCK_D"]))

            def call(cfg=cfg, grid=grid, h=h, out=out, m=m, d=d):
                _geglu_kernel[grid](h, out, m, d, h.stride(0), ROWS=cfg["ROWS"], BLOCK_D=cfg["BLOCK_D"],
                                    num_warps=cfg["num_warps"])

            out.fill_(float("nan"))
            call()
            err = float((out.float() - ref.float()).abs().max())
            us = do_bench_cudagraph(call, rep=50) * 1e3
            gbs = m * (two_d + d) * 2 / us / 1e3
            rows_out.append(dict(model=model, M=m, two_D=two_d, **cfg, us=round(us, 2),
                                 frac=round(gbs / (CEILING_TBS * 1e3), 3), max_err=err, current=cfg == current))
    return rows_out


def sweep(args) -> int:
    """The ``sweep`` subcommand."""
    rows = sweep_rows()
    for key in dict.fromkeys((r["model"], r["M"], r["two_D"]) for r in rows):
        mine = sorted((r for r in rows if (r["model"], r["M"], r["two_D"]) == key), key=lambda r: r["us"])
        print(f"{key}: " + "; ".join(f"{r['ROWS']}x{r['BLOCK_D']} w{r['num_warps']} {r['us']} us {r['frac']}"
                                     + (" (current)" if r["current"] else "") for r in mine[:5]))
        print("   current: " + "; ".join(f"{r['ROWS']}x{r['BLOCK_D']} w{r['num_warps']} {r['us']} us {r['frac']}"
                                         for r in mine if r["current"])
              + f"; worst err {max(r['max_err'] for r in mine):.2e}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "geglu.json").write_text(json.dumps(rows, indent=1))
    return 0


# --------------------------------------------------------------------------------------------
# tma: the TMA GEGLU GEMM's tile configs against cuBLAS + the activation kernel
# --------------------------------------------------------------------------------------------
def extra_configs():
    """Tiles beyond the measured candidates: 16 warps (four warpgroups) for 256-row tiles, and BLOCK_K 128."""
    from kernels.geglu.triton_tma_gemm import TileConfig

    return (TileConfig(256, 128, 64, 3, 16, single_dot=True), TileConfig(256, 128, 64, 2, 16, single_dot=True),
            TileConfig(128, 128, 128, 2, 8, single_dot=True), TileConfig(256, 128, 64, 3, 16, group_m=4))


def per_tile_configs():
    """One program per tile (several per SM, so one's epilogue can overlap another's main loop), as the linear GEMM's
    small-K winners run."""
    from kernels.geglu.triton_tma_gemm import TileConfig

    return tuple(TileConfig(bm, bn, 64, st, w, group_m=8, single_dot=sd, persistent=False)
                 for bm, bn, st, w in ((128, 64, 3, 4), (64, 64, 4, 4), (128, 128, 3, 8), (64, 128, 3, 4))
                 for sd in (False, True))


def _time(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=40) * 1e3


def measured_choice(x, w, b) -> str | None:
    """The candidate ``geglu_projection``'s choice runs for these operands, decided afresh (earlier and saved
    decisions of the choice forgotten first); None when nothing was decided (the CPU, a capture)."""
    from kernels import select
    from kernels.geglu import projection as gp

    select.clear(gp.CHOICE.name)
    gp.geglu_projection(x, w, b)
    made = select.decisions(gp.CHOICE.name)
    return made[-1].winner if made else None


def tma_rows(extra: bool = False, per_tile: bool = False) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kernels.geglu import projection as gp
    from kernels.geglu.ref import geglu_linear_ref
    from kernels.geglu.triton_tma_gemm import CONFIGS, geglu_linear

    rows = []
    for model, name, m, k, n, count in TMA_SHAPES:
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
        row["measured_choice"] = measured_choice(x, w, b)
        ok = {cfg: r["us"] for cfg, r in row["configs"].items() if r.get("us")}
        row["best_tma"] = min(ok, key=ok.get) if ok else None
        row["best_tma_us"] = ok[row["best_tma"]] if ok else None
        rows.append(row)
        print(f"{model} {name} M={m} K={k} N={n}: cuBLAS+GEGLU {row['cublas_us']:.1f} us (GEMM {row['cublas_gemm_us']:.1f}),"
              f" best TMA {row['best_tma_us'] and round(row['best_tma_us'], 1)} us {row['best_tma']}, choice "
              f"{row['measured_choice']}, err tma {min((r.get('err', 9) for r in row['configs'].values()), default=None)}"
              f" cublas {row['cublas_err']:.2e}", flush=True)
    return rows


def tma_markdown(rows: list[dict]) -> str:
    out = ["| model | layer | M | K | N | cuBLAS + GEGLU µs | cuBLAS GEMM µs | best TMA µs | TMA / cuBLAS+GEGLU | config | x per step |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        t = r["best_tma_us"]
        tma, ratio = ("—", "—") if t is None else (f"{t:.1f}", f"{t / r['cublas_us']:.2f}")
        out.append(f"| {r['model']} | {r['layer']} | {r['M']} | {r['K']} | {r['N']} | {r['cublas_us']:.1f} | "
                   f"{r['cublas_gemm_us']:.1f} | {tma} | {ratio} | {r['best_tma']} | {r['count']} |")
    return "\n".join(out) + "\n"


def tma(args) -> int:
    """The ``tma`` subcommand."""
    rows = tma_rows(args.extra, args.per_tile)
    print(tma_markdown(rows))
    if args.out:
        from benchmarks.report import write_sweep

        write_sweep(args.out, "geglu_tma", rows, tma_markdown(rows))
    return 0


# --------------------------------------------------------------------------------------------
# fp8: the FP8 TMA GEGLU GEMM (E4M3 in and out) against scaled_mm + GEGLU + quantize
# --------------------------------------------------------------------------------------------
def fp8_extra_configs():
    """FP8 tiles beyond the candidates: one program per 128x128 tile with two stages (two programs fit an SM's
    shared memory), four stages, two products, a grouping of 4; the persistent one-product 128x128 tile."""
    from kernels.geglu.triton_tma_gemm import TileConfig

    return (TileConfig(128, 128, 128, 2, 8, single_dot=True, persistent=False),
            TileConfig(128, 128, 128, 4, 8, single_dot=True, persistent=False),
            TileConfig(128, 128, 128, 3, 8, persistent=False),
            TileConfig(128, 128, 128, 3, 8, group_m=4, single_dot=True, persistent=False),
            TileConfig(128, 128, 128, 3, 8, group_m=4, single_dot=True))


def fp8_rows(extra: bool = False) -> list[dict]:
    import torch

    from kernels import select
    from kernels.geglu import projection as gp
    from kernels.geglu.ref import geglu_linear_fp8_ref
    from kernels.geglu.triton_tma_gemm import FP8_CONFIGS, geglu_linear_fp8
    from kernels.gemm.fp8_static import fp8_linear, quantize_static
    from kernels.testing import e4m3_far

    rows = []
    for model, name, m, k, n, count in TMA_SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", generator=g)
        w = torch.randn(2 * n, k, device="cuda", generator=g) / k**0.5
        sa, sw = (x.abs().max() / 448).reshape(()), (w.abs().max() / 448).reshape(())
        q, qw = quantize_static(x, 1 / sa), quantize_static(w, 1 / sw)
        b = (torch.randn(2 * n, device="cuda", generator=g) * 0.1).half()
        ref16 = geglu_linear_fp8_ref(q, qw, sa, sw, b, out_dtype=torch.float32)
        inv = (448 / ref16.abs().max()).reshape(())
        ref = geglu_linear_fp8_ref(q, qw, sa, sw, b, out_scale_inv=inv)

        def off(y):
            return float(e4m3_far(y, ref).float().mean())

        row = dict(model=model, layer=name, M=m, K=k, N=n, count=count,
                   floor_us=2 * m * k * 2 * n / (FP8_PEAK_TFLOPS * 1e12) * 1e6)
        row["scaled_mm_us"] = _time(lambda: gp.scaled_mm_geglu(q, qw, sa, sw, b, inv, torch.float16))
        row["scaled_mm_gemm_us"] = _time(lambda: fp8_linear(q, qw, sa, sw, b))
        row["scaled_mm_off"] = off(gp.scaled_mm_geglu(q, qw, sa, sw, b, inv, torch.float16))
        row["configs"] = {}
        for c in FP8_CONFIGS + (fp8_extra_configs() if extra else ()):
            try:
                err = off(geglu_linear_fp8(q, qw, sa, sw, b, out_scale_inv=inv, config=c))
                row["configs"][str(c)] = dict(
                    us=_time(lambda c=c: geglu_linear_fp8(q, qw, sa, sw, b, out_scale_inv=inv, config=c)), off=err)
            except Exception as e:  # noqa: BLE001 - recorded: a config that does not compile here
                row["configs"][str(c)] = dict(us=None, error=f"{type(e).__name__}: {str(e)[:200]}")
        select.clear(gp.FP8_CHOICE.name)
        gp.geglu_projection_fp8(q, qw, sa, sw, b, out_scale_inv=inv)
        made = select.decisions(gp.FP8_CHOICE.name)
        row["measured_choice"] = made[-1].winner if made else None
        ok = {cfg: r["us"] for cfg, r in row["configs"].items() if r.get("us")}
        row["best_tma"] = min(ok, key=ok.get) if ok else None
        row["best_tma_us"] = ok[row["best_tma"]] if ok else None
        rows.append(row)
        best = row["best_tma_us"]
        print(f"{model} {name} M={m} K={k} N={n}: scaled_mm+GEGLU+quantize {row['scaled_mm_us']:.1f} us (GEMM "
              f"{row['scaled_mm_gemm_us']:.1f}), best TMA {best and round(best, 1)} us {row['best_tma']}, floor "
              f"{row['floor_us']:.1f}, choice {row['measured_choice']}", flush=True)
    return rows


def fp8_markdown(rows: list[dict]) -> str:
    out = ["| model | layer | M | K | N | scaled_mm + GEGLU + quantize µs | its GEMM µs | best FP8 TMA µs | TMA / scaled_mm "
           "| FP8 floor µs | TFLOP/s | config | off-grid share (TMA / scaled_mm) | x per step |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    per_step: dict[str, list[float]] = {}
    for r in rows:
        t = r["best_tma_us"]
        fl = 2 * r["M"] * r["K"] * 2 * r["N"]
        tma, ratio, tf = ("—", "—", "—") if t is None else (f"{t:.1f}", f"{t / r['scaled_mm_us']:.2f}",
                                                              f"{fl / t / 1e6:.0f}")
        offs = r["configs"].get(r["best_tma"] or "", {}).get("off")
        out.append(f"| {r['model']} | {r['layer']} | {r['M']} | {r['K']} | {r['N']} | {r['scaled_mm_us']:.1f} | "
                   f"{r['scaled_mm_gemm_us']:.1f} | {tma} | {ratio} | {r['floor_us']:.1f} | {tf} | {r['best_tma']} | "
                   f"{offs if offs is None else f'{offs:.1e}'} / {r['scaled_mm_off']:.1e} | {r['count']} |")
        acc = per_step.setdefault(r["model"], [0.0, 0.0])
        acc[0] += r["count"] * r["scaled_mm_us"]
        acc[1] += r["count"] * min(r["scaled_mm_us"], t or float("inf"))
    out.append("")
    for model, (a, b) in per_step.items():
        out.append(f"- {model}, per UNet step: scaled_mm path {a:.0f} µs, the faster of the two per shape {b:.0f} µs")
    return "\n".join(out) + "\n"


def fp8(args) -> int:
    """The ``fp8`` subcommand."""
    rows = fp8_rows(args.extra)
    print(fp8_markdown(rows))
    if args.out:
        from benchmarks.report import write_sweep

        write_sweep(args.out, "geglu_fp8", rows, fp8_markdown(rows))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ops.geglu", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("bench", help="the activation kernel against eager and torch.compile at SD's shapes")
    p.add_argument("--quick", action="store_true", help="no torch.compile column")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--out", type=Path, default=None, help="write geglu_bench.json/.md here")
    p.set_defaults(fn=bench)
    p = sub.add_parser("sweep", help="the activation kernel's tile configs at SD's shapes")
    p.add_argument("--out", type=Path, default=None, help="write geglu.json here")
    p.set_defaults(fn=sweep)
    p = sub.add_parser("tma", help="the TMA GEGLU GEMM's tile configs against cuBLAS + the activation kernel")
    p.add_argument("--out", type=Path, default=None, help="write geglu_tma.json/.md here")
    p.add_argument("--extra", action="store_true", help="also time the tiles of extra_configs()")
    p.add_argument("--per-tile", action="store_true", help="also time the per-tile grids of per_tile_configs()")
    p.set_defaults(fn=tma)
    p = sub.add_parser("fp8", help="the FP8 TMA GEGLU GEMM (E4M3 in and out) against scaled_mm + GEGLU + quantize")
    p.add_argument("--out", type=Path, default=None, help="write geglu_fp8.json/.md here")
    p.add_argument("--extra", action="store_true", help="also time the tiles of fp8_extra_configs()")
    p.set_defaults(fn=fp8)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
