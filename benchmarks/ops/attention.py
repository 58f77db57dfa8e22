"""Attention benchmarks, one CLI (GPU only; nothing runs at import):

    python -m benchmarks.ops.attention bench [--quick] [--out DIR]
    python -m benchmarks.ops.attention sweep --out DIR [--quick] [--only LABELS]

``bench``: the attention backends at every attention shape of SD1.5 512², SDXL 1024² and their VAE (fp16); the
``attention`` section of ``benchmarks.bench_kernels`` (``run``), written here to ``attention_bench.json`` / ``.md``
in ``--out``. Shapes are what ``sdfast.passes.attention.SdfastAttnProcessor`` hands the dispatcher: q/k/v are
(B, H, L, D) strided views of the fused projection output (B, L, 3|2, H, D); UNet batch 2 (CFG), VAE batch 1.

One row per (shape, backend), backends: ``sdpa`` (SDPA's own choice = stock diffusers), ``cudnn``,
``flash``, ``efficient``, ``math`` (SDPA forced), ``xformers`` (if it works), ``triton`` (ours), and
``dispatcher`` (an ``AttentionDispatcher`` after its warm-up measurement, i.e. what the pass runs). All
with ``upcast=False``, as the processor calls them: the VAE's ``upcast_softmax`` asks for the fp32
softmax that every backend already does (see ``SdfastAttnProcessor``). Columns:

- ``us``: ``triton.testing.do_bench_cudagraph`` median, calls replayed in a CUDA graph (how sdfast
  runs the UNet); ``us_eager``: ``triton.testing.do_bench`` median (host overhead included).
- ``tflops``: 4·B·H·Lq·Lk·D FLOP / ``us`` (ceiling: 739 TFLOP/s measured bf16 matmul).
- ``picked``: the dispatcher's choice for the shape (same on every row of the shape).
- ``x_best``: ``us`` / best single backend's ``us`` on the shape; on the ``triton`` row this is
  ours/best, on the ``dispatcher`` row dispatcher/best.
- ``note``: ``error: ...`` for a backend that raised or gave a wrong answer (never dropped).

Targets (issue 4): dispatcher x_best <= 1.0 everywhere, up to timing noise (two medians of the same
kernel differ by up to ~3 %); triton x_best <= 1.3 on head_dim 40/64
self-attention; triton faster than ``sdpa`` on the VAE's 1 x 512 heads (``summary``).

``sweep``: the flash-attention kernel's tile configs at SD's attention shapes, next to SDPA's backends. For each
shape of ``SWEEP_SHAPES`` (the q/k/v layouts the engine passes: (B, L, H, D) projections seen as (B, H, L, D))
every config of a grid (5 tile shapes, 4 or 8 warps, 2 to 4 stages, and the head-dim chunking D0 + D1) is launched
directly, checked against SDPA's math backend (fp32) and timed with ``triton.testing.do_bench`` (L2 cleared between
calls); SDPA's cuDNN and flash backends are timed the same way. The point is to find configs the autotuner's short
list (``flash_attention_configs``) misses. Rows go to ``DIR/sweep_attention.json``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PEAK_TFLOPS = 739.0
_LEAD = ("model", "attn", "B", "H", "Lq", "Lk", "D", "backend", "us", "tflops", "picked", "x_best")


# --------------------------------------------------------------------------------------------
# bench: every backend and the dispatcher at SD's attention shapes
# --------------------------------------------------------------------------------------------
def shapes(quick: bool = False) -> list[dict]:
    """Attention calls of one denoising step / one VAE decode: (model, attn, B, H, Lq, Lk, D, upcast)."""
    s = []

    def unet(model, tokens, heads, dim):
        s.append(dict(model=model, attn="self", B=2, H=heads, Lq=tokens, Lk=tokens, D=dim, upcast=False))
        s.append(dict(model=model, attn="cross", B=2, H=heads, Lq=tokens, Lk=77, D=dim, upcast=False))

    # SD1.5 512²: latent 64x64; 8 heads of 40/80/160 at 64²/32²/16², mid-block at 8²
    unet("sd15", 4096, 8, 40)
    if not quick:
        unet("sd15", 1024, 8, 80)
        unet("sd15", 256, 8, 160)
        unet("sd15", 64, 8, 160)
    # SDXL 1024²: latent 128x128; heads of 64: 10 at 64², 20 at 32² (and mid-block)
    unet("sdxl", 4096, 10, 64)
    if not quick:
        unet("sdxl", 1024, 20, 64)
    # VAE mid-block: one head of 512 over the latent grid (decode of 512² and 1024² images)
    s.append(dict(model="vae512", attn="self", B=1, H=1, Lq=4096, Lk=4096, D=512, upcast=False))
    if not quick:
        s.append(dict(model="vae1024", attn="self", B=1, H=1, Lq=16384, Lk=16384, D=512, upcast=False))
    return s


def _inputs(sh: dict, dtype, device):
    """q, k, v as the processor makes them: (B, H, L, D) views of (B, L, 3|2, H, D) projections."""
    import torch

    B, H, Lq, Lk, D = sh["B"], sh["H"], sh["Lq"], sh["Lk"], sh["D"]
    g = torch.Generator(device=device).manual_seed(0)
    if sh["attn"] == "self":
        qkv = torch.randn(B, Lq, 3, H, D, device=device, dtype=dtype, generator=g)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    else:
        q = torch.randn(B, Lq, H, D, device=device, dtype=dtype, generator=g).transpose(1, 2)
        kv = torch.randn(B, Lk, 2, H, D, device=device, dtype=dtype, generator=g)
        k, v = (t.transpose(1, 2) for t in kv.unbind(2))
    return q, k, v


def _row(meta: dict, **fields) -> dict:
    row = {k: fields.pop(k, None) for k in _LEAD}
    row.update(fields)
    row.update(meta)
    return row


def _shape_rows(sh: dict, dispatcher, names: list[str], dtype, device, rep: int) -> list[dict]:
    """The rows of one shape: every backend in ``names`` and the dispatcher, checked against the reference and
    timed on this shape's q, k, v (freed when this returns)."""
    import torch
    import triton.testing

    from sdfast.passes import attention as ap
    from sdfast.passes.attention.backends import reference
    from sdfast.passes.attention.dispatch import mismatch

    q, k, v = _inputs(sh, dtype, device)
    scale = sh["D"] ** -0.5
    upcast = sh["upcast"]
    flop = 4.0 * sh["B"] * sh["H"] * sh["Lq"] * sh["Lk"] * sh["D"]
    base = {k_: sh[k_] for k_ in ("model", "attn", "B", "H", "Lq", "Lk", "D")}
    rows: list[dict] = []
    with torch.no_grad():
        ref = reference(q, k, v, None, scale)
        # the dispatcher's warm-up measurement for this key (what the pass does on first sight)
        try:
            dispatcher(q, k, v, scale=scale, upcast=upcast)
            decided = dispatcher.decision(ap.AttentionDispatcher.key_for(q, k, None, upcast))  # kernels.select's
            picked = decided.winner if decided is not None else None
        except Exception as e:  # noqa: BLE001 - reported in the rows
            picked = f"error: {type(e).__name__}: {e}"[:200]
        calls = {n: functools.partial(dispatcher.backend_fn(n), q, k, v, None, scale, upcast) for n in names}
        if not str(picked).startswith("error"):
            calls["dispatcher"] = lambda: dispatcher(q, k, v, scale=scale, upcast=upcast)
        timed = {}
        for name, fn in calls.items():
            r = dict(base, backend=name, upcast=upcast)
            try:
                bad = mismatch(fn(), ref, dtype)
                if bad is not None:
                    raise RuntimeError(f"wrong result: {bad}")
                r["us"] = triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3
                r["us_eager"] = triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median") * 1e3
                r["tflops"] = flop / (r["us"] * 1e-6) / 1e12
                r["pct_peak"] = 100.0 * r["tflops"] / PEAK_TFLOPS
                timed[name] = r["us"]
            except Exception as e:  # noqa: BLE001 - a failing backend is a row, not a crash
                r["note"] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            rows.append(r)
    singles = {n: t for n, t in timed.items() if n != "dispatcher"}
    best = min(singles.values()) if singles else None
    best_name = min(singles, key=singles.get) if singles else None
    for r in rows:
        r["picked"] = picked
        r["best"] = best_name
        if best and r.get("us"):
            r["x_best"] = r["us"] / best
    return rows


