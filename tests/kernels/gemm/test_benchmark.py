"""The GEMM benchmark module (``benchmarks.ops.gemm``) on the CPU: one CLI with the subcommands of the two scripts it
replaced (the kernel suite's gemm section: ``bench``; the TMA linear sweep: ``tma``, same ``--out`` / ``--only`` and
``linear_tma.json`` / ``.md``), the suite still runs its ``gemm`` section from it, and the TMA sweep's shapes and
table. (The backends' CPU check is ``tests/test_bench.py::test_gemm_benchmark_candidates_run_on_cpu``.)"""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_kernels, sd_shapes
from benchmarks.ops import gemm as bench


def test_cli_subcommands(capsys):
    with pytest.raises(SystemExit):
        bench.main([])  # a subcommand is required
    for cmd, fn in (("bench", bench.bench), ("tma", bench.tma)):
        with pytest.raises(SystemExit) as e:
            bench.main([cmd, "--help"])
        assert e.value.code == 0
        assert fn.__name__ == cmd
    assert "(default: out/linear_tma)" in " ".join(capsys.readouterr().out.split())  # help wraps at the terminal width
    with pytest.raises(SystemExit) as e:
        bench.main(["tma", "--only", "sd21"])  # no shape of that model: named, not an empty table
    assert e.value.code == 2 and "--only 'sd21' matches no model of TMA_SHAPES (sd15, sdxl)" in capsys.readouterr().err


def test_the_suite_runs_this_module_for_its_gemm_section():
    assert bench_kernels.section_module("gemm") == "benchmarks.ops.gemm"
    if not torch.cuda.is_available():
        assert bench.run(quick=True)[0]["note"] == "skipped: needs a CUDA GPU"


def test_bench_writes_its_rows(tmp_path, monkeypatch, capsys):
    rows = [bench._row({}, bench="gemm", model="sd15", layer="l0.ff_out", M=8192, K=1280, N=320, backend="cublas_fp16",
                       us=20.0)]
    monkeypatch.setattr(bench, "run", lambda quick: rows)
    assert bench.main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "gemm_bench.json").read_text())["rows"] == rows
    md = (tmp_path / "gemm_bench.md").read_text()
    assert "| gemm | sd15 | l0.ff_out | 8192 | 1280 | 320 | cublas_fp16 | 20.0 |" in md
    assert md == capsys.readouterr().out


def test_tma_shapes_cover_the_unet_linears_and_the_grid():
    """Every UNet linear of ``sd_shapes`` that is neither a GEGLU projection (``benchmarks.ops.geglu tma``) nor a
    cross-attention K/V on the text tokens is one of the TMA sweep's shapes."""
    plain = {(m, M, K, N) for m, name, M, K, N, epi, _ in sd_shapes.SD_LINEAR_SHAPES
             if epi is None and "cross_kv" not in name}
    assert plain and plain <= {(m, M, K, N) for m, _, M, K, N, _, _ in bench.TMA_SHAPES}
    grid = bench.tma_grid()
    assert len(grid) == len({str(c) for c in grid}) == 16
    assert {c.persistent for c in grid} == {True, False}


def test_tma_writes_its_table(tmp_path, monkeypatch):
    rows = [dict(model="sd15", layer="l0 qkv", M=8192, K=320, N=960, residual=False, count=5, cublas_us=20.0,
                 cublas_err=0.0, configs={}, best="t", best_us=15.0),
            dict(model="sd15", layer="l0 ff.out", M=8192, K=1280, N=320, residual=False, count=5, cublas_us=10.0,
                 cublas_err=0.0, configs={}, best=None, best_us=None)]
    seen = []
    monkeypatch.setattr(bench, "tma_rows", lambda only: seen.append(only) or rows)
    assert bench.main(["tma", "--only", "sd15", "--out", str(tmp_path)]) == 0
    assert seen == ["sd15"]
    md = (tmp_path / "linear_tma.md").read_text()
    assert "| sd15 | l0 qkv | 8192 | 320 | 960 | 20.00 | 15.0 | 0.75 | t | 5 |" in md
    assert "| sd15 | l0 ff.out | 8192 | 1280 | 320 | 10.00 | None | None | None | 5 |" in md
    assert json.loads((tmp_path / "linear_tma.json").read_text())["rows"] == rows
