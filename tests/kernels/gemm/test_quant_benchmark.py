"""The quantization benchmark module (``benchmarks.ops.quant``) on the CPU: one CLI whose ``bench`` subcommand is the
kernel suite's quant section, the suite still runs its ``quant`` section from it,
and the methods it quantizes with."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_kernels
from benchmarks.ops import quant as bench


def test_cli_subcommands():
    with pytest.raises(SystemExit):
        bench.main([])  # a subcommand is required
    with pytest.raises(SystemExit) as e:
        bench.main(["bench", "--help"])
    assert e.value.code == 0 and bench.bench.__name__ == "bench"


def test_the_suite_runs_this_module_for_its_quant_section():
    assert bench_kernels.section_module("quant") == "benchmarks.ops.quant"
    if not torch.cuda.is_available():
        assert bench.run(quick=True) == [{"bench": "quant", "note": "skipped: needs a CUDA GPU"}]


def test_bench_writes_its_rows(tmp_path, monkeypatch, capsys):
    rows = [dict(bench="quant", model="sd15", method="fp16", ms_step=20.0, x_fp16=1.0, weight_ratio=1.0),
            dict(bench="quant", model="sd15", method="w8a8_int8", note="error: RuntimeError: x")]
    seen = []
    monkeypatch.setattr(bench, "run", lambda quick: seen.append(quick) or rows)
    assert bench.main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    assert seen == [True]
    assert json.loads((tmp_path / "quant_bench.json").read_text())["rows"] == rows
    md = (tmp_path / "quant_bench.md").read_text()
    assert "| sd15 | fp16 | 20.0 | 1.00 | 1.00 |" in md and "error: RuntimeError: x |" in md
    assert md == capsys.readouterr().out


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)])
def test_methods(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    fp8 = ["w8a8_fp8"] if capability >= (8, 9) else []
    quick = [name for name, _ in bench._methods("sd15", quick=True)]
    assert quick == ["w8a8_int8", *fp8, "w4a16_awq", "int8_outlier"]
    full = [name for name, _ in bench._methods("sd15", quick=False)]
    assert full == ["w8a8_int8", "w8a8_int8_zeroquant_g128", *fp8, "w4a16_awq", "int8_outlier", "w4a16_awq_csrc",
                    "w4a16_rtn", "w4a16_gptq"]
    assert "w4a16_gptq" not in [name for name, _ in bench._methods("sdxl", quick=False)]  # SD1.5 only
