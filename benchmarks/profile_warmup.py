"""Where the warm-up goes: ``sdfast.load(..., optimize=True)`` plus the first image, profiled with cProfile.

    python -m benchmarks.profile_warmup --out DIR [--model random:sd15] [--cold]

``--cold`` points Triton at an empty cache directory (``TRITON_CACHE_DIR``), so every kernel compiles, as
on a machine that never ran sdfast; without it the user's cache is used. Prints the wall time of the load
and of the first image, the time spent in Triton compilation, in autotuning benchmarks, in the attention
dispatcher's measurements and in CUDA-graph capture (cumulative times of those functions), and the top
functions by cumulative time; writes ``DIR/warmup.pstats`` and ``DIR/warmup.txt``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import tempfile
import time
from pathlib import Path

# (label, substring of "file:function" in the profile) of the phases worth knowing
PHASES = [
    ("triton compile", "triton/compiler/compiler.py:compile"),
    ("triton autotune benchmarks", "triton/runtime/autotuner.py:_bench"),
    ("attention dispatcher measurement", "sdfast/passes/attention.py:_choose"),
    ("cuda graph capture", "sdfast/runtime/cuda_graphs.py:_capture"),
    ("cudnn/cublas first calls (conv2d)", "built-in method conv2d"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="random:sd15")
    ap.add_argument("--cold", action="store_true", help="compile every Triton kernel (empty cache)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cold:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")

    import torch

    import sdfast

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    engine = sdfast.load(args.model, optimize=True)
    t_load = time.perf_counter() - t0
    engine.txt2img("a photo of a cat", num_inference_steps=2, seed=0)
    torch.cuda.synchronize()
    prof.disable()
    total = time.perf_counter() - t0
    prof.dump_stats(str(args.out / "warmup.pstats"))

    stats = pstats.Stats(prof)
    lines = [f"model {args.model}, cold Triton cache: {args.cold}",
             f"load + optimize {t_load:.1f} s; first image (2 steps) {total - t_load:.1f} s; total {total:.1f} s", ""]
    for label, key in PHASES:
        cum = max((v[3] for k, v in stats.stats.items() if key in f"{k[0]}:{k[2]}"), default=0.0)
        lines.append(f"{label:40s} {cum:7.1f} s (cumulative, outermost call)")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(45)
    text = "\n".join(lines) + "\n\n" + buf.getvalue()
    (args.out / "warmup.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
