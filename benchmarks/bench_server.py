"""Service benchmark: the HTTP service under closed-loop and open-loop load, continuous against static batching.

One engine is loaded (default ``random:sd15`` on a GPU, ``random:tiny`` on a CPU; optimized with ``--max-graphs``
CUDA graphs kept per module, so that both modes' shapes stay captured) and warmed up at every batch shape the run
can form: engine calls of 1..max batch images with CFG on and off (static batching), and step batches of 1..max batch
requests with CFG on and off (continuous batching: every UNet row bucket, text-encoder batch and VAE decode size), so
no CUDA-graph capture is timed. The app (``server.app.create_app``) is served by uvicorn on 127.0.0.1 in a thread of
this process. Rows, by ``kind``:

- ``engine``: the engine alone, ``engine.txt2img`` of b prompts (``--engine-batches``; ``--steps``, CFG 7.5): the
  throughput ceiling a service could reach (``images_per_s``, best of two calls);
- ``closed``: for each ``--batching`` mode and ``--max-batch`` setting, ``--clients`` client threads each send
  ``--requests`` requests back to back (closed loop: saturation) to ``POST /v1/txt2img`` (one PNG, ``--size``,
  ``--steps``, CFG 7.5, a distinct seed per request);
- with the open loop (default; ``--no-open-loop`` leaves it out), on a mixed workload (``--mix-steps`` LO,HI: steps
  drawn uniformly; ``--mix-guidance``: CFG 7.5 or off, 1.0, drawn evenly):
  - ``capacity``: the closed loop on the mix, static batching at the largest ``--max-batch``: the capacity that
    ``--rate-fraction`` scales;
  - ``idle``: for each mode, each (steps, guidance) kind of the mix sent alone to the idle service: the latency of the
    same request on an idle service (``latency_s``);
  - ``open``: for each mode, ``--arrivals`` requests of the mix at Poisson arrivals (``--seed``) of ``--rate`` per
    second, default ``--rate-fraction`` (0.9) x the capacity row's requests per second. Latency is from the arrival's
    scheduled time to the PNG; ``slowdown_p50`` / ``slowdown_p99``: of each request's latency over its kind's idle
    latency.

Each row has ``images_per_s`` (images answered 200 / wall time from the first request to the last answer), ``p50_s``
/ ``p99_s`` / ``mean_s`` (client-side latency of the 200 answers), ``errors`` (non-200 answers and transport errors;
``error_kinds`` says which), ``mean_batch_images`` (``X-Batch-Images``: images per engine call, or per UNet step
shared on average with continuous batching), ``engine_calls`` / ``unet_steps`` (the worker's counts) and
``gpu_peak_gib`` (``torch.cuda.max_memory_allocated`` during the row; None on a CPU). ``summarize`` compares them with
issue 33's targets: at saturation continuous >= 1.15x static's best and >= 95 % of the engine's best; in the open loop
p50 slowdown <= 1.3 and p99 <= 2.

    python -m benchmarks.bench_server --out benchmarks/results/h200          # on the GPU machine
    python -m benchmarks.bench_server --model random:tiny --size 64 --steps 2 --clients 4 --requests 2

Rows are returned by ``run``; ``main`` writes ``server.json`` (rows and summary) / ``server.csv`` / ``server.md``
to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import random
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
MODES = ("continuous", "static")
TABLE = [("kind", "kind"), ("batching", "batching"), ("max_batch", "max batch"), ("load", "load"),
         ("requests", "requests"), ("images_per_s", "img/s"), ("p50_s", "p50 s"), ("p99_s", "p99 s"),
         ("slowdown_p50", "p50/idle"), ("slowdown_p99", "p99/idle"), ("mean_batch_images", "images/call"),
         ("errors", "errors"), ("wall_s", "wall s")]
TARGETS = {"saturation_vs_static": 1.15, "saturation_vs_engine": 0.95, "open_slowdown_p50": 1.3,
           "open_slowdown_p99": 2.0}


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` in [0, 100] (None for no values)."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def warm_up(engine, *, size: int, steps: int, max_batch: int, guidances=(GUIDANCE,), engine_batch: int = 0) -> float:
    """One engine call per batch size 1..max_batch and guidance (captures every CUDA graph static batching uses; at CFG
    7.5 up to ``engine_batch`` too, for the engine rows), and, on an engine the step path takes, step batches of
    1..max_batch requests per guidance (every UNet row bucket, text-encoder batch and decode size of continuous
    batching); seconds."""
    t0 = time.perf_counter()
    for g in guidances:
        for b in range(1, max(max_batch, engine_batch if g == GUIDANCE else 0) + 1):
            engine.txt2img(PROMPTS[:1] * b, num_inference_steps=steps, guidance_scale=g, height=size, width=size,
                           seed=list(range(b)), num_images_per_prompt=1)
    _warm_up_steps(engine, size=size, max_batch=max_batch, guidances=guidances)
    return time.perf_counter() - t0


def _warm_up_steps(engine, *, size: int, max_batch: int, guidances) -> None:
    from sdfast.request import Txt2ImgRequest
    from sdfast.runtime import step_batch

    probe = Txt2ImgRequest.build(PROMPTS[0], width=size, height=size, seed=0, num_inference_steps=2)
    if not step_batch.supports(engine, probe):
        return
    batch = step_batch.StepBatch(engine, step_batch.group_key(engine, probe))
    for g in guidances:
        for b in range(1, max_batch + 1):
            requests = [Txt2ImgRequest.build(PROMPTS[i % len(PROMPTS)], width=size, height=size, seed=i,
                                             guidance_scale=g, num_inference_steps=2) for i in range(b)]
            slots = batch.join(requests)
            while not all(s.done for s in slots):
                batch.step()
            batch.decode(slots)
            for s in slots:
                batch.leave(s)


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


class _Tally:
    """Answers of one row, from client threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.slowdowns: list[float] = []
        self.batch_images: list[int] = []
        self.errors: dict[str, int] = {}
        self.first = self.last = None

    def post(self, client, body: dict, *, since: float | None = None, idle: dict | None = None) -> None:
        """Send ``body``; latency from ``since`` (the arrival's scheduled time) or from the send."""
        import httpx

        t0 = time.perf_counter()
        start = t0 if since is None else since
        try:
            r = client.post("/v1/txt2img", json=body)
            kind = None if r.status_code == 200 else f"http_{r.status_code}"
        except httpx.HTTPError as e:
            r, kind = None, type(e).__name__
        done = time.perf_counter()
        with self.lock:
            self.first = start if self.first is None else min(self.first, start)
            self.last = done if self.last is None else max(self.last, done)
            if kind is None:
                self.latencies.append(done - start)
                self.batch_images.append(int(r.headers.get("x-batch-images", 0)))
                if idle:
                    self.slowdowns.append((done - start) / idle[_kind(body)])
            else:
                self.errors[kind] = self.errors.get(kind, 0) + 1

    def row(self) -> dict:
        wall = (self.last - self.first) if self.first is not None else 0.0
        return {
            "images_per_s": len(self.latencies) / wall if wall > 0 else None,
            "p50_s": percentile(self.latencies, 50),
            "p99_s": percentile(self.latencies, 99),
            "mean_s": statistics.fmean(self.latencies) if self.latencies else None,
            "slowdown_p50": percentile(self.slowdowns, 50),
            "slowdown_p99": percentile(self.slowdowns, 99),
            "errors": sum(self.errors.values()),
            "error_kinds": dict(self.errors),
            "mean_batch_images": statistics.fmean(self.batch_images) if self.batch_images else None,
            "wall_s": wall,
        }


