"""Writing benchmark results: environment metadata, markdown tables, CSV, JSON and the txt2img chart.

Nothing here runs at import (no GPU work, no subprocess, no matplotlib import): every helper is a
function. ``env_metadata()`` is what each result row carries so a number can be traced to the GPU,
the driver and the library versions that produced it.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import math
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PUBLISHED_LABEL = "published, not measured here"


# ----------------------------------------------------------------------------- environment


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        try:  # a module importable without dist-info (e.g. PYTHONPATH-installed wheels keep it; source trees don't)
            mod = __import__(dist)
            return getattr(mod, "__version__", None)
        except Exception:
            return None


def _nvidia_smi() -> dict:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=15, check=True,
        ).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    if not out:
        return {}
    name, driver, mem = (v.strip() for v in out[0].split(","))
    return {"gpu": name, "driver": driver, "gpu_memory_gib": round(float(mem) / 1024, 1), "driver_source": "nvidia-smi"}


def _cuda_driver_api_version() -> str | None:
    """The CUDA driver API version via libcuda (``cuDriverGetVersion``), e.g. '13.0'; None without a driver."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
            return None
        return f"{v.value // 1000}.{(v.value % 1000) // 10}"
    except OSError:
        return None


def _git() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {}
    if commit.returncode != 0:
        return {}
    return {"git_commit": commit.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}


def env_metadata() -> dict:
    """Where the numbers come from: GPU name, driver, versions, date, hostname (JSON-serialisable dict).

    GPU name and driver come from ``nvidia-smi`` when it runs, else from torch (name) and libcuda
    (driver API version). Without CUDA, ``gpu`` is None and ``device`` says 'cpu'.
    """
    import torch

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": __import__("os").cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "diffusers": _version("diffusers"),
        "transformers": _version("transformers"),
        "sdfast": _version("sdfast"),
        "tensorrt": _version("tensorrt"),
        "gpu": None,
        "driver": None,
        "device": "cpu",
    }
    try:
        import sdfast

        env["sdfast"] = sdfast.__version__
    except Exception:
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            device="cuda",
            gpu=torch.cuda.get_device_name(0),
            gpu_count=torch.cuda.device_count(),
            compute_capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cudnn=torch.backends.cudnn.version(),
        )
        smi = _nvidia_smi()
        if smi:
            env.update(smi)
        else:
            env["driver"] = _cuda_driver_api_version()
            env["driver_source"] = "libcuda cuDriverGetVersion (CUDA API version)"
    env.update(_git())
    return env


def tensorrt_note() -> str:
    """One line: whether the ``tensorrt`` package is importable here (the reference rows are published figures)."""
    import importlib.util

    if importlib.util.find_spec("tensorrt") is None:
        return ("TensorRT: the `tensorrt` package is not importable on this machine, so no TensorRT engine was built "
                "or timed here; the TensorRT rows below are published figures.")
    return (f"TensorRT: `tensorrt` {_version('tensorrt')} is importable, but this benchmark does not build TensorRT "
            "engines; the TensorRT rows below are published figures.")


# ----------------------------------------------------------------------------- formatting


def fmt(value, digits: int = 3) -> str:
    """Compact cell text: None -> '—', floats to about ``digits`` significant digits, inf -> 'inf'."""
    if value is None or value == "":
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        a = abs(value)
        if a >= 10 ** (digits - 1):
            return f"{value:.0f}"
        if a == 0:
            return "0"
        decimals = max(0, digits - 1 - int(math.floor(math.log10(a))))
        return f"{value:.{decimals}f}"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, default=str)
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict], columns: list[tuple[str, str]] | list[str]) -> str:
    """A GitHub markdown table. ``columns``: keys, or (key, header) pairs."""
    cols = [(c, c) if isinstance(c, str) else c for c in columns]
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(k)) for k, _ in cols) + " |")
    return "\n".join(lines)


