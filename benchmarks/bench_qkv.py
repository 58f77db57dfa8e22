"""Self-attention Q/K/V projections at SD's shapes: three GEMMs against one batched GEMM (GPU only).

    python -m benchmarks.bench_qkv [--out DIR]

For each (M tokens, C channels) of the SD1.5 512² and SDXL 1024² UNets (batch 2, CFG) and fp16, times in a CUDA
graph (``triton.testing.do_bench_cudagraph``, median µs):

- ``separate``: ``F.linear`` three times (stock diffusers, and sdfast with ``fuse_qkv=False``);
- ``batched``: ``sdfast.passes.attention.split_projection`` (one ``bmm`` over the packed (3C, C) weight, input
  broadcast with batch stride 0), what sdfast runs with ``fuse_qkv=True``;
- ``wide``: one ``F.linear`` with N = 3C (diffusers' ``fuse_qkv_projections``), whose Q/K/V are interleaved views.

``extra_MiB`` is the memory the batched call allocates beyond its output (0 unless the broadcast input is copied).
Writes ``DIR/qkv.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.report import markdown_table

# (model, level, tokens per image, channels); the UNet runs batch 2 (CFG)
SHAPES = (
    ("sd15", "64x64", 4096, 320), ("sd15", "32x32", 1024, 640), ("sd15", "16x16", 256, 1280),
    ("sd15", "8x8", 64, 1280), ("sdxl", "64x64", 4096, 640), ("sdxl", "32x32", 1024, 1280),
)


def run(batch: int = 2) -> list[dict]:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from triton.testing import do_bench_cudagraph

    from sdfast.passes.attention.qkv import split_projection

    rows = []
    for model, level, tokens, c in SHAPES:
        m = batch * tokens
        x = torch.randn(batch, tokens, c, device="cuda", dtype=torch.float16)
        fused = nn.Linear(c, 3 * c, bias=False, device="cuda", dtype=torch.float16)
        w = fused.weight.data
        parts = w.view(3, c, c).unbind(0)
        fns = {
            "separate": lambda: [F.linear(x, p) for p in parts],
            "batched": lambda: split_projection(fused, x, 3),
            "wide": lambda: fused(x),
        }
        ref = fns["separate"]()
        got = fns["batched"]()
        err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref, got))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fns["batched"]()
        extra = torch.cuda.max_memory_allocated() - base - 3 * m * c * 2
        del out
        row = dict(model=model, level=level, M=m, C=c, max_abs_diff=err, extra_MiB=round(extra / 2**20, 2))
        for name, fn in fns.items():
            row[f"{name}_us"] = round(do_bench_cudagraph(fn, rep=50) * 1e3, 2)  # the median comes in ms
        row["batched_vs_separate"] = round(row["batched_us"] / row["separate_us"], 3)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = run()
    print(markdown_table(rows, list(rows[0])))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "qkv.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