def _kind(body: dict) -> tuple[int, float]:
    return body["num_inference_steps"], body["guidance_scale"]


def _body(i: int, *, size: int, steps: int, guidance: float = GUIDANCE, seed: int | None = None) -> dict:
    return {"prompt": PROMPTS[i % len(PROMPTS)], "num_inference_steps": steps, "guidance_scale": guidance,
            "width": size, "height": size, "seed": i if seed is None else seed, "response_format": "png"}


def mix_bodies(n: int, *, size: int, steps=(20, 30), guidances=(GUIDANCE, 1.0), seed: int = 0) -> list[dict]:
    """``n`` request bodies of the mixed workload: steps uniform in [steps[0], steps[1]], a guidance of
    ``guidances`` (CFG on, off) drawn evenly, four prompts in turn, distinct seeds; reproducible from ``seed``."""
    rng = random.Random(seed)
    return [_body(i, size=size, steps=rng.randint(steps[0], steps[1]), guidance=rng.choice(guidances),
                  seed=10_000 + i) for i in range(n)]


def poisson_gaps(n: int, rate: float, *, seed: int = 0) -> list[float]:
    """Seconds between ``n`` arrivals of a Poisson process of ``rate`` per second (exponential gaps; the first gap
    before the first arrival), reproducible from ``seed``."""
    rng = random.Random(seed + 1)
    return [rng.expovariate(rate) for _ in range(n)]


