# Per-kernel GPU time of GroupNorm+SiLU at SD shapes (L2 flushed before each call), both layouts.
import torch
from torch.profiler import ProfilerActivity, profile

from kernels.norm.group_norm import group_norm, group_norm_plan

torch.manual_seed(0)
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
CASES = [(s, cl) for s in [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 32, 32), (2, 1280, 16, 16), (2, 640, 64, 64)]
         for cl in (False, True)]
CASES += [(s, True) for s in [(2, 320, 128, 128), (2, 640, 128, 128), (1, 512, 256, 256), (1, 128, 512, 512)]]
for shape, cl in CASES:
    if True:
        x = torch.randn(shape, device="cuda", dtype=torch.half)
        if cl:
            x = x.to(memory_format=torch.channels_last)
        w = torch.randn(shape[1], device="cuda", dtype=torch.half)
        b = torch.randn_like(w)
        fn = lambda: group_norm(x, 32, w, b, activation="silu")  # noqa: E731
        fn()
        torch.cuda.synchronize()
        n = 30
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                flush.bitwise_not_()
                fn()
            torch.cuda.synchronize()
        plan = group_norm_plan(shape[0], shape[1], shape[2] * shape[3], 32, cl, 2, False)
        print(f"{shape} {'NHWC' if cl else 'NCHW'} {plan}")
        tot = 0.0
        for e in prof.key_averages():
            if "bitwise_not" in e.key or e.device_time_total == 0:
                continue
            per = e.device_time_total / n
            if e.count >= n:
                tot += per
                print(f"    {per:7.2f} us  x{e.count // n}  {e.key[:90]}")
        print(f"    {tot:7.2f} us  total")
