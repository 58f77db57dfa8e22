"""Where one UNet step spends its time: GPU kernel time per category, from ``torch.profiler``.

The profiler behind ``benchmarks.profile_step`` (its command line) and ``bench_txt2img --profile``; it knows no
system or model. Categories: layout copies (NCHW<->NHWC
conversions, ``copy_``/``direct_copy``/``nchwToNhwc``), GroupNorm, SiLU/elementwise, adds,
GELU/GEGLU, LayerNorm, conv, GEMM, attention, memcpy/memset, each sdfast Triton kernel by name
(``sdfast:<kernel>``, names found by scanning ``kernels/`` for ``@triton.jit`` functions), other.
torch.compile's generated kernels (``triton_poi/red/per/tem_fused_<ops>``) are classified by the ops
in their names.

On CUDA the figures are kernel durations from the profiler trace (kernels replayed from CUDA graphs
included), in µs per step, with kernel counts per step. On a CPU (tests) they are the self CPU times
of the aten ops, so the same code path runs; the numbers then mean little.
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
import time
from functools import lru_cache
from pathlib import Path

LAYOUT = "layout copies"
CATEGORIES = (
    LAYOUT, "GroupNorm", "SiLU/elementwise", "adds", "GELU/GEGLU", "LayerNorm", "conv", "GEMM", "attention",
    "memcpy/memset", "other",
)
SDFAST_PREFIX = "sdfast:"

_KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"
_JIT_DEF = re.compile(r"@triton\.jit[^\n]*\n(?:\s*@[^\n]*\n)*\s*def\s+(\w+)")
_CUDA_DEF = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)\s*\(")
_CUDA_NAME = re.compile(r"(?:^|::|void\s+)(\w+)\s*[<(]")  # "void (anonymous namespace)::name<...>(...)" -> name


@lru_cache(maxsize=1)
def sdfast_kernel_names(root: str | None = None) -> frozenset[str]:
    """Names of the ``@triton.jit`` functions and the CUDA C++ ``__global__`` kernels under ``kernels/`` (how
    sdfast's kernels appear in traces)."""
    base = Path(root) if root else _KERNELS_DIR
    names = set()
    for pattern, regex in (("*.py", _JIT_DEF), ("*.cu", _CUDA_DEF)):
        for path in base.rglob(pattern) if base.is_dir() else ():
            try:
                names.update(regex.findall(path.read_text(errors="replace")))
            except OSError:
                continue
    return frozenset(names)


def _any(n: str, words) -> bool:
    return any(w in n for w in words)


def _inductor_category(n: str) -> str:
    """torch.compile (Inductor) kernels: ``triton_<kind>_fused_<op>_<op>..._<n>``; templates ``triton_tem_``."""
    if n.startswith("triton_tem"):
        return "conv" if "conv" in n else "GEMM"
    if _any(n, ("group_norm", "groupnorm")):
        return "GroupNorm"
    if _any(n, ("layer_norm", "layernorm")):
        return "LayerNorm"
    if "gelu" in n:
        return "GELU/GEGLU"
    if _any(n, ("softmax", "_sdpa", "attention", "flash")):
        return "attention"
    if _any(n, ("silu", "sigmoid", "mul", "div", "exp", "sin", "cos", "pow")):
        return "SiLU/elementwise"
    ops = n.split("_fused_", 1)[-1]
    if _any(ops, ("add", "convolution", "addmm")):  # bias / residual adds fused after extern convs and GEMMs
        return "adds"
    if _any(ops, ("clone", "copy", "permute", "transpose", "view", "cat")):
        return LAYOUT
    return "SiLU/elementwise"


def categorize(name: str, *, kind: str = "kernel", sdfast_names: frozenset[str] | None = None) -> str:
    """The category of one kernel (or, on CPU, one aten op) from its name.

    ``kind``: the trace category ('kernel', 'gpu_memcpy', 'gpu_memset', 'cpu_op'). ``sdfast_names``:
    Triton kernel names that belong to sdfast (default: scanned from ``kernels/``).
    """
    names = sdfast_kernel_names() if sdfast_names is None else sdfast_names
    base = name.split("(")[0].split("<")[0].strip()
    if base in names or name in names:
        return SDFAST_PREFIX + (base if base in names else name)
    cuda = next((m for m in _CUDA_NAME.findall(name) if m in names), None)  # a CUDA C++ kernel's demangled name
    if cuda is not None:
        return SDFAST_PREFIX + cuda
    n = name.lower()
    if kind in ("gpu_memcpy", "gpu_memset") or n.startswith(("memcpy", "memset")):
        return "memcpy/memset"
    if n.startswith("triton_"):
        return _inductor_category(n)
    if "catarraybatchedcopy" in n or n.startswith("aten::cat"):
        return "other"
    if _any(n, ("nchwtonhwc", "nhwctonchw", "direct_copy", "copy_kernel", "copy_", "aten::contiguous", "aten::clone")):
        return LAYOUT
    if _any(n, ("flash", "fmha", "sdpa", "attention", "attn", "mha_", "softmax")):
        return "attention"
    if _any(n, ("conv", "fprop", "implicit_gemm", "implicit_convolve", "winograd", "dgrad", "wgrad", "cudnn")):
        return "conv"
    if _any(n, ("gemm", "cutlass", "cublas", "nvjet", "matmul", "s16816", "h16816", "xmma", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::baddbmm", "aten::linear")):
        return "GEMM"
    if _any(n, ("group_norm", "groupnorm", "rowwisemoments", "computefusedparams")):
        return "GroupNorm"
    if _any(n, ("layer_norm", "layernorm")):
        return "LayerNorm"
    if _any(n, ("gelu", "geglu")):
        return "GELU/GEGLU"
    if _any(n, ("functor_add", "add_kernel", "addfunctor", "aten::add")):
        return "adds"
    if _any(n, ("silu", "sigmoid", "elementwise", "aten::mul", "aten::div", "aten::fill", "aten::to",
                "aten::_to_copy")):
        return "SiLU/elementwise"
    return "other"


def breakdown(events, *, steps: int, sdfast_names: frozenset[str] | None = None) -> dict:
    """Aggregate (name, duration_us, kind) events over ``steps`` UNet steps.

    Returns ``{"categories": {cat: {"us": µs/step, "kernels": count/step}}, "total_us": µs/step,
    "kernels_per_step": n, "layout_copies_per_step": n, "top": [(name, µs/step, count/step), ...]}``;
    categories in the order of ``CATEGORIES`` then sdfast kernels, every fixed category present.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    cats: dict[str, list[float]] = {c: [0.0, 0] for c in CATEGORIES}
    per_name: dict[str, list[float]] = {}
    for name, dur, kind in events:
        cat = categorize(name, kind=kind, sdfast_names=sdfast_names)
        acc = cats.setdefault(cat, [0.0, 0])
        acc[0] += dur
        acc[1] += 1
        pn = per_name.setdefault(name, [0.0, 0])
        pn[0] += dur
        pn[1] += 1
    order = list(CATEGORIES) + sorted(c for c in cats if c not in CATEGORIES)
    categories = {c: {"us": cats[c][0] / steps, "kernels": cats[c][1] / steps} for c in order}
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:40]
    return {
        "categories": categories,
        "total_us": sum(v["us"] for v in categories.values()),
        "kernels_per_step": sum(v["kernels"] for v in categories.values()),
        "layout_copies_per_step": categories[LAYOUT]["kernels"],
        "top": [(n[:160], v[0] / steps, v[1] / steps) for n, v in top],
    }


def _trace_events(prof, cuda: bool) -> list[tuple[str, float, str]]:
    """(name, µs, kind) of the GPU kernels / memcpys (CUDA) or the self times of aten ops (CPU)."""
    if cuda:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        return [(e.get("name", "?"), float(e.get("dur", 0.0)), e["cat"]) for e in events
                if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    out = []
    for avg in prof.key_averages():
        if not avg.key.startswith("aten::"):
            continue
        self_us = float(getattr(avg, "self_cpu_time_total", 0.0))
        # one entry per op name: spread its count so kernel counts stay per call
        out.extend([(avg.key, self_us / max(avg.count, 1), "cpu_op")] * max(avg.count, 1))
    return out


def clone_inputs(tree):
    """A copy of a call's inputs (tensors detached and cloned, the rest as is), so a replay sees the first call's values."""
    import torch
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


def profile_unet_step(unet, args: tuple, kwargs: dict, *, steps: int | None = None, warmup: int | None = None,
                      timed: int | None = None) -> dict:
    """Profile ``steps`` calls of ``unet(*args, **kwargs)`` (one denoising step's real inputs) and break the
    kernel time down by category (see ``breakdown``), plus ``direct_ms``: the median of ``timed`` calls
    timed with CUDA events (wall clock on CPU), outside the profiler, after ``warmup`` calls.
    Defaults: 5 / 2 / 10 calls on CUDA, 1 / 0 / 1 on a CPU (where it only checks the code path).

    Runs under ``torch.no_grad()`` (as the pipeline does), so CUDA-graphed and compiled UNets replay.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in list(args) + list(kwargs.values()))
    steps = steps or (5 if cuda else 1)
    warmup = (2 if cuda else 0) if warmup is None else warmup
    timed = timed or (10 if cuda else 1)
    args, kwargs = clone_inputs(args), clone_inputs(kwargs)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.no_grad():
        for _ in range(warmup):
            unet(*args, **kwargs)
        sync()
        times = []
        for _ in range(timed):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                unet(*args, **kwargs)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                unet(*args, **kwargs)
                times.append((time.perf_counter() - t0) * 1e3)
        # CUDA activity alone keeps the trace small; if it shows no kernel, retry with CPU activity too
        tries = [[ProfilerActivity.CUDA], [ProfilerActivity.CPU, ProfilerActivity.CUDA]] if cuda else [[ProfilerActivity.CPU]]
        for activities in tries:
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    unet(*args, **kwargs)
                sync()
            events = _trace_events(prof, cuda)
            if events:
                break
    result = breakdown(events, steps=steps)
    result.update(direct_ms=statistics.median(times), source="cuda kernels" if cuda else "cpu aten ops (self time)",
                  profiled_steps=steps)
    if cuda and result["kernels_per_step"] < 10:
        result["warning"] = "fewer than 10 kernels per step seen: the profiler may not see kernels inside CUDA graphs here"
    return result


def format_breakdown(profile: dict, title: str = "") -> str:
    """Markdown: one line per non-empty category (µs/step, share, kernels/step), then totals."""
    from benchmarks.report import markdown_table

    total = profile["total_us"] or 1.0
    rows = [{"category": c, "us": v["us"], "share": f"{100 * v['us'] / total:.1f}%", "kernels": v["kernels"]}
            for c, v in profile["categories"].items() if v["kernels"]]
    head = f"{title}: " if title else ""
    lines = [
        f"{head}{profile['total_us'] / 1e3:.2f} ms of {'GPU kernel' if 'cuda' in profile.get('source', '') else 'op'} "
        f"time per step ({profile['kernels_per_step']:.0f} kernels, {profile['layout_copies_per_step']:.0f} layout "
        f"copies); one call timed alone: {profile['direct_ms']:.2f} ms",
        "",
        markdown_table(rows, [("category", "category"), ("us", "µs/step"), ("share", "share"), ("kernels", "kernels/step")]),
    ]
    if profile.get("warning"):
        lines.append(f"warning: {profile['warning']}")
    return "\n".join(lines)
