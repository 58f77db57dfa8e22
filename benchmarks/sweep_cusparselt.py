"""cuSPARSELt's settings (a staged sweep), at every SD1.5 / SDXL linear shape, against dense cuBLAS (issue 8).

    python -m benchmarks.sweep_cusparselt --out DIR [--shapes ff|all] [--dtypes fp16,fp8] [--quick]

cuSPARSELt's own search (``cusparseLtMatmulSearch``) broke the CUDA context on the H200, so this
walks the settings by hand, each timed in a CUDA graph (``triton.testing.do_bench_cudagraph``, median):

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
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPLITS = ((1, -1), (2, 0), (2, 1), (4, 0), (4, 1))  # (split_k, split_k_mode): -1 default, 0 one kernel, 1 two
# torch.backends.cusparselt.get_max_alg_id() knows cuSPARSELt 0.4-0.6 only (None for 0.8.0, torch 2.11's): walk
# the ids up from 0 until the library rejects one.
MAX_ALG_ID = 63


def _shapes(which: str) -> list[tuple[str, str, int, int, int]]:
    from benchmarks.sd_shapes import SD_LINEAR_SHAPES

    rows = []
    for model, name, m, k, n, epilogue, _count in SD_LINEAR_SHAPES:
        n_out = 2 * n if epilogue == "geglu" else n
        if which == "all" or "ff" in name:
            rows.append((model, name, m, k, n_out))
    return rows


def _prune_24(w):
    import torch

    g = w.reshape(-1, 4)
    keep = g.abs().topk(2, dim=1).indices
    mask = torch.zeros_like(g, dtype=torch.bool).scatter_(1, keep, True)
    return (g * mask).reshape(w.shape)


def _time_us(fn) -> float:
    import triton

    return 1e3 * float(triton.testing.do_bench_cudagraph(fn, rep=20))  # do_bench_cudagraph gives ms


def _rel_err(y, ref) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def _sweep_shape(model: str, name: str, m: int, k: int, n: int, dtypes: list[str], quick: bool = False) -> list[dict]:
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.float16)
    w = _prune_24(torch.randn(n, k, device="cuda", generator=g, dtype=torch.float16) / k**0.5)
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
                dense = _time_us(lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.float16,
                                                          use_fast_accum=True))
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
        run = functools.partial(_run_setting, dict(base, dtype=dt), packed, operands, scale_kw, ref, dense, dense_us)
        stage1 = [run(0, 1, -1, bl, tr) for bl in operands for tr in (True, False)]
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
            row = run(alg, 1, -1, *layout)
            rows.append(row)
            if "error" in row and "wrong result" not in row["error"]:
                break
            if "us" in row:
                by_alg.append(row)
        for top in sorted(by_alg, key=lambda r: r["us"])[:3]:  # split-K for the three fastest algorithms
            for split_k, mode in SPLITS[1:]:
                rows.append(run(top["alg_id"], split_k, mode, *layout))
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


def _summary(rows: list[dict]) -> str:
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="ff", choices=("ff", "all"))
    p.add_argument("--dtypes", default="fp16,fp8")
    p.add_argument("--quick", action="store_true", help="stage 1 only: the four layouts at algorithm 0")
    p.add_argument("--shape-timeout", dest="shape_timeout", type=float, default=120.0,
                   help="seconds one shape's process may take (a hung setting costs that shape, not the sweep)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: "model,name,M,K,N" in this process
    a = p.parse_args(argv)
    dtypes = a.dtypes.split(",")
    if a.one:
        model, name, m, k, n = a.one.split(",")
        print(json.dumps(_sweep_shape(model, name, int(m), int(k), int(n), dtypes, a.quick)))
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for model, name, m, k, n in _shapes(a.shapes):
        cmd = [sys.executable, "-m", "benchmarks.sweep_cusparselt", "--out", a.out, "--dtypes", a.dtypes,
               "--one", f"{model},{name},{m},{k},{n}"] + (["--quick"] if a.quick else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.shape_timeout)
            got = json.loads(proc.stdout.strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            got = [dict(model=model, layer=name, M=m, K=k, N=n, dtype="?", backend="cusparselt",
                        error=f"timed out after {a.shape_timeout} s")]
        except (IndexError, json.JSONDecodeError):
            got = [dict(model=model, layer=name, M=m, K=k, N=n, dtype="?", backend="cusparselt",
                        error=f"process rc={proc.returncode}: {proc.stderr.strip()[-300:]}")]
        rows.extend(got)
        print(f"[sweep] {model} {name}: {len(got)} rows", file=sys.stderr)
        (out / "sweep_cusparselt.json").write_text(json.dumps(dict(env=_env(), rows=rows), indent=1))
    md = _summary(rows)
    (out / "sweep_cusparselt.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
