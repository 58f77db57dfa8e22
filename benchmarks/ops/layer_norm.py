"""LayerNorm benchmarks, one CLI (GPU only; nothing runs at import):

    python -m benchmarks.ops.layer_norm bench [--quick] [--no-compile] [--out DIR]
    python -m benchmarks.ops.layer_norm tune --out DIR

``bench``: the public op (:func:`kernels.norm.layer_norm`) at every LayerNorm shape SD runs
(``benchmarks.sd_shapes.LAYER_NORM_SITES``; fp16): ``layer_norm`` and ``add_layer_norm`` (the residual add
returning the sum), against eager PyTorch and ``torch.compile`` of it. These are the LayerNorm rows of the ``norm``
section of ``benchmarks.bench_kernels`` (same timing machinery: ``benchmarks.ops._vs_eager``, whose docstring lists
the columns), written here to ``layer_norm_bench.json`` / ``.md`` in ``--out``.

``tune``: the LayerNorm kernel's knobs (``kernels.norm.layer_norm._TUNING``), every combination. Shapes: the
(rows, D) that SD1.5's UNet at 512² and SDXL's at 1024² run (batch 2 with CFG), fp16, plain and with the fused
residual add that returns the sum. Timing is GPU time from the profiler's trace, L2 flushed before each call
(``benchmarks.ops._timing.device_time_us``); ``copy`` times ``y.copy_(x)`` of the input, the floor for moving the
input once. Rows go to ``DIR/tune_layer_norm.json``. Winning values are put into ``_TUNING`` by hand, never loaded
at run time.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BENCH_OPS = ("layer_norm", "add_layer_norm")
SHAPES = [(8192, 320), (2048, 640), (512, 1280), (8192, 640), (2048, 1280)]
KNOBS = {"tile_elems": [2048, 4096, 8192, 16384], "warps_per_4k": [4, 8]}


# --------------------------------------------------------------------------------------------
# bench: the public op against eager and torch.compile
# --------------------------------------------------------------------------------------------
def bench_cases(quick: bool = False) -> list[dict]:
    """The LayerNorm cases of the kernel suite (plain picklable descriptions), in the suite's order (the same with
    ``quick``)."""
    from benchmarks import sd_shapes

    models: dict = {}
    for model, shape, _ in sd_shapes.LAYER_NORM_SITES:
        models.setdefault(shape, []).append(model)
    return [dict(op=op, shape=shape, layout="rows", eps=1e-5, model="+".join(models[shape]))
            for shape in sd_shapes.unique_layer_norm_shapes() for op in BENCH_OPS]


def make_bench_case(case: dict, device="cuda", dtype=None):
    """(sdfast_fn, eager_fn, bytes, config) for one LayerNorm case, with seeded random inputs."""
    import torch
    import torch.nn.functional as F

    from kernels.norm import layer_norm

    shape, eps, op = case["shape"], case["eps"], case["op"]
    if op not in BENCH_OPS:
        raise ValueError(f"unknown LayerNorm op {op!r}; one of {BENCH_OPS}")
    dtype = dtype or torch.float16
    g = torch.Generator(device=device).manual_seed(0)
    e = torch.tensor([], dtype=dtype).element_size()

    def rnd(*s):
        return torch.randn(*s, device=device, dtype=dtype, generator=g)

    D = shape[-1]
    x, w, b = rnd(*shape), rnd(D), rnd(D)
    n = x.numel()
    if op == "add_layer_norm":
        r = rnd(*shape)

        def ours():
            return layer_norm(x, w, b, eps, residual=r, return_sum=True)

        def eager():
            s = x + r
            return F.layer_norm(s, (D,), w, b, eps), s

        return ours, eager, 4 * n * e, ""

    def ours():
        return layer_norm(x, w, b, eps)

    def eager():
        return F.layer_norm(x, (D,), w, b, eps)

    return ours, eager, 2 * n * e, ""


def bench(args) -> int:
    """The ``bench`` subcommand: the kernel suite's machinery (``benchmarks.ops._vs_eager``) on the LayerNorm cases
    only."""
    from benchmarks.ops import _vs_eager

    return _vs_eager.bench(args, bench_cases, "LayerNorm (fp16)", "layer_norm_bench")


# --------------------------------------------------------------------------------------------
# tune: the kernel's knobs, every combination
# --------------------------------------------------------------------------------------------
def tune_shape(M: int, D: int, residual: bool) -> list[dict]:
    import torch

    from benchmarks.ops._timing import device_time_us

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


def tune(args) -> int:
    """The ``tune`` subcommand (see the module docstring)."""
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ops.layer_norm", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("bench", help="the public op against eager and torch.compile at SD's shapes")
    p.add_argument("--quick", action="store_true", help="no torch.compile column")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--out", type=Path, default=None, help="write layer_norm_bench.json/.md here")
    p.set_defaults(fn=bench)
    p = sub.add_parser("tune", help="every combination of the kernel's knobs at SD's shapes")
    p.add_argument("--out", type=Path, required=True, help="write tune_layer_norm.json here")
    p.set_defaults(fn=tune)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
