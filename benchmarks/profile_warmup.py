"""Where the warm-up goes: ``sdfast.load(..., optimize=True)`` plus the first image, profiled with cProfile.

    python -m benchmarks.profile_warmup --out DIR [--model random:sd15] [--cold] [--second-size | --warm]

``--cold`` points Triton at an empty cache directory (``TRITON_CACHE_DIR``), so every kernel compiles, as
on a machine that never ran sdfast; without it the user's cache is used. Prints the wall time of the load
and of the first image, the time spent compiling Triton kernels, in SDPA calls (mostly the attention
dispatcher's measurements), in CUDA-graph capture and in Triton's autotuner, and the top functions by cumulative
time (``--second-size``: of the first image at a second size only; ``--warm``: of a warm 50-step image, the
host work per image); with ``--cold``, also the Triton kernels compiled in the profiled part, by name. Writes
``DIR/warmup.pstats``, ``DIR/warmup.txt`` and ``DIR/warmup.log`` (sdfast's INFO log: attention choices,
ahead-of-time compile counts).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import pstats
import tempfile
import time
from collections import Counter
from pathlib import Path

# (label, [(file suffix, function)]): cumulative times summed. Only functions that run start to end in Python
# frames cProfile sees (calls that re-enter Python from a torch custom op show no cumulative time).
PHASES = [
    ("triton compile: TTIR/TTGIR/LLVM/PTX", [("nvidia/compiler.py", f) for f in ("make_ttir", "make_ttgir", "make_llir", "make_ptx")]),
    ("triton compile: ptxas (make_cubin)", [("nvidia/compiler.py", "make_cubin")]),
    ("triton launcher builds (C compiler)", [("triton/runtime/build.py", "compile_module_from_src")]),
    ("SDPA calls (dispatcher measurement, warm-up)", [("~", "<built-in method torch._C._nn.scaled_dot_product_attention>")]),
    ("cuda graph capture", [("sdfast/runtime/cuda_graphs.py", "_capture")]),
    ("triton autotuning (timing configs)", [("triton/runtime/autotuner.py", "benchmark")]),
]


def compiled_kernels(cache_dir: str) -> Counter:
    """Kernel name -> number of compiled specializations in a Triton cache directory (one ``<name>.cubin``
    per compilation)."""
    return Counter(p.stem for p in Path(cache_dir).rglob("*.cubin"))


def phase_seconds(stats: pstats.Stats, keys) -> float:
    return sum(v[3] for (path, _, fn), v in stats.stats.items() for suffix, name in keys
               if path.endswith(suffix) and fn == name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="random:sd15")
    ap.add_argument("--cold", action="store_true", help="compile every Triton kernel (empty cache)")
    ap.add_argument("--second-size", action="store_true",
                    help="profile only the first image at a second size (width + 128) after an unprofiled first one")
    ap.add_argument("--warm", action="store_true",
                    help="profile only a warm image (the third at the same size, 50 steps): the host's share")
    args = ap.parse_args(argv)
    if args.second_size and args.warm:
        ap.error("--second-size and --warm profile different images; pick one")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cold:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    # sdfast's INFO lines (attention choices, precompile counts) go to DIR/warmup.log
    handler = logging.FileHandler(args.out / "warmup.log", mode="w")
    handler.setFormatter(logging.Formatter("%(relativeCreated)8.0f ms %(name)s: %(message)s"))
    logging.getLogger("sdfast").addHandler(handler)
    logging.getLogger("sdfast").setLevel(logging.INFO)

    import torch

    import sdfast

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    if not (args.second_size or args.warm):
        prof.enable()
    engine = sdfast.load(args.model, optimize=True)
    t_load = time.perf_counter() - t0
    first = engine.txt2img("a photo of a cat", num_inference_steps=2, seed=0)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    lines = [f"model {args.model}, cold Triton cache: {args.cold}",
             f"load + optimize {t_load:.1f} s; first image (2 steps) {total - t_load:.1f} s; total {total:.1f} s"]
    cache_dir = os.environ.get("TRITON_CACHE_DIR")
    before = Counter()  # what the cold cache held when profiling started: nothing, unless a later image is profiled
    if args.second_size:
        w, h = first[0].size
        before = compiled_kernels(cache_dir) if args.cold else Counter()
        t1 = time.perf_counter()
        prof.enable()
        engine.txt2img("a photo of a cat", num_inference_steps=2, seed=0, width=w + 128, height=h)
        torch.cuda.synchronize()
        prof.disable()
        lines.append(f"profiled: first image at the second size {w + 128}x{h}: {time.perf_counter() - t1:.2f} s")
    if args.warm:
        kw = dict(num_inference_steps=50, seed=0)
        engine.txt2img("a photo of a cat", **kw)
        torch.cuda.synchronize()
        before = compiled_kernels(cache_dir) if args.cold else Counter()
        t1 = time.perf_counter()
        prof.enable()
        engine.txt2img("a photo of a cat", **kw)
        torch.cuda.synchronize()
        prof.disable()
        lines.append(f"profiled: a warm image (50 steps) at the first size: {time.perf_counter() - t1:.3f} s")
    prof.disable()
    prof.dump_stats(str(args.out / "warmup.pstats"))

    stats = pstats.Stats(prof)
    lines.append("")
    for label, keys in PHASES:
        lines.append(f"{label:45s} {phase_seconds(stats, keys):7.1f} s")
    if args.cold:
        new = compiled_kernels(cache_dir) - before
        lines.append(f"\nTriton kernels compiled in the profiled part: {sum(new.values())}")
        lines += [f"  {n:4d}  {name}" for name, n in new.most_common()]
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(45)
    text = "\n".join(lines) + "\n\n" + buf.getvalue()
    (args.out / "warmup.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
