"""Issue 9 acceptance: the real service (uvicorn subprocess, random:tiny on the CPU) over HTTP:
each endpoint, 16 concurrent requests equal to the same requests alone, each bad input, the API
key, and /metrics counting what happened."""

from __future__ import annotations

import base64
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from sdfast.png import read_parameters

from .conftest import MAX_BATCH
from .helpers import metric_value

STEPS = 2


def _png(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    assert img.format == "PNG"
    return img.convert("RGB")


def _pixels(img: Image.Image) -> np.ndarray:
    return np.asarray(img).astype(np.int16)


def _same_image(a: Image.Image, b: Image.Image) -> bool:
    """Equal up to the engine's batch-size rounding (1/255 per channel on the CPU)."""
    return a.size == b.size and int(np.abs(_pixels(a) - _pixels(b)).max()) <= 1


def test_health_is_public_and_describes_the_model_with_the_key(live):
    """Issue 29 item 17: without the key /health says only the status (it is public, for probes); its
    details (the --model argument, a path in real deployments, the GPU, the dtype) need the key."""
    with live.client(key=False) as anon:
        r = anon.get("/health")
        wrong = anon.get("/health", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert wrong.status_code == 200 and wrong.json() == {"status": "ok"}
    with live.client() as c:
        r = c.get("/health")
    assert r.status_code == 200
    h = r.json()
    assert h["status"] == "ok" and h["model_loaded"] and h["model"] == "random:tiny"
    assert h["device"] == "cpu" and h["gpu"] is None and h["queue_depth"] == 0
    assert h["max_batch"] == MAX_BATCH and h["default_size"] == 64 and "euler" in h["schedulers"]


def test_txt2img_png_is_one_deterministic_image(live):
    body = {"prompt": "a photo of a cat", "num_inference_steps": STEPS, "seed": 5}
    with live.client() as c:
        a = c.post("/v1/txt2img", json=body)
        b = c.post("/v1/txt2img", json=body)
        other = c.post("/v1/txt2img", json={**body, "seed": 6})
    assert a.status_code == 200 and a.headers["content-type"] == "image/png"
    assert a.headers["x-seed"] == "5" and "generate;dur=" in a.headers["server-timing"]
    img = _png(a.content)
    assert img.size == (64, 64)
    assert json.loads(Image.open(io.BytesIO(a.content)).text["sdfast"])["seed"] == 5
    assert _same_image(img, _png(b.content))
    assert np.abs(_pixels(img) - _pixels(_png(other.content))).max() > 10


def test_txt2img_b64_json_gives_every_image_its_seed_and_timings(live):
    body = {"prompt": "a red bird", "negative_prompt": "blurry", "num_inference_steps": STEPS, "seed": 7,
            "num_images": 2, "width": 96, "height": 64, "scheduler": "euler", "guidance_scale": 5.0,
            "response_format": "b64_json"}
    with live.client() as c:
        r = c.post("/v1/txt2img", json=body)
        alone = c.post("/v1/txt2img", json={**body, "seed": 8, "num_images": 1, "response_format": "png"})
    assert r.status_code == 200
    data = r.json()
    assert data["model"] == "random:tiny"
    assert [im["seed"] for im in data["images"]] == [7, 8]
    assert all(im["width"] == 96 and im["height"] == 64 for im in data["images"])
    t = data["timings"]
    assert t["total_s"] >= t["generate_s"] > 0 and t["queue_s"] >= 0 and t["batch_images"] == 2
    second = _png(base64.b64decode(data["images"][1]["b64_json"]))
    assert second.size == (96, 64)
    assert _same_image(second, _png(alone.content))  # image 2 of a request == that seed alone


def test_head_answers_200_and_docs_are_not_served_from_a_cdn(live):
    """Issue 29 item 10: HEAD / and HEAD /health answer 200 (not 405); /docs (Swagger UI from a CDN) is off,
    /openapi.json stays."""
    with live.client(key=False) as anon, live.client() as c:
        assert anon.head("/health").status_code == 200
        assert c.head("/").status_code == 200 and c.head("/health").status_code == 200
        assert c.get("/docs").status_code == 404 and c.get("/redoc").status_code == 404
        schema = c.get("/openapi.json")
    assert schema.status_code == 200
    body = schema.json()["paths"]["/v1/images/generations"]["post"]["requestBody"]
    assert "output_format" in body["content"]["application/json"]["schema"]["properties"]


def test_openai_images_generations(live):
    with live.client() as c:
        r = c.post("/v1/images/generations", json={"prompt": "a cat", "n": 2, "size": "64x64",
                                                   "response_format": "b64_json", "num_inference_steps": STEPS})
    assert r.status_code == 200
    data = r.json()
    assert isinstance(data["created"], int) and len(data["data"]) == 2
    imgs = [_png(base64.b64decode(d["b64_json"])) for d in data["data"]]
    assert all(im.size == (64, 64) for im in imgs)
    assert np.abs(_pixels(imgs[0]) - _pixels(imgs[1])).max() > 10  # two seeds, two images


def test_the_official_openai_client(live):
    """Issue 29 item 4: the official ``openai`` client with gpt-image-1's parameters: output_format png / jpeg /
    webp encoded as asked at output_compression, size 'auto' the native size, the ignored parameters accepted,
    and what cannot be honoured refused with a 422 saying why."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=live.key, max_retries=0, timeout=60)
    common = dict(prompt="a lighthouse", extra_body={"num_inference_steps": STEPS, "seed": 3})
    r = client.images.generate(**common, size="64x64", response_format="b64_json", model="gpt-image-1",
                               quality="low", style="vivid", moderation="low", background="opaque", user="u1",
                               stream=False)
    png = Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json)))
    assert png.format == "PNG" and png.size == (64, 64) and r.output_format == "png" and r.size == "64x64"

    files = {}
    for fmt, compression in [("jpeg", 95), ("jpeg", 5), ("webp", 95), ("webp", 5)]:
        r = client.images.generate(**common, size="auto", n=1, output_format=fmt, output_compression=compression,
                                   quality="high", background="auto")
        data = base64.b64decode(r.data[0].b64_json)
        img = Image.open(io.BytesIO(data))
        assert img.format == fmt.upper() and img.size == (64, 64), (fmt, img.format, img.size)  # auto: native
        assert read_parameters(img)["seed"] == 3  # the parameters, as in a PNG's text chunk
        assert r.output_format == fmt
        files[fmt, compression] = img.convert("RGB")
    for fmt in ("jpeg", "webp"):  # the compression is honoured: lower quality, further from the PNG
        err = {c: np.abs(_pixels(files[fmt, c]) - _pixels(png.convert("RGB"))).mean() for c in (95, 5)}
        assert err[5] > err[95], (fmt, err)

    refused = [({"background": "transparent"}, "background", "alpha"),
               ({"response_format": "url"}, "response_format", "stores no files"),
               ({"output_format": "gif"}, "output_format", "png, jpeg, webp"),
               ({"output_compression": 101}, "output_compression", "[0, 100]"),
               ({"partial_images": 2}, "partial_images", "streaming")]
    for change, field, why in refused:
        with pytest.raises(openai.UnprocessableEntityError) as e:
            client.images.generate(**common, size="64x64", **change)
        error = e.value.body if "message" in e.value.body else e.value.body["error"]
        assert error["param"] == field and why in error["message"], (change, error)
    with pytest.raises(openai.UnprocessableEntityError) as e:  # the client reads a stream; the 422 comes first
        client.images.generate(**common, size="64x64", stream=True)
    assert "streaming is not supported" in str(e.value)


def test_returned_seeds_are_accepted_back_and_give_their_image(live):
    """Issue 29 item 14: image i uses seed + i; a request whose last seed would pass 2**32 - 1 is refused
    (naming ``seed``), so every seed the service returns is one it accepts, and that seed alone gives the image."""
    top = 2**32 - 1
    body = {"prompt": "a cat", "num_inference_steps": STEPS, "response_format": "b64_json"}
    with live.client() as c:
        r = c.post(TXT, json={**body, "seed": top - 2, "num_images": 3})
        over = c.post(TXT, json={**body, "seed": top, "num_images": 3})
        assert r.status_code == 200, r.text
        images = r.json()["images"]
        assert [im["seed"] for im in images] == [top - 2, top - 1, top]
        again = c.post(TXT, json={**body, "seed": images[-1]["seed"]})
        assert again.status_code == 200, again.text
    assert over.status_code == 422 and over.json()["error"]["param"] == "seed"
    assert "at most 4294967293" in over.json()["error"]["message"]
    assert _same_image(_png(base64.b64decode(images[-1]["b64_json"])),
                       _png(base64.b64decode(again.json()["images"][0]["b64_json"])))


def test_16_concurrent_requests_equal_the_same_requests_alone(live):
    bodies = [{"prompt": ["a cat", "a dog", "a red car", "a castle"][i % 4], "seed": 1000 + 17 * i,
               "num_inference_steps": STEPS, "response_format": "b64_json"} for i in range(16)]
    with live.client() as c, ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda b: c.post("/v1/txt2img", json=b), bodies))
        alone = [c.post("/v1/txt2img", json=b) for b in bodies]  # one at a time: each its own batch
    assert [r.status_code for r in together] == [200] * 16
    assert [r.status_code for r in alone] == [200] * 16
    batch_sizes = [r.json()["timings"]["batch_images"] for r in together]
    assert max(batch_sizes) > 1, f"16 concurrent requests were never batched: {batch_sizes}"
    assert max(batch_sizes) <= MAX_BATCH
    assert all(r.json()["timings"]["batch_images"] == 1 for r in alone)
    for body, t, a in zip(bodies, together, alone):
        (ti,), (ai,) = t.json()["images"], a.json()["images"]
        assert ti["seed"] == ai["seed"] == body["seed"]
        assert _same_image(_png(base64.b64decode(ti["b64_json"])), _png(base64.b64decode(ai["b64_json"]))), body


def test_long_prompts_batch_only_with_their_window_count(live):
    """A prompt over CLIP's 75 tokens is encoded in two windows; batched with short prompts it would be
    padded differently, so the service batches it only with prompts of the same window count."""
    long_prompt = ", ".join(["a very detailed oil painting of a quiet harbour town at dawn"] * 8)  # > 75 tokens
    bodies = [{"prompt": p, "seed": 50 + i, "num_inference_steps": STEPS, "response_format": "b64_json"}
              for i, p in enumerate([long_prompt, "a cat", long_prompt + " with boats", "a dog"])]
    with live.client() as c, ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda b: c.post("/v1/txt2img", json=b), bodies * 2))
        alone = [c.post("/v1/txt2img", json=b) for b in bodies]
    assert all(r.status_code == 200 for r in together + alone)
    for t, a in zip(together, alone * 2):
        (ti,), (ai,) = t.json()["images"], a.json()["images"]
        assert _same_image(_png(base64.b64decode(ti["b64_json"])), _png(base64.b64decode(ai["b64_json"])))


TXT = "/v1/txt2img"
OAI = "/v1/images/generations"
BAD = [
    (TXT, {"width": 100}, "width", "multiple of 8"),
    (TXT, {"height": 4096}, "height", "[64, 2048]"),
    (TXT, {"width": 32}, "width", "[64, 2048]"),
    (TXT, {"num_inference_steps": 0}, "num_inference_steps", "[1, 150]"),
    (TXT, {"num_inference_steps": 151}, "num_inference_steps", "[1, 150]"),
    (TXT, {"num_images": 0, "response_format": "b64_json"}, "num_images", "[1, 8]"),
    (TXT, {"num_images": 9, "response_format": "b64_json"}, "num_images", "[1, 8]"),
    (TXT, {"num_images": 2}, "num_images", "b64_json"),
    (TXT, {"guidance_scale": -0.5}, "guidance_scale", "[0.0, 30.0]"),
    (TXT, {"guidance_scale": 30.5}, "guidance_scale", "[0.0, 30.0]"),
    (TXT, {"prompt": ""}, "prompt", "non-empty"),
    (TXT, {"prompt": "   "}, "prompt", "non-empty"),
    (TXT, {"prompt": "a" * 1001}, "prompt", "77 tokens"),
    (TXT, {"scheduler": "nope"}, "scheduler", "euler_a"),
    (TXT, {"scheduler": "lcm", "num_inference_steps": 60}, "num_inference_steps", "at most 50"),  # before queueing
    (TXT, {"seed": -1}, "seed", "[0, 4294967295]"),
    (TXT, {"model": "/etc/passwd"}, "model", "unknown field"),
    (TXT, {"model_path": "/models/x.safetensors"}, "model_path", "unknown field"),
    (TXT, {"response_format": "jpeg"}, "response_format", "png"),
    (OAI, {"n": 0}, "n", "[1, 8]"),
    (OAI, {"n": 9}, "n", "[1, 8]"),
    (OAI, {"size": "100x100"}, "size", "multiple of 8"),
    (OAI, {"size": "huge"}, "size", "WIDTHxHEIGHT"),
    (OAI, {"response_format": "url"}, "response_format", "b64_json"),
    (OAI, {"prompt": ""}, "prompt", "non-empty"),
    (OAI, {"scheduler_path": "/tmp/x"}, "scheduler_path", "unknown field"),
    (OAI, {"quality": "x" * 33}, "quality", "standard, hd"),
    (OAI, {"size": "\uff16\uff14x\uff16\uff14"}, "size", "ASCII digits"),  # full-width "６４x６４" (item 15)
    (OAI, {"size": "\u0664\u0660x64"}, "size", "ASCII digits"),  # Arabic-Indic digits
    (OAI, {"size": "64x64\n"}, "size", "WIDTHxHEIGHT"),
    (OAI, {"background": "transparent"}, "background", "no alpha"),  # item 4
    (OAI, {"output_format": "svg"}, "output_format", "png, jpeg, webp"),
    (OAI, {"output_compression": -1}, "output_compression", "[0, 100]"),
    (OAI, {"stream": True}, "stream", "streaming is not supported"),  # item 10
    (OAI, {"frame_count": 4}, "frame_count", "GIF output is not supported"),
]


@pytest.mark.parametrize("path, change, field, hint", BAD,
                         ids=[f"{p.split('/')[-1]}-{f}-{i}" for i, (p, _, f, _) in enumerate(BAD)])
def test_bad_input_answers_422_naming_the_field(live, path, change, field, hint):
    body = {"prompt": "a cat", "num_inference_steps": STEPS}
    body.update(change)
    with live.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field}:") and hint in err["message"], err
    assert err["type"] == "invalid_request_error"
    detail = r.json()["detail"]  # every 422, from the schema or from the endpoint, lists its fields
    assert detail and detail[0]["field"] == field and detail[0]["message"] == err["message"]


NUMERIC = [(TXT, f) for f in ("num_inference_steps", "guidance_scale", "width", "height", "seed", "num_images")] + [
    (OAI, f) for f in ("n", "num_inference_steps", "guidance_scale", "seed", "output_compression", "partial_images")]


@pytest.mark.parametrize("path, field", NUMERIC, ids=[f"{p.split('/')[-1]}-{f}" for p, f in NUMERIC])
@pytest.mark.parametrize("digits", [25, 5000])
def test_huge_integer_answers_422_naming_its_field(live, path, field, digits):
    """Issue 29 item 16: a 5000-digit integer (past Python's 4300-digit int-from-str limit) names its field."""
    number = "9" * digits
    raw = '{"prompt": "a cat", "num_inference_steps": %d, "%s": %s}' % (STEPS, field, number)
    if field == "num_inference_steps":
        raw = '{"prompt": "a cat", "num_inference_steps": %s}' % number
    with live.client() as c:
        r = c.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field}:"), err
    assert len(r.content) < 2000 and number[:30] not in r.text


def test_422_for_many_unknown_keys_is_small_and_does_not_stall_the_service(live):
    """Issue 29 item 11: 1 MiB of ~111,000 unknown keys gets a small 422 (a few errors and a count of the rest),
    and /health keeps answering while such bodies are validated (off the event loop)."""
    body = ('{"prompt":"a"' + "".join(f',"{i:x}":0' for i in range(111_000)) + "}").encode()
    assert len(body) < 1 << 20
    with live.client() as c, live.client(key=False) as probe, ThreadPoolExecutor(4) as pool:
        started = time.monotonic()
        futures = [pool.submit(c.post, TXT, content=body, headers={"content-type": "application/json"})
                   for _ in range(3)]
        waits = []
        while not all(f.done() for f in futures):
            t0 = time.monotonic()
            assert probe.get("/health").status_code == 200
            waits.append(time.monotonic() - t0)
            time.sleep(0.05)
        took = time.monotonic() - started
        answers = [f.result() for f in futures]
    for r in answers:
        assert r.status_code == 422 and len(r.content) < 10_000, (r.status_code, len(r.content))
        data = r.json()
        assert data["error"]["param"] == "0" and "unknown field" in data["error"]["message"]
        assert len(data["detail"]) <= 8 and len(data["detail"]) + data["detail_omitted"] == 111_000
    assert max(waits) < 2.0, f"/health waited {max(waits):.2f} s while the bodies were validated ({took:.1f} s)"


def test_every_endpoint_but_health_needs_the_key(live):
    with live.client(key=False) as c:
        for method, path in [("GET", "/"), ("GET", "/metrics"), ("POST", TXT), ("POST", OAI)]:
            r = c.request(method, path, json={"prompt": "a cat", "num_inference_steps": STEPS})
            assert r.status_code == 401, path
            assert "API key" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 200
        assert c.get("/metrics", headers={"X-API-Key": "wrong"}).status_code == 401
    with live.client() as c:
        assert c.get("/").status_code == 200 and 'id="generate"' in c.get("/").text
        assert c.get("/metrics").status_code == 200


def test_metrics_count_what_happened(live):
    def scrape(c):
        r = c.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return r.text

    body = {"prompt": "a cat", "num_inference_steps": STEPS}
    with live.client() as c, live.client(key=False) as anon:
        before = scrape(c)
        assert c.post(TXT, json={**body, "num_images": 3, "response_format": "b64_json"}).status_code == 200
        assert c.post(TXT, json=body).status_code == 200
        assert c.post(TXT, json={**body, "width": 1}).status_code == 422
        assert anon.post(TXT, json=body).status_code == 401
        assert c.post(OAI, json={"prompt": "a cat", "n": 2, "num_inference_steps": STEPS}).status_code == 200
        after = scrape(c)

    def delta(name, **labels):
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("sdfast_requests_total", endpoint=TXT, status="200") == 2
    assert delta("sdfast_requests_total", endpoint=TXT, status="422") == 1
    assert delta("sdfast_requests_total", endpoint=TXT, status="401") == 1
    assert delta("sdfast_requests_total", endpoint=OAI, status="200") == 1
    assert delta("sdfast_images_generated_total") == 6
    assert delta("sdfast_request_latency_seconds_count", endpoint=TXT) == 4
    assert delta("sdfast_batches_total", outcome="ok") == 3
    assert metric_value(after, "sdfast_queue_depth") == 0
    assert "sdfast_gpu_memory_allocated_bytes 0.0" in after  # CPU: no CUDA memory


@pytest.mark.parametrize("path, field", [(TXT, "prompt"), (TXT, "negative_prompt"), (OAI, "prompt")])
def test_lone_surrogate_in_text_answers_422(live, path, field):
    """JSON allows "\\ud800" (a lone UTF-16 surrogate), which no tokenizer takes: 422 naming the field, and
    the service serves the next request."""
    text = {"prompt": '"a cat"', "negative_prompt": "null"}
    text[field] = '"\\ud800 cat"'
    body = ('{"prompt": %s, "negative_prompt": %s, "num_inference_steps": %d}' % (text["prompt"], text["negative_prompt"], STEPS))
    with live.client() as c:
        r = c.post(path, content=body.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == field and "unicode" in r.json()["error"]["message"].lower()
        assert c.post(path, json={"prompt": "a cat", "num_inference_steps": STEPS,
                                  **({"response_format": "b64_json"} if path == OAI else {})}).status_code == 200


def test_oversized_body_is_413_before_parsing_and_the_service_goes_on(live):
    """A body over 1 MiB is refused from its Content-Length, or while a chunked body streams in."""
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    with live.client() as c:
        r = c.post(TXT, content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text
        chunks = (big[i:i + 65536] for i in range(0, len(big), 65536))  # no Content-Length: chunked
        r = c.post(TXT, content=chunks, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        small = (b for b in [b'{"prompt": "a cat", ', b'"num_inference_steps": %d}' % STEPS])  # chunked, small
        r = c.post(TXT, content=small, headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.headers["content-type"] == "image/png", r.text


def test_json_nested_past_the_recursion_limit_is_a_422_naming_body(live):
    with live.client() as c:
        r = c.post(TXT, content=b"[" * 100000, headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == "body" and r.json()["detail"][0]["field"] == "body"
        assert c.post(TXT, json={"prompt": "a cat", "num_inference_steps": STEPS}).status_code == 200
