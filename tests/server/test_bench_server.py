"""Issue 9: benchmarks/bench_server.py runs end to end on a fake engine (the real run is on a GPU machine); issue 33:
both batching modes, the open-loop load generator (Poisson arrivals, mixed steps and guidance) and the summary
against the targets, on the real engine (``random:tiny``)."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.bench_server import mix_bodies, percentile, poisson_gaps, run, summarize

from .helpers import FakeEngine


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == 9.9


def test_rows_for_each_mode_with_batching_on_and_off():
    engine = FakeEngine()
    rows = run(engine, max_batches=(2, 1), clients=3, requests=2, size=64, steps=1)
    assert [(r["batching"], r["max_batch"]) for r in rows] == [("continuous", 2), ("continuous", 1), ("static", 2),
                                                              ("static", 1)]
    assert [r["batching_on"] for r in rows] == [True, False, True, False]
    for r in rows:
        assert r["kind"] == "closed" and r["errors"] == 0 and r["requests"] == 6 and r["images_per_s"] > 0
        assert 0 < r["p50_s"] <= r["p99_s"] and r["model"] == "fake" and r["optimized"] is False
        assert 1 <= r["mean_batch_images"] <= r["max_batch"]
    assert rows[3]["engine_calls"] == 6
    assert sum(len(c["seeds"]) for c in engine.calls) == 4 * 6 + (1 + 2)  # the runs + warm-up at sizes 1, 2


def test_the_mix_and_the_arrivals_are_reproducible():
    bodies = mix_bodies(200, size=64, steps=(20, 30), guidances=(7.5, 1.0), seed=3)
    assert bodies == mix_bodies(200, size=64, steps=(20, 30), guidances=(7.5, 1.0), seed=3)
    assert {b["num_inference_steps"] for b in bodies} == set(range(20, 31))
    assert 60 < sum(b["guidance_scale"] == 1.0 for b in bodies) < 140 and len({b["seed"] for b in bodies}) == 200
    gaps = poisson_gaps(4000, 8.0, seed=3)
    assert gaps == poisson_gaps(4000, 8.0, seed=3) and abs(statistics.fmean(gaps) - 1 / 8) < 0.01


@pytest.fixture(scope="module")
def tiny(stock_tiny):
    return stock_tiny


def test_open_loop_against_static_batching_in_one_run(tiny):
    rows = run(tiny, max_batches=(2,), clients=2, requests=2, size=64, steps=1, open_loop=True, arrivals=4,
               mix_steps=(1, 2), engine_batches=(1, 2))
    kinds = [(r["kind"], r["batching"]) for r in rows]
    assert kinds[:5] == [("engine", "engine alone")] * 2 + [("closed", "continuous"), ("closed", "static"),
                                                            ("capacity", "static")]
    capacity = rows[4]
    opened = {r["batching"]: r for r in rows if r["kind"] == "open"}
    assert set(opened) == {"continuous", "static"}
    idle = [r for r in rows if r["kind"] == "idle"]
    assert idle and {r["batching"] for r in idle} == {"continuous", "static"}
    for r in opened.values():
        assert r["errors"] == 0 and r["requests"] == 4 and r["rate_per_s"] == pytest.approx(0.9 * capacity["images_per_s"])
        assert r["slowdown_p50"] > 0 and r["p99_s"] >= r["p50_s"] > 0
    assert opened["continuous"]["unet_steps"] > 0 and opened["static"]["unet_steps"] is None
    summary = summarize(rows)
    assert summary["engine_best"] == max(r["images_per_s"] for r in rows[:2])
    for name in ("saturation_vs_static", "saturation_vs_engine", "open_slowdown_p50", "open_slowdown_p99"):
        assert summary[name]["value"] > 0 and summary[name]["met"] in (True, False), name
