"""Issue 29 item 13: a request past its deadline (or whose client left) stops its generation at the next
denoising step, on the real engine (``random:tiny`` on the CPU), and the engine's next image is unchanged."""

from __future__ import annotations

import io
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from sdfast.errors import GenerationCancelled
from server.app import create_app

from .helpers import serving, wait_for

SMALL = {"prompt": "a cat", "num_inference_steps": 3, "seed": 5, "width": 64, "height": 64}


@pytest.fixture
def unet_calls(stock_tiny):
    """A list that gets one entry per UNet forward (one per denoising step without CFG batching) from now on."""
    calls = []
    handle = stock_tiny.pipe.unet.register_forward_hook(lambda *a: calls.append(1))
    yield calls
    handle.remove()


def test_should_stop_stops_at_the_step_and_the_next_image_is_unchanged(stock_tiny, unet_calls):
    kw = dict(num_inference_steps=3, seed=5, width=64, height=64)
    reference = np.asarray(stock_tiny.txt2img("a cat", **kw)[0])
    calls = unet_calls
    calls.clear()
    with pytest.raises(GenerationCancelled, match="after step 2 of") as info:
        stock_tiny.txt2img("a dog", num_inference_steps=50, seed=1, width=64, height=64,
                            should_stop=lambda: len(calls) >= 2)
    assert info.value.step == 2 and len(calls) == 2
    assert np.array_equal(np.asarray(stock_tiny.txt2img("a cat", **kw)[0]), reference)


def test_request_past_its_deadline_stops_its_generation_early(stock_tiny, unet_calls):
    reference = np.asarray(stock_tiny.txt2img("a cat", num_inference_steps=3, seed=5, width=64, height=64)[0])
    calls = unet_calls
    calls.clear()
    app = create_app(stock_tiny, api_key="", request_timeout_s=1.0)
    # at least 20 ms per step whatever the machine's speed (150 steps: over 3 s if run out; a fast machine ran the tiny
    # UNet's 150 steps inside the 1 s deadline)
    pace = stock_tiny.pipe.unet.register_forward_hook(lambda *a: time.sleep(0.02))
    with serving(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        t0 = time.monotonic()
        try:
            r = c.post("/v1/txt2img", json={**SMALL, "num_inference_steps": 150})
            assert r.status_code == 504, r.text
            wait_for(lambda: not c.get("/health").json()["busy"], timeout=5, what="the generation to stop")
        finally:
            pace.remove()
        assert time.monotonic() - t0 < 6
        assert len(calls) < 75, f"ran {len(calls)} of 150 steps after its deadline"
        ok = c.post("/v1/txt2img", json=SMALL)
        assert ok.status_code == 200
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(ok.content)).convert("RGB")), reference)
