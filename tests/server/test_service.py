"""Issue 9: the HTTP service with a fake engine, served by uvicorn in a thread (real sockets):
429 with a full queue, 504 past the deadline, a client that leaves releases its place, GPU OOM
answers 503 and the next request succeeds, other engine errors 500, the API key, metrics."""

from __future__ import annotations

import base64
import io
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from PIL import Image

from server.app import create_app

from .helpers import FakeEngine, health, metric_value, seed_color, serving, wait_for

REQ = {"prompt": "a cat", "num_inference_steps": 2, "seed": 1}


def _client(url, **kw):
    return httpx.Client(base_url=url, timeout=kw.pop("timeout", 20), **kw)


@pytest.fixture
def gated_service():
    """(url, engine, gate): max_batch 1, queue 1, an engine that blocks until ``gate`` is set."""
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    app = create_app(engine, max_batch=1, queue_size=1, api_key="")
    with serving(app) as url:
        yield url, engine, gate
        gate.set()


def test_full_queue_answers_429_at_once(gated_service):
    url, engine, gate = gated_service
    with ThreadPoolExecutor(2) as pool, _client(url) as c:
        running = pool.submit(c.post, "/v1/txt2img", json={**REQ, "seed": 1})
        assert engine.started.wait(10)
        waiting = pool.submit(c.post, "/v1/txt2img", json={**REQ, "seed": 2})
        wait_for(lambda: health(c)["queue_depth"] == 1, what="second request queued")
        t0 = time.monotonic()
        r = c.post("/v1/txt2img", json={**REQ, "seed": 3})
        assert r.status_code == 429 and time.monotonic() - t0 < 2
        assert r.headers["retry-after"] == "1" and "queue is full" in r.json()["error"]["message"]
        gate.set()
        assert running.result(20).status_code == 200 and waiting.result(20).status_code == 200
        text = c.get("/metrics").text
    assert metric_value(text, "sdfast_requests_total", endpoint="/v1/txt2img", status="429") == 1
    assert metric_value(text, "sdfast_requests_total", endpoint="/v1/txt2img", status="200") == 2
    assert [call["seeds"] for call in engine.calls] == [[1], [2]]


def test_deadline_answers_504_and_frees_the_queue():
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    app = create_app(engine, max_batch=1, queue_size=4, api_key="", request_timeout_s=0.6)
    with serving(app) as url, ThreadPoolExecutor(2) as pool, _client(url) as c:
        running = pool.submit(c.post, "/v1/txt2img", json=REQ)
        assert engine.started.wait(10)
        r = c.post("/v1/txt2img", json={**REQ, "seed": 2})  # waits in the queue past its deadline
        assert r.status_code == 504 and "deadline" in r.json()["error"]["message"]
        assert health(c)["queue_depth"] == 0
        assert running.result(20).status_code == 504  # still generating when its deadline passed
        gate.set()
        wait_for(lambda: not health(c)["busy"], what="worker idle")
        assert [call["seeds"] for call in engine.calls] == [[1]], "the expired request still ran"


def test_client_that_leaves_releases_its_place(gated_service):
    url, engine, gate = gated_service
    with ThreadPoolExecutor(2) as pool, _client(url) as c:
        running = pool.submit(c.post, "/v1/txt2img", json=REQ)
        assert engine.started.wait(10)
        with pytest.raises(httpx.ReadTimeout), _client(url, timeout=0.5) as impatient:
            impatient.post("/v1/txt2img", json={**REQ, "seed": 2})
        wait_for(lambda: health(c)["queue_depth"] == 0, timeout=5, what="the place to be released")
        # The released place takes a new request at once (queue_size is 1).
        later = pool.submit(c.post, "/v1/txt2img", json={**REQ, "seed": 3})
        wait_for(lambda: health(c)["queue_depth"] == 1, what="the new request queued")
        gate.set()
        assert running.result(20).status_code == 200 and later.result(20).status_code == 200
        text = c.get("/metrics").text
    assert [call["seeds"] for call in engine.calls] == [[1], [3]], "the departed client's request ran"
    assert metric_value(text, "sdfast_requests_total", endpoint="/v1/txt2img", status="499") == 1


