"""The 3x3 convolution benchmark module (``benchmarks.ops.conv3x3``) on the CPU: one CLI whose ``sweep`` subcommand is
the sweep script it replaced (same ``--out`` / ``--models`` and ``conv.json`` / ``conv.md``), a bad
``--models`` named, and the table's per-step saving."""

from __future__ import annotations

import json

import pytest

from benchmarks import sd_shapes
from benchmarks.ops import conv3x3 as bench


def test_cli_subcommands(capsys):
    with pytest.raises(SystemExit):
        bench.main([])  # a subcommand is required
    with pytest.raises(SystemExit) as e:
        bench.main(["sweep", "--help"])
    assert e.value.code == 0 and bench.sweep.__name__ == "sweep"
    assert "--models" in capsys.readouterr().out
    for bad in ("sd21", "sd15,nope", ","):  # a model without shapes would give an empty table
        with pytest.raises(SystemExit) as e:
            bench.main(["sweep", "--models", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--models must be a comma list of sd15, sdxl" in err and repr(bad) in err


def test_models_are_the_shape_tables():
    assert bench.models() == ["sd15", "sdxl"]
    assert {m for m, *_ in sd_shapes.SD_CONV3X3_SHAPES} == set(bench.models())


def _row(model, cudnn, gemm, count, choice):
    return dict(model=model, Cin=320, Cout=320, H=64, W=64, count=count, gflop=2 * 2 * 64 * 64 * 320 * 320 * 9 / 1e9,
                cudnn_us=cudnn, cudnn_err=0.0, cudnn_benchmark_us=cudnn, gemm_us=gemm, gemm_err=0.0,
                measured_choice=choice)


def test_sweep_writes_the_rows_and_the_table(tmp_path, monkeypatch, capsys):
    rows = [_row("sd15", 30.0, 20.0, 7, "gemm"), _row("sd15", 10.0, 12.0, 2, "cudnn")]
    seen = []
    monkeypatch.setattr(bench, "sweep_rows", lambda models: seen.append(models) or rows)
    assert bench.main(["sweep", "--models", "sd15", "--out", str(tmp_path)]) == 0
    assert seen == [("sd15",)]
    md = (tmp_path / "conv.md").read_text()
    assert "| sd15 | 320 | 320 | 64x64 | 7 | 30.0 | 503 | 30.0 | 20.0 | gemm |" in md  # 15.1 GFLOP in 30 µs
    assert "| sd15 | 320 | 320 | 64x64 | 2 | 10.0 | 1510 | 10.0 | 12.0 | cudnn |" in md
    # the faster path per shape: 7 x (30 - 20) µs saved, none where cuDNN is faster
    assert md.endswith("\n- sd15: the faster of cuDNN and im2col + cuBLAS at every shape would save 70 µs per UNet "
                       "step\n")
    assert json.loads((tmp_path / "conv.json").read_text())["rows"] == rows
    assert "would save 70 µs" in capsys.readouterr().out
