"""Issue 33: continuous (step-level) batching in the service, on the real engine (``random:tiny``, the stock pipeline on
the CPU): a short request sent while a long one runs finishes first; oldest first between sizes; cancellation by the
client and by the deadline frees the place at the next step; out of memory retries in smaller groups before a 503;
the static mode stays available."""

from __future__ import annotations

import gc
import io
import time
import weakref

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from sdfast.request import Txt2ImgRequest
from server.app import create_app
from server.continuous import ContinuousWorker
from server.worker import Cancelled, DeadlineExceeded, GPUOutOfMemory, InvalidRequest, Job, Worker

from .helpers import health, metric_value, serving, wait_for

PACE_S = 0.01  # at least this long per UNet call, whatever the machine's speed


@pytest.fixture(scope="module")
def tiny(stock_tiny):
    return stock_tiny


@pytest.fixture
def unet_rows(tiny):
    """The UNet's batch rows of every call from now on (each call paced to ``PACE_S``)."""
    rows = []

    def hook(module, args, kwargs):
        rows.append(args[0].shape[0] if args else kwargs["sample"].shape[0])
        time.sleep(PACE_S)

    handle = tiny.pipe.unet.register_forward_pre_hook(hook, with_kwargs=True)
    yield rows
    handle.remove()


def request(prompt="a cat", *, seed=1, steps=2, size=64, guidance=7.5, scheduler=None, n=1, negative=None):
    return Txt2ImgRequest.build([prompt] * n, negative_prompt=None if negative is None else [negative] * n,
                                seed=[seed + i for i in range(n)], width=size, height=64, num_inference_steps=steps,
                                guidance_scale=guidance, scheduler=scheduler)


def job(req, timeout_s=60.0) -> Job:
    return Job(request=req, timeout_s=timeout_s)


@pytest.fixture
def worker(tiny):
    made = []

    def make(**kw):
        w = ContinuousWorker(tiny, **{"max_batch": 4, "queue_size": 8, **kw})
        w.start()
        made.append(w)
        return w

    yield make
    for w in made:
        w.stop()


def _px(image) -> np.ndarray:
    return np.asarray(image).astype(np.int16)


def _close_to(images, alone) -> bool:
    return len(images) == len(alone) and all(np.abs(_px(a) - _px(b)).max() <= 1 for a, b in zip(images, alone))


def test_a_short_request_sent_while_a_long_one_runs_finishes_first(tiny, worker, unet_rows):
    long_req = request("a long walk", seed=3, steps=25, scheduler="euler_a")
    short_req = request("a cat", seed=4, steps=2, guidance=1.0, scheduler="dpmpp_2m")
    long_alone, short_alone = tiny.run(long_req), tiny.run(short_req)
    unet_rows.clear()
    w = worker()
    long_job = job(long_req)
    w.submit(long_job)
    wait_for(lambda: long_job.steps_run >= 3, what="the long request to be running")
    short_job = job(short_req)
    w.submit(short_job)
    short = short_job.future.result(30)
    assert not long_job.future.done(), "the short request waited for the long one"
    assert long_job.steps_run < 25
    long = long_job.future.result(30)
    assert short.batch_images == 2 and short.queue_s < 1.0  # it shared its steps with the long request
    assert _close_to(short.images, short_alone) and _close_to(long.images, long_alone)
    assert max(unet_rows) == 3  # 2 CFG rows + 1 row without CFG in one UNet call
    assert not w.busy and w.in_flight == 0


def test_oldest_first_between_sizes_and_no_group_waits_for_ever(worker, unet_rows):
    w = worker()
    a = job(request("a", seed=1, steps=12))
    w.submit(a)
    wait_for(lambda: a.steps_run >= 1, what="a running")
    b, c = job(request("b", seed=2, steps=2, size=96)), job(request("c", seed=3, steps=30))
    w.submit(b)
    w.submit(c)  # younger than b, of a's size: it joins a's group, then waits while b (older) runs
    done = []
    for j, name in ((a, "a"), (b, "b"), (c, "c")):
        j.future.add_done_callback(lambda f, name=name: done.append(name))
    c.future.result(30)
    # c was in flight before b started, and b (older) still went first: c's group took no step while b ran
    assert done == ["a", "b", "c"] and c.first_step_at < b.first_step_at
    assert c.steps_run == 31 and a.future.result().batch_images == 2  # PNDM: steps + 1 iterations


def test_a_cancelled_request_and_one_past_its_deadline_free_their_places_at_the_next_step(worker, unet_rows):
    """Two long requests fill the batch (max_batch 2); a third waits. The client of the first leaves
    (``Worker.cancel``, what the HTTP handler calls): at the next step it is out and the third runs, beside the second,
    which leaves at the step after its deadline."""
    w = worker(max_batch=2)
    first, second = job(request("a", seed=1, steps=150)), job(request("b", seed=2, steps=150), timeout_s=2.5)
    third = job(request("c", seed=3, steps=3))
    for j in (first, second):
        w.submit(j)
    wait_for(lambda: first.steps_run >= 2 and second.steps_run >= 2, what="both running")
    w.submit(third)
    time.sleep(0.1)
    assert third.started_at is None and w.depth == 1  # no place for it
    w.cancel(first)
    assert third.future.result(20).images
    with pytest.raises(Cancelled, match=r"stopped after step \d+ of 151"):
        first.future.result(1)
    assert first.steps_run < 75 and not second.future.done()  # the second went on beside the third
    with pytest.raises(DeadlineExceeded, match=r"2.5 s deadline; stopped after step \d+ of 151"):
        second.future.result(10)
    assert second.steps_run < 150
    wait_for(lambda: not w.busy, timeout=5, what="the worker idle")


