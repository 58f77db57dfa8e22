"""Kernel micro-benchmarks: runs the kernel suite's sections and writes one table.

Each section is a module exposing ``run(quick=False) -> list[dict]`` (``SECTIONS``: section -> module): an op's
benchmark module under ``benchmarks/ops/`` (``attention``, ``gemm``, ``quant``, ``sparse``:
``benchmarks.ops.sparse24``), and for ``norm`` the machinery that runs GroupNorm's, LayerNorm's and GEGLU's ``bench``
cases in one table (``benchmarks.ops._vs_eager``). Rows: whatever the section measures, e.g. op, shape, dtype,
backend, µs, GB/s or TFLOP/s, and the ceiling it is compared with. Sections are imported lazily, one at a time; a
section whose module is missing or raises gives one row with ``error`` filled and the others still run; a name that
is not in ``SECTIONS`` is a usage error.

    python -m benchmarks.bench_kernels --out benchmarks/results/h200
    python -m benchmarks.bench_kernels --only norm,attention --quick

Writes ``kernels.csv``, ``kernels.json`` (rows + env metadata) and ``kernels.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SECTIONS = {  # section -> its module, in the order the suite runs them
    "norm": "benchmarks.ops._vs_eager",  # the bench cases of benchmarks.ops.{group_norm,layer_norm,geglu}
    "attention": "benchmarks.ops.attention",
    "gemm": "benchmarks.ops.gemm",
    "quant": "benchmarks.ops.quant",
    "sparse": "benchmarks.ops.sparse24",
}
MAX_COLUMNS = 12  # printed per section; the CSV/JSON keep every key


def section_module(name: str) -> str:
    """The module that runs section ``name`` (``SECTIONS[name]``); KeyError naming it for an unknown section."""
    if name not in SECTIONS:
        raise KeyError(f"unknown kernel section {name!r}; one of {', '.join(SECTIONS)}")
    return SECTIONS[name]


def run_section(name: str, *, quick: bool = False) -> list[dict]:
    """Import the section's module (``section_module``) and return its rows, each tagged ``section=name``.

    Never raises for a broken section: a missing module, a failing ``run`` or a result that is not a
    list of dicts gives ``[{"section": name, "error": "..."}]``.
    """
    t0 = time.perf_counter()
    try:
        module = importlib.import_module(section_module(name))
        rows = module.run(quick=quick)
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise TypeError(f"{module.__name__}.run() must return a list of dicts, got {type(rows).__name__}")
    except Exception as e:  # one row per broken section; the others run
        print(f"[kernels/{name}] failed:\n{traceback.format_exc()}", file=sys.stderr)
        return [{"section": name, "error": f"{type(e).__name__}: {e}"[:500], "section_s": time.perf_counter() - t0}]
    took = time.perf_counter() - t0
    print(f"[kernels/{name}] {len(rows)} rows in {took:.1f} s", file=sys.stderr)
    return [{"section": name, **r} for r in rows]


def _columns(rows: list[dict]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols.extend(k for k in r if k not in cols and k != "section")
    if len(cols) > MAX_COLUMNS:
        cols = cols[:MAX_COLUMNS - 1] + (["error"] if "error" in cols[MAX_COLUMNS - 1:] else [cols[MAX_COLUMNS - 1]])
    return cols


def render(rows: list[dict], env: dict) -> str:
    """One compact markdown table per section (at most ``MAX_COLUMNS`` columns; files keep all)."""
    from benchmarks.report import markdown_table

    gpu = env.get("gpu") or "CPU"
    out = [f"## Kernel benchmarks: {gpu}, torch {env.get('torch')}, triton {env.get('triton')}"]
    for section in dict.fromkeys(r["section"] for r in rows):
        srows = [r for r in rows if r["section"] == section]
        out += ["", f"### {section}", "", markdown_table(srows, _columns(srows))]
    return "\n".join(out)


def main(argv=None) -> int:
    """Run the kernel sections; returns 0, or 1 when every section failed."""
    from benchmarks.report import env_metadata

    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_kernels", description="kernel micro-benchmarks")
    p.add_argument("--only", default=None, help=f"comma list of sections (default: {','.join(SECTIONS)})")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    p.add_argument("--out", default=None, help="write kernels.csv/.json/.md here")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        p.error(f"--only: unknown section(s) {', '.join(unknown)}; one of {', '.join(SECTIONS)}")
    env = env_metadata()
    t0 = time.perf_counter()
    rows: list[dict] = []
    for name in names:
        rows.extend(run_section(name, quick=args.quick))
        if args.out:  # after every section: a run cut short by a time limit keeps what it measured
            _write(Path(args.out), rows, env, vars(args))
    text = render(rows, env)
    print(text)
    print(f"\ntotal kernel benchmark time {time.perf_counter() - t0:.0f} s", flush=True)
    if args.out:
        print(f"wrote {Path(args.out) / 'kernels.csv'}, kernels.json, kernels.md", file=sys.stderr)
    return 0 if not rows or any(not r.get("error") for r in rows) else 1


def _write(out: Path, rows: list[dict], env: dict, args: dict) -> None:
    from benchmarks.report import flatten_env, write_csv, write_json

    write_csv(out / "kernels.csv", [{**r, **flatten_env(env)} for r in rows])
    write_json(out / "kernels.json", {"env": env, "args": args, "rows": rows})
    (out / "kernels.md").write_text(render(rows, env) + "\n")


if __name__ == "__main__":
    sys.exit(main())
