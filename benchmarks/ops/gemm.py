"""GEMM kernels at every SD1.5 / SDXL UNet linear shape (fp16 activations; GPU only).

``run(quick=False) -> list[dict]`` (GPU only; nothing runs at import). One row per (shape, backend):

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
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

import torch
import torch.nn.functional as F

PEAK_TFLOPS = 739.0  # dense fp16 matmul ceiling measured with torch.matmul on the benchmark's GPU (sm_90)
_LEAD = ("bench", "model", "layer", "M", "K", "N", "backend", "us", "tflops", "x_cublas", "us_eager", "rel_err", "note")


def _row(meta: dict, **fields) -> dict:
    row = {k: fields.pop(k, None) for k in _LEAD}
    row.update(fields)
    row.update(meta)
    return row


def _meta() -> dict:
    import triton

    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                triton=triton.__version__, dtype="float16", group_size=128, peak_tflops=PEAK_TFLOPS)


def _bench(fn, quick: bool) -> tuple[float | None, float | None, str | None]:
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
    """Benchmark every backend at every shape; returns rows (see the module docstring)."""
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


__all__ = ["run"]