def _jsonable(value):
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def write_json(path, obj) -> Path:
    """Strict JSON (inf -> "inf", NaN -> null, unknown objects -> str)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(obj), indent=2, allow_nan=False) + "\n")
    return path


def write_rows(out_dir, name: str, rows: list[dict], md: str, env: dict | None = None) -> None:
    """``out_dir/name.json`` (``rows`` and this machine's ``env_metadata``) and ``out_dir/name.md`` (``md``)."""
    write_json(Path(out_dir) / f"{name}.json", {"env": env or env_metadata(), "rows": rows})
    (Path(out_dir) / f"{name}.md").write_text(md)


def write_sweep(out_dir, name: str, rows: list[dict], table_md: str) -> None:
    """A kernel sweep's results: as :func:`write_rows`, the ``.md`` starting with a GPU / versions / date line."""
    env = env_metadata()
    write_rows(out_dir, name, rows, f"GPU {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, "
                                    f"{env.get('date')}\n\n" + table_md, env)


def write_csv(path, rows: list[dict], columns: list[str] | None = None) -> Path:
    """One line per row; columns default to the union of keys in first-seen order; dicts/lists as JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if columns is None:
        columns = []
        for row in rows:
            columns.extend(k for k in row if k not in columns)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: (json.dumps(_jsonable(v)) if isinstance(v, (dict, list, tuple)) else _jsonable(v))
                        for k, v in row.items() if k in columns})
    return path


def flatten_env(env: dict, keys=("gpu", "driver", "torch", "cuda", "triton", "diffusers", "transformers",
                                 "sdfast", "date", "hostname", "git_commit")) -> dict:
    """The env fields every CSV row carries, prefixed ``env_``."""
    return {f"env_{k}": env.get(k) for k in keys}


# ----------------------------------------------------------------------------- chart


def plot_txt2img(path, rows: list[dict], reference: list[dict]) -> Path:
    """PNG: per model, end-to-end seconds and UNet ms/step per measured system (coloured bars), with the
    published reference rows of that architecture as grey hatched bars labelled 'published, <GPU>'.

    ``rows``: measured rows (keys system, model, arch, e2e_s, unet_ms_step, size, steps, error; task, strength and
    steps_run for a task other than txt2img);
    ``reference``: rows of ``benchmarks.reference.REFERENCE`` (keys arch, system, gpu, e2e_s, unet_ms_step).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows)) or ["(none)"]
    metrics = [("e2e_s", "end-to-end s (prompt to PIL)"), ("unet_ms_step", "UNet ms / step")]
    panels = []
    for model in models:
        measured = [r for r in rows if r["model"] == model]
        arch = measured[0].get("arch") if measured else None
        refs = [r for r in reference if r.get("arch") == arch]
        panels.append((model, measured, refs))
    heights = [max(2, len(m) + sum(1 for r in refs if any(r.get(k) is not None for k, _ in metrics))) for _, m, refs in panels]
    fig, axes = plt.subplots(len(panels), 2, figsize=(15, 1.2 + 0.42 * sum(heights) + 0.8 * len(panels)),
                             squeeze=False, gridspec_kw={"height_ratios": heights})
    palette = plt.get_cmap("tab10")
    systems = list(dict.fromkeys(r["system"] for r in rows))
    for i, (model, measured, refs) in enumerate(panels):
        for j, (key, title) in enumerate(metrics):
            ax = axes[i][j]
            labels, values, colors, hatches = [], [], [], []
            for r in measured:
                desc = f"{r['system']}, {r.get('steps', '')} steps"
                if r.get("tier"):  # a speed tier: its label
                    desc = f"{r['system']} {r['tier']}, {r.get('steps', '')} steps"
                elif r.get("task") not in (None, "txt2img"):  # another task: its name, strength and the steps it ran
                    desc = f"{r['system']} {r['task']} (strength {r.get('strength')}), {r.get('steps_run')} of {r.get('steps')} steps"
                labels.append(desc if r.get(key) is not None else f"{desc}: {'failed' if r.get('error') else 'n/a'}")
                values.append(r.get(key) or 0.0)
                colors.append(palette(systems.index(r["system"]) % 10))
                hatches.append("")
            for r in refs:
                if r.get(key) is None:
                    continue
                derived = "*" if key == "unet_ms_step" and "it/s" in (r.get("note") or "") else ""
                gpu = "GPU not stated" if "not stated" in r["gpu"] else r["gpu"]
                steps = "steps not stated" if "not stated" in str(r["steps"]) else f"{r['steps']} steps"
                labels.append(f"published, {gpu}: {r['system'].split(' (')[0]}, {steps}{derived}")
                values.append(r[key])
                colors.append("0.75")
                hatches.append("//")
            y = list(range(len(values)))[::-1]
            bars = ax.barh(y, values, color=colors, edgecolor="0.3", linewidth=0.5)
            for bar, h in zip(bars, hatches):
                bar.set_hatch(h)
            ax.set_yticks(y, labels, fontsize=7)
            for yy, v in zip(y, values):
                if v:
                    ax.text(v, yy, f" {fmt(float(v))}", va="center", fontsize=7)
            sizes = sorted({str(r.get("size")) for r in measured if r.get("size")})
            ax.set_title(f"{model} {', '.join(sizes)}: {title}", fontsize=9)
            ax.set_xlim(0, (max(values) if values and max(values) > 0 else 1) * 1.18)
            ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("sdfast txt2img benchmark. Grey hatched: published figures (other GPUs, sizes, steps), not measured "
                 "here; * ms/step = 1000 / (it/s)", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
