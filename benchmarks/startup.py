"""Start-up time: a fresh process, ``sdfast.load`` and its first image, first ever and again on the same machine.

    python -m benchmarks.startup --out DIR [--models sd15,sdxl] [--steps 30] [--repeat N] [--skip-first] [--profile]
        [--caches DIR2] [--first-calls] [--thread-shapes]
        [--wrap-second "py-spy record -o DIR/spy.txt --format raw --native --threads --"]

For each model, two child processes run one after the other with the same cache directories (``TRITON_CACHE_DIR``
and ``SDFAST_CACHE_DIR`` under ``<caches>/<model>``, empty before the first; ``--caches`` defaults to a new
temporary directory): the first one compiles every
kernel and measures every kernel choice (the first start ever on a machine); the second finds the compiled
kernels and the saved kernel choices (``kernels.select``) and should measure nothing (``--repeat N``: N second
processes, one row each; run the module from another tree with the same ``--caches`` for an A/B). Each child reports, in
seconds: from its spawn to ``load`` returning (``start_to_load``: interpreter, imports, weights, ``optimize``; ``load``:
the ``sdfast.load`` call alone), the
first image after ``load`` returned (``first_image``: warm-up, graph capture and the steps themselves) and a second
image at the same size (``warm_image``, the steady state), how many kernel choices it measured and read from
the saved file, the graph runtime's set-up seconds per graphed module (``setup``: dry run, warm-ups, capture) and
the seconds of each kind of library call of ``sdfast.runtime.warm_start`` (``warm_start``, on its thread during
``load``). ``--profile`` writes a cProfile of the second process's first image to
``DIR/<model>-second.pstats`` and its top functions (by cumulative, then by own time) to ``DIR/<model>-second.txt``; ``--wrap-second`` runs the
second process under a command prefix (a sampling profiler that sees every thread and native frame); ``--first-calls`` times the first cuBLAS, cuDNN,
SDPA, graph capture and replay calls of a bare process, and of one where another thread made such calls first
(``first_calls.md``); ``--thread-shapes`` times the first call of each of SD's convolution and attention shapes on a
first thread, a second one and the main thread (``thread_shapes.md``: what torch keeps per thread). Rows go to ``DIR/startup.json``
and ``DIR/startup.md``, with the GPU's name and the versions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {"sd15": ("random:sd15", 512), "sdxl": ("random:sdxl", 1024)}

CHILD = r"""
import cProfile, io, json, os, pstats, sys, time
spawned = float(sys.argv[1]); model, size, steps, profile = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
import torch
import sdfast
from kernels import select
t_imported = time.time()
engine = sdfast.load(model)
t_load = time.time()
prof = cProfile.Profile() if profile != "-" else None
kw = dict(num_inference_steps=steps, height=size, width=size, seed=0)
if prof: prof.enable()
t0 = time.perf_counter()
engine.txt2img("a photo of a cat", **kw)
torch.cuda.synchronize()
first = time.perf_counter() - t0
if prof:
    prof.disable()
    prof.dump_stats(profile + ".pstats")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(60)
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
    open(profile + ".txt", "w").write(buf.getvalue())
t0 = time.perf_counter()
engine.txt2img("a photo of a cat", **kw)
torch.cuda.synchronize()
warm_image = time.perf_counter() - t0
sources = [d.source for d in select.decisions()]
try:
    from sdfast.runtime import warm_start
    warm = warm_start.wait()
except ImportError:  # a tree from before the warm start (an A/B base)
    warm = None
graphs = getattr(getattr(engine.pipe, "_sdfast", None), "graphs", None)
setup = {name: {k: round(v, 4) for k, v in r.stats.setup_s.items()} for name, r in graphs.runners.items()} if graphs else {}
print("STARTUP " + json.dumps(dict(start_to_load=t_load - spawned, load=t_load - t_imported, setup=setup,
      warm_start=warm, first_image=first, warm_image=warm_image,
      measured=sources.count("measured"), saved=sources.count("saved"), gpu=torch.cuda.get_device_name(),
      torch=torch.__version__)))
"""


FIRST_CALLS = r"""
import json, sys, threading, time, torch
def t(label, fn, rows):
    torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
    rows.append((label, round(time.perf_counter() - t0, 4)))
