"""GroupNorm benchmarks, one CLI (GPU only; nothing runs at import):

    python -m benchmarks.ops.group_norm bench [--quick] [--no-compile] [--out DIR]
    python -m benchmarks.ops.group_norm tune --out DIR [--budget-s 240] [--knobs a,b]
    python -m benchmarks.ops.group_norm cluster --out DIR [--sweep] [--quick]

``bench``: the public op at every GroupNorm shape SD runs (``benchmarks.sd_shapes``; fp16, NCHW and NHWC):
``group_norm_silu`` / ``group_norm`` (the site's own pattern) and ``bias_res_group_norm_silu`` (the ResNet block's
``norm2(conv1 + temb)`` with the next block's residual add, returning the sum, on the UNet ResNet shapes of 32x32
and up), against eager PyTorch and ``torch.compile`` of it. These are the GroupNorm rows of the ``norm`` section of
``benchmarks.bench_kernels`` (same timing machinery: ``benchmarks.ops._vs_eager``, whose docstring lists the
columns), written here to ``group_norm_bench.json`` / ``.md`` in ``--out``. Targets (issue 3): >= 0.70 of the copy
ceiling on shapes of at least 8 MB; ``group_norm_silu`` (2, 320, 64, 64) fp16 <= 8 µs in both layouts, judged on
the device time (``kernel_us``).

``tune``: the Triton planner's knobs (``kernels.group_norm.plan.TUNING``). For each shape of ``TUNE_SHAPES``
(fp16, GroupNorm+SiLU, 32 groups, NCHW and NHWC) it times the default plan, then walks the knobs one at a time
(coordinate descent: each value of a knob with the others at the best so far) and keeps what is faster. Timing is
GPU time from the profiler's trace, L2 flushed before each call (``benchmarks.ops._timing``, the bench's
``kernel_us``); ``copy`` times ``y.copy_(x)`` of the same tensor the same way, the floor for moving those bytes
once. Rows go to ``DIR/tune_group_norm.json`` after every shape. The winning values are read from the rows and put
into the planner by hand (with a test), never loaded at run time.

``cluster``: the cluster GroupNorm (``kernels.group_norm.cluster``) against the Triton kernels, on the
channels_last GroupNorm shapes SD runs. Per shape (fp16, GroupNorm+SiLU unless the site has none; the ResNet fusion
with channel bias + residual + ``return_sum`` at the UNet's 64x64 shape): GPU time with L2 flushed before each call
(``device_time_us``) of the cluster kernel, of the Triton kernels (the choice pinned to them) and of a copy of the
same bytes; the time per call inside a CUDA graph of back-to-back calls; and which of the two the public op's
choice runs (``chosen``, from ``kernels.select.decisions()``; ``chosen_source``: measured or saved). ``--sweep`` times every candidate plan of both kernels (channels_last and NCHW;
clusters up to 16 CTAs and up to 1024 threads where the GPU can launch them) at the UNet shapes and marks the
planner's pick. Writes ``group_norm_cluster.json`` / ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

COPY_CEILING_BPS = 4.05e12
BENCH_OPS = ("group_norm", "group_norm_silu", "bias_res_group_norm_silu")


# --------------------------------------------------------------------------------------------
# bench: the public op against eager and torch.compile
# --------------------------------------------------------------------------------------------
def bench_cases(quick: bool = False) -> list[dict]:
    """The GroupNorm cases of the kernel suite (plain picklable descriptions), in the suite's order."""
    from benchmarks import sd_shapes

    models: dict = {}
    for model, shape, eps, silu, _ in sd_shapes.GROUP_NORM_SITES:
        models.setdefault((shape, silu), []).append(model)
    out = []
    for shape, silu, eps in sd_shapes.unique_group_norm_cases():
        for layout in ("nchw", "nhwc"):
            out.append(dict(op="group_norm_silu" if silu else "group_norm", shape=shape, layout=layout, eps=eps,
                            model="+".join(dict.fromkeys(models[(shape, silu)]))))
    # The ResNet-block fusion on the UNet ResNet shapes (batch 2, followed by SiLU) of at least 32x32.
    for shape, silu, eps in sd_shapes.unique_group_norm_cases():
        big = shape[2] * shape[3] >= 32 * 32
        if silu and shape[0] == 2 and big and (not quick or shape == (2, 320, 64, 64)):
            for layout in ("nchw", "nhwc"):
                out.append(dict(op="bias_res_group_norm_silu", shape=shape, layout=layout, eps=eps,
                                model="+".join(dict.fromkeys(models[(shape, silu)]))))
    return out