@contextlib.contextmanager
def _service(engine, *, batching: str, max_batch: int, queue_size: int, timeout_s: float):
    """(url, worker) of a fresh app of ``batching`` on ``engine``, served; the GPU's peak memory counter reset."""
    import torch

    from server.app import create_app

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    app = create_app(engine, max_batch=max_batch, queue_size=queue_size, api_key="", request_timeout_s=timeout_s,
                     batching=batching)
    with serving(app) as url:
        yield url, app.state.service.worker
    _sync()


def _common(engine_worker, batching: str, max_batch: int) -> dict:
    import torch

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {"batching": batching, "max_batch": max_batch, "engine_calls": engine_worker.batches_run,
            "unet_steps": getattr(engine_worker, "steps_run", None),
            "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def run_one(engine, *, max_batch: int, clients: int, requests: int, size: int, steps: int, batching: str = "static",
            bodies: list[dict] | None = None, timeout_s: float = 600.0) -> dict:
    """Closed loop: serve ``engine`` with ``batching`` and ``max_batch`` and drive it with ``clients`` x ``requests``
    back to back (``bodies`` in turn when given, else ``--steps`` at CFG 7.5); one ``closed`` row."""
    import httpx

    tally = _Tally()
    start = threading.Barrier(clients)
    with _service(engine, batching=batching, max_batch=max_batch, queue_size=max(64, clients * 2),
                  timeout_s=timeout_s) as (url, worker):

        def client(i: int) -> None:
            with httpx.Client(base_url=url, timeout=timeout_s) as c:
                start.wait()
                for j in range(requests):
                    k = i * requests + j
                    body = (_body(i + j, size=size, steps=steps, seed=1000 * i + j) if bodies is None
                            else bodies[k % len(bodies)])
                    tally.post(c, body)

        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(client, range(clients)))
        row = tally.row()
    return {"kind": "closed", **_common(worker, batching, max_batch), "batching_on": max_batch > 1,
            "load": f"{clients} clients", "clients": clients, "requests": clients * requests,
            "size": f"{size}x{size}", "steps": steps if bodies is None else "mix", **row}


def measure_idle(engine, *, batching: str, max_batch: int, kinds, size: int, timeout_s: float = 600.0) -> dict:
    """{(steps, guidance): seconds} of one request of each kind sent alone to an idle service of ``batching``."""
    import httpx

    out = {}
    with _service(engine, batching=batching, max_batch=max_batch, queue_size=8, timeout_s=timeout_s) as (url, _):
        with httpx.Client(base_url=url, timeout=timeout_s) as c:
            for i, (steps, guidance) in enumerate(sorted(kinds)):
                t0 = time.perf_counter()
                r = c.post("/v1/txt2img", json=_body(i, size=size, steps=steps, guidance=guidance))
                if r.status_code != 200:
                    raise RuntimeError(f"idle request ({steps} steps, guidance {guidance}) answered {r.status_code}: "
                                       f"{r.text[:200]}")
                out[steps, guidance] = time.perf_counter() - t0
    return out


def run_open(engine, *, batching: str, max_batch: int, rate: float, bodies: list[dict], idle: dict | None = None,
             seed: int = 0, timeout_s: float = 600.0) -> dict:
    """Open loop: ``bodies`` sent at Poisson arrivals of ``rate`` per second, whatever the answers (each on its own
    thread, latency from its scheduled arrival); one ``open`` row, with slowdowns against ``idle``."""
    import httpx

    n = len(bodies)
    tally = _Tally()
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    lag = 0.0
    with _service(engine, batching=batching, max_batch=max_batch, queue_size=max(64, n),
                  timeout_s=timeout_s) as (url, worker):
        with httpx.Client(base_url=url, timeout=timeout_s, limits=limits) as c, \
                ThreadPoolExecutor(min(n, 256)) as pool:
            due = time.perf_counter()
            for body, gap in zip(bodies, poisson_gaps(n, rate, seed=seed)):
                due += gap
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                lag = max(lag, -wait)
                pool.submit(tally.post, c, body, since=due, idle=idle)
        row = tally.row()
    return {"kind": "open", **_common(worker, batching, max_batch), "batching_on": max_batch > 1,
            "load": f"{rate:.3g}/s Poisson", "rate_per_s": rate, "requests": n, "arrival_lag_s": lag,
            "size": f"{bodies[0]['width']}x{bodies[0]['height']}", "steps": "mix", **row}


