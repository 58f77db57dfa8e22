"""The kernel suite's ``norm`` section: the memory-bound ops (GroupNorm, LayerNorm, GEGLU) at every shape SD runs,
against eager PyTorch and ``torch.compile`` (fp16; GPU only), and the timing machinery their ``bench`` subcommands
share.

The cases are the op modules' (``OPS``: ``benchmarks.ops.group_norm``, ``.layer_norm``, ``.geglu``; each has
``BENCH_OPS``, ``bench_cases(quick)`` and ``make_bench_case(case, device, dtype)``; also run alone there as
``python -m benchmarks.ops.<op> bench``); the timing is this module's.

``run(quick=False) -> list[dict]`` (GPU only; nothing runs at import). Shapes come from
``benchmarks.sd_shapes`` (derived with forward hooks from the diffusers configs): SD1.5 UNet 512²
(batch 2 = CFG), SD1.5 VAE 512² (batch 1; decoder and encoder), SDXL base UNet 1024² (batch 2).

Rows, one per (op, shape, layout):

- ``op``: ``group_norm_silu`` / ``group_norm`` (the site's own pattern: SiLU follows the ResNet
  norms, not the transformer/attention norms), ``bias_res_group_norm_silu`` (the ResNet block's
  ``norm2(conv1 + temb)`` with the next block's residual add, returning the sum: ``channel_bias``
  (B, C) + ``residual`` + SiLU + ``return_sum``; on the UNet ResNet shapes of 32x32 and up),
  ``layer_norm``,
  ``add_layer_norm`` (residual add + LayerNorm returning the sum), ``geglu``.
- ``sdfast_us`` / ``eager_us`` / ``compile_us``: median µs of ours, of the same op in eager PyTorch
  (what stock diffusers runs, same memory layout) and of ``torch.compile`` (default mode) of that
  eager code; each call is captured in a CUDA graph and replayed (``triton.testing.do_bench``,
  which flushes L2 before every replay), so host launch overhead is excluded for all three.
  ``compile_us`` is None with ``quick=True`` or once the compile time budget is spent.
- ``bytes``: the op's minimal HBM traffic (each input read once, each output written once);
  ``gbps`` = bytes / ``sdfast_us``; ``frac_of_copy_ceiling`` = gbps / 4050 (device copy, measured).
- ``x_eager``: eager_us / sdfast_us. ``config``: the GroupNorm plan (path, channel tile, splits).
- ``kernel_us`` / ``eager_kernel_us`` / ``copy_kernel_us``: GPU time of ours, of eager's kernels, and of
  ``dst.copy_(src)`` moving the same bytes (half read, half written), L2 flushed before each call, from
  the profiler's CUPTI trace (``benchmarks.ops._timing.device_time_us``): what the kernels take inside the UNet's
  CUDA graph, without the ~5 µs a single replay's launch adds to ``sdfast_us``.
  ``kernel_frac_of_copy_ceiling`` = bytes / kernel_us / 4.05 TB/s; ``copy_frac_of_copy_ceiling`` the
  same for the copy (what moving these bytes once reaches at this size).

Targets (issue 3): >= 0.70 of the copy ceiling on shapes of at least 8 MB; ``group_norm_silu``
(2, 320, 64, 64) fp16 <= 8 µs in both layouts. Both are judged on the device time (``kernel_us``): the
issue's ceiling and its 2.4 µs "moving the bytes once" are device-time figures.

Triton compiles every kernel variant once (~0.5 s each); ``run`` first compiles them in a pool of
worker processes that fill Triton's on-disk cache, so the timed process only loads them.
"""

from __future__ import annotations

import time

COPY_CEILING_BPS = 4.05e12
OPS = ("benchmarks.ops.group_norm", "benchmarks.ops.layer_norm", "benchmarks.ops.geglu")  # the suite's case order
LEAD_COLUMNS = ("op", "shape", "layout", "dtype", "kernel_us", "kernel_frac_of_copy_ceiling", "copy_kernel_us",
         "copy_frac_of_copy_ceiling", "eager_kernel_us", "sdfast_us", "eager_us", "compile_us", "gbps",
         "frac_of_copy_ceiling", "x_eager", "bytes", "model", "config")


# --------------------------------------------------------------------------------------------
# cases (plain picklable descriptions; tensors are made in the process that runs them)
# --------------------------------------------------------------------------------------------
def op_modules() -> list:
    """The op modules of ``OPS``, imported (each imports nothing heavy)."""
    import importlib

    return [importlib.import_module(name) for name in OPS]


def cases(quick: bool = False) -> list[dict]:
    """Benchmark cases, most important first (the compile budget is spent in this order)."""
    return sort_cases([c for module in op_modules() for c in module.bench_cases(quick)])


def sort_cases(out: list[dict]) -> list[dict]:
    """The suite's order: the 8 µs target first, then big shapes (the 70% target), then the rest (stable)."""

    def priority(c):
        n = 1
        for d in c["shape"]:
            n *= d
        target = c["op"] == "group_norm_silu" and c["shape"] == (2, 320, 64, 64)
        return (not target, -(n * 2 >= 8 << 20), c["op"] != "group_norm_silu")

    return sorted(out, key=priority)