def test_a_client_that_disconnects_frees_its_place_at_the_next_step(tiny, unet_rows):
    app = create_app(tiny, max_batch=1, queue_size=4, api_key="", poll_interval_s=0.02)
    body = {"prompt": "a cat", "seed": 5, "width": 64, "height": 64, "num_inference_steps": 150}
    with serving(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=url, timeout=0.5) as impatient:
            impatient.post("/v1/txt2img", json=body)
        t0 = time.monotonic()
        r = c.post("/v1/txt2img", json={**body, "num_inference_steps": 2})  # needs the one place
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < 5
        steps = len(unet_rows)
        assert steps < 100, f"the departed client's request ran {steps} steps"
        h, text = health(c), c.get("/metrics").text
    assert h["batching"] == "continuous" and h["in_flight_images"] == 0
    assert metric_value(text, "sdfast_generation_latency_seconds_count", outcome="cancelled") == 1
    assert metric_value(text, "sdfast_generation_latency_seconds_count", outcome="ok") == 1
    assert metric_value(text, "sdfast_time_to_first_step_seconds_count") == 2
    assert metric_value(text, "sdfast_queue_wait_seconds_count") == 2
    assert metric_value(text, "sdfast_steps_total", outcome="ok") == steps
    assert metric_value(text, "sdfast_step_images_count") == steps and metric_value(text, "sdfast_step_images_sum") == steps


def test_out_of_memory_retries_in_smaller_groups_before_any_503(tiny, unet_rows):
    """A UNet call of more than 2 rows runs out of memory (simulated): three CFG requests (2 rows each) that joined
    together are stepped one per call, and all get their images; a request of 2 images (4 rows) runs out of memory
    alone and gets 503, and the memory its failed call held is not referenced; the worker goes on."""
    requests = [request(p, seed=10 * i, steps=2) for i, p in enumerate(["a", "b c", "d e f"])]
    alone = [tiny.run(r) for r in requests]
    held = []
    unet_forward = tiny.pipe.unet.forward

    def small_batches_only(sample, *args, **kwargs):
        if sample.shape[0] > 2:
            scratch = torch.ones(1 << 16)
            held.append(weakref.ref(scratch))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return unet_forward(sample, *args, **kwargs)

    steps = []
    w = ContinuousWorker(tiny, max_batch=4, queue_size=8, on_step=lambda n, s, o: steps.append((n, o)))
    jobs = [job(r) for r in requests]
    big = job(request("g", seed=7, steps=2, n=2))
    tiny.pipe.unet.forward = small_batches_only
    try:
        with w._cond:  # queued before the thread can take any: they join at the same step boundary
            for j in jobs:
                w.submit(j)
        results = [j.future.result(30) for j in jobs]
        w.submit(big)
        with pytest.raises(GPUOutOfMemory, match="out of GPU memory generating 2 image"):
            big.future.result(30)
        after = job(request("h", seed=8, steps=2, guidance=1.0))
        w.submit(after)
        assert after.future.result(30).images
    finally:
        del tiny.pipe.unet.forward
        w.stop()
    assert all(_close_to(r.images, a) for r, a in zip(results, alone))
    assert steps[:3] == [(3, "oom"), (2, "oom"), (1, "ok")]  # 3 requests, then 2 and 1, then 1 by 1
    assert ("oom" not in {o for _, o in steps[3:9]}) and (2, "oom") in steps[9:]
    gc.collect()
    assert held and all(ref() is None for ref in held), "a failed call's tensors are still referenced"


def test_the_static_mode_stays_available(tiny, unet_rows):
    app = create_app(tiny, max_batch=2, api_key="", batching="static")
    assert type(app.state.service.worker) is Worker and app.state.service.worker.mode == "static"
    with serving(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/v1/txt2img", json={"prompt": "a cat", "seed": 5, "width": 64, "height": 64,
                                        "num_inference_steps": 2})
        assert r.status_code == 200 and health(c)["batching"] == "static"
        text = c.get("/metrics").text
    expected = tiny.txt2img("a cat", seed=5, width=64, height=64, num_inference_steps=2)[0]
    assert np.array_equal(_px(Image.open(io.BytesIO(r.content)).convert("RGB")), _px(expected))
    assert metric_value(text, "sdfast_time_to_first_step_seconds_count") == 1  # the engine's step callback
    with pytest.raises(ValueError, match="batching must be one of continuous, static"):
        create_app(tiny, batching="dynamic")


def test_a_request_the_engine_refuses_gets_the_same_422(tiny, worker):
    """The step path refuses what ``Engine.run`` refuses, with its message (here a scheduler step limit the
    service's own check would catch first)."""
    w = worker()
    bad = job(request("a cat", steps=60, scheduler="lcm"))
    w.submit(bad)
    with pytest.raises(InvalidRequest, match="num_inference_steps: at most 50 with the lcm scheduler") as e:
        bad.future.result(20)
    assert e.value.field == "num_inference_steps"
    ok = job(request("a cat", steps=2))
    w.submit(ok)
    assert ok.future.result(20).images