def test_gpu_oom_answers_503_then_serves_again():
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")
    engine = FakeEngine(failures=[oom], hold=True)
    with serving(create_app(engine, api_key="")) as url, _client(url) as c:
        r = c.post("/v1/txt2img", json={**REQ, "width": 2048, "height": 2048})
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["type"] == "gpu_out_of_memory" and "out of GPU memory" in err["message"]
        assert "2048x2048" in err["message"]
        assert engine.held[0]() is None, "memory of the failed request is still referenced"
        r = c.post("/v1/txt2img", json=REQ)
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        h = health(c)
        text = c.get("/metrics").text
    assert h["status"] == "ok" and h["worker_alive"]
    assert metric_value(text, "sdfast_requests_total", endpoint="/v1/txt2img", status="503") == 1
    assert metric_value(text, "sdfast_batches_total", outcome="oom") == 1
    assert metric_value(text, "sdfast_images_generated_total") == 1


def test_engine_error_answers_500_with_a_request_id_then_serves_again(caplog):
    """Issue 29 item 20: the 500 body says nothing of the exception (no internal paths); its request id
    finds the details in the log."""
    engine = FakeEngine(failures=[ValueError("weights went missing from /srv/models/secret.safetensors")])
    with caplog.at_level(logging.ERROR, logger="sdfast.server"):
        with serving(create_app(engine, api_key="")) as url, _client(url) as c:
            r = c.post("/v1/txt2img", json=REQ)
            assert r.status_code == 500
            err = r.json()["error"]
            assert "/srv" not in r.text and "weights" not in r.text and "ValueError" not in r.text, r.text
            assert err["type"] == "internal_error" and err["request_id"] in err["message"]
            assert r.headers["x-request-id"] == err["request_id"]
            assert c.post("/v1/txt2img", json=REQ).status_code == 200
    logged = [rec.getMessage() for rec in caplog.records if err["request_id"] in rec.getMessage()]
    assert logged and "/srv/models/secret.safetensors" in logged[0]


def test_unexpected_exception_answers_500_with_a_request_id(caplog):
    """An exception outside the worker (here: the PNG encoder) gets the same generic 500 as an engine failure."""

    class BrokenImage:
        def __init__(self, *a, **k):
            pass

        def save(self, *a, **k):
            raise OSError("disk full at /var/secret/tmp")

    engine = FakeEngine()
    engine.run = lambda request, **kw: [BrokenImage() for _ in request.seeds]
    with caplog.at_level(logging.ERROR, logger="sdfast.server"):
        with serving(create_app(engine, api_key="")) as url, _client(url) as c:
            r = c.post("/v1/txt2img", json=REQ)
            assert r.status_code == 500 and "/var/secret" not in r.text, r.text
            rid = r.json()["error"]["request_id"]
            assert c.post("/v1/images/generations", json={"prompt": "a cat", "output_format": "jpeg"}).status_code == 500
    assert any(rid in rec.getMessage() and "/var/secret" in rec.getMessage() for rec in caplog.records)


def test_drawn_seeds_leave_room_for_every_image(monkeypatch):
    """Issue 29 item 14: a drawn seed s serves n images s .. s + n - 1, all at most 2**32 - 1, even when the draw
    is the highest it can be."""
    import server.app

    monkeypatch.setattr(server.app.secrets, "randbelow", lambda n: n - 1)  # the highest draw
    engine = FakeEngine()
    with serving(create_app(engine, max_batch=8, api_key="")) as url, _client(url) as c:
        r = c.post("/v1/txt2img", json={**REQ, "seed": None, "num_images": 8, "response_format": "b64_json"})
        assert r.status_code == 200, r.text
        seeds = [im["seed"] for im in r.json()["images"]]
        again = c.post("/v1/txt2img", json={**REQ, "seed": seeds[-1]})
        assert again.status_code == 200, again.text
    assert seeds == list(range(2**32 - 8, 2**32))
    assert engine.calls[-1]["seeds"] == [2**32 - 1]


def test_page_sends_security_headers_that_allow_its_own_script_and_style():
    """Issue 29 item 21: Content-Security-Policy (the page's inline script and style allowed by hash, fetches to
    this origin, data: images), X-Frame-Options DENY, nosniff."""
    import hashlib
    import re

    with serving(create_app(FakeEngine(), api_key="")) as url, _client(url) as c:
        r = c.get("/")
    assert r.status_code == 200
    assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"
    csp = dict(d.strip().split(" ", 1) for d in r.headers["content-security-policy"].split(";"))
    assert csp["default-src"] == "'none'" and csp["frame-ancestors"] == "'none'"
    assert csp["img-src"] == "data:" and csp["connect-src"] == "'self'"
    for tag in ("script", "style"):
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", r.text, flags=re.DOTALL)
        assert blocks, tag
        for block in blocks:
            digest = base64.b64encode(hashlib.sha256(block.encode()).digest()).decode()
            assert f"'sha256-{digest}'" in csp[f"{tag}-src"].split(), tag
        assert "unsafe-inline" not in csp[f"{tag}-src"]
    assert not re.search(r"<[^>]+\son\w+=", r.text), "inline event handlers would need 'unsafe-inline'"
    assert not re.search(r"<[^>]+\sstyle=", r.text), "style attributes would need 'unsafe-inline'"


