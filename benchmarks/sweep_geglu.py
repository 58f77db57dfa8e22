"""The GEGLU kernel's tile configs at the shapes SD1.5 512² and SDXL 1024² run (GPU only).

    python -m benchmarks.sweep_geglu [--out DIR]

For each (M rows, 2D input columns) of the UNets' feed-forwards (batch 2, CFG, fp16) and each config
(ROWS x BLOCK_D tile, warps), the kernel ``kernels.norm.geglu._geglu_kernel`` is timed in a CUDA graph
(``triton.testing.do_bench_cudagraph``, median; calls back to back, as in the UNet's graph, where the input was
just written by the projection GEMM) and checked against ``geglu_ref``. ``frac`` is the achieved bytes per second
(2D read + D written per row) over the measured copy ceiling (``CEILING_TBS``). The current choice
(``geglu_config``) is marked. Writes ``DIR/geglu.json`` and prints, per shape, the best five and the current one.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

CEILING_TBS = 4.05
# (model, M, 2D): the GEGLU inputs of one UNet step (tokens x 2 images)
SHAPES = (("sd15", 8192, 2560), ("sd15", 2048, 5120), ("sd15", 512, 10240), ("sd15", 128, 10240),
          ("sdxl", 8192, 5120), ("sdxl", 2048, 10240))


def configs():
    for block_d, rows, warps in itertools.product((256, 512, 1024, 2048), (1, 2, 4, 8, 16, 32), (2, 4, 8)):
        if 1024 <= block_d * rows <= 16384:
            yield {"ROWS": rows, "BLOCK_D": block_d, "num_warps": warps}


def run() -> list[dict]:
    import torch
    import triton
    from triton.testing import do_bench_cudagraph

    from kernels.geglu.ref import geglu_ref
    from kernels.geglu.triton_elementwise import _geglu_kernel, geglu_config

    rows_out = []
    for model, m, two_d in SHAPES:
        d = two_d // 2
        h = torch.randn(m, two_d, device="cuda", dtype=torch.float16)
        ref = geglu_ref(h)
        out = torch.empty(m, d, device="cuda", dtype=torch.float16)
        current = geglu_config(m, d)
        for cfg in configs():
            if d % cfg["BLOCK_D"]:
                continue
            grid = (triton.cdiv(m, cfg["ROWS"]), triton.cdiv(d, cfg["BLOCK_D"]))

            def call(cfg=cfg, grid=grid):
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = run()
    for key in dict.fromkeys((r["model"], r["M"], r["two_D"]) for r in rows):
        mine = sorted((r for r in rows if (r["model"], r["M"], r["two_D"]) == key), key=lambda r: r["us"])
        print(f"{key}: " + "; ".join(f"{r['ROWS']}x{r['BLOCK_D']} w{r['num_warps']} {r['us']} us {r['frac']}"
                                     + (" (current)" if r["current"] else "") for r in mine[:5]))
        print("   current: " + "; ".join(f"{r['ROWS']}x{r['BLOCK_D']} w{r['num_warps']} {r['us']} us {r['frac']}"
                                         for r in mine if r["current"]) + f"; worst err {max(r['max_err'] for r in mine):.2e}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "geglu.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
