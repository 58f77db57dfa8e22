"""Issue 33 on the GPU (marker ``gpu``): ``sdfast.runtime.step_batch`` on the optimized engine (fused kernels, CUDA
graphs): requests of every kind mixed in one batch give their image alone (up to fp16 batched-kernel rounding), the
UNet replays one graph per row bucket (no capture once the buckets are warm), the timesteps stay on the host, and the
cross-attention K/V is projected again only when the batch's membership changes. The service's real CUDA OOM in a
continuous batch: ``tests/server/test_gpu_service.py``."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import sdfast
from sdfast.runtime.step_batch import StepBatch, group_key

pytestmark = pytest.mark.gpu


def psnr(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = np.mean((a - b) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.fixture(scope="module", params=["random:sd15", "random:sdxl"])
def fast(request):
    engine = sdfast.load(request.param)
    yield engine
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def _requests(engine, size):
    kinds = [(None, 7.5, 6), ("euler_a", 1.0, 5), ("dpmpp_2m", 5.0, 7), ("ddim", 1.0, 4), ("unipc", 7.5, 5)]
    return [engine.request(f"a photo of thing {i}", negative_prompt="blurry" if i % 2 else None, seed=40 + i,
                           scheduler=name, guidance_scale=g, num_inference_steps=steps, width=size, height=size)
            for i, (name, g, steps) in enumerate(kinds)]


def test_mixed_requests_give_their_image_alone_and_reuse_one_graph_per_bucket(fast):
    size = 512 if fast.pipe.unet.config.sample_size == 64 else 768  # SDXL at 768² keeps the test short
    requests = _requests(fast, size)
    alone = [fast.run(r)[0] for r in requests]
    batch = StepBatch(fast, group_key(fast, requests[0]))
    assert batch.buckets is not None  # graphed: padded to buckets
    runner = fast.pipe._sdfast.graphs.runners["unet"]

    memberships = []  # the batch's members at each step

    def run_all(join_every):
        pending, out = list(enumerate(requests)), {}
        memberships.clear()
        while pending or batch.slots:
            if pending:
                take, pending = pending[:join_every], pending[join_every:]
                batch.join([r for _, r in take], tags=[i for i, _ in take])
            memberships.append(tuple(s.tag for s in batch.slots))
            result = batch.step()
            assert not result.failed
            for slot, images in zip(result.finished, batch.decode(result.finished)):
                batch.leave(slot)
                out[slot.tag] = images[0]
        return out

    run_all(2)  # warms every bucket this membership sequence uses
    captures, eager, projections = runner.stats.captures, runner.stats.eager_calls, runner.stats.conditioning_runs
    replays = runner.stats.replays
    got = run_all(2)
    assert runner.stats.captures == captures and runner.stats.eager_calls == eager
    assert runner.stats.replays - replays == len(memberships)
    # the K/V projected once per stretch of steps with the same members (after a join or a leave), not once per step
    stretches = 1 + sum(a != b for a, b in zip(memberships, memberships[1:]))
    assert runner.stats.conditioning_runs - projections == stretches < len(memberships)
    for i, (a, b) in enumerate(zip(alone, [got[i] for i in range(len(requests))])):
        assert psnr(a, b) >= 35, (i, requests[i].scheduler, psnr(a, b))
    assert all(s.timesteps.device.type == "cpu" for s in batch.slots)
