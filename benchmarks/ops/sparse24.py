"""2:4 sparse linear benchmarks, one CLI (GPU only; nothing runs at import):

    python -m benchmarks.ops.sparse24 bench [--quick] [--out DIR]
    python -m benchmarks.ops.sparse24 cusparselt --out DIR [--shapes ff|all] [--dtypes fp16,fp8] [--quick]

``bench``: 2:4 sparse linear vs dense cuBLAS at every SD1.5 / SDXL transformer linear shape (fp16); the ``sparse``
section of ``benchmarks.bench_kernels`` (``run``), written here to ``sparse24_bench.json`` / ``.md`` in ``--out``.
One row per (shape, backend):

- ``dense``: ``F.linear`` (cuBLAS) with the pruned weight.
- ``cusparselt_default``: torch's default path, ``F.linear(x, to_sparse_semi_structured(W))``
  (cuSPARSELt subclass, alg_id 0, per-call plan creation, tensor-subclass dispatch).
- ``cusparselt_alg0``: our direct call (``kernels.sparse24.cusparselt.cusparselt_linear``: sparse weight
  as the left operand, x^T as a K-major view, transposed result, fused bias), algorithm 0.
- ``cusparselt_tuned``: same with the algorithm / split-K found by cuSPARSELt's search for the shape.
- ``cutlass_default``: ``F.linear`` with the CUTLASS subclass (what ``_FORCE_CUTLASS`` gives).
- ``cutlass``: ``torch._sparse_semi_structured_linear`` directly (bias fused, (M, N) out).
- ``triton``: our kernel reading compressed values + 2-bit metadata (dense tensor cores).

Every row has ``us_eager`` (``triton.testing.do_bench`` median: events around each call, so host
overhead shows when the host is slower than the GPU, as in eager inference) and ``us_graph``
(``triton.testing.do_bench_cudagraph`` median: kernels replayed in a CUDA graph, as sdfast runs the
UNet), ``tflops_graph`` (dense-equivalent 2*M*K*N FLOP / us_graph; ceiling 739 TFLOP/s) and
``speedup_graph`` / ``speedup_eager`` against dense in the same mode. Target: >= 1.3x on the large
feed-forward shapes. Rows with ``bench == "sparse24_default_path_diagnosis"`` decompose the default
path's slowdown at 8192 x 320 -> 2560: eager vs graph time, host time per
call, layout variants, algorithm 0 vs searched. A backend that fails on a shape (or gives a wrong
result) gives a row whose ``note`` starts with ``error:`` (never dropped silently).

``cusparselt``: cuSPARSELt's settings (a staged sweep), at every SD1.5 / SDXL linear shape, against dense cuBLAS
(issue 8). cuSPARSELt's own search (``cusparseLtMatmulSearch``) broke the CUDA context on the H200, so this walks
the settings by hand, each timed in a CUDA graph (``triton.testing.do_bench_cudagraph``, median):

- the dense operand as x^T viewed (K-major, no copy) or x^T copied (M-major), and the result transposed
  (M, N) or not (N, M), at algorithm 0; then, in the fastest of those four layouts,
- every ``alg_id`` from 1 up to the first one the library rejects, and
- ``split_k`` 2 and 4 in the one-kernel and two-kernel split-K modes for the three fastest algorithms;
- fp16 (2:4 fp16 against ``F.linear`` fp16) and FP8 E4M3 (2:4 FP8 with an unscaled bf16 result against
  ``torch._scaled_mm`` per-tensor FP8 with fast accumulation: the same precision on both sides).

Every row checks the result against the dense product of the pruned weight first (max relative error),
so a fast wrong setting is not counted. Each shape runs in its own process: a setting that breaks the
context costs that shape's remaining rows, not the sweep. Rows go to ``DIR/sweep_cusparselt.json``
(GPU, versions, date), the best setting per shape and dtype to ``DIR/sweep_cusparselt.md``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PEAK_TFLOPS = 739.0  # the measured bf16 matmul ceiling of the H200


# --------------------------------------------------------------------------------------------
# bench: every 2:4 backend against dense cuBLAS, and why torch's default path is slow
# --------------------------------------------------------------------------------------------
_LEAD = ("bench", "model", "layer", "M", "K", "N", "backend", "us_graph", "tflops_graph", "speedup_graph", "us_eager", "note")


def _row(meta: dict, **fields) -> dict:
    """Keys in a fixed order (the kernel table prints the first 12), metadata last. ``note`` holds
    ``"error: ..."`` for a backend that failed, or the diagnosis explanation."""
    row = {k: fields.pop(k, None) for k in _LEAD}
    row.update(fields)
    row.update(meta)
    return row


def bench_shapes(quick: bool) -> list[dict]:
    """SD1.5 512^2 and SDXL 1024^2, batch 1 with CFG (UNet batch 2): M = 2 x tokens, (K, N) per linear."""
    rows = []

    def level(model, tokens, c):
        m = 2 * tokens
        rows.append(dict(model=model, layer=f"attn q/k/v/out, proj_in/out C={c}", M=m, K=c, N=c, ff=False))
        rows.append(dict(model=model, layer=f"ff GEGLU proj {c}->{8 * c}", M=m, K=c, N=8 * c, ff=True))
        rows.append(dict(model=model, layer=f"ff out {4 * c}->{c}", M=m, K=4 * c, N=c, ff=True))

    if quick:
        level("sd15", 4096, 320)
        level("sdxl", 1024, 1280)
        return rows
    for tokens, c in ((4096, 320), (1024, 640), (256, 1280), (64, 1280)):
        level("sd15", tokens, c)
    for c in (320, 640, 1280):
        rows.append(dict(model="sd15", layer=f"cross k/v 768->{c} (77 text tokens)", M=154, K=768, N=c, ff=False))
    for tokens, c in ((4096, 640), (1024, 1280)):
        level("sdxl", tokens, c)
    for c in (640, 1280):
        rows.append(dict(model="sdxl", layer=f"cross k/v 2048->{c} (77 text tokens)", M=154, K=2048, N=c, ff=False))
    return rows


def _meta() -> dict:
    import torch
    import triton

    try:
        cslt = torch.backends.cusparselt.version()
    except Exception:  # noqa: BLE001 pragma: no cover - GPU only
        cslt = None
    return dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=triton.__version__,
        cusparselt=cslt,
        dtype="float16",
    )


def _bench(fn) -> tuple[float | None, float | None, str | None]:
    import torch
    from triton.testing import do_bench, do_bench_cudagraph

    try:
        fn()
        torch.cuda.synchronize()
        eager = do_bench(fn, warmup=5, rep=25, return_mode="median") * 1000.0
    except Exception as e:  # noqa: BLE001 - a failing backend is a row
        return None, None, f"{type(e).__name__}: {e}"[:300]
    try:
        graph = do_bench_cudagraph(fn, rep=10, return_mode="median") * 1000.0
    except Exception as e:  # noqa: BLE001 - a failing backend is a row
        return eager, None, f"graph capture: {type(e).__name__}: {e}"[:300]
    return eager, graph, None


def _host_us_per_call(fn, n: int = 50) -> float:
    """Wall time per call of ``n`` calls issued back to back (then one sync): max(host, GPU) per call."""
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / n


def _search_enabled() -> bool:
    """cuSPARSELt's algorithm search runs where the kernel policy asks for it (``SDFAST_CUSPARSELT_SEARCH=1``)."""
    from sdfast.config import KernelPolicy

    return KernelPolicy.from_env().cusparselt_search