def run(quick: bool = False) -> list[dict]:
    """The ``attention`` section of the kernel suite: its rows (see the module docstring); one error row without
    CUDA."""
    import torch
    import triton

    from sdfast.passes import attention as ap

    if not torch.cuda.is_available():
        return [{"model": "-", "note": "error: attention benchmark needs CUDA"}]
    device = torch.device("cuda")
    dtype = torch.float16
    meta = dict(
        dtype="fp16", gpu=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton.__version__,
    )
    rep = 20 if quick else 40
    dispatcher = ap.AttentionDispatcher(budget_ms=2.0 if quick else 3.0)
    names = ["sdpa", "cudnn", "flash", "efficient", "math"]
    if ap.xformers_works(device):
        names.append("xformers")
    names.append("triton")
    rows: list[dict] = []
    for sh in shapes(quick):
        rows += _shape_rows(sh, dispatcher, names, dtype, device, rep)
        torch.cuda.empty_cache()
    return [_row(meta, **r) for r in rows]


def summary(rows: list[dict]) -> list[dict]:
    """Per shape: best backend, ours/best, dispatcher/best, and the targets met (for reports)."""
    out = []
    keyf = ("model", "attn", "Lq", "Lk", "H", "D")
    for key in dict.fromkeys(tuple(r.get(k) for k in keyf) for r in rows if r.get("backend")):
        rs = {r["backend"]: r for r in rows if tuple(r.get(k) for k in keyf) == key}
        s = dict(zip(keyf, key, strict=True))
        s["best"] = next(iter(rs.values())).get("best")
        s["picked"] = next(iter(rs.values())).get("picked")
        s["triton_x_best"] = rs.get("triton", {}).get("x_best")
        s["dispatcher_x_best"] = rs.get("dispatcher", {}).get("x_best")
        if s["attn"] == "self" and s["D"] in (40, 64):
            s["target_triton_1.3x"] = s["triton_x_best"] is not None and s["triton_x_best"] <= 1.3
        if str(s["model"]).startswith("vae"):
            t, d = rs.get("triton", {}).get("us"), rs.get("sdpa", {}).get("us")
            s["target_vae_faster_than_sdpa"] = bool(t and d and t < d)
        out.append(s)
    return out


