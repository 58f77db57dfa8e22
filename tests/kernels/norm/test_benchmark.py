"""The LayerNorm benchmark module (``benchmarks.ops.layer_norm``) on the CPU: one CLI with the subcommands ``bench``
(the kernel suite's LayerNorm cases) and ``tune`` (the tuning script it replaced), and the suite's
``norm`` section still runs exactly its LayerNorm cases, beside GroupNorm's and GEGLU's."""

from __future__ import annotations

import importlib

import pytest
import torch

from benchmarks import sd_shapes
from benchmarks.ops import _vs_eager, geglu, group_norm
from benchmarks.ops import layer_norm as bench


def test_cli_subcommands(capsys):
    with pytest.raises(SystemExit):
        bench.main([])  # a subcommand is required
    for cmd, fn in (("bench", bench.bench), ("tune", bench.tune)):
        with pytest.raises(SystemExit) as e:
            bench.main([cmd, "--help"])
        assert e.value.code == 0
        assert fn.__name__ == cmd
    with pytest.raises(SystemExit):
        bench.main(["tune"])  # --out is required
    assert "--out" in capsys.readouterr().err


@pytest.mark.parametrize("quick", [False, True])
def test_the_norm_section_runs_the_layer_norm_cases(quick):
    cases = bench.bench_cases(quick)
    shapes = sd_shapes.unique_layer_norm_shapes()
    assert [(c["op"], c["shape"]) for c in cases] == [(op, s) for s in shapes for op in bench.BENCH_OPS]
    assert bench.BENCH_OPS == ("layer_norm", "add_layer_norm")
    assert all(c["eps"] == 1e-5 and c["layout"] == "rows" for c in cases)
    assert cases[0]["model"] == "sd15-unet" and "sdxl-unet" in {c["model"] for c in cases}
    suite = _vs_eager.cases(quick)
    assert [c for c in suite if c["op"] in bench.BENCH_OPS] == _vs_eager.sort_cases(cases)
    # the section is the three ops' cases and nothing else
    assert len(suite) == len(group_norm.bench_cases(quick)) + len(cases) + len(geglu.bench_cases(quick))
    assert {c["op"] for c in suite} == {*group_norm.BENCH_OPS, *bench.BENCH_OPS, *geglu.BENCH_OPS}


@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm"])
def test_bench_case_runs_ours_and_eager_alike_on_the_cpu(op):
    case = dict(op=op, shape=(1, 3, 32), eps=1e-5, layout="rows")
    ours, eager, nbytes, config = bench.make_bench_case(case, device="cpu", dtype=torch.float32)
    torch.testing.assert_close(ours(), eager(), atol=1e-5, rtol=1e-5)
    assert nbytes == (4 if op == "add_layer_norm" else 2) * 3 * 32 * 4 and config == ""
    # the section builds the same case through the op module
    torch.testing.assert_close(_vs_eager._make(case, "cpu", torch.float32)[0](), ours())


def test_unknown_op_is_named():
    with pytest.raises(ValueError, match="'nope'"):
        bench.make_bench_case(dict(op="nope", shape=(1, 2, 8), eps=1e-5, layout="rows"), device="cpu")
    with pytest.raises(ValueError, match="'nope'"):
        _vs_eager._make(dict(op="nope", shape=(1, 2, 8), eps=1e-5, layout="rows"), device="cpu")


def test_tune_grid():
    assert {d for _, d in bench.SHAPES} == {320, 640, 1280}
    assert set(bench.KNOBS) == {"tile_elems", "warps_per_4k"}  # the kernel's knobs
    ln = importlib.import_module("kernels.norm.layer_norm")  # the module (the package exports the function)
    assert set(bench.KNOBS) == set(ln._TUNING)
    assert all(ln._TUNING[k] in v for k, v in bench.KNOBS.items())  # the defaults are among the values timed