def _candidates(x, w, b) -> dict:
    import torch
    import torch.nn.functional as F

    from kernels.sparse24 import cusparselt as cslt
    from kernels.sparse24 import format as fmt
    from kernels.sparse24 import kernel as k24

    out = {"dense": lambda: F.linear(x, w, b)}
    n, k = w.shape
    errors = {}
    ok, why = cslt.backend_supports("cusparselt", n, k, w.dtype)
    if ok:
        try:
            ws = cslt.to_semi_structured(w, "cusparselt")
            out["cusparselt_default"] = lambda: F.linear(x, ws, b)
            packed = torch._cslt_compress(w)
            out["cusparselt_alg0"] = lambda: cslt.cusparselt_linear(x, packed, b)
            if _search_enabled():
                plan = cslt.cusparselt_search(packed, cslt.pad_rows(x, 8), b)
                out["cusparselt_tuned"] = lambda: cslt.cusparselt_linear(x, packed, b, plan)
                out["_plan"] = plan
        except Exception as e:  # noqa: BLE001 - a failing backend is a row
            errors["cusparselt"] = f"{type(e).__name__}: {e}"[:300]
    else:
        errors["cusparselt"] = why
    ok, why = cslt.backend_supports("cutlass", n, k, w.dtype)
    if ok:
        try:
            wc = cslt.to_semi_structured(w, "cutlass")
            out["cutlass_default"] = lambda: F.linear(x, wc, b)
            cp, cm = fmt.to_cutlass_format(w)
            out["cutlass"] = lambda: cslt.cutlass_linear(x, cp, cm, b)
        except Exception as e:  # noqa: BLE001 - a failing backend is a row
            errors["cutlass"] = f"{type(e).__name__}: {e}"[:300]
    else:
        errors["cutlass"] = why
    values, meta = fmt.compress_24(w)
    out["triton"] = lambda: k24.sparse24_linear(x, values, meta, b)
    out["_errors"] = errors
    return out


