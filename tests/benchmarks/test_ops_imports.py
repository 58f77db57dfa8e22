"""Importing a benchmark module loads nothing heavy: no torch, Triton, sdfast or kernels until a benchmark runs (the
suite and the CLIs' ``--help`` start at once; GPU-only imports stay where they are used)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("benchmarks.bench_kernels", "benchmarks.ops._timing", "benchmarks.ops._vs_eager",
           *(f"benchmarks.ops.{p.stem}" for p in sorted((ROOT / "benchmarks" / "ops").glob("[!_]*.py"))))


def test_importing_the_benchmark_modules_loads_nothing_heavy():
    assert {"benchmarks.ops.conv3x3", "benchmarks.ops.gemm", "benchmarks.ops.layer_norm", "benchmarks.ops.quant",
            "benchmarks.ops.group_norm"} <= set(MODULES)
    code = ("import importlib, sys\n"
            f"for m in {list(MODULES)!r}:\n"
            "    importlib.import_module(m)\n"
            "print(sorted(k for k in ('torch', 'triton', 'sdfast', 'kernels', 'diffusers') if k in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

