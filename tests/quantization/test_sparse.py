"""CPU tests of sdfast/quantization/sparse.py: SparseLinear on the CPU (the pruned weight's dense matmul), its
undo and validation, and its per-shape choice (the kernel-choice service's "sparse24") measured on the CPU with
the Triton backend (interpreter), emulated cuSPARSELt / CUTLASS and a stand-in timer (the real timer needs CUDA
events: test_sparse24_gpu.py runs it)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sdfast
from kernels import select
from kernels.select import rules
from kernels.sparse24 import cusparselt as cslt
from kernels.sparse24 import format as fmt
from kernels.sparse24 import prune
from sdfast.quantization import sparse
from sdfast.quantization.sparse import SparseLinear
from tests.kernels.sparse24 import fake_cusparselt

# ---------------------------------------------------------------------------------------------
# SparseLinear on CPU (reference path: dense matmul of the pruned weight)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_sparse_linear_cpu_equals_pruned_dense(bias):
    lin = nn.Linear(64, 48, bias=bias)
    sl = SparseLinear.from_dense(lin)
    pruned, _ = prune.prune_24_magnitude(lin.weight)
    assert torch.equal(sl.weight, pruned) and not sl.weight.requires_grad
    x = torch.randn(2, 5, 64)
    assert torch.equal(sl(x), F.linear(x, pruned, lin.bias))
    assert sl.chosen == {}  # nothing measured on CPU


def test_sparse_linear_undo_with_and_without_dense_copy():
    lin = nn.Linear(32, 16)
    kept = SparseLinear.from_dense(lin, keep_dense_copy=True)
    assert kept.dense_weight_cpu is not None and torch.equal(kept.to_linear().weight, lin.weight)
    plain = SparseLinear.from_dense(lin)
    back = plain.to_linear()
    assert isinstance(back, nn.Linear) and torch.equal(back.weight, plain.weight)
    assert torch.equal(back.bias, lin.bias)
    assert "dense_weight_cpu" not in dict(kept.state_dict())


def test_sparse_linear_validation():
    lin = nn.Linear(32, 16)
    with pytest.raises(ValueError, match="not 2:4"):
        SparseLinear.from_dense(lin, lin.weight.detach())
    with pytest.raises(ValueError, match="backend"):
        SparseLinear(32, 16, backend="fast")
    with pytest.raises(ValueError, match="timing"):
        SparseLinear(32, 16, timing="wall")
    with pytest.raises(ValueError, match="multiple of 4"):
        SparseLinear(30, 16)
    with pytest.raises(ValueError, match="min_speedup"):  # outside the service's margins (0, 1.5]
        SparseLinear(32, 16, min_speedup=0.5)
    with pytest.raises(TypeError, match="cusparselt_search"):
        SparseLinear(32, 16, cusparselt_search="yes")


def test_sparse_linear_to_dtype_drops_cached_state():
    sl = SparseLinear.from_dense(nn.Linear(32, 16))
    sl._data["triton"] = fmt.compress_24(sl.weight.detach())
    sl.chosen[8] = "triton"
    sl.to(torch.float16)
    assert sl._data == {} and sl.chosen == {} and sl.weight.dtype == torch.float16
    assert prune.is_24_sparse(sl.weight)


def test_the_choice_is_a_declaration_of_the_service():
    assert sparse.CHOICE.name == "sparse24" and sparse.CHOICE.default == "dense"
    assert sparse.CHOICE.margin == pytest.approx(1 / 1.03)
    assert SparseLinear(32, 16).choice is sparse.CHOICE
    assert SparseLinear(32, 16, min_speedup=1.25).choice.margin == pytest.approx(0.8)


# ---------------------------------------------------------------------------------------------
# SparseLinear's per-shape choice, measured on the CPU (measure_cpu) with a stand-in for the service's timer
# ---------------------------------------------------------------------------------------------


def _measured(monkeypatch, times, timed=None):
    """select.decide as on a GPU (the decision measured on the CPU), the service's timer answering ``times``
    after running each candidate once; ``timed`` collects (candidates, timer keywords) of each measurement."""
    real = rules.decide

    def timer(fns, **kw):
        for fn in fns.values():
            fn()
        if timed is not None:
            timed.append((list(fns), kw))
        return {n: times[n] for n in fns}

    monkeypatch.setattr(select, "gpu_time_us", timer)
    monkeypatch.setattr(select, "decide", lambda *a, **k: real(*a, **k, measure_cpu=True))


@pytest.fixture
def fake_cslt(monkeypatch):
    return fake_cusparselt.install(monkeypatch)


@pytest.mark.parametrize("t_triton,min_speedup,expect", [(5.0, 1.03, "triton"), (9.9, 1.03, "dense"), (12.0, 1.0, "dense")])
def test_selection_keeps_fastest_and_requires_margin(monkeypatch, fresh_choices, t_triton, min_speedup, expect):
    timed = []
    _measured(monkeypatch, {"dense": 10.0, "triton": t_triton}, timed)
    sl = SparseLinear.from_dense(nn.Linear(64, 32), min_speedup=min_speedup)
    x2d = torch.randn(16, 64)
    assert sl._decide(x2d) == expect
    [d] = fresh_choices("sparse24")
    assert d.winner == expect and d.source == "measured" and d.times_us == {"dense": 10.0, "triton": t_triton}
    assert timed == [(["dense", "triton"], {})]  # timing="graph": the service's timer as it is
    assert sl.chosen == {16: expect} and sl.timings_us == {16: {"dense": 10.0, "triton": t_triton}}
    assert set(sl._data) == ({"triton"} if expect == "triton" else set())  # losers' copies freed
    # a second layer of the same shape reuses the decision without measuring
    other = SparseLinear.from_dense(nn.Linear(64, 32), min_speedup=min_speedup)
    assert other._decide(x2d) == expect and len(timed) == 1 and len(fresh_choices("sparse24")) == 1
    assert other.chosen == {16: expect}
    assert torch.allclose(sl._run(expect, x2d), F.linear(x2d, sl.weight, sl.bias), atol=1e-4)
    # the public report (what benchmarks/bench_txt2img.py's sparse_shapes lists)
    [row] = [r for r in sdfast.decisions() if r["choice"] == "sparse24"]
    assert row["winner"] == expect and row["times_us"] == {"dense": 10.0, "triton": t_triton}


def test_eager_timing_counts_the_host(monkeypatch, fresh_choices):
    """timing="eager": the service's timer without its host-hiding spin (sleep_cycles=0), so the host's per-call
    time counts; a layer of another timing is another key (measured again)."""
    timed = []
    _measured(monkeypatch, {"dense": 10.0, "triton": 5.0}, timed)
    x2d = torch.randn(16, 64)
    assert SparseLinear.from_dense(nn.Linear(64, 32), timing="eager")._decide(x2d) == "triton"
    assert SparseLinear.from_dense(nn.Linear(64, 32))._decide(x2d) == "triton"
    assert timed == [(["dense", "triton"], {"sleep_cycles": 0}), (["dense", "triton"], {})]


def test_selection_drops_a_backend_with_wrong_results(monkeypatch, fresh_choices, caplog):
    _measured(monkeypatch, {"dense": 10.0, "triton": 1.0})
    sl = SparseLinear.from_dense(nn.Linear(64, 32))
    real_run = SparseLinear._run

    def bad_run(self, name, x2d):
        y = real_run(self, name, x2d)
        return y + 1.0 if name == "triton" else y

    monkeypatch.setattr(SparseLinear, "_run", bad_run)
    with caplog.at_level("WARNING", logger="sdfast.kernels"):
        assert sl._decide(torch.randn(16, 64)) == "dense"
    [d] = fresh_choices("sparse24")
    assert d.winner == "dense" and "triton" not in d.times_us
    assert any("wrong result" in r.getMessage() for r in caplog.records)


def test_forced_backend_unsupported_falls_back_to_dense(fresh_choices):
    sl = SparseLinear.from_dense(nn.Linear(64, 32), backend="cusparselt")
    assert sl._decide(torch.randn(16, 64)) == "dense"  # float32: no hardware 2:4 backend
    [d] = fresh_choices("sparse24")
    assert d.winner == "dense" and d.source == "only" and "dtype" in d.reasons["cusparselt"]
    assert sl.chosen == {16: "dense"}


def test_forced_backend_is_pinned_unmeasured(monkeypatch, fresh_choices):
    monkeypatch.setattr(select, "gpu_time_us", lambda *a, **k: pytest.fail("a forced backend is not timed"))
    sl = SparseLinear.from_dense(nn.Linear(64, 32), backend="triton")
    x2d = torch.randn(40, 64)
    assert sl._decide(x2d) == "triton"
    [d] = fresh_choices("sparse24")
    assert d.source == "pinned" and sl.chosen == {40: "triton"}
    torch.testing.assert_close(sl._run("triton", x2d), F.linear(x2d, sl.weight, sl.bias), rtol=1e-4, atol=1e-4)


def test_selection_flow_with_every_backend(monkeypatch, fake_cslt, fresh_choices):
    """The whole auto-selection on CPU fp16 with emulated cuSPARSELt/CUTLASS and a stand-in timer:
    candidates, labels, plan, chosen backend and the cleanup of the losers' compressed copies
    (with cuSPARSELt's search switched on; off, its candidate is not built: next test). Our Triton
    kernel is not a candidate where a sparse-tensor-core backend runs the shape."""
    monkeypatch.setattr(torch, "_sparse_semi_structured_linear",
                        lambda x, p, m, bias=None: F.linear(x, fmt.from_cutlass_format(p, m), bias), raising=False)
    times = {"dense": 10.0, "cusparselt": 9.0, "cusparselt:search": 6.0, "cutlass": 8.0}
    timed = []
    _measured(monkeypatch, times, timed)
    sl = SparseLinear.from_dense(nn.Linear(128, 64, dtype=torch.float16), cusparselt_search=True)
    x2d = torch.randn(32, 128, dtype=torch.float16)
    assert sl._decide(x2d) == "cusparselt:search"
    [d] = fresh_choices("sparse24")
    assert d.times_us == times and timed[0][0] == list(times) and "triton" in d.reasons
    assert sl.chosen == {32: "cusparselt"} and set(sl._data) == {"cusparselt"}
    assert sl._plan("cusparselt:search", x2d, search=False) == cslt.CusparseltPlan(3, 2, 1)
    torch.testing.assert_close(sl._run("cusparselt:search", x2d), F.linear(x2d, sl.weight, sl.bias))
    assert fake_cslt.calls[-1]["alg_id"] == 3


def test_cusparselt_search_is_off_by_default(monkeypatch, fake_cslt, fresh_choices):
    """cuSPARSELt's search broke the CUDA context on the H200: by default it never runs, and the
    default-algorithm cuSPARSELt still competes."""
    assert not SparseLinear(128, 64).cusparselt_search
    monkeypatch.setattr(cslt, "cusparselt_search", lambda *a, **k: pytest.fail("search ran"))
    monkeypatch.setattr(torch, "_sparse_semi_structured_linear",
                        lambda x, p, m, bias=None: F.linear(x, fmt.from_cutlass_format(p, m), bias), raising=False)
    times = {"dense": 10.0, "cusparselt": 6.0, "cutlass": 8.0}
    _measured(monkeypatch, times)
    sl = SparseLinear.from_dense(nn.Linear(128, 64, dtype=torch.float16))
    x2d = torch.randn(32, 128, dtype=torch.float16)
    assert sl._decide(x2d) == "cusparselt" and sl._plan("cusparselt", x2d) == cslt.CusparseltPlan()
    [d] = fresh_choices("sparse24")
    assert d.times_us == times
    assert fake_cslt.calls[-1]["alg_id"] == 0


def test_out_of_memory_while_measuring_decides_nothing(monkeypatch, fresh_choices):
    """An OOM while a backend is measured is the input's size, not the backend's fault: it is raised and
    no decision is recorded, so the next call (memory freed) measures again."""
    sl = SparseLinear.from_dense(nn.Linear(128, 64, dtype=torch.float16))
    state = {"oom": True}

    def timer(fns, **kw):
        if state["oom"]:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return {n: 1.0 for n in fns}

    real = rules.decide
    monkeypatch.setattr(select, "gpu_time_us", timer)
    monkeypatch.setattr(select, "decide", lambda *a, **k: real(*a, **k, measure_cpu=True))
    x2d = torch.randn(32, 128, dtype=torch.float16)
    with pytest.raises(torch.OutOfMemoryError):
        sl._decide(x2d)
    assert fresh_choices("sparse24") == [] and sl.chosen == {}
    state["oom"] = False
    assert sl._decide(x2d) == "dense" and len(fresh_choices("sparse24")) == 1


def test_nothing_is_measured_on_the_cpu_without_measure_cpu(monkeypatch, fresh_choices):
    """The service's guards hold for SparseLinear: on the CPU (as inside a CUDA graph capture or a precompile dry
    run) the default runs and nothing is recorded."""
    monkeypatch.setattr(select, "gpu_time_us", lambda *a, **k: pytest.fail("timed on the CPU"))
    sl = SparseLinear.from_dense(nn.Linear(64, 32))
    assert sl._decide(torch.randn(16, 64)) == "dense"
    assert fresh_choices("sparse24") == [] and sl.chosen == {}
