"""The GEGLU benchmark module (``benchmarks.ops.geglu``) on the CPU: its one CLI has the subcommands ``bench``,
``sweep`` (the activation kernel's configs) and ``tma`` (the TMA GEMM's configs), the kernel suite's ``norm`` section
still runs exactly its GEGLU cases, and the TMA sweep reads the choice from the public report."""

from __future__ import annotations

import pytest
import torch

from benchmarks import sd_shapes
from benchmarks.ops import _vs_eager
from benchmarks.ops import geglu as bench


@pytest.mark.parametrize("quick", [False, True])
def test_the_norm_section_runs_the_geglu_cases(quick):
    cases = bench.bench_cases(quick)
    assert [c["shape"] for c in cases] == [shape for _, shape in sd_shapes.GEGLU_SITES]
    assert [c for c in _vs_eager.cases(quick) if c["op"] in bench.BENCH_OPS] == _vs_eager.sort_cases(cases)


def test_cli_subcommands(capsys):
    with pytest.raises(SystemExit):
        bench.main([])  # a subcommand is required
    for cmd, fn in (("bench", bench.bench), ("sweep", bench.sweep), ("tma", bench.tma)):
        with pytest.raises(SystemExit) as e:
            bench.main([cmd, "--help"])
        assert e.value.code == 0
        assert fn.__name__ == cmd
    with pytest.raises(SystemExit):
        bench.main(["tma", "--tiles"])
    assert "--tiles" in capsys.readouterr().err


def test_bench_case_runs_ours_and_eager_alike_on_the_cpu():
    with pytest.raises(ValueError, match="'nope'"):
        bench.make_bench_case(dict(op="nope", shape=(1, 2, 8), eps=0.0, layout="rows"), device="cpu")
    ours, eager, nbytes, _ = bench.make_bench_case(dict(op="geglu", shape=(1, 3, 64), eps=0.0, layout="rows"),
                                                   device="cpu", dtype=torch.float32)
    torch.testing.assert_close(ours(), eager(), atol=2e-6, rtol=2e-6)
    assert nbytes == (3 * 64 + 3 * 32) * 4


def test_the_two_sweeps_time_the_same_geglu_inputs():
    """The activation sweep's (M, 2D) are the TMA sweep's (M, 2N); the TMA table holds every GEGLU projection of
    ``sd_shapes``' UNet linears."""
    assert [(m, two_d) for _, m, two_d in bench.sweep_shapes()] == [(m, 2 * n) for *_, m, _, n, _ in bench.TMA_SHAPES]
    linears = {(model, m, k, n) for model, name, m, k, n, epi, _ in sd_shapes.SD_LINEAR_SHAPES if epi == "geglu"}
    assert linears and linears <= {(model, m, k, n) for model, _, m, k, n, _ in bench.TMA_SHAPES}
    configs = list(bench.sweep_configs())
    assert configs and all(1024 <= c["ROWS"] * c["BLOCK_D"] <= 16384 for c in configs)


def test_measured_choice_reads_the_public_decisions(fresh_choices):
    x, w = torch.randn(4, 36).half(), torch.randn(32, 36).half()  # K = 36: the TMA GEMM cannot run
    assert bench.measured_choice(x, w, None) == "cublas"
    x, w = torch.randn(4, 64).half(), torch.randn(32, 64).half()
    assert bench.measured_choice(x, w, None) is None  # the CPU measures nothing