def report(rows: list[dict]) -> str:
    """The ``bench`` subcommand's markdown: the rows' lead columns (and ``note``), then ``summary``."""
    from benchmarks.report import markdown_table

    sums = summary(rows)
    sum_cols = list(dict.fromkeys(k for s in sums for k in s))
    return "\n".join(["# Attention backends (fp16)", "", markdown_table(rows, [*_LEAD, "note"]), "", "## per shape", "",
                      markdown_table(sums, sum_cols)])


def bench(args) -> int:
    """The ``bench`` subcommand (see the module docstring)."""
    from benchmarks.report import write_rows

    rows = run(args.quick)
    md = report(rows)
    if args.out is not None:
        write_rows(args.out, "attention_bench", rows, md + "\n")
    print(md)
    return 0


# --------------------------------------------------------------------------------------------
# sweep: the flash-attention kernel's tile configs
# --------------------------------------------------------------------------------------------
# (label, B, H, Lq, Lk, D, upcast): SD1.5 512², SDXL 1024², SD2.1 768² (upcast_attention: fp32-accurate P.V in our
# kernel), CFG batch 2
SWEEP_SHAPES = [
    ("sd15 self 64x64", 2, 8, 4096, 4096, 40, False),
    ("sd15 self 32x32", 2, 8, 1024, 1024, 80, False),
    ("sd15 cross 64x64", 2, 8, 4096, 77, 40, False),
    ("sdxl self 64x64", 2, 10, 4096, 4096, 64, False),
    ("sdxl self 32x32", 2, 20, 1024, 1024, 64, False),
    ("sdxl cross 32x32", 2, 20, 1024, 77, 64, False),
    ("sdxl cross 64x64", 2, 10, 4096, 77, 64, False),
    ("sd21 self 96x96", 2, 5, 9216, 9216, 64, True),
    ("sd21 self 48x48", 2, 10, 2304, 2304, 64, True),
    ("sd21 cross 96x96", 2, 5, 9216, 77, 64, True),
]


def _chunkings(d: int) -> list[tuple[int, int]]:
    from kernels.attention.flash_attention import _next_pow2, head_dim_chunks

    out = [head_dim_chunks(d)]
    if _next_pow2(d) != sum(out[0]):
        out.append((_next_pow2(d), 0))  # one padded chunk
    return out


def _configs(d: int, quick: bool):
    blocks = [(64, 64), (128, 64), (128, 128), (64, 128), (128, 32)] if not quick else [(128, 64), (128, 128)]
    for (bm, bn), warps, stages, (d0, d1) in itertools.product(blocks, (4, 8), (2, 3, 4), _chunkings(d)):
        yield dict(BLOCK_M=bm, BLOCK_N=bn, D0=d0, D1=d1, DV0=d0, DV1=d1), warps, stages