def _check(fn, ref32, lowp) -> str | None:
    try:
        y = fn()
    except Exception as e:  # noqa: BLE001 - a failing backend is a row
        return f"{type(e).__name__}: {e}"[:300]
    err = (y.float() - ref32).abs().max().item()
    base = (lowp.float() - ref32).abs().max().item()
    tol = 2 * base + 1e-2
    if not (err <= tol):
        return f"wrong result: max|y - ref32| = {err:.3e} > {tol:.3e}"
    return None


def _diagnosis(meta: dict) -> list[dict]:
    """Why torch's default path is slower than dense at 8192 x 320 -> 2560: its parts, timed one by one."""
    import torch
    import torch.nn.functional as F

    from kernels.sparse24 import cusparselt as cslt
    from kernels.sparse24 import prune

    m, k, n = 8192, 320, 2560
    gen = torch.Generator(device="cuda").manual_seed(0)
    w, _ = prune.prune_24_magnitude(torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen))
    x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
    b = torch.randn(n, device="cuda", dtype=torch.float16, generator=gen)
    rows = []
    variants = {"dense": lambda: F.linear(x, w, b)}
    if cslt.cusparselt_available():
        ws = cslt.to_semi_structured(w, "cusparselt")
        packed = torch._cslt_compress(w)
        plan = cslt.cusparselt_search(packed, x, b) if _search_enabled() else cslt.CusparseltPlan()
        xt_contig = x.t().contiguous()
        variants.update(
            {
                "default: F.linear(x, to_sparse_semi_structured(W))": lambda: F.linear(x, ws, b),
                "default without bias (mm path, no addmm)": lambda: F.linear(x, ws),
                "direct _cslt_sparse_mm, alg 0, x^T view, transposed result": lambda: cslt.cusparselt_linear(x, packed, b),
                f"direct, searched alg {plan.alg_id} split_k {plan.split_k}": lambda: cslt.cusparselt_linear(x, packed, b, plan),
                "direct, x^T made contiguous (copy each call)": lambda: torch._cslt_sparse_mm(
                    packed, x.t().contiguous(), bias=b, transpose_result=True, alg_id=plan.alg_id
                ),
                "direct, x^T pre-transposed (copy excluded)": lambda: torch._cslt_sparse_mm(
                    packed, xt_contig, bias=b, transpose_result=True, alg_id=plan.alg_id
                ),
                "direct, (N, M) result (needs a transpose copy downstream)": lambda: torch._cslt_sparse_mm(
                    packed, x.t(), bias=b.view(-1), transpose_result=False, alg_id=plan.alg_id
                ),
            }
        )
    dense_graph = None
    for label, fn in variants.items():
        eager, graph, err = _bench(fn)
        host = None
        if err is None or eager is not None:
            try:
                host = _host_us_per_call(fn)
            except Exception:  # noqa: BLE001 - no host time for this variant
                host = None
        if label == "dense":
            dense_graph = graph
        rows.append(
            _row(
                meta,
                bench="sparse24_default_path_diagnosis",
                model="sd15",
                layer="ff GEGLU proj 320->2560",
                M=m,
                K=k,
                N=n,
                backend=label,
                us_eager=eager,
                us_graph=graph,
                tflops_graph=(2.0 * m * k * n / graph / 1e6 if graph else None),
                speedup_graph=(None if graph is None or dense_graph is None else dense_graph / graph),
                note=(f"error: {err}" if err else None),
                host_us_per_call=host,
                host_overhead_us=(None if eager is None or graph is None else eager - graph),
            )
        )
    by = {r["backend"]: r for r in rows}
    d = by.get("default: F.linear(x, to_sparse_semi_structured(W))")
    if d and d["us_eager"] and d["us_graph"]:
        tuned = [r for v, r in by.items() if v.startswith("direct, searched")]
        t = tuned[0]["us_graph"] if tuned and tuned[0]["us_graph"] else float("nan")
        a0 = by["direct _cslt_sparse_mm, alg 0, x^T view, transposed result"]["us_graph"] or float("nan")
        rows.append(
            _row(
                meta,
                bench="sparse24_default_path_diagnosis",
                model="sd15",
                layer="ff GEGLU proj 320->2560",
                M=m,
                K=k,
                N=n,
                backend="explanation",
                note=(
                    f"default path {d['us_eager']:.0f} us eager vs {d['us_graph']:.1f} us replayed in a CUDA graph: "
                    f"{d['us_eager'] - d['us_graph']:.0f} us per call is host-side (host time per call "
                    f"{d['host_us_per_call'] or float('nan'):.0f} us: cuSPARSELt descriptors + matmul plan + workspace "
                    f"rebuilt on every call, tensor-subclass dispatch). Kernel time: alg 0 {a0:.1f} us, searched {t:.1f} us, "
                    f"dense {dense_graph or float('nan'):.1f} us."
                ),
            )
        )
    return rows


