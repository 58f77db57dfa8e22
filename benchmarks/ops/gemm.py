"""GEMM benchmarks (``kernels/gemm/``), one CLI (GPU only; nothing runs at import):

    python -m benchmarks.ops.gemm bench [--quick] [--out DIR]
    python -m benchmarks.ops.gemm tma [--out DIR] [--only sd15]

``bench``: the GEMM kernels at every SD1.5 / SDXL UNet linear shape (``benchmarks.sd_shapes.SD_LINEAR_SHAPES``;
fp16 activations), the ``gemm`` section of ``benchmarks.bench_kernels`` (``run``), written here to
``gemm_bench.json`` / ``.md`` in ``--out``. One row per (shape, backend):

- ``cublas_fp16``: ``F.linear(x, W, b)`` (for GEGLU shapes the 2N-row GEMM alone, no activation).
- ``cublas_fp16+geglu_eager`` (GEGLU shapes): ``F.linear`` then ``chunk`` + ``gelu`` + ``mul`` as diffusers runs it.
- ``w8a8_int8``: per-token quantize kernel + int8 GEMM with dequant epilogue (SmoothQuant, smoothing fused);
  ``w8a8_int8_gemm_only``: the int8 GEMM on pre-quantized activations; ``torch_int_mm``: ``torch._int_mm``
  on the same operands (int32 out, no dequant) for reference.
- ``w8a8_fp8``: the same with E4M3 (sm_89+). ``fp8_scaled_mm_rowwise``: our per-token FP8 quantize kernel,
  then ``torch._scaled_mm`` with row-wise (per-token x per-channel) scales and the bias (cuBLASLt/CUTLASS);
  ``..._gemm_only`` on pre-quantized activations. A candidate backend, measured before any switch.
  ``fp8_scaled_mm_tensorwise[_fast_accum]_gemm_only``: ``torch._scaled_mm`` with one static scale per
  tensor on pre-quantized activations (with fast accumulation: no fp32 promotion in cuBLASLt's K loop).
  ``w8a8_fp8_static``: what ``W8A8StaticLinear`` runs per call: the static quantize kernel, then that GEMM
  with fast accumulation (``kernels.gemm.fp8_static``).
- ``w4a16_triton`` / ``w4a16_csrc``: packed int4, group_size 128, dequantized in the main loop (``w4a16_csrc``: the
  CUDA C++ cp.async / mma.sync kernel of ``kernels/csrc``, built in a background thread at the start; a row says so
  if the build fails).
- ``int8_outlier``: LLM.int8() with a fixed outlier mask of 8 columns (as after calibration).

Times: ``us`` = ``triton.testing.do_bench_cudagraph`` median (kernels replayed in a CUDA graph, as sdfast
runs the UNet); ``us_eager`` = ``do_bench`` median (includes host launch overhead when the host is slower).
``tflops`` = 2·M·K·N_w / us (N_w: weight rows; dense-equivalent for quantized kernels), against the
739 TFLOP/s ceiling; ``x_cublas`` = cuBLAS us / our us (> 1: faster than cuBLAS). ``rel_err``: relative
L2 error against the fp32 product of the unquantized weights (the quantization error for quantized
backends). Rows with ``layer == "UNET TOTAL"`` add up count × us over one UNet forward per model.
A backend that fails on a shape gives a row whose ``note`` starts with ``error:``.

``SDFAST_GEMM_BACKENDS`` (environment, a regular expression): only backends whose name matches it run
(``cublas_fp16`` always runs: the rows are compared with it). Each row is printed to stderr as it is
measured, so a run cut short by a time limit still shows what it measured.

``tma``: the TMA linear GEMM's tile configs against cuBLAS. For each projection of the two UNets (``TMA_SHAPES``;
fp16, batch 2 with CFG: M tokens, K in, N out, with its bias): ``cublas`` (``F.linear``) and every config of
:func:`tma_grid` of :func:`kernels.gemm.linear_tma.linear_tma`; for the 1x1 ``proj_out`` shapes also with the
residual: ``cublas`` is then what the engine runs today (``F.linear`` without bias, then ``bias_residual_add`` on
the channels_last residual). Each timed in a CUDA graph (``triton.testing.do_bench_cudagraph``, median), checked
against ``linear_ref`` (max abs error). ``--only``: the shapes whose model contains it. Writes
``DIR/linear_tma.json`` (GPU, versions, date) and ``DIR/linear_tma.md`` (default ``DIR``: ``out/linear_tma``);
prints one line per shape.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PEAK_TFLOPS = 739.0  # dense fp16 matmul ceiling measured with torch.matmul on the benchmark's GPU (sm_90)
_LEAD = ("bench", "model", "layer", "M", "K", "N", "backend", "us", "tflops", "x_cublas", "us_eager", "rel_err", "note")


# --------------------------------------------------------------------------------------------
# bench: every backend at SD's linear shapes
# --------------------------------------------------------------------------------------------
def _row(meta: dict, **fields) -> dict:
    row = {k: fields.pop(k, None) for k in _LEAD}
    row.update(fields)
    row.update(meta)
    return row


def _meta() -> dict:
    import torch
    import triton

    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                triton=triton.__version__, dtype="float16", group_size=128, peak_tflops=PEAK_TFLOPS)


def _bench(fn, quick: bool) -> tuple[float | None, float | None, str | None]:
    import torch
    from triton.testing import do_bench, do_bench_cudagraph

    fn()  # autotune / first-call work outside the timed region and the graph capture
    torch.cuda.synchronize()
    eager = do_bench(fn, warmup=5, rep=10 if quick else 20, return_mode="median") * 1e3
    try:
        graph = do_bench_cudagraph(fn, rep=10 if quick else 20, return_mode="median") * 1e3
    except Exception as e:  # noqa: BLE001 - reported in the row
        return eager, None, f"graph capture: {type(e).__name__}: {e}"[:300]
    return eager, graph, None


def _start_csrc_build() -> dict:
    """Build the CUDA C++ extension in a background thread (compilation runs in subprocesses)."""
    state: dict = {}

    def work():
        t0 = time.perf_counter()
        try:
            from kernels.csrc.build import backend

            state["backend"] = backend()
        except Exception as e:  # noqa: BLE001
            state["error"] = f"{type(e).__name__}: {e}"[-600:]
        state["build_s"] = time.perf_counter() - t0

    th = threading.Thread(target=work, daemon=True)
    th.start()
    state["thread"] = th
    return state


def _candidates(shape: dict, phase: str, csrc_state: dict, device: str = "cuda") -> dict:
    """backend name -> (callable, reference kind) for one shape; operands built once per shape.

    ``phase="main"``: everything but the CUDA C++ kernels; ``phase="csrc"``: those (run last, after the
    background build, so the build overlaps the main phase)."""
    import torch
    import torch.nn.functional as F

    from kernels.gemm.int8_outlier import int8_outlier_linear
    from kernels.gemm.w4a16 import quantize_w4, w4a16_linear
    from kernels.gemm.w8a8 import quantize_per_token, quantize_weight_per_channel, w8a8_gemm, w8a8_linear

    M, K, N, epi = shape["M"], shape["K"], shape["N"], shape["epilogue"]
    rows = 2 * N if epi == "geglu" else N
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, device=device, generator=g).half()
    w32 = torch.randn(rows, K, device=device, generator=g) / K**0.5
    w = w32.half()
    b = torch.randn(rows, device=device, generator=g).half() * 0.1
    smooth = (torch.rand(K, device=device, generator=g) + 0.5)
    qw8, ws8 = quantize_weight_per_channel(w32 / smooth, torch.int8)
    qa8, sa8 = quantize_per_token(x, smooth)
    qw4, s4, z4 = quantize_w4(w32, 128, scale_dtype=torch.float16)
    mask = torch.zeros(K, dtype=torch.bool, device=device)
    mask[torch.randperm(K, device=device, generator=g)[:8]] = True
    ref_gemm = x.float() @ w32.t() + b.float()
    if epi == "geglu":
        h, gate = ref_gemm.chunk(2, dim=-1)
        ref_fused = h * F.gelu(gate)
    else:
        ref_fused = ref_gemm
    refs = {"_refs": {"gemm": ref_gemm, "fused": ref_fused}}
    if phase == "csrc":
        th = csrc_state.get("thread")
        if th is not None:
            th.join()
        if "backend" not in csrc_state:
            return {**refs, "w4a16_csrc": (None, f"error: csrc build failed: {csrc_state.get('error')}")}
        from kernels.csrc.build import gemm_w4a16

        return {**refs, "w4a16_csrc": (lambda: gemm_w4a16(x, qw4, s4, z4, b, group_size=128), "gemm")}
    c: dict = {
        "cublas_fp16": (lambda: F.linear(x, w, b), "gemm"),
    }
    if epi == "geglu":
        def eager_geglu():
            h, gate = F.linear(x, w, b).chunk(2, dim=-1)
            return h * F.gelu(gate)

        c["cublas_fp16+geglu_eager"] = (eager_geglu, "fused")
    c["w8a8_int8"] = (lambda: w8a8_linear(x, qw8, ws8, b, smooth=smooth), "gemm")
    c["w8a8_int8_gemm_only"] = (lambda: w8a8_gemm(qa8, qw8, sa8, ws8, b, out_dtype=torch.float16), "gemm")
    if M > 16 and K % 8 == 0 and rows % 8 == 0:
        qw8t = qw8.t()
        c["torch_int_mm"] = (lambda: torch._int_mm(qa8, qw8t), "int32")
    if device == "cpu" or torch.cuda.get_device_capability() >= (8, 9):
        qf8, wsf8 = quantize_weight_per_channel(w32 / smooth, torch.float8_e4m3fn)
        c["w8a8_fp8"] = (lambda: w8a8_linear(x, qf8, wsf8, b, smooth=smooth), "gemm")
        if device == "cuda" and K % 16 == 0 and rows % 16 == 0:
            # cuBLASLt/CUTLASS FP8 with row-wise scales (torch._scaled_mm): a candidate W8A8 FP8 backend
            qa_f8, sa_f8 = quantize_per_token(x, smooth, torch.float8_e4m3fn)
            wt_f8, sw = qf8.t(), wsf8.view(1, -1)

            def fp8_scaled_mm(gemm_only=False):
                qa, sa = (qa_f8, sa_f8) if gemm_only else quantize_per_token(x, smooth, torch.float8_e4m3fn)
                return torch._scaled_mm(qa, wt_f8, scale_a=sa.view(-1, 1), scale_b=sw, bias=b,
                                        out_dtype=torch.float16)

            c["fp8_scaled_mm_rowwise"] = (fp8_scaled_mm, "gemm")
            c["fp8_scaled_mm_rowwise_gemm_only"] = (lambda: fp8_scaled_mm(True), "gemm")
            c.update(_tensorwise_fp8(x, w32, b))
    c["w4a16_triton"] = (lambda: w4a16_linear(x, qw4, s4, z4, b, group_size=128), "gemm")
    qo, wso = quantize_weight_per_channel(w32, torch.int8)
    c["int8_outlier"] = (lambda: int8_outlier_linear(x, qo, wso, b, outlier_mask=mask), "gemm")
    return {**refs, **c}


def _tensorwise_fp8(x: torch.Tensor, w32: torch.Tensor, b: torch.Tensor) -> dict:
    """``torch._scaled_mm`` with one static scale per tensor (activation scale from calibration, as
    TensorRT's FP8 SD recipes do), on activations already in E4M3 (a producer kernel would write them):
    the GEMM alone, with and without cuBLASLt's fast (non-promoted) fp8 accumulation."""
    import torch

    f8 = torch.float8_e4m3fn
    sa = (x.float().abs().amax() / 448.0).reshape(())
    sw = (w32.abs().amax() / 448.0).reshape(())
    qa = (x.float() / sa).clamp(-448, 448).to(f8)
    qwt = (w32 / sw).clamp(-448, 448).to(f8).t()

    def gemm(fast: bool) -> torch.Tensor:
        return torch._scaled_mm(qa, qwt, scale_a=sa, scale_b=sw, bias=b, out_dtype=torch.float16, use_fast_accum=fast)

    from kernels.gemm.fp8_static import fp8_linear, quantize_static

    inv, qw = (1.0 / sa).reshape(()), qwt.t()

    def static_linear() -> torch.Tensor:  # what W8A8StaticLinear runs: our quantize kernel, then cuBLASLt
        return fp8_linear(quantize_static(x, inv), qw, sa, sw, b, out_dtype=torch.float16)

    return {"fp8_scaled_mm_tensorwise_gemm_only": (lambda: gemm(False), "gemm"),
            "fp8_scaled_mm_tensorwise_fast_accum_gemm_only": (lambda: gemm(True), "gemm"),
            "w8a8_fp8_static": (static_linear, "gemm")}


def _shapes(quick: bool) -> list[dict]:
    from benchmarks.sd_shapes import SD_LINEAR_SHAPES

    out = [dict(model=m, layer=n, M=M, K=K, N=N, epilogue=e, count=c) for m, n, M, K, N, e, c in SD_LINEAR_SHAPES]
    if quick:
        keep = {("sd15", "l0.attn_qkvo"), ("sd15", "l0.ff_geglu"), ("sdxl", "l2.attn_qkvo_proj"), ("sdxl", "l2.ff_out")}
        out = [s for s in out if (s["model"], s["layer"]) in keep]
    return out


def _selected(cands: dict) -> dict:
    """``cands`` limited to ``SDFAST_GEMM_BACKENDS`` (a regular expression; cuBLAS fp16 always kept)."""
    pattern = os.environ.get("SDFAST_GEMM_BACKENDS")
    if not pattern:
        return cands
    return {k: v for k, v in cands.items() if k == "cublas_fp16" or re.search(pattern, k)}


def run(quick: bool = False) -> list[dict]:
    """The ``gemm`` section of the kernel suite: every backend at every shape; returns rows (see the module
    docstring); one skip row without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return [_row({}, bench="gemm", note="skipped: needs a CUDA GPU")]
    meta = _meta()
    t_start = time.perf_counter()
    want_csrc = bool(_selected({"w4a16_csrc": 1}).keys() - {"cublas_fp16"})
    csrc_state = _start_csrc_build() if want_csrc else {}
    rows: list[dict] = []
    totals: dict[tuple[str, str], float] = {}
    cublas_us: dict[tuple[str, str], float] = {}
    phases = ("main", "csrc") if want_csrc else ("main",)
    for phase, shape in [(ph, s) for ph in phases for s in _shapes(quick)]:
        M, K, N, epi = shape["M"], shape["K"], shape["N"], shape["epilogue"]
        n_w = 2 * N if epi == "geglu" else N
        flop = 2.0 * M * K * n_w
        with torch.no_grad():
            cands = _candidates(shape, phase, csrc_state)
        refs = cands.pop("_refs")
        shape_rows = []
        for name, (fn, kind) in _selected(cands).items():
            base = dict(bench="gemm", model=shape["model"], layer=shape["layer"], M=M, K=K, N=n_w, backend=name,
                        epilogue=epi, count=shape["count"])
            if fn is None:
                shape_rows.append(_row(meta, **base, note=kind))
                continue
            try:
                with torch.no_grad():
                    out = fn()
                    rel = None
                    if kind in refs:
                        ref = refs[kind]
                        rel = ((out.float() - ref).norm() / ref.norm()).item()
                eager, graph, err = _bench(fn, quick)
            except Exception as e:  # noqa: BLE001 - one row per failure
                shape_rows.append(_row(meta, **base, note=f"error: {type(e).__name__}: {e}"[:400]))
                continue
            us = graph if graph is not None else eager
            shape_rows.append(_row(meta, **base, us=us, us_eager=eager, tflops=flop / us / 1e6 if us else None,
                                   frac_of_peak=flop / us / 1e6 / PEAK_TFLOPS if us else None, rel_err=rel, note=err))
            print(f"[gemm] {shape['model']} {shape['layer']} {M}x{K}x{n_w} {name}: {us:.2f} us, rel_err {rel}",
                  file=sys.stderr, flush=True)
        skey = (shape["model"], shape["layer"])
        cub = next((r["us"] for r in shape_rows if r["backend"] == "cublas_fp16" and r["us"]), None)
        if cub:
            cublas_us[skey] = cub
        cub = cublas_us.get(skey)
        for r in shape_rows:
            if r["us"] and cub:
                r["x_cublas"] = cub / r["us"]
            if r["us"]:
                key = (shape["model"], r["backend"])
                totals[key] = totals.get(key, 0.0) + shape["count"] * r["us"]
        rows.extend(shape_rows)
        torch.cuda.empty_cache()
    # count-weighted totals over one UNet forward (the listed linears)
    for model in dict.fromkeys(s["model"] for s in _shapes(quick)):
        cub = totals.get((model, "cublas_fp16"))
        for (m, backend), us in totals.items():
            if m == model:
                rows.append(_row(meta, bench="gemm", model=model, layer="UNET TOTAL", backend=backend, us=us,
                                 x_cublas=cub / us if cub else None,
                                 note="sum of count x us over the listed linears of one UNet forward"))
    if "build_s" in csrc_state:
        rows.append(_row(meta, bench="gemm", layer="csrc build", backend="csrc", us=None,
                         note=f"build {csrc_state['build_s']:.0f} s" + (f"; error: {csrc_state['error']}" if "error" in csrc_state else "")))
    for r in rows:
        r["section_wall_s"] = time.perf_counter() - t_start
    return rows


def bench(args) -> int:
    """The ``bench`` subcommand (see the module docstring)."""
    from benchmarks.report import markdown_table, write_rows

    rows = run(args.quick)
    md = "\n".join(["# GEMM backends (fp16 activations)", "", markdown_table(rows, _LEAD)])
    if args.out is not None:
        write_rows(args.out, "gemm_bench", rows, md + "\n")
    print(md)
    return 0


# --------------------------------------------------------------------------------------------
# tma: the TMA linear GEMM's tile configs against cuBLAS
# --------------------------------------------------------------------------------------------
# (model, name, M, K, N, residual, count per UNet step)
TMA_SHAPES = (
    ("sd15", "l0 proj/out/q", 8192, 320, 320, False, 21), ("sd15", "l0 qkv", 8192, 320, 960, False, 5),
    ("sd15", "l0 ff.out", 8192, 1280, 320, False, 5), ("sd15", "l0 proj_out+res", 8192, 320, 320, True, 5),
    ("sd15", "l1 proj/out/q", 2048, 640, 640, False, 21), ("sd15", "l1 qkv", 2048, 640, 1920, False, 5),
    ("sd15", "l1 ff.out", 2048, 2560, 640, False, 5), ("sd15", "l1 proj_out+res", 2048, 640, 640, True, 5),
    ("sd15", "l2 proj/out/q", 512, 1280, 1280, False, 21), ("sd15", "l2 qkv", 512, 1280, 3840, False, 5),
    ("sd15", "l2 ff.out", 512, 5120, 1280, False, 5),
    ("sdxl", "l1 out/q", 8192, 640, 640, False, 30), ("sdxl", "l1 qkv", 8192, 640, 1920, False, 10),
    ("sdxl", "l1 ff.out", 8192, 2560, 640, False, 10),
    ("sdxl", "l2 out/q", 2048, 1280, 1280, False, 130), ("sdxl", "l2 qkv", 2048, 1280, 3840, False, 70),
    ("sdxl", "l2 ff.out", 2048, 5120, 1280, False, 70),
)


def tma_grid():
    """The tile configs timed: 8 tiles (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps), persistent or one program
    per tile."""
    from kernels.gemm.linear_tma import LinearTile

    tiles = [(128, 64, 64, 3, 4), (128, 64, 64, 4, 4), (128, 128, 64, 3, 8), (128, 128, 64, 4, 4), (64, 128, 64, 3, 4),
             (64, 64, 64, 4, 4), (256, 64, 64, 3, 8), (128, 256, 64, 3, 8)]
    return [LinearTile(*t, persistent=p) for t in tiles for p in (True, False)]


def _graph_us(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=40) * 1e3


def tma_rows(only: str | None = None) -> list[dict]:
    """The ``tma`` subcommand's rows, one per shape of ``TMA_SHAPES`` whose model contains ``only``."""
    import torch
    import torch.nn.functional as F

    from kernels.elementwise import bias_residual_add
    from kernels.gemm.linear_tma import linear_ref, linear_tma

    rows = []
    for model, name, m, k, n, residual, count in TMA_SHAPES:
        if only and only not in model:
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g)
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).half()
        b = (torch.randn(n, device="cuda", generator=g) * 0.1).half()
        r = torch.randn(m, n, device="cuda", dtype=torch.float16, generator=g) if residual else None
        ref = linear_ref(x, w, b, r).float()
        row = dict(model=model, layer=name, M=m, K=k, N=n, residual=residual, count=count)
        if residual:  # the engine's path: bias-free GEMM, then bias + residual in one pass over NHWC memory
            hw = int((m // 2) ** 0.5)
            r4 = r.view(2, hw, hw, n).permute(0, 3, 1, 2)

            def cublas():
                return bias_residual_add(F.linear(x, w).view(2, hw, hw, n).permute(0, 3, 1, 2), b, r4)
            row["cublas_err"] = float((cublas().permute(0, 2, 3, 1).reshape(m, n).float() - ref).abs().max())
        else:
            def cublas():
                return F.linear(x, w, b)
            row["cublas_err"] = float((cublas().float() - ref).abs().max())
        row["cublas_us"] = _graph_us(cublas)
        row["configs"] = {}
        for c in tma_grid():
            try:
                err = float((linear_tma(x, w, b, r, c).float() - ref).abs().max())
                row["configs"][str(c)] = dict(us=_graph_us(lambda c=c: linear_tma(x, w, b, r, c)), err=err)
            except Exception as e:  # noqa: BLE001 - recorded: a config that does not compile or fit here
                row["configs"][str(c)] = dict(us=None, error=f"{type(e).__name__}: {str(e)[:200]}")
        ok = {cfg: v["us"] for cfg, v in row["configs"].items() if v.get("us")}
        row["best"] = min(ok, key=ok.get) if ok else None
        row["best_us"] = ok[row["best"]] if ok else None
        rows.append(row)
        print(f"{model} {name} M={m} K={k} N={n}: cuBLAS {row['cublas_us']:.2f} us, best TMA "
              f"{row['best_us'] and round(row['best_us'], 2)} us {row['best']}", flush=True)
    return rows


def tma_markdown(rows: list[dict]) -> str:
    out = ["| model | layer | M | K | N | cuBLAS µs | best TMA µs | TMA / cuBLAS | config | x per step |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = r["best_us"] / r["cublas_us"] if r["best_us"] else None
        out.append(f"| {r['model']} | {r['layer']} | {r['M']} | {r['K']} | {r['N']} | {r['cublas_us']:.2f} | "
                   f"{r['best_us'] and round(r['best_us'], 2)} | {ratio and round(ratio, 2)} | {r['best']} | {r['count']} |")
    return "\n".join(out)


def tma(args) -> int:
    """The ``tma`` subcommand (see the module docstring)."""
    from benchmarks.report import write_sweep

    rows = tma_rows(args.only)
    print(tma_markdown(rows))
    write_sweep(args.out, "linear_tma", rows, tma_markdown(rows))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ops.gemm", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("bench", help="every GEMM backend (fp16, 8-bit, 4-bit) at SD's linear shapes")
    p.add_argument("--quick", action="store_true", help="4 shapes, fewer repetitions")
    p.add_argument("--out", type=Path, default=None, help="write gemm_bench.json/.md here")
    p.set_defaults(fn=bench)
    tp = sub.add_parser("tma", help="the TMA linear GEMM's tile configs against cuBLAS at SD's linear shapes")
    tp.add_argument("--out", default="out/linear_tma", help="write linear_tma.json/.md here (default: %(default)s)")
    tp.add_argument("--only", default=None, help="sd15 or sdxl: the shapes whose model contains it")
    tp.set_defaults(fn=tma)
    args = ap.parse_args(argv)
    models = list(dict.fromkeys(m for m, *_ in TMA_SHAPES))
    if args.command == "tma" and args.only is not None and not any(args.only in m for m in models):
        tp.error(f"--only {args.only!r} matches no model of TMA_SHAPES ({', '.join(models)})")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
