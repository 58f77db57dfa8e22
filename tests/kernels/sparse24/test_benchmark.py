"""The 2:4 benchmark module (``benchmarks.ops.sparse24``) on the CPU: one CLI with the subcommands of the two scripts
it replaced (the kernel suite's sparse section and the cuSPARSELt sweep), the suite still runs its ``sparse`` section
from it, the shape tables, and the sweep's summary of the fastest checked setting."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from benchmarks import bench_kernels
from benchmarks.ops import sparse24 as bench


def test_cli_subcommands(capsys):
    with pytest.raises(SystemExit):
        bench.main([])  # a subcommand is required
    for cmd, fn in (("bench", bench.bench), ("cusparselt", bench.cusparselt)):
        with pytest.raises(SystemExit) as e:
            bench.main([cmd, "--help"])
        assert e.value.code == 0
        assert fn.__name__ == cmd
    with pytest.raises(SystemExit):
        bench.main(["cusparselt"])  # --out is required
    assert "--out" in capsys.readouterr().err


def test_the_suite_runs_this_module_for_its_sparse_section():
    assert bench_kernels.section_module("sparse") == "benchmarks.ops.sparse24"
    assert "sparse" in bench_kernels.SECTIONS


def test_benchmark_module_shapes_and_cpu_guard():
    shapes = {(r["model"], r["M"], r["K"], r["N"]) for r in bench.bench_shapes(quick=False)}
    for want in [("sd15", 8192, 320, 2560), ("sd15", 8192, 1280, 320), ("sd15", 2048, 640, 5120), ("sd15", 512, 1280, 10240),
                 ("sd15", 128, 5120, 1280), ("sd15", 154, 768, 320), ("sdxl", 8192, 640, 5120), ("sdxl", 2048, 1280, 10240),
                 ("sdxl", 2048, 5120, 1280), ("sdxl", 154, 2048, 1280)]:
        assert want in shapes, want
    assert {r["M"] for r in bench.bench_shapes(quick=False) if r["model"] == "sdxl"} == {8192, 2048, 154}
    row = bench._row({"gpu": "x"}, bench="b", backend="dense", us_graph=1.0, extra=2)
    assert list(row)[:12] == list(bench._LEAD) and list(row)[-1] == "gpu"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            bench.run(quick=True)


def test_cusparselt_sweep_summary_picks_the_fastest_checked_setting():
    shapes = bench.cusparselt_shapes("ff")
    assert ("sdxl", "l2.ff_geglu", 2048, 1280, 10240) in shapes  # GEGLU weights have 2N rows
    assert all("ff" in name for _, name, *_ in shapes) and len(bench.cusparselt_shapes("all")) > len(shapes)
    base = dict(model="sdxl", layer="l2.ff_geglu", M=2048, K=1280, N=10240)
    setting = dict(backend="cusparselt", split_k=1, split_k_mode=-1, b_layout="xT_copy", transpose_result=False)
    rows = [
        dict(base, dtype="fp16", backend="dense cuBLAS", us=80.0),
        dict(base, dtype="fp16", **setting, alg_id=0, us=61.0, speedup_vs_dense_same_dtype=80 / 61, speedup_vs_fp16_cublas=80 / 61),
        dict(base, dtype="fp16", **setting, alg_id=1, us=70.0, speedup_vs_dense_same_dtype=80 / 70, speedup_vs_fp16_cublas=80 / 70),
        dict(base, dtype="fp16", **setting, alg_id=2, error="RuntimeError: wrong result: max rel err 0.5"),
        dict(base, dtype="fp8", backend="cusparselt", error="RuntimeError: operation not supported"),
    ]
    md = bench.cusparselt_summary(rows)
    assert "| 80.0 | 61.0 | 1.31x | alg 0," in md
    assert "errors: RuntimeError: operation not supported" in md


def test_cusparselt_runs_each_shape_in_a_child_process_of_this_module(tmp_path, monkeypatch):
    """The sweep's parent starts ``python -m benchmarks.ops.sparse24 cusparselt --one ...`` per shape and keeps a
    child that dies or hangs as an error row."""
    cmds = []

    def fake_run(cmd, **kw):
        cmds.append(cmd)
        if len(cmds) == 2:
            raise subprocess.TimeoutExpired(cmd, kw["timeout"])
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Traceback ...\nRuntimeError: CUDA error")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(bench, "cusparselt_shapes", lambda which: [("sd15", "a.ff", 8, 16, 32), ("sd15", "b.ff", 8, 16, 64)])
    monkeypatch.setattr(bench, "_env", lambda: {"gpu": "test"})
    assert bench.main(["cusparselt", "--out", str(tmp_path), "--dtypes", "fp16", "--quick", "--shape-timeout", "5"]) == 0
    assert cmds[0][1:] == ["-m", "benchmarks.ops.sparse24", "cusparselt", "--out", str(tmp_path), "--dtypes", "fp16",
                           "--one", "sd15,a.ff,8,16,32", "--quick"]
    rows = json.loads((tmp_path / "sweep_cusparselt.json").read_text())["rows"]
    assert [r["error"] for r in rows] == ["process rc=1: Traceback ...\nRuntimeError: CUDA error", "timed out after 5.0 s"]
    assert "errors: process rc=1" in (tmp_path / "sweep_cusparselt.md").read_text()