def run(quick: bool = False) -> list[dict]:
    """The ``sparse`` section of the kernel suite: its rows (see the module docstring). Needs CUDA; raises
    RuntimeError without it."""
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        raise RuntimeError("benchmarks.ops.sparse24 bench needs a CUDA GPU")
    from kernels.sparse24 import prune

    meta = _meta()
    rows: list[dict] = []
    torch.manual_seed(0)
    for shape in bench_shapes(quick):
        m, k, n = shape["M"], shape["K"], shape["N"]
        w, _ = prune.prune_24_magnitude(torch.randn(n, k, device="cuda", dtype=torch.float16) * k**-0.5)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = torch.randn(n, device="cuda", dtype=torch.float16) * 0.1
        ref32 = F.linear(x.float(), w.float(), b.float())
        lowp = F.linear(x, w, b)
        cands = _candidates(x, w, b)
        plan = cands.pop("_plan", None)
        errors = cands.pop("_errors")
        flop = 2.0 * m * k * n
        shape_rows = []
        for label, fn in cands.items():
            err = _check(fn, ref32, lowp) if label != "dense" else None
            eager, graph, berr = (None, None, err) if err else _bench(fn)
            shape_rows.append(
                _row(
                    meta,
                    bench="sparse24_linear",
                    **{kk: vv for kk, vv in shape.items() if kk != "ff"},
                    backend=label,
                    us_eager=eager,
                    us_graph=graph,
                    tflops_graph=(flop / graph / 1e6 if graph else None),
                    note=(f"error: {berr}" if berr else None),
                    feed_forward=shape["ff"],
                    frac_of_peak=(flop / graph / 1e6 / PEAK_TFLOPS if graph else None),
                    cusparselt_alg=(plan.alg_id if plan is not None and label == "cusparselt_tuned" else None),
                    cusparselt_split_k=(plan.split_k if plan is not None and label == "cusparselt_tuned" else None),
                )
            )
        for backend, why in errors.items():
            shape_rows.append(_row(meta, bench="sparse24_linear", **{kk: vv for kk, vv in shape.items() if kk != "ff"},
                                   backend=backend, note=f"error: {why}", feed_forward=shape["ff"]))
        dense = next(r for r in shape_rows if r["backend"] == "dense")
        for r in shape_rows:
            r["speedup_graph"] = dense["us_graph"] / r["us_graph"] if r.get("us_graph") and dense["us_graph"] else None
            r["speedup_eager"] = dense["us_eager"] / r["us_eager"] if r.get("us_eager") and dense["us_eager"] else None
        sparse = [r for r in shape_rows if r["backend"] != "dense" and r.get("speedup_graph")]
        best = max(sparse, key=lambda r: r["speedup_graph"], default=None)
        for r in shape_rows:
            r["best_sparse_backend"] = best["backend"] if best else None
            r["best_sparse_speedup_graph"] = best["speedup_graph"] if best else None
            r["meets_1p3x_target"] = (best["speedup_graph"] >= 1.3) if (best and shape["ff"]) else None
        rows.extend(shape_rows)
    rows.extend(_diagnosis(meta))
    return rows


