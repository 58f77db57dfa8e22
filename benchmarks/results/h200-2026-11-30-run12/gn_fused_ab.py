# A/B of the GroupNorm statistics kernel finalizing its own groups (arrival counters) against the separate
# finalize launch, GroupNorm+SiLU fp16 at SD shapes, channels_last (the engine's layout; NCHW for reference):
#  - kernel: the sum of the call's kernel GPU times (profiler), L2 flushed before each call (as gn_breakdown.py);
#  - graph: one CUDA graph of 20 back-to-back calls, replayed; wall time per call (launch gaps included, L2 warm:
#    what the engine's UNet graph sees).
import importlib

import torch
from torch.profiler import ProfilerActivity, profile

gn = importlib.import_module("kernels.norm.group_norm")
torch.manual_seed(0)
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
SHAPES = [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 32, 32), (2, 640, 64, 64), (2, 960, 64, 64),
          (2, 320, 128, 128), (2, 640, 128, 128), (1, 512, 256, 256), (1, 128, 512, 512)]


def kernel_us(fn, n=30):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            flush.bitwise_not_()
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total / n for e in prof.key_averages()
               if "bitwise_not" not in e.key and e.device_time_total > 0 and e.count >= n)


def graph_us(fn, calls=20, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) * 1e3 / (calls * reps)


print(f"{'shape':<22} {'layout':<5} {'kernel sep':>10} {'kernel fused':>12} {'graph sep':>10} {'graph fused':>11}")
for shape in SHAPES:
    for cl in ((True, False) if shape == (2, 320, 64, 64) else (True,)):
        x = torch.randn(shape, device="cuda", dtype=torch.half)
        x = x.to(memory_format=torch.channels_last) if cl else x
        w = torch.randn(shape[1], device="cuda", dtype=torch.half)
        b = torch.randn_like(w)
        ys = {}
        row = {}
        for fused in (False, True):
            gn._TUNING["nhwc_fused_finalize"] = fused
            fn = lambda: gn.group_norm(x, 32, w, b, activation="silu")  # noqa: E731
            ys[fused] = fn()
            row[fused] = (kernel_us(fn), graph_us(fn))
        gn._TUNING["nhwc_fused_finalize"] = True
        err = (ys[True].float() - ys[False].float()).abs().max().item()
        print(f"{str(shape):<22} {'NHWC' if cl else 'NCHW':<5} {row[False][0]:10.2f} {row[True][0]:12.2f} "
              f"{row[False][1]:10.2f} {row[True][1]:11.2f}   max|diff| {err:.1e}", flush=True)