def make_bench_case(case: dict, device="cuda", dtype=None):
    """(sdfast_fn, eager_fn, bytes, config) for one GroupNorm case, with seeded random inputs."""
    import torch
    import torch.nn.functional as F

    from kernels.group_norm import group_norm, group_norm_plan

    dtype = dtype or torch.float16
    g = torch.Generator(device=device).manual_seed(0)
    shape, eps, op = case["shape"], case["eps"], case["op"]
    if op not in BENCH_OPS:
        raise ValueError(f"unknown GroupNorm op {op!r}; one of {BENCH_OPS}")
    e = torch.tensor([], dtype=dtype).element_size()

    def rnd(*s):
        return torch.randn(*s, device=device, dtype=dtype, generator=g)

    B, C, H, W = shape
    cl = case["layout"] == "nhwc"
    fmt = torch.channels_last if cl else torch.contiguous_format
    x = rnd(B, C, H, W).contiguous(memory_format=fmt)
    w, b = rnd(C), rnd(C)
    act = None if op == "group_norm" else "silu"
    n = x.numel()
    plan = group_norm_plan(B, C, H * W, 32, cl, e, op.startswith("bias_res"))
    config = (f"{plan.path} BC={plan.BLOCK_C} GPT={plan.GPT} BHW={plan.BLOCK_HW}"
              + (f" S={plan.S}{' fin' if plan.finalize else ''} chunk={plan.chunk_ct}/{plan.n_ct}"
                 if plan.path == "twopass" else ""))
    if op.startswith("bias_res"):
        cb, r = rnd(B, C), rnd(B, C, H, W).contiguous(memory_format=fmt)

        def ours():
            return group_norm(x, 32, w, b, eps, channel_bias=cb, residual=r, activation="silu", return_sum=True)

        def eager():
            pre = x + cb[:, :, None, None] + r
            return F.silu(F.group_norm(pre, 32, w, b, eps)), pre

        return ours, eager, 4 * n * e, config

    def ours():
        return group_norm(x, 32, w, b, eps, activation=act)

    def eager():
        y = F.group_norm(x, 32, w, b, eps)
        return F.silu(y) if act else y

    return ours, eager, 2 * n * e, config


def bench(args) -> int:
    """The ``bench`` subcommand: the kernel suite's machinery (``benchmarks.ops._vs_eager``) on the GroupNorm cases
    only."""
    from benchmarks.ops import _vs_eager

    return _vs_eager.bench(args, bench_cases, "GroupNorm (fp16)", "group_norm_bench")


# --------------------------------------------------------------------------------------------
# tune: the Triton planner's knobs
# --------------------------------------------------------------------------------------------
# The last two take the one-pass kernel by default (what the knob nhwc_onepass is about).
TUNE_SHAPES = [(2, 320, 64, 64), (2, 1280, 32, 32), (2, 640, 64, 64), (2, 320, 128, 128), (2, 640, 128, 128),
          (1, 512, 256, 256), (1, 128, 512, 512), (2, 1280, 16, 16), (2, 1280, 8, 8)]
KNOBS = {
    # first, so each is timed against the plain defaults: the NHWC channel-tile path against the
    # group-aligned kernels, its tile width, and one-pass against two-pass for the small NHWC shapes
    "nhwc_channel_tiles": [True, False],
    "nhwc_block_c": [64, 128],
    "nhwc_onepass": [True, False],
    "groups_per_tile": [None, 1, 2, 4, 8, 16],
    "tile_elems": [2048, 4096, 8192, 16384],
    "target_programs": [264, 528, 1056, 2112],
    "stats_warps": [2, 4, 8],
    "apply_warps": [2, 4, 8],
    "apply_programs": [512, 4096, 1 << 30],
    "max_inline_partials": [0, 256, 1 << 30],
    "onepass_max_elems": [16384, 32768, 65536],
    "l2_chunk_bytes": [8 << 20, 16 << 20, 32 << 20, 1 << 40],
}


