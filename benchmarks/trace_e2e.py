"""Where a warm image's wall time goes that no GPU work covers: one ``engine.txt2img`` under torch.profiler.

    python -m benchmarks.trace_e2e --out DIR [--model random:sd15] [--steps 50] [--size 512] [--guidance 7.5]
        [--scheduler lcm] [--vae-decoder-dtype bfloat16]

Records one warm image (the third at its size) with CPU, CUDA and Python-function events, merges the GPU's
kernel/copy/memset intervals, and lists every stretch of the call where the GPU is idle for at least
``--min-gap-us``: its start (ms from the call's start), its length and the innermost Python frames running on the
host at its middle (what the GPU waits for). Writes ``DIR/trace_e2e.txt`` and ``DIR/trace_e2e.json.gz`` (the
Chrome trace, for chrome://tracing or Perfetto). GPU-only: a CPU run has nothing to trace.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import time
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def gpu_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """Merged [start, end) intervals (µs) of the GPU's kernel, copy and memset events."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in GPU_CATS)
    merged: list[list[float]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def idle_gaps(busy: list[tuple[float, float]], start: float, end: float, min_gap: float) -> list[tuple[float, float]]:
    """The stretches of [start, end) of at least ``min_gap`` µs that no busy interval covers."""
    gaps, t = [], start
    for s, e in busy:
        if s > t and s - t >= min_gap:
            gaps.append((t, min(s, end)))
        t = max(t, e)
    if end - t >= min_gap:
        gaps.append((t, end))
    return gaps


def frames_at(events: list[dict], t: float, tid, depth: int = 5) -> list[str]:
    """The innermost ``depth`` Python frames (and torch ops) running on host thread ``tid`` at time ``t`` (µs)."""
    live = [e for e in events if e.get("cat") in ("python_function", "cpu_op") and e.get("tid") == tid
            and e["ts"] <= t < e["ts"] + e.get("dur", 0)]
    live.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    return [e["name"] for e in live[-depth:]]


def summarize(events: list[dict], call_start: float, call_end: float, min_gap: float, tid=None) -> str:
    busy = gpu_intervals(events)
    inside = [(max(s, call_start), min(e, call_end)) for s, e in busy if e > call_start and s < call_end]
    busy_us = sum(e - s for s, e in inside)
    total = call_end - call_start
    gaps = idle_gaps(inside, call_start, call_end, min_gap)
    lines = [f"call {total / 1e3:.1f} ms; GPU busy {busy_us / 1e3:.1f} ms; idle {(total - busy_us) / 1e3:.1f} ms, "
             f"of which {sum(e - s for s, e in gaps) / 1e3:.1f} ms in {len(gaps)} gaps >= {min_gap:.0f} us", "",
             "| at ms | gap ms | host frames at the gap's middle (outer -> inner) |", "| --- | --- | --- |"]
    for s, e in sorted(gaps, key=lambda g: g[0]):
        frames = " > ".join(f.replace("|", "/") for f in frames_at(events, (s + e) / 2, tid))
        lines.append(f"| {(s - call_start) / 1e3:.2f} | {(e - s) / 1e3:.2f} | {frames} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="random:sd15")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--size", type=int, default=None, help="width = height in pixels (default: the model's)")
    ap.add_argument("--guidance", type=float, default=7.5, help="guidance_scale (<= 1: no CFG)")
    ap.add_argument("--scheduler", default=None, help="an sdfast scheduler name (default: the model's own)")
    ap.add_argument("--vae-decoder-dtype", default=None, help="OptimizeConfig.vae_decoder_dtype")
    ap.add_argument("--min-gap-us", type=float, default=100.0)
    ap.add_argument("--no-stack", action="store_true",
                    help="no Python frames (torch ops only): the Python tracer slows Python-heavy host code about 3x, "
                         "so gap lengths are true only without it")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import sdfast

    if not torch.cuda.is_available():
        raise SystemExit("trace_e2e needs a CUDA GPU")
    optimize = sdfast.OptimizeConfig(vae_decoder_dtype=args.vae_decoder_dtype) if args.vae_decoder_dtype else True
    engine = sdfast.load(args.model, optimize=optimize)
    kw = dict(num_inference_steps=args.steps, seed=0, guidance_scale=args.guidance, scheduler=args.scheduler)
    if args.size:
        kw.update(width=args.size, height=args.size)
    for _ in range(2):
        engine.txt2img("a photo of a cat", **kw)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=not args.no_stack) as prof:
        with record_function("sdfast_txt2img_call"):
            t = time.perf_counter()
            engine.txt2img("a photo of a cat", **kw)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
    raw = args.out / "trace_e2e.json"
    prof.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text())["traceEvents"]
    with raw.open("rb") as f, gzip.open(str(raw) + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    raw.unlink()
    call = next(e for e in events if e.get("name") == "sdfast_txt2img_call" and e.get("cat") == "user_annotation")
    text = (f"model {args.model}, {args.steps} steps, size {args.size or 'default'}, guidance {args.guidance}, "
            f"scheduler {args.scheduler or 'default'}, VAE decoder {args.vae_decoder_dtype or 'default'}, one warm image: {wall * 1e3:.1f} ms wall (profiled"
            f"{', no Python frames' if args.no_stack else ', with Python frames'})\n"
            + summarize(events, call["ts"], call["ts"] + call["dur"], args.min_gap_us, call.get("tid")))
    (args.out / "trace_e2e.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