def _sweep_inputs(b, h, lq, lk, d, device):
    import torch

    g = torch.Generator(device=device).manual_seed(0)

    def proj(l):  # (B, L, H, D) as the projection GEMM writes it, seen as (B, H, L, D)
        return torch.randn(b, l, h, d, device=device, dtype=torch.float16, generator=g).transpose(1, 2)

    return proj(lq), proj(lk), proj(lk)


def sweep_shape(label, b, h, lq, lk, d, upcast, quick, device="cuda"):
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels import precompile
    from kernels.attention.flash_attention import (
        _empty_out,
        _flash_attn_fwd_kernel,
        _smem_bytes,
        kernel_arguments,
    )

    q, k, v = _sweep_inputs(b, h, lq, lk, d, device)
    scale = d ** -0.5
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale)
    flops = 4 * b * h * lq * lk * d
    rows = []

    def record(name, fn, extra=None):
        try:
            o = fn()
            err = (o.float() - ref).abs().max().item()
            us = triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3
            rows.append({"shape": label, "config": name, "us": round(us, 2), "tflops": round(flops / us / 1e6, 1),
                         "max_err": err, **(extra or {})})
        except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is a row, not the end
            rows.append({"shape": label, "config": name, "error": f"{type(e).__name__}: {str(e)[:120]}"})

    for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
        def run(be=be):
            with sdpa_kernel([getattr(SDPBackend, be)]):
                return F.scaled_dot_product_attention(q, k, v, scale=scale)
        record(f"sdpa {be.lower()}", run)
    smem = torch.cuda.get_device_properties(q.device).shared_memory_per_block_optin
    launches = []
    for meta, warps, stages in _configs(d, quick):
        if _smem_bytes(meta["BLOCK_M"], meta["BLOCK_N"], meta["D0"] + meta["D1"], meta["D0"] + meta["D1"], stages, 2) > smem:
            continue
        out = _empty_out(q)
        args, consts, grid = kernel_arguments(q, k, v, out, None, scale, upcast)

        def run(meta=meta, warps=warps, stages=stages, args=args, consts=consts, grid=grid, out=out):
            _flash_attn_fwd_kernel[grid(meta)](*args, **consts, **meta, num_warps=warps, num_stages=stages)
            return out
        name = f"bm{meta['BLOCK_M']} bn{meta['BLOCK_N']} w{warps} s{stages} d{meta['D0']}+{meta['D1']}"
        launches.append((name, run, {"warps": warps, "stages": stages, **meta}))
    precompile.dry_run(lambda: [run() for _, run, _ in launches], label=f"sweep {label}")  # compile on all cores
    for name, run, extra in launches:
        record(name, run, extra)
    return rows


def sweep(args) -> int:
    """The ``sweep`` subcommand (see the module docstring)."""
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in SWEEP_SHAPES:
        if args.only and not any(o in shape[0] for o in args.only.split(",")):
            continue
        t0 = time.perf_counter()
        got = sweep_shape(*shape, quick=args.quick)
        rows += got
        ok = sorted((r for r in got if "us" in r and r["max_err"] < 2e-2), key=lambda r: r["us"])
        sdpa = {r["config"]: r["us"] for r in got if r["config"].startswith("sdpa") and "us" in r}
        best = ok[0] if ok else None
        print(f"{shape[0]}: sdpa {sdpa}; best {best and (best['config'], best['us'], best['tflops'])} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        for r in ok[:5]:
            print(f"   {r['config']:<32} {r['us']:8.2f} us {r['tflops']:6.1f} TFLOP/s err {r['max_err']:.1e}")
    (out / "sweep_attention.json").write_text(json.dumps(rows, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ops.attention", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("bench", help="every attention backend and the dispatcher at SD's attention shapes")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    p.add_argument("--out", type=Path, default=None, help="write attention_bench.json/.md here")
    p.set_defaults(fn=bench)
    p = sub.add_parser("sweep", help="the flash-attention kernel's tile configs against SDPA's backends")
    p.add_argument("--out", type=Path, required=True, help="write sweep_attention.json here")
    p.add_argument("--quick", action="store_true", help="fewer tile shapes")
    p.add_argument("--only", default=None, help="comma list of substrings of the shape labels to run")
    p.set_defaults(fn=sweep)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