def _device_us(fn) -> float:
    from benchmarks.ops._timing import device_time_us  # GPU time, L2 flushed before each call

    return device_time_us(fn)


def tune_shape(shape, layout: str, deadline: float) -> list[dict]:
    import torch

    from kernels import group_norm as gn
    from kernels.group_norm import plan as gn_plan

    time_us = _device_us
    B, C, H, W = shape
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, C, H, W, device="cuda", dtype=torch.float16, generator=g).contiguous(memory_format=fmt)
    w = torch.randn(C, device="cuda", dtype=torch.float16, generator=g)
    b = torch.randn(C, device="cuda", dtype=torch.float16, generator=g)
    ref = gn.group_norm_ref(x, 32, w, b, 1e-5, activation="silu")
    y = torch.empty_like(x)
    base = dict(shape="x".join(map(str, shape)), layout=layout, bytes=2 * x.numel() * 2)
    rows = [dict(base, knob="copy", value=None, us=time_us(lambda: y.copy_(x)))]
    default = dict(gn_plan.TUNING)
    best = dict(default)

    def measure(tuning: dict) -> float | None:
        gn_plan.TUNING.update(tuning)
        try:
            fn = lambda: gn.group_norm(x, 32, w, b, 1e-5, activation="silu")  # noqa: E731
            err = (fn().float() - ref.float()).abs().max().item()
            if err > 0.05:
                raise RuntimeError(f"wrong result: max err {err}")
            return time_us(fn)
        finally:
            gn_plan.TUNING.clear()
            gn_plan.TUNING.update(default)

    best_us = measure(best)
    rows.append(dict(base, knob="default", value=None, us=best_us, plan=str(_plan(gn, shape, layout, best))))
    for knob, values in KNOBS.items():
        for v in values:
            if v == best[knob] or time.perf_counter() > deadline:
                continue
            trial = dict(best, **{knob: v})
            row = dict(base, knob=knob, value=v, plan=str(_plan(gn, shape, layout, trial)))
            try:
                row["us"] = measure(trial)
            except Exception as e:  # noqa: BLE001 - a failing config is a row
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
            if row.get("us") and row["us"] < best_us * 0.98:
                best, best_us = trial, row["us"]
    rows.append(dict(base, knob="best", value={k: best[k] for k in KNOBS if best[k] != default[k]}, us=best_us,
                     plan=str(_plan(gn, shape, layout, best))))
    return rows


def _plan(gn, shape, layout, tuning):
    from kernels.group_norm import plan as gn_plan

    saved = dict(gn_plan.TUNING)
    gn_plan.TUNING.update(tuning)
    try:
        B, C, H, W = shape
        return gn.group_norm_plan(B, C, H * W, 32, layout == "nhwc", 2, False)
    finally:
        gn_plan.TUNING.clear()
        gn_plan.TUNING.update(saved)


def tune(args) -> int:
    """The ``tune`` subcommand (see the module docstring)."""
    for k in [k for k in KNOBS if k not in args.knobs.split(",")]:
        del KNOBS[k]
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.budget_s
    rows: list[dict] = []
    for shape in TUNE_SHAPES:
        for layout in ("nchw", "nhwc"):
            rows += tune_shape(shape, layout, deadline)
            (args.out / "tune_group_norm.json").write_text(json.dumps(rows, indent=1, default=str))
            for r in rows:
                if r["knob"] in ("copy", "default", "best") and r["shape"] == "x".join(map(str, shape)) and r["layout"] == layout:
                    print(f"{r['shape']:>14} {layout} {r['knob']:>8} {r['us']:8.2f} us  {r.get('value') or ''}", flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# cluster: the cluster kernel against the Triton kernels, and its launch shapes
# --------------------------------------------------------------------------------------------
SWEEP_SHAPES = [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 32, 32), (2, 640, 64, 64), (2, 1280, 16, 16),
                (2, 1280, 8, 8), (2, 960, 64, 64), (2, 320, 128, 128)]


