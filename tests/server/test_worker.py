"""Issue 9: the worker thread on its own (no HTTP): batching, cancellation, deadlines, failures."""

from __future__ import annotations

import gc
import weakref
import threading

import pytest
import torch

from sdfast.request import Txt2ImgRequest
from server.worker import (
    Cancelled,
    DeadlineExceeded,
    GenerationFailed,
    GPUOutOfMemory,
    Job,
    QueueFull,
    ShuttingDown,
    Worker,
)

from .helpers import FakeEngine, seed_color, wait_for


def job(prompt="a cat", seeds=(1,), *, width=64, height=64, steps=2, guidance=7.5, scheduler=None,
        negative=None, timeout_s=30.0, windows=(1, 1)) -> Job:
    request = Txt2ImgRequest.build(
        [prompt] * len(seeds), negative_prompt=None if negative is None else [negative] * len(seeds), seed=list(seeds),
        width=width, height=height, num_inference_steps=steps, guidance_scale=guidance, scheduler=scheduler)
    return Job(request=request, timeout_s=timeout_s, text_windows=windows)


@pytest.fixture
def gated():
    """A worker (max_batch 4, queue 8) whose engine blocks each call until ``gate`` is set."""
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    worker = Worker(engine, max_batch=4, queue_size=8)
    worker.start()
    yield worker, engine, gate
    gate.set()
    worker.stop()


def _block_worker(worker, engine):
    """Submit a job and wait until the engine runs it (so later jobs queue up)."""
    first = job("blocker", seeds=[999])
    worker.submit(first)
    assert engine.started.wait(10)
    return first


def test_compatible_jobs_share_one_call_within_max_batch(gated):
    worker, engine, gate = gated
    first = _block_worker(worker, engine)
    a = job("a", seeds=[10])
    b = job("bb", seeds=[20, 21])
    other_size = job("c", seeds=[30], width=128)
    d = job("dddd", seeds=[40])
    e = job("e", seeds=[50])  # would make 5 images: waits for the next call
    other_steps = job("f", seeds=[60], steps=3)
    neg = job("g", seeds=[70], negative="blurry")
    for j in (a, b, other_size, d, e, other_steps, neg):
        worker.submit(j)
    assert worker.depth == 7
    gate.set()
    for j in (first, a, b, other_size, d, e, other_steps, neg):
        j.future.result(10)
    calls = [(c["prompts"], c["seeds"], c["width"], c["steps"], c["negative_prompt"]) for c in engine.calls]
    assert calls == [
        (["blocker"], [999], 64, 2, None),
        (["a", "bb", "bb", "dddd"], [10, 20, 21, 40], 64, 2, None),  # oldest first, compatible ones join
        (["c"], [30], 128, 2, None),
        (["e"], [50], 64, 2, None),
        (["f"], [60], 64, 3, None),
        (["g"], [70], 64, 2, ["blurry"]),
    ]
    assert all(c["num_images_per_prompt"] == 1 for c in engine.calls)
    # Each job gets its own images, in its seed order.
    got = b.future.result()
    assert [im.info["seed"] for im in got.images] == ["20", "21"]
    assert got.images[1].getpixel((0, 0)) == seed_color(21, "bb")
    assert got.batch_images == 4 and a.future.result().batch_images == 4
    assert worker.depth == 0


def test_negative_prompt_and_none_do_not_mix(gated):
    worker, engine, gate = gated
    _block_worker(worker, engine)
    jobs = [job("x", seeds=[1], negative=None), job("y", seeds=[2], negative=""), job("z", seeds=[3], negative="ugly")]
    for j in jobs:
        worker.submit(j)
    gate.set()
    for j in jobs:
        j.future.result(10)
    assert [c["negative_prompt"] for c in engine.calls[1:]] == [None, ["", "ugly"]]


