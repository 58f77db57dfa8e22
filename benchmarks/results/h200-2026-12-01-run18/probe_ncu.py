"""One SD1.5 step's biggest kernels, one at a time, for Nsight Compute (ncu) to read their hardware counters.

    python3 probe_ncu.py TARGET     # TARGET: attn_cudnn, attn_triton, attn_triton_lazy, gemm_l0, geglu_l0, conv_l0

Each target runs its op 6 times (compile/autotune first), so `ncu --launch-skip 3 --launch-count 1` sees a warm one.
Shapes: SD1.5 512², CFG batch 2: self-attention at 64x64 (8 heads, head dim 40), the 320->320 linear at 64x64,
the GEGLU projection 320->2x1280, the 320->320 3x3 convolution (channels_last).
"""
import sys

import torch
import torch.nn.functional as F

target = sys.argv[1]
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
h = torch.float16


def rnd(*shape, scale=1.0):
    return (torch.randn(*shape, device=dev, generator=g) * scale).to(h)


if target.startswith("attn"):
    q, k, v = (rnd(2, 4096, 8, 40).transpose(1, 2) for _ in range(3))
    if target == "attn_cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def op():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v)
    else:
        from kernels.attention.flash_attention import _empty_out, _flash_attn_fwd_kernel, kernel_arguments

        out = _empty_out(q)
        args, consts, grid = kernel_arguments(q, k, v, out, None, 40 ** -0.5, False,
                                              lazy_rescale=target.endswith("lazy"))
        meta = dict(BLOCK_M=128, BLOCK_N=64, D0=64, D1=0, DV0=64, DV1=0)

        def op():
            _flash_attn_fwd_kernel[grid(meta)](*args, **consts, **meta, num_warps=4, num_stages=3)
elif target == "gemm_l0":
    x, w = rnd(8192, 320), rnd(320, 320, scale=320 ** -0.5)

    def op():
        return F.linear(x, w)
elif target == "geglu_l0":
    from kernels.gemm.geglu_tma import CONFIGS, geglu_linear

    x, w, b = rnd(8192, 320), rnd(2560, 320, scale=320 ** -0.5), rnd(2560, scale=0.1)

    def op():
        return geglu_linear(x, w, b, CONFIGS[2])
elif target == "conv_l0":
    x = rnd(2, 320, 64, 64).contiguous(memory_format=torch.channels_last)
    w = rnd(320, 320, 3, 3, scale=(9 * 320) ** -0.5).contiguous(memory_format=torch.channels_last)

    def op():
        return F.conv2d(x, w, padding=1)
else:
    raise SystemExit(f"unknown target {target}")

for _ in range(6):
    op()
torch.cuda.synchronize()
print(f"{target}: done")
