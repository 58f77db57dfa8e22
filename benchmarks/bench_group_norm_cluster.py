"""The cluster GroupNorm (``kernels.norm.group_norm_cluster``) against the Triton kernels, on the channels_last
GroupNorm shapes SD runs, and a sweep of its launch shapes against the planner's model.

    python -m benchmarks.bench_group_norm_cluster --out DIR [--sweep] [--quick]

Per shape (fp16, GroupNorm+SiLU unless the site has none; the ResNet fusion with channel bias + residual +
``return_sum`` at the UNet's 64x64 shape): GPU time with L2 flushed before each call (``device_time_us``) of
the cluster kernel, of the Triton kernels (cluster path off) and of a copy of the same bytes; the time per
call inside a CUDA graph of back-to-back calls; and which of the two the public op's measured choice runs
(``chosen``). ``--sweep`` times every candidate plan of both kernels (channels_last and NCHW; clusters up to 16
CTAs and up to 1024 threads where the GPU can launch them) at the UNet shapes and marks the planner's pick.
Writes ``group_norm_cluster.json`` / ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COPY_CEILING_BPS = 4.05e12
SWEEP_SHAPES = [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 32, 32), (2, 640, 64, 64), (2, 1280, 16, 16),
                (2, 1280, 8, 8), (2, 960, 64, 64), (2, 320, 128, 128)]


def _shapes(quick: bool) -> list[tuple[tuple[int, int, int, int], float, bool]]:
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


def _case(shape, eps, silu, fused) -> dict:
    import torch

    from benchmarks.kernel_benches.device_time import device_time_us
    from kernels.norm import group_norm, group_norm_cluster

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
    group_norm_cluster.TUNING["enabled"] = False
    try:
        row["triton_us"], row["triton_graph_us"] = device_time_us(call), _graph_us(call)
    finally:
        group_norm_cluster.TUNING["enabled"] = True
    group_norm_cluster._choices.clear()
    call()  # the public op's measured choice for this signature
    row["chosen"] = None if plan is None else ("cluster" if any(group_norm_cluster._choices.values()) else "triton")
    if row.get("cluster_us"):
        row["cluster_frac_of_copy_ceiling"] = nbytes / (row["cluster_us"] * 1e-6) / COPY_CEILING_BPS
    row["triton_frac_of_copy_ceiling"] = nbytes / (row["triton_us"] * 1e-6) / COPY_CEILING_BPS
    row["mbytes"] = nbytes / 1e6
    return row


def _sweep(shape, nchw: bool = False) -> list[dict]:
    """Every candidate plan at ``shape`` (GroupNorm+SiLU; channels_last, or NCHW with ``nchw``), the cluster kernel
    itself each time, checked against the Triton kernels."""
    import torch

    from benchmarks.kernel_benches.device_time import device_time_us
    from kernels.norm import group_norm, group_norm_cluster as gc

    B, C, H, W = shape
    x, w, b, _, _ = _inputs(shape, False)
    if nchw:
        x = x.contiguous()
    y = torch.empty_like(x)
    rows = []
    old = dict(gc.TUNING)
    gc.TUNING.update(max_cluster=16, max_threads=1024, enabled=False)
    cands = gc.nchw_candidate_plans(B, C, H * W, 32, 2) if nchw else gc.candidate_plans(B, C, H * W, 32, 2)
    chosen = gc.device_plan(B, C, H * W, 32, x.dtype, nchw=nchw)
    base = {"shape": "x".join(map(str, shape)), "layout": "nchw" if nchw else "nhwc"}
    try:
        ref = group_norm(x, 32, w, b, 1e-5, activation="silu")  # the Triton kernels
        for plan in cands:
            active = gc.max_active_clusters(plan, C, 32, x.dtype)
            clusters = B * 32 if nchw else B * C // plan.CS
            if active < 1:
                rows.append({**base, **plan.__dict__, "error": "cannot launch"})
                continue
            gc.TUNING.update(plan=plan, enabled=True)

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    from benchmarks.report import env_metadata, markdown_table, write_json
    from kernels.norm import group_norm_cluster

    t0 = time.perf_counter()
    group_norm_cluster.library()
    build_s = time.perf_counter() - t0
    rows = [_case(s, eps, silu, False) for s, eps, silu in _shapes(args.quick)]
    rows.append(_case((2, 320, 64, 64), 1e-5, True, True))
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


if __name__ == "__main__":
    raise SystemExit(main())