def _make(case: dict, device="cuda", dtype=None):
    """(sdfast_fn, eager_fn, bytes, config) for one case, from the op module whose ``BENCH_OPS`` has its op."""
    for module in op_modules():
        if case["op"] in module.BENCH_OPS:
            return module.make_bench_case(case, device, dtype)
    raise ValueError(f"unknown op {case['op']!r}")


def _warm_cases(descs: list[dict]) -> int:
    """Worker: run each case's sdfast op once (compiles its Triton kernels into the on-disk cache)."""
    import torch

    done = 0
    for d in descs:
        try:
            ours, _, _, _ = _make(d)
            ours()
            done += 1
        except Exception:  # the timed process reports the error for this case
            pass
    torch.cuda.synchronize()
    return done


def _precompile(all_cases: list[dict], workers: int) -> None:
    import multiprocessing as mp

    if workers <= 1:
        return
    chunks = [all_cases[i::workers] for i in range(workers)]
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        pool.map(_warm_cases, [c for c in chunks if c])


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------
def _time_us(fn) -> tuple[float, str]:
    """Median µs of ``fn`` replayed in a CUDA graph (plain launches if capture fails)."""
    import torch
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    target, how = fn, "eager"
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        target, how = graph.replay, "graph"
    except Exception:
        torch.cuda.synchronize()
    return do_bench(target, warmup=3, rep=15, return_mode="median") * 1e3, how


def _device_times(ours, eager, nbytes: int) -> dict:
    """GPU time of our kernels, of eager's, and of a copy moving the same bytes (``_timing.device_time_us``)."""
    import torch

    from benchmarks.ops._timing import device_time_us

    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    with torch.no_grad():
        out = {"kernel_us": device_time_us(ours), "eager_kernel_us": device_time_us(eager),
               "copy_kernel_us": device_time_us(lambda: dst.copy_(src))}
    out["kernel_frac_of_copy_ceiling"] = nbytes / (out["kernel_us"] * 1e-6) / COPY_CEILING_BPS
    out["copy_frac_of_copy_ceiling"] = nbytes / (out["copy_kernel_us"] * 1e-6) / COPY_CEILING_BPS
    return out


def run(quick: bool = False, *, compile: bool | None = None, compile_budget_s: float = 40.0,
        precompile_workers: int = 8, cases_fn=None) -> list[dict]:
    """Benchmark every case (see the module docstring). ``compile`` defaults to ``not quick``;
    ``compile_budget_s`` caps the time spent in torch.compile (cases past it get ``compile_us=None``).
    ``cases_fn(quick)``: the cases to run instead of :func:`cases` (in the suite's order)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the norm section (benchmarks.ops._vs_eager) needs a CUDA GPU")
    do_compile = (not quick) if compile is None else compile
    all_cases = cases(quick) if cases_fn is None else sort_cases(cases_fn(quick))
    t0 = time.perf_counter()
    try:
        _precompile(all_cases, precompile_workers)
    except Exception as e:  # compiling in the timed process instead is only slower
        print(f"[norm] parallel precompile failed ({type(e).__name__}: {e}); compiling inline")
    precompile_s = time.perf_counter() - t0

    rows = []
    compile_spent = 0.0
    for case in all_cases:
        row = {k: None for k in LEAD_COLUMNS}
        row.update(op=case["op"], shape="x".join(map(str, case["shape"])), layout=case["layout"],
                   dtype="fp16", model=case["model"])
        try:
            ours, eager, nbytes, config = _make(case)
            row.update(bytes=nbytes, config=config)
            with torch.no_grad():
                row["sdfast_us"], how = _time_us(ours)
                row["eager_us"], _ = _time_us(eager)
                if do_compile and compile_spent < compile_budget_s:
                    tc = time.perf_counter()
                    try:
                        compiled = torch.compile(eager, dynamic=False)
                        with torch._dynamo.config.patch(cache_size_limit=1024, accumulated_cache_size_limit=8192):
                            row["compile_us"], _ = _time_us(compiled)
                    except Exception as e:
                        row["note"] = f"compile failed: {type(e).__name__}: {e}"[:200]
                    compile_spent += time.perf_counter() - tc
            row["timing"] = how
            row["gbps"] = nbytes / (row["sdfast_us"] * 1e-6) / 1e9
            row["frac_of_copy_ceiling"] = row["gbps"] * 1e9 / COPY_CEILING_BPS
            row["x_eager"] = row["eager_us"] / row["sdfast_us"]
            row.update(_device_times(ours, eager, nbytes))
        except Exception as e:  # one failing case must not hide the others
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    if rows:
        rows[0]["precompile_s"] = round(precompile_s, 1)
        rows[0]["compile_budget_spent_s"] = round(compile_spent, 1)
    return rows


def bench(args, cases_fn, title: str, name: str) -> int:
    """An op module's ``bench`` subcommand over :func:`run` with ``cases_fn``: prints the table and, with
    ``args.out``, writes ``<name>.json`` / ``<name>.md`` there (``benchmarks.report.write_rows``)."""
    from benchmarks.report import markdown_table, write_rows

    rows = run(args.quick, compile=False if args.no_compile else None, cases_fn=cases_fn)
    cols = [c for c in LEAD_COLUMNS if any(r.get(c) is not None for r in rows)]
    md = "\n".join([f"# {title}", "", markdown_table(rows, cols)])
    if args.out is not None:
        write_rows(args.out, name, rows, md + "\n")
    print(md)
    return 0
