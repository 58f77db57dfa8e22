"""Run 17, call A: the NCHW cluster GroupNorm. Every NCHW plan at SD's shapes (GPU time, L2 flushed, as
bench_kernels), then the public op (measured choice) in both layouts at (2, 320, 64, 64) against a copy."""

import torch

from benchmarks.kernel_benches.device_time import device_time_us
from kernels.norm import group_norm, group_norm_cluster as gc

SHAPES = [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 16, 16), (2, 640, 64, 64), (2, 1280, 32, 32),
          (2, 320, 128, 128)]


def inputs(shape, fmt):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(*shape, device="cuda", generator=g) * 2 + 0.5).half().contiguous(memory_format=fmt)
    C = shape[1]
    w = (torch.randn(C, device="cuda", generator=g) * 0.5 + 1).half()
    b = torch.randn(C, device="cuda", generator=g).half()
    return x, w, b


def sweep(shape):
    B, C, H, W = shape
    x, w, b = inputs(shape, torch.contiguous_format)
    y = torch.empty_like(x)
    old = dict(gc.TUNING)
    gc.TUNING.update(max_cluster=16, enabled=False)
    rows = []
    try:
        ref = group_norm(x, 32, w, b, 1e-5, activation="silu")
        for plan in gc.nchw_candidate_plans(B, C, H * W, 32, 2):
            active = gc.max_active_clusters(plan, C, 32, x.dtype)
            if active < B * 32:
                continue
            gc.TUNING.update(plan=plan, enabled=True)
            fn = lambda: gc.try_group_norm(x, 32, w, b, 1e-5, None, None, True, y, None)
            assert fn()
            err = (y.float() - ref.float()).abs().max().item()
            rows.append((device_time_us(fn, iters=10), plan, active, err))
            gc.TUNING.update(plan=None, enabled=False)
    finally:
        gc.TUNING.clear()
        gc.TUNING.update(old)
    rows.sort(key=lambda r: r[0])
    print(f"== {shape} NCHW: {len(rows)} one-wave plans; model's pick {gc.device_plan(B, C, H * W, 32, x.dtype, nchw=True)}")
    for us, plan, active, err in rows[:8]:
        print(f"  {us:7.2f} us  {plan}  max_active={active} err={err:.2e}")
    print(f"  worst {rows[-1][0]:.2f} us {rows[-1][1]}" if rows else "  none")


for s in SHAPES:
    sweep(s)

for fmt, name in ((torch.contiguous_format, "NCHW"), (torch.channels_last, "NHWC")):
    x, w, b = inputs((2, 320, 64, 64), fmt)
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
