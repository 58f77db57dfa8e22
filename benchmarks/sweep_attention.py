"""Sweep of the flash-attention kernel's tile configs at SD's attention shapes, next to SDPA's backends.

For each shape (the q/k/v layouts the engine passes: (B, L, H, D) projections seen as (B, H, L, D)) every config
of a grid (5 tile shapes, 4 or 8 warps, 2 to 4 stages, and the head-dim chunking D0 + D1) is launched directly,
checked against SDPA's math backend (fp32) and timed with ``triton.testing.do_bench`` (L2 cleared between
calls); SDPA's cuDNN and flash backends are timed the same way. The point is to find configs the autotuner's
short list (``flash_attention_configs``) misses. GPU only.

    python -m benchmarks.sweep_attention --out OUT_DIR [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (label, B, H, Lq, Lk, D, upcast): SD1.5 512², SDXL 1024², SD2.1 768² (upcast_attention: fp32-accurate P.V in our
# kernel), CFG batch 2
SHAPES = [
    ("sd15 self 64x64", 2, 8, 4096, 4096, 40, False),
    ("sd15 self 32x32", 2, 8, 1024, 1024, 80, False),
    ("sd15 cross 64x64", 2, 8, 4096, 77, 40, False),
    ("sdxl self 64x64", 2, 10, 4096, 4096, 64, False),
    ("sdxl self 32x32", 2, 20, 1024, 1024, 64, False),
    ("sdxl cross 32x32", 2, 20, 1024, 77, 64, False),
    ("sdxl cross 64x64", 2, 10, 4096, 77, 64, False),
    ("sd21 self 96x96", 2, 5, 9216, 9216, 64, True),
    ("sd21 self 48x48", 2, 10, 2304, 2304, 64, True),
    ("sd21 cross 96x96", 2, 5, 9216, 77, 64, True),
]


def _chunkings(d: int) -> list[tuple[int, int]]:
    from kernels.attention.flash_attention import _next_pow2, head_dim_chunks

    out = [head_dim_chunks(d)]
    if _next_pow2(d) != sum(out[0]):
        out.append((_next_pow2(d), 0))  # one padded chunk
    return out


def _configs(d: int, quick: bool):
    blocks = [(64, 64), (128, 64), (128, 128), (64, 128), (128, 32)] if not quick else [(128, 64), (128, 128)]
    for (bm, bn), warps, stages, (d0, d1) in itertools.product(blocks, (4, 8), (2, 3, 4), _chunkings(d)):
        yield dict(BLOCK_M=bm, BLOCK_N=bn, D0=d0, D1=d1, DV0=d0, DV1=d1), warps, stages


def _inputs(b, h, lq, lk, d, device):
    import torch

    g = torch.Generator(device=device).manual_seed(0)

    def proj(l):  # (B, L, H, D) as the projection GEMM writes it, seen as (B, H, L, D)
        return torch.randn(b, l, h, d, device=device, dtype=torch.float16, generator=g).transpose(1, 2)

    return proj(lq), proj(lk), proj(lk)


def sweep_shape(label, b, h, lq, lk, d, upcast, quick, device="cuda"):
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels import precompile
    from kernels.attention.flash_attention import _empty_out, _flash_attn_fwd_kernel, _smem_bytes, kernel_arguments

    q, k, v = _inputs(b, h, lq, lk, d, device)
    scale = d ** -0.5
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale)
    flops = 4 * b * h * lq * lk * d
    rows = []

    def record(name, fn, extra=None):
        try:
            o = fn()
            err = (o.float() - ref).abs().max().item()
            us = triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3
            rows.append({"shape": label, "config": name, "us": round(us, 2), "tflops": round(flops / us / 1e6, 1),
                         "max_err": err, **(extra or {})})
        except Exception as e:  # a config that does not compile or fit is a row, not the end
            rows.append({"shape": label, "config": name, "error": f"{type(e).__name__}: {str(e)[:120]}"})

    for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
        def run(be=be):
            with sdpa_kernel([getattr(SDPBackend, be)]):
                return F.scaled_dot_product_attention(q, k, v, scale=scale)
        record(f"sdpa {be.lower()}", run)
    smem = torch.cuda.get_device_properties(q.device).shared_memory_per_block_optin
    launches = []
    for meta, warps, stages in _configs(d, quick):
        if _smem_bytes(meta["BLOCK_M"], meta["BLOCK_N"], meta["D0"] + meta["D1"], meta["D0"] + meta["D1"], stages, 2) > smem:
            continue
        out = _empty_out(q)
        args, consts, grid = kernel_arguments(q, k, v, out, None, scale, upcast)

        def run(meta=meta, warps=warps, stages=stages, args=args, consts=consts, grid=grid, out=out):
            _flash_attn_fwd_kernel[grid(meta)](*args, **consts, **meta, num_warps=warps, num_stages=stages)
            return out
        name = f"bm{meta['BLOCK_M']} bn{meta['BLOCK_N']} w{warps} s{stages} d{meta['D0']}+{meta['D1']}"
        launches.append((name, run, {"warps": warps, "stages": stages, **meta}))
    precompile.dry_run(lambda: [run() for _, run, _ in launches], label=f"sweep {label}")  # compile on all cores
    for name, run, extra in launches:
        record(name, run, extra)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep_attention", description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="fewer tile shapes")
    p.add_argument("--only", default=None, help="comma list of substrings of the shape labels to run")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in SHAPES:
        if args.only and not any(o in shape[0] for o in args.only.split(",")):
            continue
        t0 = time.perf_counter()
        got = sweep_shape(*shape, quick=args.quick)
        rows += got
        ok = sorted((r for r in got if "us" in r and r["max_err"] < 2e-2), key=lambda r: r["us"])
        sdpa = {r["config"]: r["us"] for r in got if r["config"].startswith("sdpa") and "us" in r}
        best = ok[0] if ok else None
        print(f"{shape[0]}: sdpa {sdpa}; best {best and (best['config'], best['us'], best['tflops'])} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        for r in ok[:5]:
            print(f"   {r['config']:<32} {r['us']:8.2f} us {r['tflops']:6.1f} TFLOP/s err {r['max_err']:.1e}")
    (out / "sweep_attention.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
