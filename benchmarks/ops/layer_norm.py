"""Time the LayerNorm kernel's knobs (``kernels.norm.layer_norm._TUNING``) on the GPU, every combination.

    python -m benchmarks.tune_layer_norm --out DIR

Shapes: the (rows, D) that SD1.5's UNet at 512² and SDXL's at 1024² run (batch 2 with CFG), fp16, plain and
with the fused residual add that returns the sum. Timing is GPU time from the profiler's trace, L2 flushed
before each call (``kernel_benches.device_time``); ``copy`` times ``y.copy_(x)`` of the input, the floor for
moving the input once. Rows go to ``DIR/tune_layer_norm.json``. Winning values are put into ``_TUNING`` by
hand, never loaded at run time.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
from pathlib import Path

SHAPES = [(8192, 320), (2048, 640), (512, 1280), (8192, 640), (2048, 1280)]
KNOBS = {"tile_elems": [2048, 4096, 8192, 16384], "warps_per_4k": [4, 8]}


def tune_shape(M: int, D: int, residual: bool) -> list[dict]:
    import torch

    from benchmarks.kernel_benches.device_time import device_time_us

    ln = importlib.import_module("kernels.norm.layer_norm")  # the module (the package exports the function)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, D, device="cuda", dtype=torch.float16, generator=g)
    r = torch.randn(M, D, device="cuda", dtype=torch.float16, generator=g) if residual else None
    w = torch.randn(D, device="cuda", dtype=torch.float16, generator=g)
    b = torch.randn(D, device="cuda", dtype=torch.float16, generator=g)
    ref = ln.layer_norm_ref(x, w, b, residual=r)
    y = torch.empty_like(x)
    base = dict(shape=f"{M}x{D}", op="add_layer_norm" if residual else "layer_norm",
                bytes=x.numel() * 2 * (4 if residual else 2))  # x (+ residual) read, y (+ sum) written
    rows = [dict(base, config="copy", us=device_time_us(lambda: y.copy_(x)))]
    default = dict(ln._TUNING)
    for values in itertools.product(*KNOBS.values()):
        trial = dict(zip(KNOBS, values))
        ln._TUNING.update(trial)
        try:
            def fn():
                return ln.layer_norm(x, w, b, residual=r, return_sum=residual)

            out = fn()[0] if residual else fn()
            err = (out.float() - ref.float()).abs().max().item()
            row = dict(base, config=trial, default=trial == default, plan=ln.layer_norm_config(M, D))
            if err > 0.05:
                row["error"] = f"wrong result: max err {err}"
            else:
                row["us"] = device_time_us(fn)
        except Exception as e:  # noqa: BLE001 - a failing config is a row
            row = dict(base, config=trial, error=f"{type(e).__name__}: {e}"[:200])
        finally:
            ln._TUNING.clear()
            ln._TUNING.update(default)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for (M, D), residual in itertools.product(SHAPES, (False, True)):
        new = tune_shape(M, D, residual)
        rows += new
        (args.out / "tune_layer_norm.json").write_text(json.dumps(rows, indent=1, default=str))
        timed = [r for r in new if "us" in r and r["config"] != "copy"]
        copy = new[0]["us"]
        dflt = next((r for r in timed if r.get("default")), None)
        best = min(timed, key=lambda r: r["us"]) if timed else None
        gbs = lambda r: r["bytes"] / r["us"] / 1e3  # noqa: E731  GB/s
        print(f"{new[0]['op']:>15} {M}x{D}: copy {copy:6.2f} us | default "
              + (f"{dflt['us']:6.2f} us ({gbs(dflt) / 4050:.2f} of 4.05 TB/s)" if dflt else "-")
              + (f" | best {best['us']:6.2f} us ({gbs(best) / 4050:.2f}) {best['config']}" if best else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