def _table(rows: list[dict]) -> str:
    lines = ["| model | layer | M | K | N | backend | us eager | us graph | TFLOP/s | x dense (graph) | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def f(v, fmt):
        return "" if v is None else format(v, fmt)

    for r in rows:
        if r.get("bench") != "sparse24_linear":
            continue
        lines.append(
            f"| {r['model']} | {r['layer']} | {r['M']} | {r['K']} | {r['N']} | {r['backend']} | {f(r['us_eager'], '.1f')} | "
            f"{f(r['us_graph'], '.1f')} | {f(r.get('tflops_graph'), '.0f')} | {f(r.get('speedup_graph'), '.2f')} | "
            f"{r.get('note') or ''} |"
        )
    for r in rows:
        if r.get("bench") == "sparse24_default_path_diagnosis":
            if r.get("backend") == "explanation":
                lines.append(f"\n{r['note']}")
            else:
                lines.append(f"\n- {r['backend']}: eager {f(r['us_eager'], '.1f')} us, graph {f(r['us_graph'], '.1f')} us, "
                             f"host/call {f(r.get('host_us_per_call'), '.1f')} us {r.get('note') or ''}")
    return "\n".join(lines)


def bench(args) -> int:
    """The ``bench`` subcommand (see the module docstring)."""
    from benchmarks.report import write_rows

    t0 = time.time()
    rows = run(quick=args.quick)
    md = _table(rows)
    if args.out is not None:
        write_rows(args.out, "sparse24_bench", rows, md + "\n")
    print(md)
    print(f"\n{len(rows)} rows in {time.time() - t0:.0f} s")
    return 0


# --------------------------------------------------------------------------------------------
# cusparselt: cuSPARSELt's layouts, algorithms and split-K, one process per shape
# --------------------------------------------------------------------------------------------
SPLITS = ((1, -1), (2, 0), (2, 1), (4, 0), (4, 1))  # (split_k, split_k_mode): -1 default, 0 one kernel, 1 two
# torch.backends.cusparselt.get_max_alg_id() knows cuSPARSELt 0.4-0.6 only (None for 0.8.0, torch 2.11's): walk
# the ids up from 0 until the library rejects one.
MAX_ALG_ID = 63


def cusparselt_shapes(which: str) -> list[tuple[str, str, int, int, int]]:
    """(model, layer, M, K, N) of ``benchmarks.sd_shapes.SD_LINEAR_SHAPES``: the feed-forward ones (``"ff"``) or
    all; a GEGLU projection's N is its weight's 2N rows."""
    from benchmarks.sd_shapes import SD_LINEAR_SHAPES

    rows = []
    for model, name, m, k, n, epilogue, _count in SD_LINEAR_SHAPES:
        n_out = 2 * n if epilogue == "geglu" else n
        if which == "all" or "ff" in name:
            rows.append((model, name, m, k, n_out))
    return rows


def _time_us(fn) -> float:
    import triton

    return 1e3 * float(triton.testing.do_bench_cudagraph(fn, rep=20))  # do_bench_cudagraph gives ms


def _rel_err(y, ref) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def _sweep_shape(model: str, name: str, m: int, k: int, n: int, dtypes: list[str], quick: bool = False) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kernels.sparse24 import prune

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.float16)
    w, _ = prune.prune_24_magnitude(torch.randn(n, k, device="cuda", generator=g, dtype=torch.float16) / k**0.5)
    base = dict(model=model, layer=name, M=m, K=k, N=n)
    rows = []
    dense_us = _time_us(lambda: F.linear(x, w))
    rows.append(dict(base, dtype="fp16", backend="dense cuBLAS", us=dense_us))
    for dt in dtypes:
        if dt == "fp16":
            packed = torch._cslt_compress(w)
            xs, scale_kw, ref, dense = x, {}, F.linear(x, w), dense_us
        else:
            f8 = torch.float8_e4m3fn
            sx, sw = x.abs().max().float() / 448, w.abs().max().float() / 448
            x8, w8 = (x.float() / sx).to(f8), (w.float() / sw).to(f8)
            ref = (x8.float() * sx) @ (w8.float() * sw).t()
            try:
                dense = _time_us(functools.partial(torch._scaled_mm, x8, w8.t(), scale_a=sx, scale_b=sw,
                                                   out_dtype=torch.float16, use_fast_accum=True))
                rows.append(dict(base, dtype="fp8", backend="dense _scaled_mm per-tensor fast accum", us=dense))
                packed = torch._cslt_compress(w8)
            except Exception as e:  # noqa: BLE001 - an error row, the sweep goes on
                rows.append(dict(base, dtype="fp8", backend="cusparselt", error=f"{type(e).__name__}: {e}"[:300]))
                continue
            # No alpha: torch passes it as a per-row vector (CUSPARSELT_MATMUL_ALPHA_VECTOR_SCALING), which
            # cuSPARSELt 0.8 rejected on the H200 ("operation not supported", call 2). The unscaled products of
            # E4M3 values overflow fp16, so the result is bf16 and the check scales it by sx * sw afterwards
            # (a layer would fold that scale into the next op).
            xs, scale_kw = x8, dict(out_dtype=torch.bfloat16)
            ref = ref / (sx * sw)
        # Stage 1: the four operand layouts at algorithm 0; stage 2: every algorithm and split-K in the best one.
        operands = {"xT_view": xs.t(), "xT_copy": xs.t().contiguous()}  # the dense operand, made once per dtype
        setting = functools.partial(_run_setting, dict(base, dtype=dt), packed, operands, scale_kw, ref, dense,
                                    dense_us)
        stage1 = [setting(0, 1, -1, bl, tr) for bl in operands for tr in (True, False)]
        rows.extend(stage1)
        timed = [r for r in stage1 if "us" in r]
        if not timed:
            continue
        if quick:
            continue
        best = min(timed, key=lambda r: r["us"])
        layout = (best["b_layout"], best["transpose_result"])
        by_alg = [best]
        for alg in range(1, MAX_ALG_ID + 1):  # until the library rejects the id
            row = setting(alg, 1, -1, *layout)
            rows.append(row)
            if "error" in row and "wrong result" not in row["error"]:
                break
            if "us" in row:
                by_alg.append(row)
        for top in sorted(by_alg, key=lambda r: r["us"])[:3]:  # split-K for the three fastest algorithms
            for split_k, mode in SPLITS[1:]:
                rows.append(setting(top["alg_id"], split_k, mode, *layout))
    return rows