def other_thread():  # the same kinds of call at other shapes, on a thread that has exited before the timed calls
    torch.cuda.set_device(0)
    m = torch.randn(256, 192, device="cuda", dtype=torch.float16); m @ m.T
    c = torch.randn(1, 64, 16, 16, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    torch.nn.functional.conv2d(c, torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last), padding=1)
    torch.nn.functional.conv2d(c, torch.randn(32, 64, 1, 1, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last))
    h = torch.randn(1, 2, 64, 40, device="cuda", dtype=torch.float16); torch.nn.functional.scaled_dot_product_attention(h, h, h)
    torch.nn.functional.layer_norm(m, (192,)); torch.nn.functional.group_norm(c, 32); torch.nn.functional.gelu(m)
    torch.cuda.synchronize()
rows = []
if sys.argv[1] == "after-thread":
    torch.zeros(1, device="cuda")
    th = threading.Thread(target=other_thread); t0 = time.perf_counter(); th.start(); th.join()
    rows.append(("(other thread's calls, joined)", round(time.perf_counter() - t0, 4)))
t("CUDA context", lambda: torch.zeros(1, device="cuda"), rows)
a = torch.randn(2048, 320, device="cuda", dtype=torch.float16); w = torch.randn(320, 320, device="cuda", dtype=torch.float16)
t("first fp16 matmul (cuBLAS)", lambda: a @ w, rows)
t("second matmul shape", lambda: a @ torch.randn(320, 1280, device="cuda", dtype=torch.float16), rows)
x = torch.randn(2, 320, 64, 64, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
k = torch.randn(320, 320, 3, 3, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
t("first conv2d 3x3 (cuDNN)", lambda: torch.nn.functional.conv2d(x, k, padding=1), rows)
t("same conv again", lambda: torch.nn.functional.conv2d(x, k, padding=1), rows)
x2 = torch.randn(2, 640, 32, 32, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
k2 = torch.randn(640, 640, 3, 3, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
t("second conv2d shape", lambda: torch.nn.functional.conv2d(x2, k2, padding=1), rows)
k3 = torch.randn(640, 320, 1, 1, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
t("first conv2d 1x1", lambda: torch.nn.functional.conv2d(x, k3), rows)
q = torch.randn(2, 8, 4096, 40, device="cuda", dtype=torch.float16)
t("first SDPA", lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q), rows)
t("first layer_norm", lambda: torch.nn.functional.layer_norm(a, (320,)), rows)
t("first group_norm (torch)", lambda: torch.nn.functional.group_norm(x, 32), rows)
t("first gelu", lambda: torch.nn.functional.gelu(a), rows)
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
def side():
    with torch.cuda.stream(s):
        a @ w
t("first matmul on a new stream", side, rows)
g = torch.cuda.CUDAGraph()
def capture():
    with torch.cuda.graph(g):
        torch.nn.functional.conv2d(x, k, padding=1)
t("first graph capture", capture, rows)
t("first replay", g.replay, rows)
t("second replay", g.replay, rows)
print("FIRSTCALLS " + json.dumps(rows))
"""


THREAD_SHAPES = r"""
import json, threading, time, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
torch.zeros(1, device="cuda")
def convs():  # SD1.5's at 512x512, batch 2 (CFG): (in, out, latent side, kernel, stride)
    for c_in, c_out, hw, k, s in [(4, 320, 64, 3, 1), (320, 320, 64, 3, 1), (320, 320, 64, 3, 2), (320, 640, 32, 3, 1),
                                  (640, 640, 32, 3, 1), (640, 1280, 16, 3, 1), (1280, 1280, 16, 3, 1),
                                  (2560, 1280, 8, 3, 1), (1920, 640, 32, 3, 1), (960, 320, 64, 3, 1),
                                  (640, 320, 64, 3, 1), (320, 640, 32, 1, 1), (320, 320, 64, 1, 1), (640, 640, 32, 1, 1),
                                  (960, 320, 64, 1, 1), (320, 4, 64, 3, 1)]:
        x = torch.randn(2, c_in, hw, hw, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
        w = torch.randn(c_out, c_in, k, k, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
        b = torch.randn(c_out, device="cuda", dtype=torch.float16)
        yield f"conv {c_in}->{c_out} @{hw} k{k} s{s}", lambda x=x, w=w, b=b, k=k, s=s: F.conv2d(x, w, b, stride=s, padding=k // 2)
def attention(backend):  # SD1.5's (heads 8, head dim 40/80/160) and SDXL's (head dim 64) at batch 2
    for h, lq, lk, d in [(8, 4096, 4096, 40), (8, 4096, 77, 40), (8, 1024, 1024, 80), (8, 1024, 77, 80),
                         (8, 256, 256, 160), (8, 256, 77, 160), (8, 64, 64, 160), (8, 64, 77, 160),
                         (10, 4096, 4096, 64), (20, 1024, 1024, 64), (10, 4096, 77, 64), (20, 1024, 77, 64)]:
        q = torch.randn(2, h, lq, d, device="cuda", dtype=torch.float16)
        kv = torch.randn(2, h, lk, d, device="cuda", dtype=torch.float16)
        def run(q=q, kv=kv):
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, kv, kv)
        yield f"sdpa {backend.name} h{h} {lq}x{lk} d{d}", run
def timed(cases):
    rows = []
    for label, fn in cases:
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); first = time.perf_counter() - t0
        t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); rows.append((label, first, time.perf_counter() - t0))
    return rows
def on_new_thread(cases):
    box = {}
    def run():
        torch.cuda.set_device(0)
        box["rows"] = timed(cases)
    t = threading.Thread(target=run); t.start(); t.join()
    return box["rows"]
out = {}
for kind, make in [("cuDNN convolution", convs), ("cuDNN SDPA", lambda: attention(SDPBackend.CUDNN_ATTENTION)),
                   ("FlashAttention-2 SDPA", lambda: attention(SDPBackend.FLASH_ATTENTION)),
                   ("memory-efficient SDPA", lambda: attention(SDPBackend.EFFICIENT_ATTENTION))]:
    cases = list(make())
    out[kind] = [on_new_thread(cases), on_new_thread(cases), timed(cases)]
print("THREADSHAPES " + json.dumps(out))
"""


def thread_shapes(out: Path) -> dict:
    """First-call seconds of SD's convolution and attention shapes in a fresh process: on a first thread, on a second
    new thread after it (what is kept per thread, e.g. cuDNN plans and attention graphs in torch's ``thread_local``
    caches, is paid again), and on the main thread; each with the same call's second run beside it
    (``thread_shapes.md``)."""
    run = subprocess.run([sys.executable, "-c", THREAD_SHAPES], capture_output=True, text=True, timeout=600, check=False)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("THREADSHAPES ")), None)
    if line is None:
        raise RuntimeError(f"thread-shapes child failed (rc {run.returncode}):\n{run.stderr[-4000:]}")
    result = json.loads(line[len("THREADSHAPES "):])
    threads = ("first thread", "second thread", "main thread")
    lines = []
    for kind, per_thread in result.items():
        lines += [f"## {kind}", "", "| call | " + " | ".join(f"{t}: first / again (ms)" for t in threads) + " |",
                  "| --- |" + " --- |" * len(threads)]
        for i, (label, *_) in enumerate(per_thread[0]):
            lines.append(f"| {label} | " + " | ".join(f"{rows[i][1] * 1e3:.2f} / {rows[i][2] * 1e3:.3f}"
                                                     for rows in per_thread) + " |")
        lines += [""] + [f"- {t}: first calls together {sum(r[1] for r in rows) * 1e3:.1f} ms"
                         for t, rows in zip(threads, per_thread)] + [""]
    (out / "thread_shapes.md").write_text("\n".join(lines))
    return result


def first_calls(out: Path) -> list:
    """Seconds of the first CUDA library calls of a fresh process (cuBLAS, cuDNN, kernels loaded lazily, graphs):
    what no kernel cache of ours can save; in a bare process, and in one where another thread made the same kinds
    of call at other shapes and exited first (what of a first call's cost such a thread can take over)."""
    runs = {}
    for mode in ("bare", "after-thread"):
        run = subprocess.run([sys.executable, "-c", FIRST_CALLS, mode], capture_output=True, text=True, timeout=300,
                             check=False)
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith("FIRSTCALLS ")), None)
        if line is None:
            raise RuntimeError(f"first-calls child ({mode}) failed (rc {run.returncode}):\n{run.stderr[-4000:]}")
        runs[mode] = dict(json.loads(line[len("FIRSTCALLS "):]))
    labels = list(dict.fromkeys([*runs["after-thread"], *runs["bare"]]))
    rows = [(label, runs["bare"].get(label), runs["after-thread"].get(label)) for label in labels]
    cell = lambda sec: "" if sec is None else f"{sec:.4f}"  # noqa: E731
    (out / "first_calls.md").write_text(
        "| call | s, first in a bare process | s, after another thread's calls |\n| --- | --- | --- |\n" +
        "".join(f"| {label} | {cell(a)} | {cell(b)} |\n" for label, a, b in rows))
    return rows


def run_child(model: str, size: int, steps: int, env: dict, profile: str, wrap: list[str] = ()) -> dict:
    spawned = time.time()
    out = subprocess.run([*wrap, sys.executable, "-c", CHILD, repr(spawned), model, str(size), str(steps), profile],
                         env=env, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("STARTUP ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"startup child for {model} failed (rc {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(line[len("STARTUP "):])


def _setup(row: dict) -> str:
    """``unet 0.31/0.12x1/0.05; vae ...``: each graphed module's dry run, warm-ups (seconds x passes), capture."""
    return "; ".join(f"{name} {p.get('dry_run', 0):.2f}/{p.get('warmup', 0):.2f}x{p.get('warmups', 0)}/"
                     f"{p.get('capture', 0):.2f}" for name, p in row.get("setup", {}).items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="sd15,sdxl")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile", action="store_true", help="cProfile the second process's first image")
    ap.add_argument("--caches", type=Path, default=None, help="where the per-model cache directories go")
    ap.add_argument("--wrap-second", default="", help="a command prefix for the second process ({model} is replaced)")
    ap.add_argument("--repeat", type=int, default=1, help="how many second processes per model (one row each)")
    ap.add_argument("--skip-first", action="store_true", help="only second processes (the caches are already warm)")
    ap.add_argument("--first-calls", action="store_true",
                    help="also time the first CUDA library calls of a fresh process (first_calls.md)")
    ap.add_argument("--thread-shapes", action="store_true",
                    help="also time SD's convolution and attention shapes' first calls per thread (thread_shapes.md)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.thread_shapes:
        thread_shapes(args.out)
    if args.first_calls:
        for label, bare, after in first_calls(args.out):
            print(f"{label}: bare {bare} s, after another thread {after} s", flush=True)
    rows = []
    for name in filter(None, args.models.split(",")):
        model, size = MODELS[name]
        caches = (args.caches or Path(tempfile.mkdtemp(prefix="sdfast-startup-"))) / name
        env = dict(os.environ, TRITON_CACHE_DIR=str(caches / "triton"), SDFAST_CACHE_DIR=str(caches / "sdfast"))
        for run in ([] if args.skip_first else ["first"]) + ["second"] * args.repeat:
            profile = str(args.out / f"{name}-second") if (args.profile and run == "second") else "-"
            wrap = args.wrap_second.replace("{model}", name).split() if run == "second" else []
            row = dict(model=model, size=size, steps=args.steps, run=run,
                       date=time.strftime("%Y-%m-%d"), **run_child(model, size, args.steps, env, profile, wrap))
            rows.append(row)
            print(json.dumps(row), flush=True)
    (args.out / "startup.json").write_text(json.dumps(rows, indent=1))
    lines = ["| model | run | start -> load returns (s) | of which load (s) | first image (s) | warm image (s) | "
             "choices measured | choices read | graph set-up in the first image (s: dry run, warm-ups, capture) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['model']} {r['size']}² | {r['run']} | {r['start_to_load']:.2f} | {r['load']:.2f} | "
              f"{r['first_image']:.2f} | {r['warm_image']:.3f} | {r['measured']} | {r['saved']} | {_setup(r)} |"
              for r in rows]
    (args.out / "startup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
