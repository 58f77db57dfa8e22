"""``runtime.async_upload`` on the GPU: a blocking CPU->CUDA copy made in the mode does not wait for the work queued
before it, and gives the same values. That the engine's samplers, in the mode, give stock's images is
``tests/test_schedulers_gpu.py``'s matrix."""

import time

import pytest
import torch

from sdfast.runtime.async_upload import AsyncUpload

pytestmark = pytest.mark.gpu


def _host_seconds(fn) -> float:
    """(host seconds of ``fn()`` issued behind about 0.5 s of queued GPU work, its result)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))  # ~0.5 s on a ~2 GHz SM clock
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt, out


def test_a_copy_in_the_mode_does_not_wait_and_keeps_the_values():
    x = torch.randn(2, 4, 64, 64)
    waited, stock = _host_seconds(lambda: x.to("cuda"))
    assert waited > 0.1  # the reason for the mode: a blocking copy waits for the queue
    with AsyncUpload() as mode:
        quick, ours = _host_seconds(lambda: x.to("cuda"))
        _, half = _host_seconds(lambda: x.to(device=torch.device("cuda"), dtype=torch.float16))
    assert quick < 0.05, quick
    assert torch.equal(ours, stock) and ours.device.type == "cuda"
    assert torch.equal(half, stock.half())
    assert torch.equal(mode.host_copy(ours), x) and mode.host_copy(ours) is not x
    ours.add_(1)  # changed on the GPU since: its host values are no longer the source's
    assert torch.equal(mode.host_copy(ours), x + 1)