def _run_setting(base, packed, operands, scale_kw, ref, dense, dense_us, alg, split_k, mode, b_layout, transpose_result):
    """One timed, checked ``torch._cslt_sparse_mm`` setting as a row (``error`` set when it fails); ``operands``
    maps each ``b_layout`` name to the dense operand in that layout."""
    import torch

    b = operands[b_layout]
    kw = dict(scale_kw, transpose_result=transpose_result, alg_id=alg, split_k=split_k, split_k_mode=mode)
    row = dict(base, backend="cusparselt", alg_id=alg, split_k=split_k, split_k_mode=mode,
               b_layout=b_layout, transpose_result=transpose_result)
    try:
        y = torch._cslt_sparse_mm(packed, b, **kw)
        row["rel_err"] = _rel_err(y if transpose_result else y.t(), ref)
        if row["rel_err"] > (2e-2 if base["dtype"] == "fp16" else 6e-2):
            raise RuntimeError(f"wrong result: max rel err {row['rel_err']:.3g}")
        row["us"] = _time_us(lambda: torch._cslt_sparse_mm(packed, b, **kw))
        row["speedup_vs_dense_same_dtype"] = dense / row["us"]
        row["speedup_vs_fp16_cublas"] = dense_us / row["us"]
    except Exception as e:  # noqa: BLE001 - an error row, the sweep goes on
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def _env() -> dict:
    import torch
    import triton

    from kernels.sparse24.cusparselt import cusparselt_runtime_version, loaded_libraries

    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                triton=triton.__version__,
                cusparselt_built_with=getattr(torch.backends.cusparselt, "version", lambda: None)(),
                cusparselt_loaded=".".join(map(str, cusparselt_runtime_version() or ())) or None,
                cusparselt_paths=loaded_libraries("libcusparseLt.so"),  # every mapped copy (an LD_PRELOAD: two)
                date=datetime.datetime.now().isoformat(timespec="seconds"))


