"""Issue 9: benchmarks/bench_server.py runs end to end on a fake engine (the real run is on a GPU machine)."""

from __future__ import annotations

from benchmarks.bench_server import percentile, run

from .helpers import FakeEngine


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == 9.9


def test_rows_for_batching_on_and_off():
    engine = FakeEngine()
    rows = run(engine, max_batches=(2, 1), clients=3, requests=2, size=64, steps=1)
    assert [r["max_batch"] for r in rows] == [2, 1] and [r["batching"] for r in rows] == ["on", "off"]
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == 6 and r["images_per_s"] > 0
        assert 0 < r["p50_s"] <= r["p99_s"] and r["model"] == "fake" and r["optimized"] is False
        assert 1 <= r["mean_batch_images"] <= r["max_batch"]
    assert rows[1]["engine_calls"] == 6
    assert sum(len(c["seeds"]) for c in engine.calls) == 2 * 6 + (1 + 2)  # the runs + warm-up at sizes 1, 2