def test_batched_requests_get_their_own_images():
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    app = create_app(engine, max_batch=4, queue_size=8, api_key="")
    with serving(app) as url, ThreadPoolExecutor(4) as pool, _client(url) as c:
        first = pool.submit(c.post, "/v1/txt2img", json={**REQ, "prompt": "blocker", "seed": 100})
        assert engine.started.wait(10)
        bodies = [{**REQ, "prompt": "p" * (i + 1), "seed": 10 * i, "num_images": 1 + (i == 1),
                   "response_format": "b64_json"} for i in range(3)]
        futures = [pool.submit(c.post, "/v1/txt2img", json=b) for b in bodies]
        wait_for(lambda: health(c)["queue_depth"] == 3, what="three requests queued")
        gate.set()
        assert first.result(20).status_code == 200
        for body, fut in zip(bodies, futures):
            r = fut.result(20)
            assert r.status_code == 200
            data = r.json()
            assert data["timings"]["batch_images"] == 4
            seeds = [body["seed"] + k for k in range(body["num_images"])]
            assert [im["seed"] for im in data["images"]] == seeds
            for im, s in zip(data["images"], seeds):
                pixel = Image.open(io.BytesIO(base64.b64decode(im["b64_json"]))).convert("RGB").getpixel((0, 0))
                assert pixel == seed_color(s, body["prompt"])
    assert len(engine.calls) == 2 and sorted(engine.calls[1]["seeds"]) == [0, 10, 11, 20]