def test_prompts_of_different_clip_window_counts_do_not_mix(gated):
    worker, engine, gate = gated
    _block_worker(worker, engine)
    jobs = [job("short", seeds=[1]), job("long " * 80, seeds=[2], windows=(2, 1)), job("short too", seeds=[3]),
            job("long " * 90, seeds=[4], windows=(2, 1)), job("neg long", seeds=[5], negative="x " * 80, windows=(1, 2))]
    for j in jobs:
        worker.submit(j)
    gate.set()
    for j in jobs:
        j.future.result(10)
    assert [c["seeds"] for c in engine.calls[1:]] == [[1, 3], [2, 4], [5]]


def test_full_queue_raises_at_once_and_cancel_releases_the_place(gated):
    worker, engine, gate = gated
    _block_worker(worker, engine)
    waiting = [job(seeds=[i]) for i in range(8)]
    for j in waiting:
        worker.submit(j)
    with pytest.raises(QueueFull, match="queue is full"):
        worker.submit(job(seeds=[100]))
    assert worker.cancel(waiting[3]) is True
    assert worker.depth == 7
    late = job(seeds=[101])
    worker.submit(late)  # the released place is free again
    gate.set()
    late.future.result(10)
    assert waiting[3].future.cancelled()
    assert all(3 not in c["seeds"] for c in engine.calls), "the cancelled job ran"


def test_expired_job_is_not_run(gated):
    worker, engine, gate = gated
    _block_worker(worker, engine)
    stale = job(seeds=[7], timeout_s=0.05)
    worker.submit(stale)
    threading.Event().wait(0.1)
    gate.set()
    with pytest.raises(DeadlineExceeded, match="deadline"):
        stale.future.result(10)
    wait_for(lambda: not worker.busy, what="worker idle")
    assert all(7 not in c["seeds"] for c in engine.calls)


def test_oom_fails_that_batch_frees_its_memory_and_the_worker_goes_on():
    engine = FakeEngine(failures=[torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")],
                        hold=True)
    outcomes = []
    worker = Worker(engine, max_batch=4, queue_size=4, on_batch=lambda n, s, o: outcomes.append((n, o)))
    worker.start()
    try:
        bad = job(seeds=[1, 2])
        worker.submit(bad)
        with pytest.raises(GPUOutOfMemory, match="out of GPU memory") as info:
            bad.future.result(10)
        assert info.value.status == 503
        assert info.value.__cause__ is None and info.value.__context__ is None  # the engine's frames are not kept
        del info
        gc.collect()
        assert engine.held and engine.held[0]() is None, "the failed call's tensors are still referenced"
        good = job(seeds=[3])
        worker.submit(good)
        assert good.future.result(10).images[0].info["seed"] == "3"
        assert outcomes == [(0, "oom"), (1, "ok")]
        assert worker.alive
    finally:
        worker.stop()


class ChainedOOMEngine(FakeEngine):
    """Runs out of memory while handling an earlier out-of-memory error (as a fallback path does):
    the tensor lives only in a frame of the first error's traceback, reachable via ``__context__``."""

    def run(self, request, **kw):
        def first_try():
            held = torch.ones(1 << 16)
            self.held.append(weakref.ref(held))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (first try)")

        try:
            first_try()
        except torch.cuda.OutOfMemoryError:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fallback)")  # noqa: B904 - chained on purpose


def test_oom_raised_while_handling_an_oom_keeps_no_frame_of_either():
    engine = ChainedOOMEngine()
    worker = Worker(engine, max_batch=1, queue_size=4)
    worker.start()
    try:
        bad = job(seeds=[1])
        worker.submit(bad)
        with pytest.raises(GPUOutOfMemory):
            bad.future.result(10)
        wait_for(lambda: not worker.busy, what="worker idle")
        gc.collect()
        assert engine.held and engine.held[0]() is None, "the first error's frame still holds its tensor"
    finally:
        worker.stop()


