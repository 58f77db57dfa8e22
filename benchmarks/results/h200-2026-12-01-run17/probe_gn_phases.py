"""Run 17, call D: where the channels_last cluster GroupNorm's time goes at (2, 320, 64, 64). Three builds of the
kernel source: "copy" (no statistics: load, normalize with mean 0 / scale 1, store), "cta" (statistics reduced
within each CTA, no cluster exchange), "full" (the kernel); each timed (GPU time, L2 flushed) at the planned launch
shape and at the clusters-of-8 one; with the NCHW kernel and a copy for reference."""

import ctypes
import subprocess
import tempfile
from pathlib import Path

import torch

from benchmarks.kernel_benches.device_time import device_time_us
from kernels.csrc.build import find_nvcc, gencode_flags
from kernels.norm import group_norm_cluster as gc

SRC = Path("kernels/csrc/group_norm_cluster.cu").read_text()
A_STATS = "  // 2. Shifted per-channel sums of the CTA, then of the cluster.\n"
A_NORM = "  // 4. Normalize from the registers and store.\n"
A_SYNC = "  cluster.sync();  // every CTA's ch[] is complete\n"
A_GATHER_END = "  cluster_arrive();  // done reading the other CTAs' shared memory\n  __syncthreads();\n\n  // 3. Group"
A_WAIT = "  cluster_wait();  // keep this CTA's shared memory alive until every CTA of the cluster has read it\n#endif\n}\n\n// NCHW"


def variant(name: str) -> str:
    s = SRC
    if name == "copy":
        i, j = s.index(A_STATS), s.index(A_NORM)
        s = s[:i] + ("  float2* tot = reinterpret_cast<float2*>(smem);\n"
                     "  for (int c = threadIdx.x; c < CS; c += blockDim.x) tot[c] = make_float2(0.f, 1.f);\n"
                     "  __syncthreads();\n\n") + s[j:]
        s = s.replace(A_WAIT, "#endif\n}\n\n// NCHW")
    elif name == "cta":
        i = s.index(A_SYNC)
        j = s.index(A_GATHER_END)
        s = s[:i] + ("  __syncthreads();\n  float2* tot = part;\n"
                     "  for (int c = threadIdx.x; c < CS; c += blockDim.x) tot[c] = ch[c];\n  __syncthreads();\n\n  // 3. Group") \
            + s[j + len(A_GATHER_END):]
        s = s.replace(A_WAIT, "#endif\n}\n\n// NCHW")
    return s


def build(name: str, tmp: Path) -> ctypes.CDLL:
    src = tmp / f"gn_{name}.cu"
    src.write_text(variant(name))
    so = tmp / f"gn_{name}.so"
    cmd = [find_nvcc(), "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-DSDFAST_GN_DTYPE=0",
           *gencode_flags(["9.0"]), str(src), "-o", str(so)]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(so))
    vp, i, ll, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
    lib.sdfast_gn_cluster_nhwc_f16.argtypes = [vp] * 7 + [i] * 8 + [ll, f, i, vp]
    lib.sdfast_gn_cluster_nhwc_f16.restype = i
    return lib


g = torch.Generator(device="cuda").manual_seed(0)
x = (torch.randn(2, 320, 64, 64, device="cuda", generator=g) * 2 + 0.5).half().contiguous(memory_format=torch.channels_last)
w = (torch.randn(320, device="cuda", generator=g) * 0.5 + 1).half()
b = torch.randn(320, device="cuda", generator=g).half()
y = torch.empty_like(x)
ref = torch.nn.functional.silu(torch.nn.functional.group_norm(x.float(), 32, w.float(), b.float(), 1e-5))
PLANS = [gc.ClusterPlan(40, 16, 64, 4, 320, 256), gc.ClusterPlan(40, 8, 64, 8, 320, 128),
         gc.ClusterPlan(40, 16, 32, 8, 160, 256), gc.ClusterPlan(80, 16, 32, 8, 320, 128)]
with tempfile.TemporaryDirectory() as d:
    libs = {n: build(n, Path(d)) for n in ("copy", "cta", "full")}
    stream = torch.cuda.current_stream().cuda_stream
    for plan in PLANS:
        for name, lib in libs.items():
            def run():
                rc = lib.sdfast_gn_cluster_nhwc_f16(x.data_ptr(), None, None, w.data_ptr(), b.data_ptr(), y.data_ptr(),
                                                   None, 2, 320, 4096, 32, plan.CS, plan.K, plan.R, plan.J, 0, 1e-5, 1,
                                                   torch.cuda.current_stream().cuda_stream)
                assert rc == 0, rc
            run()
            torch.cuda.synchronize()
            err = (y.float() - ref).abs().max().item()
            print(f"{name:5s} {plan}: {device_time_us(run):.2f} us (max err vs GroupNorm+SiLU {err:.2e})", flush=True)
x2 = x.contiguous()
y2 = torch.empty_like(x2)
for plan in (gc.NchwPlan(2, 640, 4, 128), gc.NchwPlan(8, 320, 2, 512)):
    gc.TUNING["plan"] = plan
    print(f"NCHW full {plan}: {device_time_us(lambda: gc.try_group_norm(x2, 32, w, b, 1e-5, None, None, True, y2, None)):.2f} us")
gc.TUNING["plan"] = None
print(f"copy: {device_time_us(lambda: y.copy_(x)):.2f} us")
