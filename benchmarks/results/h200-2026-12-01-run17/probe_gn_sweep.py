"""Run 17, call B: the cluster GroupNorm's plans after the NCHW kernel and the per-channel (mean, scale) table: every
channels_last plan (up to 1024 threads for J <= 5) and every NCHW plan at SD's 64x64/32x32 shapes, the planner's
pick marked; then the public op (measured choice) in both layouts at (2, 320, 64, 64) against a copy."""

import torch

from benchmarks.bench_group_norm_cluster import _sweep
from benchmarks.kernel_benches.device_time import device_time_us
from kernels.norm import group_norm, group_norm_cluster as gc

for shape, nchw in [((2, 320, 64, 64), False), ((2, 320, 64, 64), True), ((2, 640, 32, 32), False),
                    ((2, 1280, 32, 32), False), ((2, 1280, 16, 16), False), ((2, 640, 64, 64), False)]:
    rows = [r for r in _sweep(shape, nchw) if "us" in r]
    one = sorted((r for r in rows if r["one_wave"]), key=lambda r: r["us"])
    planned = [r for r in rows if r["planned"]]
    print(f"== {shape} {'NCHW' if nchw else 'NHWC'}: {len(rows)} plans, {len(one)} one-wave; planned "
          f"{[(r['us'], {k: r.get(k) for k in ('CS', 'K', 'R', 'J', 'nt')}) for r in planned]}")
    for r in one[:8]:
        print(f"  {r['us']:7.2f} us  " + " ".join(f"{k}={r.get(k)}" for k in ("CS", "K", "R", "J", "nt", "ctas",
              "est_us", "max_active", "max_err")))

for fmt, name in ((torch.contiguous_format, "NCHW"), (torch.channels_last, "NHWC")):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(2, 320, 64, 64, device="cuda", generator=g) * 2 + 0.5).half().contiguous(memory_format=fmt)
    w = (torch.randn(320, device="cuda", generator=g) * 0.5 + 1).half()
    b = torch.randn(320, device="cuda", generator=g).half()
    gc._choices.clear()
    fn = lambda: group_norm(x, 32, w, b, 1e-5, activation="silu")
    fn()
    chosen = list(gc._choices.values())
    gc.TUNING["enabled"] = False
    tri = device_time_us(fn)
    gc.TUNING["enabled"] = True
    dst = torch.empty_like(x)
    print(f"public op {name} (2, 320, 64, 64): {device_time_us(fn):.2f} us (cluster chosen: {chosen}); Triton "
          f"{tri:.2f} us; copy {device_time_us(lambda: dst.copy_(x)):.2f} us")
