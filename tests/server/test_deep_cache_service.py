"""Issue 34: DeepCache's request fields on the service (``cache_interval``, ``cache_branch``): limits (422 naming
the field, before anything is queued), the model's branches checked before the queue, the engine's request built
with them, one schedule per batch, and the PNG's parameters."""

from __future__ import annotations

import io
import json

import httpx
import pytest
import torch
from PIL import Image

from server import schemas
from server.app import create_app
from server.worker import Job

from .helpers import FakeEngine, serving

REQ = {"prompt": "a cat", "num_inference_steps": 2, "seed": 1}


def test_limits_are_within_the_engines():
    import sdfast.request as engine

    assert 1 <= schemas.MAX_CACHE_INTERVAL <= engine.MAX_CACHE_INTERVAL
    assert 0 <= schemas.MAX_CACHE_BRANCH <= engine.MAX_CACHE_BRANCH
    assert schemas.MAX_CACHE_BRANCH == 11  # every skip branch of SD 1.x/2.x (0-11) and SDXL (0-8) passes the schema


@pytest.mark.parametrize("path", ["/v1/txt2img", "/v1/images/generations"])
@pytest.mark.parametrize("fields, field", [
    ({"cache_interval": 0}, "cache_interval"),
    ({"cache_interval": schemas.MAX_CACHE_INTERVAL + 1}, "cache_interval"),
    ({"cache_interval": 2.5}, "cache_interval"),
    ({"cache_interval": "3"}, "cache_interval"),
    ({"cache_interval": True}, "cache_interval"),
    ({"cache_branch": -1}, "cache_branch"),
    ({"cache_branch": schemas.MAX_CACHE_BRANCH + 1}, "cache_branch"),
])
def test_bad_values_are_422_naming_the_field(path, fields, field):
    engine = FakeEngine()
    with serving(create_app(engine, api_key="")) as url, httpx.Client(base_url=url, timeout=20) as c:
        r = c.post(path, json={**REQ, **fields})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}:")
    assert not engine.requests


def test_the_engines_request_carries_them_and_they_key_the_batch():
    engine = FakeEngine()
    with serving(create_app(engine, api_key="")) as url, httpx.Client(base_url=url, timeout=20) as c:
        r = c.post("/v1/txt2img", json={**REQ, "cache_interval": 3, "cache_branch": 1, "response_format": "b64_json"})
        assert r.status_code == 200, r.text
        assert c.post("/v1/images/generations", json={**REQ, "cache_interval": 2}).status_code == 200
    (a, b) = engine.requests
    assert (a.cache_interval, a.cache_branch, b.cache_interval, b.cache_branch) == (3, 1, 2, 0)
    keys = {Job(request=r, timeout_s=1.0).key for r in (a, b)}
    assert len(keys) == 2  # different schedules never share an engine call


def test_the_models_branches_are_checked_before_the_queue_and_the_png_records_them():
    import sdfast

    stock = sdfast.load("random:tiny", optimize=False)  # four skip tensors: branches 0 to 3
    runs = []
    run = stock.run
    stock.run = lambda request, **kw: runs.append(request) or run(request, **kw)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with serving(create_app(stock, api_key="")) as url, httpx.Client(base_url=url, timeout=60) as c:
            bad = c.post("/v1/txt2img", json={**REQ, "cache_interval": 2, "cache_branch": 4})
            ok = c.post("/v1/txt2img", json={**REQ, "cache_interval": 2, "cache_branch": 1, "width": 64,
                                             "height": 64})
    finally:
        torch.set_num_threads(threads)
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "cache_branch", bad.text
    assert "[0, 3]" in bad.json()["error"]["message"]
    assert ok.status_code == 200, ok.text
    params = json.loads(Image.open(io.BytesIO(ok.content)).text["sdfast"])
    assert (params["cache_interval"], params["cache_branch"]) == (2, 1)
    assert len(runs) == 1 and stock.last_deep_cache["full_steps"] == 2  # PNDM: 3 iterations for 2 steps
