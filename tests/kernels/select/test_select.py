"""The kernel-choice service: rules (pin, cache, problems, guards, margin, failures), the report, saved choices."""

import json
import logging

import pytest
import torch

from kernels import precompile, select
from kernels.select import rules, store

CPU = torch.device("cpu")
CHOICE = select.Choice("test_choice", default="lib", margin=0.9)


@pytest.fixture
def timed(monkeypatch, fresh_choices):
    """The timer answers from ``times`` (name -> µs) and records the candidates of each measurement."""
    calls, times = [], {}
    monkeypatch.setattr(rules, "gpu_time_us", lambda c: calls.append(list(c)) or {n: times[n] for n in c})
    return calls, times


def _decide(key=("k",), problem=None, ran=None, **kw):
    ran = [] if ran is None else ran
    cands = {name: (lambda name=name: ran.append(name)) for name in ("lib", "fast", "faster")}
    return select.decide(CHOICE, key, candidates=cands, device=CPU, problem=problem, measure_cpu=True, **kw)


def test_measured_once_per_key_with_the_margin(timed):
    calls, times = timed
    times.update(lib=100.0, fast=95.0, faster=80.0)
    assert _decide() == "faster" and _decide() == "faster"
    assert calls == [["lib", "fast", "faster"]]
    times.update(faster=92.0)  # 92 > 0.9 * 100: not by the margin
    assert _decide(key=("other",)) == "lib"
    [first, second] = select.decisions("test_choice")
    assert (first.winner, first.source, first.times_us["faster"]) == ("faster", "measured", 80.0)
    assert second.key == repr(("other",))


def test_measured_count_counts_measurements_only(timed):
    _, times = timed
    times.update(lib=100.0, fast=95.0, faster=80.0)
    before = select.measured_count()
    _decide()
    assert select.measured_count() == before + 1
    _decide()  # the decision made before: nothing timed
    with select.pinned({"test_choice": "fast"}):
        _decide(key=("pinned",))
    assert select.measured_count() == before + 1
    _decide(key=("other",))
    assert select.measured_count() == before + 2


def test_problems_drop_candidates_logged_once_and_one_left_is_the_decision(timed, caplog):
    caplog.set_level(logging.INFO, logger="sdfast.kernels")
    calls, _ = timed
    why = lambda name: None if name == "lib" else "K=36 is not a multiple of 8"  # noqa: E731
    with pytest.MonkeyPatch.context() as m:
        m.setattr(rules, "interpret_mode", lambda: True)  # a choice exists on the CPU (the interpreter)
        assert _decide(problem=why) == "lib"
    assert calls == [] and caplog.text.count("K=36 is not a multiple of 8") == 1
    assert [(d.winner, d.source, d.reasons) for d in select.decisions("test_choice")] == [
        ("lib", "only", {"fast": "K=36 is not a multiple of 8", "faster": "K=36 is not a multiple of 8"})]


def test_pins_win_unmeasured_where_they_can_run(timed):
    calls, times = timed
    times.update(lib=1.0, fast=2.0, faster=3.0)
    with select.pinned({"test_choice": "fast"}):
        assert _decide() == "fast"
    assert calls == [] and [(d.winner, d.source) for d in select.decisions("test_choice")] == [("fast", "pinned")]
    with select.pinned({"test_choice": "fast"}):  # a pin that cannot run: the others are measured
        assert _decide(key=("k2",), problem=lambda n: "no TMA" if n == "fast" else None) == "lib"
    with select.pinned({"test_choice": "nope"}), pytest.raises(ValueError, match="pinned candidate 'nope'"):
        _decide(key=("k3",))
    select.set_pins({"test_choice": "faster"})
    try:
        assert _decide(key=("k4",)) == "faster"
    finally:
        select.set_pins({})