def engine_rows(engine, *, batches, size: int, steps: int, repeats: int = 2) -> list[dict]:
    """The engine alone at each batch size: ``engine.txt2img`` of b prompts, best of ``repeats`` calls."""
    rows = []
    for b in batches:
        best = None
        for r in range(repeats):
            _sync()
            t0 = time.perf_counter()
            engine.txt2img(PROMPTS[:1] * b, num_inference_steps=steps, guidance_scale=GUIDANCE, height=size,
                           width=size, seed=list(range(b)), num_images_per_prompt=1)
            _sync()
            took = time.perf_counter() - t0
            best = took if best is None else min(best, took)
        rows.append({"kind": "engine", "batching": "engine alone", "max_batch": b, "load": f"batch {b}",
                     "requests": repeats, "size": f"{size}x{size}", "steps": steps, "images_per_s": b / best,
                     "p50_s": best, "errors": 0})
    return rows


def summarize(rows: list[dict]) -> dict:
    """Issue 33's figures from ``rows``: saturation throughput of continuous over static's best and over the
    engine's best batch, and the open loop's latency slowdowns; each with its target and whether it is met."""
    def best(kind, batching=None):
        values = [r["images_per_s"] for r in rows if r["kind"] == kind and r.get("images_per_s")
                  and (batching is None or r["batching"] == batching)]
        return max(values) if values else None

    cont, static, eng = best("closed", "continuous"), best("closed", "static"), best("engine")
    out = {"closed_continuous_best": cont, "closed_static_best": static, "engine_best": eng}
    figures = {"saturation_vs_static": cont / static if cont and static else None,
               "saturation_vs_engine": cont / eng if cont and eng else None}
    for r in rows:
        if r["kind"] == "open" and r["batching"] == "continuous":
            figures["open_slowdown_p50"], figures["open_slowdown_p99"] = r["slowdown_p50"], r["slowdown_p99"]
            out["open_rate_per_s"] = r["rate_per_s"]
    for name, value in figures.items():
        target = TARGETS[name]
        met = None if value is None else (value >= target if name.startswith("saturation") else value <= target)
        out[name] = {"value": value, "target": target, "met": met}
    return out


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


def run(engine, *, max_batches=(4, 1), modes=MODES, clients: int = 8, requests: int = 4, size: int = 512,
        steps: int = 20, warmup: bool = True, open_loop: bool = False, rate: float | None = None,
        rate_fraction: float = 0.9, arrivals: int = 64, mix_steps=(20, 30), mix_guidance=(GUIDANCE, 1.0),
        engine_batches=(), seed: int = 0) -> list[dict]:
    """Rows for ``engine`` (see the module docstring): ``engine`` rows for ``engine_batches``, a ``closed`` row per
    mode and ``max_batches`` entry, and with ``open_loop`` the ``capacity``, ``idle`` and ``open`` rows."""
    top = max(max_batches)
    guidances = tuple(dict.fromkeys((GUIDANCE, *(mix_guidance if open_loop else ()))))
    warmup_s = None
    if warmup:
        warmup_s = warm_up(engine, size=size, steps=steps, max_batch=top, guidances=guidances,
                           engine_batch=max(engine_batches, default=0))
    meta = {**_engine_meta(engine), "warmup_s": warmup_s, "server": "uvicorn in-process thread, 127.0.0.1"}
    rows = engine_rows(engine, batches=engine_batches, size=size, steps=steps) if engine_batches else []
    for mode in modes:
        for mb in max_batches:
            rows.append(run_one(engine, batching=mode, max_batch=mb, clients=clients, requests=requests, size=size,
                                steps=steps))
    if open_loop:
        bodies = mix_bodies(arrivals, size=size, steps=mix_steps, guidances=mix_guidance, seed=seed)
        if rate is None:  # static batching's capacity on this mix, closed loop
            capacity = run_one(engine, batching="static", max_batch=top, clients=clients, requests=requests,
                               size=size, steps=steps, bodies=bodies)
            rows.append({**capacity, "kind": "capacity"})
            rate = rate_fraction * capacity["images_per_s"]
        kinds = {_kind(b) for b in bodies}
        for mode in modes:
            idle = measure_idle(engine, batching=mode, max_batch=top, kinds=kinds, size=size)
            rows.extend({"kind": "idle", "batching": mode, "max_batch": top, "load": "alone",
                         "size": f"{size}x{size}", "steps": s, "guidance_scale": g, "latency_s": t, "p50_s": t,
                         "errors": 0} for (s, g), t in sorted(idle.items()))
            rows.append(run_open(engine, batching=mode, max_batch=top, rate=rate, bodies=bodies, idle=idle,
                                 seed=seed))
    return [{**meta, **row} for row in rows]