def test_api_key_by_header_and_basic_auth(monkeypatch):
    monkeypatch.setenv("SDFAST_API_KEY", "s3cret")
    with serving(create_app(FakeEngine())) as url, _client(url) as c:
        assert c.get("/health").status_code == 200
        for method, path in [("GET", "/"), ("GET", "/metrics"), ("POST", "/v1/txt2img"),
                             ("POST", "/v1/images/generations"), ("GET", "/docs")]:
            r = c.request(method, path, json=REQ)
            assert r.status_code == 401, path
            assert r.json()["error"]["type"] == "authentication_error"
        assert c.get("/").headers["www-authenticate"].startswith("Basic")
        assert c.post("/v1/txt2img", json=REQ, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.post("/v1/txt2img", json=REQ, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.post("/v1/txt2img", json=REQ, headers={"X-API-Key": "s3cret"}).status_code == 200
        assert c.get("/", auth=("anyone", "s3cret")).status_code == 200
        text = c.get("/metrics", headers={"X-API-Key": "s3cret"}).text
    assert metric_value(text, "sdfast_requests_total", endpoint="/v1/txt2img", status="401") == 2
    assert metric_value(text, "sdfast_requests_total", endpoint="other", status="401") == 1  # /docs


def test_openai_endpoint_maps_n_and_size():
    engine = FakeEngine()
    with serving(create_app(engine, api_key="")) as url, _client(url) as c:
        r = c.post("/v1/images/generations", json={"prompt": "a cat", "n": 3, "size": "128x64", "model": "dall-e-2",
                                                   "response_format": "b64_json", "quality": "standard",
                                                   "style": "vivid", "user": "u1"})
        assert r.status_code == 200
        data = r.json()
        assert set(data) == {"created", "data", "output_format", "size", "background"} and len(data["data"]) == 3
        assert data["output_format"] == "png" and data["size"] == "128x64"
        img = Image.open(io.BytesIO(base64.b64decode(data["data"][0]["b64_json"])))
        assert img.size == (128, 64)
    assert engine.calls[0]["width"] == 128 and engine.calls[0]["height"] == 64 and len(engine.calls[0]["seeds"]) == 3


def test_sdfast_serve_refuses_bad_flags_before_loading(capsys):
    from sdfast.cli import main

    assert main(["serve", "--model", "random:tiny", "--max-batch", "0"]) == 2
    assert "--max-batch must be an integer >= 1" in capsys.readouterr().err
    assert main(["serve", "--model", "random:tiny", "--queue", "0"]) == 2
    assert "--queue must be an integer >= 1" in capsys.readouterr().err


def test_json_without_its_content_type_is_told_so():
    with serving(create_app(FakeEngine(), api_key="")) as url, _client(url) as c:
        r = c.post("/v1/txt2img", content=b'{"prompt": "a cat"}', headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 422
        # txt2img takes multipart/form-data too (control images as files): the message says both
        assert r.json()["error"]["message"] == ("body: send a JSON object with the header 'content-type: "
                                                "application/json' (images as base64) or multipart/form-data (images "
                                                "as files)")
        bad = c.post("/v1/txt2img", content=b'{"prompt": ', headers={"content-type": "application/json"})
        assert bad.status_code == 422 and "not valid JSON" in bad.json()["error"]["message"]


def test_more_images_than_max_batch_are_refused_with_the_field():
    """max_batch bounds one engine call (operators size it for GPU memory): a request for more images is a 422 naming
    its field, before anything is queued; the service keeps serving."""
    engine = FakeEngine()
    with serving(create_app(engine, max_batch=2, api_key="")) as url, _client(url) as c:
        r = c.post("/v1/txt2img", json={**REQ, "num_images": 3, "response_format": "b64_json"})
        assert r.status_code == 422 and r.json()["error"]["param"] == "num_images"
        assert "at most 2 images per request" in r.json()["error"]["message"]
        oai = c.post("/v1/images/generations", json={"prompt": "a cat", "n": 3, "num_inference_steps": 2})
        assert oai.status_code == 422 and oai.json()["error"]["param"] == "n"
        assert engine.calls == []
        assert c.post("/v1/txt2img", json={**REQ, "num_images": 2, "response_format": "b64_json"}).status_code == 200
        assert [len(call["seeds"]) for call in engine.calls] == [2]


@pytest.mark.parametrize("leave", ["deadline", "client"])
def test_a_stopped_generation_logs_no_unretrieved_future_error(caplog, leave):
    """A running job stopped because its deadline passed (or its client left) used to end in asyncio's
    "Future exception was never retrieved" (with the Cancelled / DeadlineExceeded) in the service log: the
    handler had left its ``wrap_future`` waiter, which still received the worker's error."""
    import gc

    engine = FakeEngine(step_s=0.05)
    timeout_s = 0.5 if leave == "deadline" else 30
    app = create_app(engine, max_batch=1, queue_size=4, api_key="", request_timeout_s=timeout_s)
    with caplog.at_level(logging.ERROR, logger="asyncio"), serving(app) as url, _client(url) as c:
        if leave == "deadline":
            assert c.post("/v1/txt2img", json={**REQ, "num_inference_steps": 150}).status_code == 504
        else:
            with pytest.raises(httpx.ReadTimeout), _client(url, timeout=0.5) as impatient:
                impatient.post("/v1/txt2img", json={**REQ, "num_inference_steps": 150})
        wait_for(lambda: engine.steps_run, timeout=5, what="the generation to stop")
        assert c.post("/v1/txt2img", json={**REQ, "num_inference_steps": 1}).status_code == 200
        gc.collect()
    assert engine.steps_run[0] < 100
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.text


def test_a_client_that_leaves_while_sending_its_body_is_no_internal_error(caplog):
    """A client gone before its body arrived (it left, or --read-timeout / --max-connections closed it) was a
    500 with an ERROR traceback per connection (``ClientDisconnect`` out of the body reader): a flood of
    half-sent bodies filled the log. It is counted as 499 (client left), and logs no error."""
    import socket

    from .helpers import metric_value

    app = create_app(FakeEngine(), api_key="")
    with caplog.at_level(logging.INFO), serving(app) as url, _client(url) as c:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        for _ in range(3):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(b"POST /v1/txt2img HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                          b"content-length: 100\r\n\r\n{\"prompt\":")
                time.sleep(0.2)  # the app is reading the body when the client goes
        count = lambda status: metric_value(c.get("/metrics").text, "sdfast_requests_total",  # noqa: E731
                                            endpoint="/v1/txt2img", status=status)
        wait_for(lambda: (count("499") or 0) + (count("500") or 0) == 3, what="the three requests answered")
        assert count("499") == 3, c.get("/metrics").text
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, caplog.text
