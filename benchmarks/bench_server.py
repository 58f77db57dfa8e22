"""Service benchmark: the HTTP service under concurrent load, with request batching on and off.

One engine is loaded (default ``random:sd15`` on a GPU, ``random:tiny`` on a CPU) and warmed up at
every batch size the run can form (so CUDA-graph captures are not timed). Then, for each
``--max-batch`` setting (default ``4,1``: batching on, then off), the app (``server.app.create_app``)
is served by uvicorn on 127.0.0.1 in a thread of this process, and ``--clients`` client threads each
send ``--requests`` requests back to back (closed loop) to ``POST /v1/txt2img`` (one PNG image,
``--size``, ``--steps``, CFG 7.5, a distinct seed per request). Each row reports:

- ``images_per_s``: images answered 200 / wall time from the first request to the last answer;
- ``p50_s`` / ``p99_s`` / ``mean_s``: client-side latency of the 200 answers (request sent to PNG received);
- ``errors``: non-200 answers and transport errors (``error_kinds`` says which);
- ``mean_batch_images``: images per engine call as the service reported them (``X-Batch-Images``);
- ``gpu_peak_gib``: ``torch.cuda.max_memory_allocated`` during the run (None on a CPU).

    python -m benchmarks.bench_server --out benchmarks/results/h200          # on the GPU machine
    python -m benchmarks.bench_server --model random:tiny --size 64 --steps 2 --clients 4 --requests 2

Rows are returned by ``run``; ``main`` writes ``server.json`` / ``server.csv`` / ``server.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [
    "a photo of an astronaut riding a horse on mars",
    "a watercolor painting of a lighthouse at dusk",
    "a bowl of ramen, studio lighting, 35mm",
    "a red fox in a snowy forest",
]
GUIDANCE = 7.5
TABLE = [("max_batch", "max batch"), ("clients", "clients"), ("requests", "requests"), ("images_per_s", "img/s"),
         ("p50_s", "p50 s"), ("p99_s", "p99 s"), ("mean_batch_images", "images/call"), ("errors", "errors"),
         ("wall_s", "wall s")]


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` in [0, 100] (None for no values)."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def warm_up(engine, *, size: int, steps: int, max_batch: int) -> float:
    """One engine call per batch size 1..max_batch (captures every CUDA graph the run will use); seconds."""
    t0 = time.perf_counter()
    for b in range(1, max_batch + 1):
        engine.txt2img(PROMPTS[:1] * b, num_inference_steps=steps, guidance_scale=GUIDANCE, height=size, width=size,
                       seed=list(range(b)), num_images_per_prompt=1)
    return time.perf_counter() - t0


def _sync():
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def serving(app):
    """uvicorn on 127.0.0.1:<free port> in a thread of this process; yields the base URL."""
    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                           timeout_keep_alive=60))
    thread = threading.Thread(target=server.run, name="bench-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("uvicorn did not start within 60 s")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def run_one(engine, *, max_batch: int, clients: int, requests: int, size: int, steps: int,
            timeout_s: float = 600.0) -> dict:
    """Serve ``engine`` with ``max_batch`` and drive it with ``clients`` × ``requests``; one result row."""
    import httpx
    import torch

    from server.app import create_app

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    app = create_app(engine, max_batch=max_batch, queue_size=max(64, clients * 2), api_key="",
                     request_timeout_s=timeout_s)
    latencies: list[float] = []
    batch_images: list[int] = []
    errors: dict[str, int] = {}
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(i: int) -> None:
        with httpx.Client(base_url=url, timeout=timeout_s) as c:
            start.wait()
            for j in range(requests):
                body = {"prompt": PROMPTS[(i + j) % len(PROMPTS)], "num_inference_steps": steps,
                        "guidance_scale": GUIDANCE, "width": size, "height": size, "seed": 1000 * i + j,
                        "response_format": "png"}
                t0 = time.perf_counter()
                try:
                    r = c.post("/v1/txt2img", json=body)
                    kind = None if r.status_code == 200 else f"http_{r.status_code}"
                except httpx.HTTPError as e:
                    r, kind = None, type(e).__name__
                took = time.perf_counter() - t0
                with lock:
                    if kind is None:
                        latencies.append(took)
                        batch_images.append(int(r.headers.get("x-batch-images", 0)))
                    else:
                        errors[kind] = errors.get(kind, 0) + 1

    with serving(app) as url:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(client, range(clients)))
        _sync()
        wall = time.perf_counter() - t0
        batches = app.state.service.worker.batches_run
    return {
        "max_batch": max_batch,
        "batching": "on" if max_batch > 1 else "off",
        "clients": clients,
        "requests": clients * requests,
        "size": f"{size}x{size}",
        "steps": steps,
        "images_per_s": len(latencies) / wall if wall > 0 else None,
        "p50_s": percentile(latencies, 50),
        "p99_s": percentile(latencies, 99),
        "mean_s": statistics.fmean(latencies) if latencies else None,
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "mean_batch_images": statistics.fmean(batch_images) if batch_images else None,
        "engine_calls": batches,
        "wall_s": wall,
        "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def _engine_meta(engine) -> dict:
    state = getattr(getattr(engine, "pipe", None), "_sdfast", None)
    config = getattr(state, "config", None)
    return {
        "model": getattr(engine, "name", None),
        "device": str(getattr(engine, "device", "")),
        "dtype": str(getattr(engine, "dtype", "")).replace("torch.", ""),
        "optimized": state is not None,
        "optimize_config": config.as_dict() if hasattr(config, "as_dict") else None,
    }


def run(engine, *, max_batches=(4, 1), clients: int = 8, requests: int = 4, size: int = 512, steps: int = 20,
        warmup: bool = True) -> list[dict]:
    """Rows (one per ``max_batches`` entry) for ``engine``; see the module docstring for the fields."""
    warmup_s = warm_up(engine, size=size, steps=steps, max_batch=max(max_batches)) if warmup else None
    meta = _engine_meta(engine)
    rows = []
    for mb in max_batches:
        row = run_one(engine, max_batch=mb, clients=clients, requests=requests, size=size, steps=steps)
        rows.append({**meta, **row, "warmup_s": warmup_s, "server": "uvicorn in-process thread, 127.0.0.1"})
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: random:sd15 on a GPU, random:tiny on a CPU")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--size", type=int, default=None, help="image side in pixels (default 512; 64 on a CPU)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default 20; 2 on a CPU)")
    p.add_argument("--max-batch", default="4,1", help="comma-separated settings to compare (default 4,1)")
    p.add_argument("--no-optimize", action="store_true", help="serve the stock diffusers pipeline")
    p.add_argument("--out", default=None, help="write server.json / server.csv / server.md here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import inspect

    import torch

    import sdfast
    from benchmarks.report import env_metadata, flatten_env, markdown_table, write_csv, write_json

    gpu = torch.cuda.is_available()
    model = args.model or ("random:sd15" if gpu else "random:tiny")
    size = args.size or (512 if gpu else 64)
    steps = args.steps or (20 if gpu else 2)
    max_batches = [int(v) for v in args.max_batch.split(",") if v.strip()]
    kwargs = {"optimize": False} if args.no_optimize and "optimize" in inspect.signature(sdfast.load).parameters else {}
    t0 = time.perf_counter()
    engine = sdfast.load(model, **kwargs)
    load_s = time.perf_counter() - t0
    print(f"loaded {model} on {engine.device} in {load_s:.1f} s", file=sys.stderr)
    rows = run(engine, max_batches=max_batches, clients=args.clients, requests=args.requests, size=size, steps=steps)
    env = env_metadata()
    for row in rows:
        row["load_s"] = load_s
    table = markdown_table(rows, TABLE)
    print(table)
    if args.out:
        out = Path(args.out)
        write_json(out / "server.json", {"env": env, "args": vars(args), "rows": rows})
        write_csv(out / "server.csv", [{**r, **flatten_env(env)} for r in rows])
        (out / "server.md").write_text(
            f"Service benchmark: {model} ({rows[0]['dtype']}, optimized: {rows[0]['optimized']}) on "
            f"{env.get('gpu') or 'CPU'}, {size}x{size}, {steps} steps, {args.clients} clients x "
            f"{args.requests} requests\n\n{table}\n")
        print(f"wrote {out}/server.json, server.csv, server.md", file=sys.stderr)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