def _pair(text: str, cast) -> tuple:
    return tuple(cast(v) for v in text.split(",") if v.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: random:sd15 on a GPU, random:tiny on a CPU")
    p.add_argument("--clients", type=int, default=8, help="closed loop: client threads (default 8)")
    p.add_argument("--requests", type=int, default=4, help="closed loop: requests per client (default 4)")
    p.add_argument("--size", type=int, default=None, help="image side in pixels (default 512; 64 on a CPU)")
    p.add_argument("--steps", type=int, default=None, help="closed loop's denoising steps (default 20; 2 on a CPU)")
    p.add_argument("--max-batch", default="4,1", help="comma-separated settings to compare (default 4,1)")
    p.add_argument("--batching", default=",".join(MODES), help="comma-separated modes (default continuous,static)")
    p.add_argument("--engine-batches", default="1,2,4,8",
                   help="the engine alone at these batch sizes (default 1,2,4,8; empty: none)")
    p.add_argument("--no-open-loop", action="store_true", help="leave out the capacity, idle and open-loop rows")
    p.add_argument("--rate", type=float, default=None,
                   help="open loop: arrivals per second (default: --rate-fraction x static capacity on the mix)")
    p.add_argument("--rate-fraction", type=float, default=0.9, help="see --rate (default 0.9)")
    p.add_argument("--arrivals", type=int, default=None, help="open loop: requests (default 64; 8 on a CPU)")
    p.add_argument("--mix-steps", default=None, help="open loop: LO,HI steps, uniform (default 20,30; 2,3 on a CPU)")
    p.add_argument("--mix-guidance", default="7.5,1.0", help="open loop: guidance values drawn evenly (default "
                                                               "7.5,1.0: CFG on and off)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals and the mix (default 0)")
    p.add_argument("--max-graphs", type=int, default=16,
                   help="CUDA graphs kept per module (OptimizeConfig.max_graphs; default 16: both modes' shapes)")
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
    arrivals = args.arrivals or (64 if gpu else 8)
    mix_steps = _pair(args.mix_steps, int) if args.mix_steps else ((20, 30) if gpu else (2, 3))
    max_batches = _pair(args.max_batch, int)
    modes = _pair(args.batching, str)
    if any(m not in MODES for m in modes):
        raise SystemExit(f"bench_server: --batching takes {', '.join(MODES)} (got {args.batching!r})")
    kwargs = {}
    if "optimize" in inspect.signature(sdfast.load).parameters:
        kwargs["optimize"] = False if args.no_optimize else sdfast.OptimizeConfig(max_graphs=args.max_graphs)
    t0 = time.perf_counter()
    engine = sdfast.load(model, **kwargs)
    load_s = time.perf_counter() - t0
    print(f"loaded {model} on {engine.device} in {load_s:.1f} s", file=sys.stderr)
    rows = run(engine, max_batches=max_batches, modes=modes, clients=args.clients, requests=args.requests, size=size,
               steps=steps, open_loop=not args.no_open_loop, rate=args.rate, rate_fraction=args.rate_fraction,
               arrivals=arrivals, mix_steps=mix_steps, mix_guidance=_pair(args.mix_guidance, float),
               engine_batches=_pair(args.engine_batches, int), seed=args.seed)
    summary = summarize(rows)
    env = env_metadata()
    for row in rows:
        row["load_s"] = load_s
    table = markdown_table([r for r in rows if r["kind"] != "idle"], TABLE)
    lines = [f"- {k}: {v['value']:.3g} (target {'>=' if k.startswith('saturation') else '<='} {v['target']}; "
             f"{'met' if v['met'] else 'not met'})" for k, v in summary.items()
             if isinstance(v, dict) and v["value"] is not None]
    print(table)
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        write_json(out / "server.json", {"env": env, "args": vars(args), "rows": rows, "summary": summary})
        write_csv(out / "server.csv", [{**r, **flatten_env(env)} for r in rows])
        (out / "server.md").write_text(
            f"Service benchmark: {model} ({rows[0]['dtype']}, optimized: {rows[0]['optimized']}) on "
            f"{env.get('gpu') or 'CPU'}, {size}x{size}; closed loop {steps} steps, {args.clients} clients x "
            f"{args.requests} requests; open loop {arrivals} arrivals, steps {mix_steps[0]}-{mix_steps[1]}, guidance "
            f"{args.mix_guidance}\n\n{table}\n\n" + "\n".join(lines) + "\n")
        print(f"wrote {out}/server.json, server.csv, server.md", file=sys.stderr)
    return 0 if all(r.get("errors", 0) == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