def _cluster_shapes(quick: bool) -> list[tuple[tuple[int, int, int, int], float, bool]]:
    from benchmarks import sd_shapes

    cases = sorted({(s, eps, silu) for _, s, eps, silu, _ in sd_shapes.GROUP_NORM_SITES})
    return cases[:6] if quick else cases


def _inputs(shape, fused: bool):
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    B, C, H, W = shape
    cl = torch.channels_last
    x = (torch.randn(B, C, H, W, device="cuda", generator=g) * 2 + 0.5).half().contiguous(memory_format=cl)
    w = (torch.randn(C, device="cuda", generator=g) * 0.5 + 1).half()
    b = torch.randn(C, device="cuda", generator=g).half()
    cb = torch.randn(B, C, device="cuda", generator=g).half() if fused else None
    r = torch.randn(B, C, H, W, device="cuda", generator=g).half().contiguous(memory_format=cl) if fused else None
    return x, w, b, cb, r


def _graph_us(fn) -> float:
    """Mean µs per call of ``fn`` captured back to back in a CUDA graph (Triton's ``do_bench_cudagraph``)."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=20) * 1e3  # ms per call


def _cluster_case(shape, eps, silu, fused) -> dict:
    import torch

    from benchmarks.ops._timing import device_time_us
    from kernels import select
    from kernels.group_norm import cluster as group_norm_cluster
    from kernels.group_norm import group_norm

    x, w, b, cb, r = _inputs(shape, fused)
    act = "silu" if silu else None
    nbytes = x.numel() * x.element_size() * (2 + (2 if fused else 0))  # x (+ residual) in, y (+ pre) out

    def call():
        return group_norm(x, 32, w, b, eps, channel_bias=cb, residual=r, activation=act, return_sum=fused)

    B, C, H, W = shape
    plan = group_norm_cluster.device_plan(B, C, H * W, 32, x.dtype)
    row = {"shape": "x".join(map(str, shape)), "silu": silu, "fused": fused, "eps": eps,
           "plan": None if plan is None else f"CS={plan.CS} K={plan.K} R={plan.R} J={plan.J} nt={plan.nt}"}
    src, dst = x.clone(), torch.empty_like(x)
    row["copy_us"] = device_time_us(lambda: dst.copy_(src))
    if plan is None:
        row["cluster_us"] = row["cluster_graph_us"] = None
    else:  # the cluster kernel itself, whatever the measured choice
        y, pre = torch.empty_like(x), (torch.empty_like(x) if fused else None)

        def cluster():
            assert group_norm_cluster.try_group_norm(x, 32, w, b, eps, cb, r, silu, y, pre)

        row["cluster_us"], row["cluster_graph_us"] = device_time_us(cluster), _graph_us(cluster)
    with select.pinned({"group_norm": "triton"}):
        row["triton_us"], row["triton_graph_us"] = device_time_us(call), _graph_us(call)
    select.clear("group_norm")
    call()  # the public op's choice for this signature (measured, or read from the saved choices)
    made = [d for d in select.decisions() if d.choice == "group_norm"]
    row["chosen"] = None if plan is None else (made[-1].winner if made else None)
    row["chosen_source"] = made[-1].source if made else None
    if row.get("cluster_us"):
        row["cluster_frac_of_copy_ceiling"] = nbytes / (row["cluster_us"] * 1e-6) / COPY_CEILING_BPS
    row["triton_frac_of_copy_ceiling"] = nbytes / (row["triton_us"] * 1e-6) / COPY_CEILING_BPS
    row["mbytes"] = nbytes / 1e6
    return row


def _sweep(shape, nchw: bool = False) -> list[dict]:
    """Every candidate plan at ``shape`` (GroupNorm+SiLU; channels_last, or NCHW with ``nchw``), the cluster kernel
    itself each time, checked against the Triton kernels."""
    import torch

    from benchmarks.ops._timing import device_time_us
    from kernels import select
    from kernels.group_norm import cluster as gc
    from kernels.group_norm import group_norm

    B, C, H, W = shape
    x, w, b, _, _ = _inputs(shape, False)
    if nchw:
        x = x.contiguous()
    y = torch.empty_like(x)
    rows = []
    old = dict(gc.TUNING)
    gc.TUNING.update(max_cluster=16, max_threads=1024)
    cands = gc.nchw_candidate_plans(B, C, H * W, 32, 2) if nchw else gc.candidate_plans(B, C, H * W, 32, 2)
    chosen = gc.device_plan(B, C, H * W, 32, x.dtype, nchw=nchw)
    base = {"shape": "x".join(map(str, shape)), "layout": "nchw" if nchw else "nhwc"}
    try:
        with select.pinned({"group_norm": "triton"}):
            ref = group_norm(x, 32, w, b, 1e-5, activation="silu")  # the Triton kernels
        for plan in cands:
            active = gc.max_active_clusters(plan, C, 32, x.dtype)
            clusters = B * 32 if nchw else B * C // plan.CS
            if active < 1:
                rows.append({**base, **plan.__dict__, "error": "cannot launch"})
                continue
            gc.TUNING.update(plan=plan)

            def cluster():
                assert gc.try_group_norm(x, 32, w, b, 1e-5, None, None, True, y, None)

            cluster()
            err = (y.float() - ref.float()).abs().max().item()
            us = device_time_us(cluster, iters=10)
            rows.append({**base, **plan.__dict__, "us": us, "max_err": err, "clusters": clusters,
                         "max_active": active, "one_wave": clusters <= active, "planned": plan == chosen})
    finally:
        gc.TUNING.clear()
        gc.TUNING.update(old)
    torch.cuda.synchronize()
    return rows


def cluster(args) -> int:
    """The ``cluster`` subcommand (see the module docstring)."""
    from benchmarks.report import env_metadata, markdown_table, write_json
    from kernels.group_norm import cluster as group_norm_cluster

    t0 = time.perf_counter()
    group_norm_cluster.library()
    build_s = time.perf_counter() - t0
    rows = [_cluster_case(s, eps, silu, False) for s, eps, silu in _cluster_shapes(args.quick)]
    rows.append(_cluster_case((2, 320, 64, 64), 1e-5, True, True))
    sweep = [r for s in SWEEP_SHAPES for nchw in (False, True) for r in _sweep(s, nchw)] if args.sweep else []
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "group_norm_cluster.json",
               {"env": env_metadata(), "build_s": build_s, "rows": rows, "sweep": sweep})
    cols = ["shape", "silu", "fused", "mbytes", "plan", "chosen", "cluster_us", "triton_us", "copy_us",
            "cluster_graph_us", "triton_graph_us", "cluster_frac_of_copy_ceiling", "triton_frac_of_copy_ceiling"]
    md = [f"# cluster GroupNorm (fp16, channels_last), library build {build_s:.1f} s", "",
          markdown_table(rows, cols)]
    if sweep:
        md += ["", "## sweep", "", markdown_table(sweep, ["shape", "layout", "CS", "K", "R", "J", "nt", "ctas", "us", "clusters", "max_active", "one_wave", "planned",
                                                          "max_err", "error"])]
    (args.out / "group_norm_cluster.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ops.group_norm", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("bench", help="the public op against eager and torch.compile at SD's shapes")
    p.add_argument("--quick", action="store_true", help="fewer shapes, no torch.compile")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--out", type=Path, default=None, help="write group_norm_bench.json/.md here")
    p.set_defaults(fn=bench)
    p = sub.add_parser("tune", help="coordinate descent over the Triton planner's knobs")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--knobs", default=",".join(KNOBS), help="comma list of the knobs to walk (default: all)")
    p.set_defaults(fn=tune)
    p = sub.add_parser("cluster", help="the cluster kernel against the Triton kernels (+ --sweep of its plans)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.set_defaults(fn=cluster)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
