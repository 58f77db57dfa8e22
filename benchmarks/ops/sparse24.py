"""2:4 sparse linear vs dense cuBLAS at every SD1.5 / SDXL transformer linear shape (fp16).

``run(quick=False) -> list[dict]`` (GPU only; nothing runs at import). One row per (shape, backend):

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
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

PEAK_TFLOPS = 739.0  # the measured bf16 matmul ceiling of the H200


_LEAD = ("bench", "model", "layer", "M", "K", "N", "backend", "us_graph", "tflops_graph", "speedup_graph", "us_eager", "note")


def _row(meta: dict, **fields) -> dict:
    """Keys in a fixed order (the kernel table prints the first 12), metadata last. ``note`` holds
    ``"error: ..."`` for a backend that failed, or the diagnosis explanation."""
    row = {k: fields.pop(k, None) for k in _LEAD}
    row.update(fields)
    row.update(meta)
    return row


def _shapes(quick: bool) -> list[dict]:
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
    import triton

    try:
        cslt = torch.backends.cusparselt.version()
    except Exception:  # pragma: no cover - GPU only
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
    from triton.testing import do_bench, do_bench_cudagraph

    try:
        fn()
        torch.cuda.synchronize()
        eager = do_bench(fn, warmup=5, rep=25, return_mode="median") * 1000.0
    except Exception as e:
        return None, None, f"{type(e).__name__}: {e}"[:300]
    try:
        graph = do_bench_cudagraph(fn, rep=10, return_mode="median") * 1000.0
    except Exception as e:
        return eager, None, f"graph capture: {type(e).__name__}: {e}"[:300]
    return eager, graph, None


def _host_us_per_call(fn, n: int = 50) -> float:
    """Wall time per call of ``n`` calls issued back to back (then one sync): max(host, GPU) per call."""
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
    from kernels.sparse24 import cusparselt as cslt, format as fmt, kernel as k24

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
        except Exception as e:
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
        except Exception as e:
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
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:300]
    err = (y.float() - ref32).abs().max().item()
    base = (lowp.float() - ref32).abs().max().item()
    tol = 2 * base + 1e-2
    if not (err <= tol):
        return f"wrong result: max|y - ref32| = {err:.3e} > {tol:.3e}"
    return None


def _diagnosis(meta: dict) -> list[dict]:
    """Why torch's default path is slower than dense at 8192 x 320 -> 2560: its parts, timed one by one."""
    from kernels.sparse24 import cusparselt as cslt, prune

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
            except Exception:
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
    """Benchmark rows (see module docstring). Needs CUDA; raises RuntimeError without it."""
    if not torch.cuda.is_available():
        raise RuntimeError("benchmarks.kernel_benches.sparse needs a CUDA GPU")
    from kernels.sparse24 import prune

    meta = _meta()
    rows: list[dict] = []
    torch.manual_seed(0)
    for shape in _shapes(quick):
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


if __name__ == "__main__":  # pragma: no cover - GPU only
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    t0 = time.time()
    result = run(quick=args.quick)
    print(_table(result))
    print(f"\n{len(result)} rows in {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
