"""Issue 33: ``sdfast.runtime.step_batch`` on ``random:tiny`` / ``random:tiny-xl`` (stock pipelines on the CPU): a
request stepped alone is the engine's image bit for bit; every scheduler with CFG on and off, joining at different
steps of one batch, gives its image alone (within 1/255); padding to a bucket; the 422s of ``Engine.run``; an OOM of
the UNet call advances no slot; a slot's own failures stay its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sdfast
from sdfast.errors import InvalidRequestError, NonFiniteOutputError
from sdfast.request import Img2ImgRequest
from sdfast.runtime.step_batch import StepBatch, StepKey, bucket_rows, group_key, supports
from sdfast.schedulers import SCHEDULERS

SIZE = dict(width=64, height=64)


@pytest.fixture(scope="module")
def tiny(stock_tiny):
    return stock_tiny


@pytest.fixture(scope="module")
def tiny_xl():
    return sdfast.load("random:tiny-xl", optimize=False)


def _px(image) -> np.ndarray:
    return np.asarray(image).astype(np.int16)


def _run_all(batch: StepBatch, requests: list, join_every: int = 0) -> dict:
    """Step ``requests`` through ``batch``: all at once (``join_every`` 0), or ``join_every`` more at each step
    boundary; each finished slot decoded and taken out at once. Returns {request index: pixels of its images}."""
    pending = list(enumerate(requests))
    out = {}
    while pending or batch.slots:
        take = pending if not join_every else pending[:join_every]
        if take:
            pending = pending[len(take):]
            slots = batch.join([r for _, r in take], tags=[i for i, _ in take])
            assert all(s is not None and not isinstance(s, Exception) for s in slots), slots
        result = batch.step()
        assert not result.failed, result.failed
        for slot, images in zip(result.finished, batch.decode(result.finished)):
            batch.leave(slot)
            out[slot.tag] = [_px(im) for im in images]
    return out


def _alone(engine, requests) -> list:
    return [[_px(im) for im in engine.run(r)] for r in requests]


def test_a_request_stepped_alone_is_the_engines_image_bit_for_bit(tiny):
    requests = [tiny.request("a cat", seed=3, num_inference_steps=3, **SIZE),  # PNDM (the model's), CFG
                tiny.request("a dog", negative_prompt="blurry", seed=4, num_inference_steps=2, scheduler="euler_a",
                             **SIZE),
                tiny.request(["a red car", "a boat"], seed=5, num_images_per_prompt=2, guidance_scale=1.0,
                             num_inference_steps=2, scheduler="dpmpp_2m", **SIZE)]
    batch = StepBatch(tiny, StepKey(64, 64))
    for i, request in enumerate(requests):
        got = _run_all(batch, [request])[0]
        alone = [_px(im) for im in tiny.run(request)]
        assert len(got) == request.num_images and all(np.array_equal(a, b) for a, b in zip(got, alone)), i
    assert batch.slots == [] and batch.images == 0


def _every_scheduler(engine, steps=(2, 3)) -> list:
    """One request per scheduler (and the model's own) with CFG on, one with CFG off; step counts, negative prompts
    and seeds differ from one to the next."""
    out = []
    for i, name in enumerate([None, *SCHEDULERS]):
        for guidance in (6.0, 1.0):
            out.append(engine.request(f"a cat number {i}", negative_prompt="blurry" if i % 2 else None,
                                      seed=100 + 2 * i + (guidance == 1.0), guidance_scale=guidance,
                                      num_inference_steps=steps[i % len(steps)], scheduler=name, **SIZE))
    return out


@pytest.mark.parametrize("model", ["tiny", "tiny_xl"])
def test_every_scheduler_with_cfg_on_and_off_in_one_batch_gives_its_image_alone(model, request):
    engine = request.getfixturevalue(model)
    requests = _every_scheduler(engine)
    alone = _alone(engine, requests)
    batch = StepBatch(engine, group_key(engine, requests[0]))
    got = _run_all(batch, requests, join_every=5)  # joins at three step boundaries, mid-flight
    for i, images in enumerate(alone):
        assert len(got[i]) == 1
        assert np.abs(got[i][0] - images[0]).max() <= 1, (i, requests[i].scheduler, requests[i].guidance_scale)


def test_padding_to_a_bucket_changes_no_image(tiny):
    requests = [tiny.request("a cat", seed=1, num_inference_steps=2, **SIZE),
                tiny.request("a dog", seed=2, num_inference_steps=2, guidance_scale=1.0, scheduler="euler", **SIZE)]
    alone = _alone(tiny, requests)
    batch = StepBatch(tiny, StepKey(64, 64), buckets=(4, 8))  # 2 + 1 rows padded to 4; PNDM's 3rd iteration: 2 to 4
    rows = []
    unet_forward = tiny.pipe.unet.forward
    tiny.pipe.unet.forward = lambda sample, *a, **k: rows.append(sample.shape[0]) or unet_forward(sample, *a, **k)
    try:
        got = _run_all(batch, requests)
    finally:
        del tiny.pipe.unet.forward
    assert rows == [4, 4, 4]
    assert all(np.abs(got[i][0] - alone[i][0]).max() <= 1 for i in range(2))
    assert [bucket_rows(r, (1, 2, 4, 8)) for r in (1, 3, 5, 8, 9, 17)] == [1, 4, 8, 8, 16, 24]


def test_join_refuses_alone_what_the_engine_refuses(tiny):
    batch = StepBatch(tiny, StepKey(64, 64))
    good = tiny.request("a cat", seed=1, num_inference_steps=2, **SIZE)
    too_many = tiny.request("a cat", seed=1, num_inference_steps=60, scheduler="lcm", **SIZE)
    other_size = tiny.request("a cat", seed=1, num_inference_steps=2, width=128, height=64)
    image = Img2ImgRequest.build(np.zeros((64, 64, 3), np.uint8), "a cat", seed=1, num_inference_steps=2)
    slot, refused, size, img2img = batch.join([good, too_many, other_size, image])
    assert batch.slots == [slot]
    with pytest.raises(InvalidRequestError) as engine_says:
        tiny.run(too_many)
    assert isinstance(refused, InvalidRequestError) and refused.field == engine_says.value.field == "num_inference_steps"
    assert str(refused) == str(engine_says.value)
    assert isinstance(size, ValueError) and "128" in str(size)
    assert isinstance(img2img, ValueError) and not supports(tiny, image) and supports(tiny, good)
    assert not supports(tiny, tiny.request("a cat", seed=1, num_inference_steps=4, cache_interval=2, **SIZE))


def test_long_prompts_get_their_own_key(tiny_xl):
    long = ", ".join(["a very detailed oil painting of a quiet harbour town at dawn"] * 8)
    short, longer = tiny_xl.request("a cat", seed=1, **SIZE), tiny_xl.request(long, seed=2, **SIZE)
    assert group_key(tiny_xl, short) == StepKey(64, 64, 1) and group_key(tiny_xl, longer) == StepKey(64, 64, 2)
    no_cfg = tiny_xl.request("a cat", negative_prompt=long, guidance_scale=1.0, seed=1, **SIZE)
    assert group_key(tiny_xl, no_cfg).windows == 1  # without CFG the negative prompt is never encoded


def test_an_oom_of_the_unet_call_advances_no_slot_and_halves_then_run(tiny):
    requests = [tiny.request(p, seed=i, num_inference_steps=2, **SIZE) for i, p in enumerate(["a", "b c", "d e f"])]
    alone = _alone(tiny, requests)
    batch = StepBatch(tiny, StepKey(64, 64))
    slots = batch.join(requests, tags=[0, 1, 2])
    unet_forward = tiny.pipe.unet.forward

    def small_batches_only(sample, *args, **kwargs):
        if sample.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return unet_forward(sample, *args, **kwargs)

    tiny.pipe.unet.forward = small_batches_only
    try:
        with pytest.raises(torch.OutOfMemoryError):
            batch.step()
        assert [s.step for s in slots] == [0, 0, 0]
        for _ in range(2):
            for s in slots:  # one request (2 CFG rows) per UNet call
                batch.step([s])
    finally:
        del tiny.pipe.unet.forward
    images = batch.decode(slots)
    assert all(np.abs(_px(images[i][0]) - alone[i][0]).max() <= 1 for i in range(3))


def test_a_slots_own_failures_are_its_own(tiny):
    requests = [tiny.request(p, seed=i, num_inference_steps=2, **SIZE) for i, p in enumerate(["a", "b", "c"])]
    batch = StepBatch(tiny, StepKey(64, 64))
    first, broken, third = batch.join(requests)

    def boom(*args, **kwargs):
        raise RuntimeError("scheduler exploded")

    broken.scheduler.step = boom
    result = batch.step()
    assert [(s, str(e)) for s, e in result.failed] == [(broken, "scheduler exploded")]
    assert batch.slots == [first, third] and first.step == third.step == 1
    batch.step()
    third.latents[0, 0, 0, 0] = float("nan")  # decoded with NaN pixels: an error for it alone
    ok, bad = batch.decode([first, third])
    assert isinstance(bad, NonFiniteOutputError) and "NaN/Inf" in str(bad)
    assert ok[0].info["seed"] == "0" and ok[0].size == (64, 64)
