"""The GroupNorm benchmark module (``benchmarks.ops.group_norm``) on the CPU: its one CLI has the three subcommands
of the scripts it replaced, and the kernel suite's ``norm`` section still runs exactly its GroupNorm cases."""

from __future__ import annotations

import pytest

from benchmarks.ops import _vs_eager
from benchmarks.ops import group_norm as bench


@pytest.mark.parametrize("quick", [False, True])
def test_the_norm_section_runs_the_group_norm_cases(quick):
    gn_cases = bench.bench_cases(quick)
    assert gn_cases and {c["op"] for c in gn_cases} == set(bench.BENCH_OPS)
    suite = [c for c in _vs_eager.cases(quick) if c["op"] in bench.BENCH_OPS]
    assert suite == _vs_eager.sort_cases(gn_cases)
    first = _vs_eager.cases(quick)[0]  # the 8 µs target leads the suite (its compile budget is spent in order)
    assert (first["op"], first["shape"]) == ("group_norm_silu", (2, 320, 64, 64))


def test_cli_subcommands(capsys):
    with pytest.raises(SystemExit):
        bench.main([])  # a subcommand is required
    for cmd, fn in (("bench", bench.bench), ("tune", bench.tune), ("cluster", bench.cluster)):
        with pytest.raises(SystemExit) as e:
            bench.main([cmd, "--help"])
        assert e.value.code == 0
        assert fn.__name__ == cmd
    with pytest.raises(SystemExit):
        bench.main(["tune"])  # --out is required
    assert "--out" in capsys.readouterr().err


def test_unknown_op_is_named():
    with pytest.raises(ValueError, match="'nope'"):
        bench.make_bench_case(dict(op="nope", shape=(1, 32, 2, 2), eps=1e-5, layout="nchw"), device="cpu")


def test_tune_plans_under_a_trial_tuning_and_restores_the_defaults():
    import kernels.group_norm as gn
    from kernels.group_norm import plan

    before = dict(plan.TUNING)
    assert bench._plan(gn, (2, 320, 64, 64), "nhwc", {"nhwc_channel_tiles": False}).path == "twopass"
    assert bench._plan(gn, (2, 320, 64, 64), "nhwc", {}).path == "nhwc_tiles"
    assert plan.TUNING == before