def cusparselt_summary(rows: list[dict]) -> str:
    """The sweep's markdown: per (shape, dtype) the dense time, the fastest checked 2:4 setting and its speedups;
    a (shape, dtype) without one lists its errors."""
    lines = ["| model | layer | M | K | N | dtype | dense µs | best 2:4 µs | speedup | setting | vs fp16 cuBLAS |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    keys = sorted({(r["model"], r["layer"], r["M"], r["K"], r["N"], r["dtype"]) for r in rows if "dtype" in r},
                  key=lambda t: (t[0], t[1], t[5]))
    for key in keys:
        same = [r for r in rows if (r["model"], r["layer"], r["M"], r["K"], r["N"], r["dtype"]) == key]
        dense = next((r["us"] for r in same if r["backend"] != "cusparselt" and "us" in r), None)
        ok = [r for r in same if r["backend"] == "cusparselt" and "us" in r]
        if not any(r["backend"] == "cusparselt" for r in same):
            continue  # the dense fp16 row of a run that swept another dtype only
        if not ok:
            errs = {r.get("error", "")[:60] for r in same if r["backend"] == "cusparselt"}
            dense_s = "—" if dense is None else f"{dense:.1f}"
            lines.append(f"| {' | '.join(map(str, key))} | {dense_s} | — | — | errors: {'; '.join(sorted(errs))} | — |")
            continue
        best = min(ok, key=lambda r: r["us"])
        setting = (f"alg {best['alg_id']}, split_k {best['split_k']}/{best['split_k_mode']}, {best['b_layout']}, "
                   f"transpose_result={best['transpose_result']}")
        lines.append(f"| {' | '.join(map(str, key))} | {dense:.1f} | {best['us']:.1f} | "
                     f"{best['speedup_vs_dense_same_dtype']:.2f}x | {setting} | {best['speedup_vs_fp16_cublas']:.2f}x |")
    return "\n".join(lines) + "\n"


def cusparselt(args) -> int:
    """The ``cusparselt`` subcommand (see the module docstring): each shape in a child process of this module
    (``--one``), or, with ``--one``, that one shape's rows as one JSON line on stdout."""
    dtypes = args.dtypes.split(",")
    if args.one:
        model, name, m, k, n = args.one.split(",")
        print(json.dumps(_sweep_shape(model, name, int(m), int(k), int(n), dtypes, args.quick)))
        return 0
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for model, name, m, k, n in cusparselt_shapes(args.shapes):
        cmd = [sys.executable, "-m", "benchmarks.ops.sparse24", "cusparselt", "--out", str(out), "--dtypes",
               args.dtypes, "--one", f"{model},{name},{m},{k},{n}"] + (["--quick"] if args.quick else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.shape_timeout, check=False)
            got = json.loads(proc.stdout.strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            got = [dict(model=model, layer=name, M=m, K=k, N=n, dtype="?", backend="cusparselt",
                        error=f"timed out after {args.shape_timeout} s")]
        except (IndexError, json.JSONDecodeError):
            got = [dict(model=model, layer=name, M=m, K=k, N=n, dtype="?", backend="cusparselt",
                        error=f"process rc={proc.returncode}: {proc.stderr.strip()[-300:]}")]
        rows.extend(got)
        print(f"[sweep] {model} {name}: {len(got)} rows", file=sys.stderr)
        (out / "sweep_cusparselt.json").write_text(json.dumps(dict(env=_env(), rows=rows), indent=1))
    md = cusparselt_summary(rows)
    (out / "sweep_cusparselt.md").write_text(md)
    print(md)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ops.sparse24", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("bench", help="every 2:4 backend against dense cuBLAS at SD's linear shapes")
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--out", type=Path, default=None, help="write sparse24_bench.json/.md here")
    p.set_defaults(fn=bench)
    p = sub.add_parser("cusparselt", help="cuSPARSELt's layouts, algorithms and split-K against dense, per shape")
    p.add_argument("--out", type=Path, required=True, help="write sweep_cusparselt.json/.md here")
    p.add_argument("--shapes", default="ff", choices=("ff", "all"))
    p.add_argument("--dtypes", default="fp16,fp8")
    p.add_argument("--quick", action="store_true", help="stage 1 only: the four layouts at algorithm 0")
    p.add_argument("--shape-timeout", dest="shape_timeout", type=float, default=120.0,
                   help="seconds one shape's process may take (a hung setting costs that shape, not the sweep)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: "model,name,M,K,N" in this process
    p.set_defaults(fn=cusparselt)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