def test_nothing_is_timed_or_kept_where_measuring_is_blocked(timed, monkeypatch):
    calls, _ = timed
    compiled = []
    assert select.decide(CHOICE, ("k",), candidates={"lib": None, "fast": None}, device=CPU) == "lib"  # CPU
    monkeypatch.setattr(precompile, "active", lambda: True)
    assert _decide(compile_all=lambda: compiled.append(1)) == "lib"
    monkeypatch.setattr(precompile, "active", lambda: False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _decide() == "lib"
    assert calls == [] and compiled == [1] and select.decisions("test_choice") == []


def test_a_candidate_that_fails_is_dropped_and_the_default_failing_raises(timed, caplog):
    caplog.set_level(logging.INFO, logger="sdfast.kernels")
    calls, times = timed
    times.update(lib=10.0, faster=1.0)

    def boom():
        raise RuntimeError("out of shared memory")

    cands = {"lib": lambda: None, "fast": boom, "faster": lambda: None}
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(rules, "interpret_mode", lambda: True)
    try:
        assert select.decide(CHOICE, ("k",), candidates=cands, device=CPU, measure_cpu=True) == "faster"
        assert calls == [["lib", "faster"]] and "fast failed: RuntimeError: out of shared memory" in caplog.text
        with pytest.raises(RuntimeError, match="out of shared memory"):
            select.decide(CHOICE, ("k2",), candidates={"lib": boom, "fast": lambda: None}, device=CPU,
                          measure_cpu=True)
    finally:
        monkeypatch.undo()


def test_a_custom_measure_replaces_the_timer_and_missing_means_failed(timed):
    calls, _ = timed
    got = select.decide(CHOICE, ("k",), candidates=["lib", "fast", "faster"], device=CPU, measure_cpu=True,
                        measure=lambda live: {"lib": 5.0, "fast": 1.0})
    assert got == "fast" and calls == []
    with pytest.raises(RuntimeError, match="every candidate failed"):
        select.decide(CHOICE, ("k2",), candidates=["lib", "fast"], device=CPU, measure_cpu=True, measure=lambda l: {})


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="margin"):
        select.Choice("x", default="a", margin=0.0)
    with pytest.raises(ValueError, match="default 'lib' is not among"):
        select.decide(CHOICE, ("k",), candidates={"fast": None}, device=CPU)


def test_signature_tells_apart_shapes_strides_dtypes_and_absence():
    x = torch.zeros(2, 3)
    assert select.signature(x, None) == select.signature(torch.ones(2, 3), None)
    assert select.signature(x) != select.signature(x.t().contiguous().t())
    assert select.signature(x) != select.signature(x.half()) != select.signature(None)


@pytest.fixture
def saved_file(tmp_path, monkeypatch, fresh_choices):
    """The store as on a GPU named "Test GPU": persisting into tmp_path."""
    monkeypatch.setenv("SDFAST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(store, "_persist", True)
    monkeypatch.setattr(store, "_saved", None)
    monkeypatch.setattr(store, "_dirty", False)
    monkeypatch.setattr(store, "device_name", lambda device: "Test GPU")
    monkeypatch.setattr(store, "_driver_version", lambda: "555.1")
    return tmp_path


def _measured(key, winner):
    d = select.Decision("test_choice", repr(key), winner, {"lib": 2.0, winner: 1.0}, "measured", {}, "Test GPU")
    return store.record(d, key, save=True)


def test_saved_choices_are_read_back_by_a_second_process(saved_file):
    _measured(("a", 1), "fast")
    path = select.save()
    assert path == select.saved_path() and path.parent == saved_file / "choices" and path.name.startswith("test-gpu-")
    assert select.save() is None  # nothing new since
    data = json.loads(path.read_text())
    assert data["key"]["gpu"] == "Test GPU" and data["decisions"][0]["winner"] == "fast"
    select.clear()
    store._saved = None  # a new process: nothing in memory, the file not read yet
    assert select.load() == 1
    found = store.lookup("test_choice", "Test GPU", ("a", 1))
    assert (found.winner, found.source) == ("fast", "saved")
    assert [d.source for d in select.decisions()] == ["saved"]


def test_a_changed_version_reads_another_file(saved_file, monkeypatch):
    _measured(("a", 1), "fast")
    first = select.save()
    monkeypatch.setattr(store, "_driver_version", lambda: "560.0")
    assert select.saved_path() != first
    select.clear()
    store._saved = None
    assert store.lookup("test_choice", "Test GPU", ("a", 1)) is None  # measured again


def test_an_unreadable_file_is_logged_and_ignored(saved_file, caplog):
    path = select.saved_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert select.load() == 0 and "ignoring the saved kernel choices" in caplog.text


def test_tests_do_not_persist(fresh_choices):
    assert store._persist is False and select.save() is None