def test_engine_error_fails_only_that_batch():
    engine = FakeEngine(failures=[RuntimeError("boom")])
    worker = Worker(engine, max_batch=1, queue_size=4)
    worker.start()
    try:
        bad, good = job(seeds=[1]), job(seeds=[2])
        worker.submit(bad)
        worker.submit(good)
        with pytest.raises(GenerationFailed, match="RuntimeError: boom"):
            bad.future.result(10)
        assert good.future.result(10).images[0].info["seed"] == "2"
        assert worker.alive
    finally:
        worker.stop()


def test_stop_fails_waiting_jobs_and_bad_sizes_are_refused(gated):
    worker, engine, gate = gated
    running = _block_worker(worker, engine)
    waiting = job(seeds=[5])
    worker.submit(waiting)
    stopper = threading.Thread(target=worker.stop)
    stopper.start()
    with pytest.raises(ShuttingDown):
        waiting.future.result(10)
    gate.set()
    stopper.join(10)
    assert not worker.alive and running.future.result(1).images
    with pytest.raises(ShuttingDown):
        worker.submit(job(seeds=[6]))
    with pytest.raises(ValueError, match="max_batch"):
        Worker(engine, max_batch=0)
    with pytest.raises(ValueError, match="queue_size"):
        Worker(engine, queue_size=0)


def test_oom_of_one_request_retries_the_others_in_halves(gated):
    """Issue 29 item 19: one request that runs out of memory fails alone; its batch-mates get their images."""
    worker, engine, gate = gated
    outcomes = []
    worker.on_batch = lambda n, s, o: outcomes.append((n, o))
    engine.oom_prompts = {"huge"}
    _block_worker(worker, engine)
    a, bad, b, c = job("a", seeds=[1]), job("huge", seeds=[2]), job("b", seeds=[3]), job("c", seeds=[4])
    for j in (a, bad, b, c):
        worker.submit(j)
    gate.set()
    for j, seed in ((a, 1), (b, 3), (c, 4)):
        assert j.future.result(10).images[0].info["seed"] == str(seed)
    with pytest.raises(GPUOutOfMemory, match="ran alone"):
        bad.future.result(10)
    assert [c["seeds"] for c in engine.calls[1:]] == [[1, 2, 3, 4], [1, 2], [1], [2], [3, 4]]
    assert outcomes[1:] == [(0, "oom"), (0, "oom"), (1, "ok"), (0, "oom"), (2, "ok")]
    assert b.future.result().batch_images == 2


def test_running_batch_stops_at_the_next_step_once_every_client_left():
    """Issue 29 item 13: a running batch stops when all its jobs are cancelled (not while one still waits)."""
    engine = FakeEngine(step_s=0.01)
    outcomes = []
    worker = Worker(engine, max_batch=4, queue_size=4, on_batch=lambda n, s, o: outcomes.append(o))
    worker.start()
    try:
        first, second = job("a", seeds=[1], steps=1000), job("a", seeds=[2], steps=1000)  # 10 s each if run out
        worker.submit(first)
        worker.submit(second)
        assert engine.started.wait(10)
        worker.cancel(first)
        threading.Event().wait(0.2)
        assert worker.busy, "stopped while one client still waited"
        worker.cancel(second)
        wait_for(lambda: not worker.busy, timeout=3, what="the batch to stop")
        assert engine.steps_run[0] < 500 and outcomes == ["cancelled"]
        with pytest.raises(Cancelled, match="stopped after step"):
            second.future.result(1)
        after = job("b", seeds=[3], steps=3)
        worker.submit(after)
        assert after.future.result(10).images[0].info["seed"] == "3"
    finally:
        worker.stop()


def test_running_batch_stops_at_the_next_step_past_its_deadline():
    engine = FakeEngine(step_s=0.01)
    worker = Worker(engine, max_batch=4, queue_size=4)
    worker.start()
    try:
        late = job(seeds=[1], steps=1000, timeout_s=0.3)
        worker.submit(late)
        with pytest.raises(DeadlineExceeded, match="0.3 s deadline; stopped after step"):
            late.future.result(5)
        assert engine.steps_run[0] < 500
    finally:
        worker.stop()
