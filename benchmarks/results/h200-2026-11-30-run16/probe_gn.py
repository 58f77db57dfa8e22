"""Run 16, call C: GroupNorm+SiLU at (2, 320, 64, 64) fp16: the NCHW "onepass" plan (one program per group, the
group in registers) against the default plan, and NHWC for reference (GPU time, L2 flushed, as bench_kernels)."""

import torch
from benchmarks.kernel_benches.device_time import device_time_us
import sys
from kernels.norm import group_norm, group_norm_ref
gnm = sys.modules["kernels.norm.group_norm"]

def case(fmt):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 320, 64, 64, device="cuda", generator=g).half().contiguous(memory_format=fmt)
    w = torch.randn(320, device="cuda", generator=g).half(); b = torch.randn(320, device="cuda", generator=g).half()
    return x, w, b

def run(label, fmt):
    x, w, b = case(fmt)
    fn = lambda: group_norm(x, 32, w, b, 1e-5, activation="silu")
    ref = group_norm_ref(x.float(), 32, w.float(), b.float(), 1e-5, activation="silu")
    err = (fn().float() - ref).abs().max().item()
    dst = torch.empty_like(x)
    print(f"{label}: {device_time_us(fn):.2f} us (copy {device_time_us(lambda: dst.copy_(x)):.2f}), err {err:.2e}, plan "
          f"{gnm.group_norm_plan(2, 320, 4096, 32, fmt is torch.channels_last, 2, False)}", flush=True)

run("NCHW default", torch.contiguous_format)
run("NHWC default", torch.channels_last)
gnm._TUNING["onepass_max_elems"] = 1 << 17
gnm._TUNING["groups_per_tile"] = 1
real = gnm._num_warps
for warps in (8, 16, 32):
    gnm._num_warps = lambda e, warps=warps: warps
    run(f"NCHW onepass GPT=1 {warps} warps", torch.contiguous_format)
gnm._num_warps = real

