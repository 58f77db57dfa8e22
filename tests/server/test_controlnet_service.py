"""Issue 31: ControlNet in the HTTP service, on random:tiny with random:tiny-controlnet (CPU, unoptimized engines: the
point is what the service hands the engine), in-process: every generation endpoint with control images (JSON base64 /
data URL, multipart files; one and two ControlNets) gives the pixels of ``engine.txt2img/img2img/inpaint(...,
control_image=...)`` with the same seed; each bad ControlNet input is a 422 naming its field (413 past the byte limit)
before anything is queued; requests with control images run alone in the worker, between the batches of others;
``sdfast serve --controlnet`` reaches the engine and ``/health`` reports the ControlNets."""

from __future__ import annotations

import base64
import io
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from PIL import Image

from sdfast.request import Img2ImgRequest, Txt2ImgRequest
from server import schemas
from server.app import create_app
from server.worker import Job, Worker

from .helpers import FakeEngine, health, serving, wait_for
from .test_image_endpoints import (
    BAD_FILES,
    _b64,
    _close,
    _file,
    _images,
    _noise,
    _png_header_only,
    _px,
    _transparent,
    _white_mask,
)

PROMPT = "a house by a lake"
STEPS = 2
GUIDANCE = 5.0
CONTROL = _noise(64, 72, seed=50)  # 64 wide, 72 high: txt2img's size without width / height
SECOND = _noise(64, 72, seed=51)
IMAGE, MASK = _noise(seed=52), _white_mask()
CONTROL_B64 = _b64(CONTROL)
NET = "random:tiny-controlnet"


def _b64_bytes(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _png_params(r: httpx.Response) -> dict:
    return json.loads(Image.open(io.BytesIO(r.content)).text["sdfast"])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine two OpenMP threads spinning at each barrier made a tiny
    txt2img call take 10 s instead of 0.1 s (measured)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one(one_thread):
    import sdfast

    return sdfast.load("random:tiny", controlnet=NET, optimize=False)


@pytest.fixture(scope="module")
def two():
    import sdfast

    return sdfast.load("random:tiny", controlnet=[NET, NET], optimize=False)


@pytest.fixture(scope="module")
def refs(one):
    """The engine's own images for the requests below, computed once (each call takes seconds on a busy CPU)."""
    kw = dict(num_inference_steps=STEPS, guidance_scale=GUIDANCE)
    return {
        "pair": one.txt2img(PROMPT, control_image=CONTROL, seed=7, num_images_per_prompt=2, **kw),
        "window": one.txt2img(PROMPT, control_image=CONTROL, seed=7, controlnet_conditioning_scale=0.5,
                              control_guidance_end=0.5, **kw)[0],
        "img2img": one.img2img(IMAGE, PROMPT, strength=0.5, control_image=CONTROL, seed=11, num_inference_steps=4,
                               guidance_scale=GUIDANCE)[0],
        "inpaint": one.inpaint(IMAGE, MASK, PROMPT, control_image=CONTROL, seed=13, **kw)[0],
    }


@pytest.fixture(scope="module")
def app_one(one):
    return create_app(one, max_batch=4, api_key="", controlnet=NET)


@pytest.fixture(scope="module")
def client(app_one):
    with serving(app_one) as url, httpx.Client(base_url=url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client_two(two):
    with serving(create_app(two, max_batch=4, api_key="")) as url, httpx.Client(base_url=url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def plain():
    """A service without a ControlNet (a fake engine: nothing may reach it)."""
    engine = FakeEngine()
    with serving(create_app(engine, api_key="")) as url, httpx.Client(base_url=url, timeout=30) as c:
        yield c, engine


DROP = object()  # a field left out of the body (None sends null)


def _txt2img_json(**change):
    body = {"prompt": PROMPT, "num_inference_steps": STEPS, "guidance_scale": GUIDANCE, "control_image": CONTROL_B64}
    body.update(change)
    return {k: v for k, v in body.items() if v is not DROP}


# -- the endpoints give the engine's pixels ------------------------------------------------------------


def test_txt2img_json_and_multipart_give_the_engines_controlnet_pixels(client, refs):
    r = client.post("/v1/txt2img", json=_txt2img_json(seed=7, num_images=2, response_format="b64_json"))
    got = _images(r)
    assert [g.shape for g in got] == [(72, 64, 3)] * 2  # without width / height: the control image's size
    assert all(_close(g, _px(ref), 1) for g, ref in zip(got, refs["pair"]))  # prompts x 2 against 1 x 2: rounding
    assert [im["seed"] for im in r.json()["images"]] == [7, 8] and r.json()["timings"]["batch_images"] == 2
    form = client.post("/v1/txt2img", files={"control_image": ("edges.png", _file(CONTROL), "image/png")},
                       data={"prompt": PROMPT, "seed": "7", "num_inference_steps": str(STEPS), "guidance_scale": "5",
                             "controlnet_conditioning_scale": "0.5", "control_guidance_end": "0.5"})
    (got,) = _images(form)
    assert _close(got, _px(refs["window"]))
    assert not _close(_px(refs["window"]), _px(refs["pair"][0]), 10)  # so the scale and window reached the engine
    params = _png_params(form)
    assert params["controlnets"] == [NET] and params["controlnet_conditioning_scale"] == [0.5]
    assert (params["control_guidance_start"], params["control_guidance_end"]) == ([0.0], [0.5])


def test_img2img_json_and_inpaint_multipart_give_the_engines_controlnet_pixels(client, refs):
    r = client.post("/v1/img2img", json={"prompt": PROMPT, "image": _b64(IMAGE), "strength": 0.5, "seed": 11,
                                         "control_image": "data:image/png;base64," + CONTROL_B64,
                                         "num_inference_steps": 4, "guidance_scale": GUIDANCE})
    assert _close(_images(r)[0], _px(refs["img2img"]))  # the control image resized to the image's size
    r = client.post("/v1/inpaint", files={"image": ("a.png", _file(IMAGE), "image/png"),
                                          "mask_image": ("m.png", _file(MASK), "image/png"),
                                          "control_image": ("c.png", _file(CONTROL), "image/png")},
                    data={"prompt": PROMPT, "seed": "13", "num_inference_steps": str(STEPS), "guidance_scale": "5"})
    assert _close(_images(r)[0], _px(refs["inpaint"]))
    assert _png_params(r)["task"] == "inpaint"


def test_openai_endpoints_take_the_controlnet_fields_as_extensions(client, refs):
    """``/v1/images/generations`` through the official client (``extra_body``: base64); ``/v1/images/edits`` with a
    ``control_image`` file beside the image and its transparent mask."""
    openai = pytest.importorskip("openai")
    oai = openai.OpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = oai.images.generate(prompt=PROMPT, response_format="b64_json", extra_body={
        "num_inference_steps": STEPS, "guidance_scale": GUIDANCE, "seed": 7, "control_image": CONTROL_B64})
    assert r.size == "64x72" and _close(_px(r.data[0].b64_json), _px(refs["pair"][0]), 1)
    edit = client.post("/v1/images/edits", data={"prompt": PROMPT, "seed": "13", "num_inference_steps": str(STEPS),
                                                 "guidance_scale": "5"},
                       files={"image": ("a.png", _file(IMAGE), "image/png"),
                              "mask": ("m.png", _file(_transparent(IMAGE, MASK)), "image/png"),
                              "control_image": ("c.png", _file(CONTROL), "image/png")})
    assert _close(_images(edit)[0], _px(refs["inpaint"]))


def test_two_controlnets_take_a_list_in_json_and_repeated_parts_in_multipart(two, client_two):
    kw = dict(num_inference_steps=STEPS, guidance_scale=GUIDANCE, seed=3)
    ref = two.txt2img(PROMPT, control_image=[CONTROL, SECOND], controlnet_conditioning_scale=[1.0, 0.5], **kw)[0]
    as_json = client_two.post("/v1/txt2img", json=_txt2img_json(
        seed=3, control_image=[CONTROL_B64, _b64(SECOND)], controlnet_conditioning_scale=[1.0, 0.5]))
    form = client_two.post("/v1/txt2img", files=[("control_image", ("a.png", _file(CONTROL), "image/png")),
                                                 ("control_image", ("b.png", _file(SECOND), "image/png"))],
                           data={"prompt": PROMPT, "seed": "3", "num_inference_steps": str(STEPS), "guidance_scale": "5",
                                 "controlnet_conditioning_scale": ["1.0", "0.5"]})
    for r in (as_json, form):
        assert _close(_images(r)[0], _px(ref)), r.request.headers["content-type"]
    assert _png_params(form)["controlnet_conditioning_scale"] == [1.0, 0.5]
    assert health(client_two)["controlnets"] == ["controlnet[0]", "controlnet[1]"]


def test_a_control_image_body_may_be_past_1_mib_on_txt2img(client):
    big = _file(_noise(640, 640, seed=53))
    assert len(big) > 1 << 20
    r = client.post("/v1/txt2img", json=_txt2img_json(control_image=_b64_bytes(big), width=64, height=64, seed=1,
                                                      num_inference_steps=1))
    assert _images(r)[0].shape == (64, 64, 3)  # resized to width x height


# -- batching ------------------------------------------------------------------------------------------


class _GatedEngine:
    """The real engine, its first ``run`` held until ``gate`` is set (so later requests queue up); records each
    request ``run`` gets."""

    def __init__(self, engine):
        self._engine = engine
        self.gate, self.started, self.requests = threading.Event(), threading.Event(), []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def run(self, request, **kw):
        self.requests.append(request)
        if len(self.requests) == 1:
            self.started.set()
            assert self.gate.wait(60)
        return self._engine.run(request, **kw)


def test_queued_control_requests_run_alone_and_each_gets_its_pixels(one, refs):
    """Two txt2img requests of one size, steps and guidance (a shared batch without control images) and an img2img
    request, queued together behind a running one: each runs in an engine call of its own, as built, and gets the
    engine's image of its request alone."""
    gated = _GatedEngine(one)
    app = create_app(gated, max_batch=4, queue_size=8, api_key="")
    bodies = [("/v1/txt2img", _txt2img_json(seed=7, num_images=2, response_format="b64_json")),
              ("/v1/txt2img", _txt2img_json(seed=7, controlnet_conditioning_scale=0.5, control_guidance_end=0.5,
                                            response_format="b64_json")),
              ("/v1/img2img", {"prompt": PROMPT, "image": _b64(IMAGE), "strength": 0.5, "seed": 11,
                               "control_image": CONTROL_B64, "num_inference_steps": 4, "guidance_scale": GUIDANCE,
                               "response_format": "b64_json"})]
    with serving(app) as url, httpx.Client(base_url=url, timeout=120) as c, ThreadPoolExecutor(4) as pool:
        blocker = pool.submit(c.post, "/v1/txt2img", json=_txt2img_json(seed=1, num_inference_steps=1))
        assert gated.started.wait(60)
        futures = []
        for path, body in bodies:  # one at a time into the queue, so its order is this one
            futures.append(pool.submit(c.post, path, json=body))
            wait_for(lambda n=len(futures): health(c)["queue_depth"] == n, timeout=20, what="the request queued")
        gated.gate.set()
        assert blocker.result(120).status_code == 200
        answers = [f.result(120) for f in futures]
    assert [(type(r).__name__, len(r.prompts)) for r in gated.requests[1:]] == [
        ("Txt2ImgRequest", 2), ("Txt2ImgRequest", 1), ("Img2ImgRequest", 1)]
    assert all(r.control is not None for r in gated.requests)
    assert [r.json()["timings"]["batch_images"] for r in answers] == [2, 1, 1]
    pair, window, edited = (_images(r) for r in answers)
    assert all(_close(g, _px(ref), 1) for g, ref in zip(pair, refs["pair"]))
    assert _close(window[0], _px(refs["window"])) and _close(edited[0], _px(refs["img2img"]))


def test_the_worker_runs_control_jobs_alone_between_the_batches_of_others():
    """Queued behind a running call: plain txt2img ``a``, control ``c1``, plain ``b`` (compatible with ``a``),
    control ``c2`` and ``c3`` (of one size, steps and guidance) and an img2img control job: ``a`` and ``b`` share
    one call; each control job runs alone, in queue order, its request handed to the engine as built."""
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    worker = Worker(engine, max_batch=8, queue_size=16)

    def plain(prompt, seed):
        return Job(Txt2ImgRequest.build([prompt], seed=[seed], width=64, height=64, num_inference_steps=2),
                   timeout_s=30)

    def control(prompt, seed, n=1):
        return Job(Txt2ImgRequest.build([prompt] * n, seed=[seed + i for i in range(n)], width=64, height=64,
                                        num_inference_steps=2, control_image=_noise(seed=seed)), timeout_s=30)

    edit = Job(Img2ImgRequest.build(_noise(seed=5), ["e"], seed=[60], strength=0.5, num_inference_steps=2,
                                    control_image=_noise(seed=6)), timeout_s=30)
    worker.start()
    try:
        blocker = plain("blocker", 999)
        worker.submit(blocker)
        assert engine.started.wait(10)
        a, c1, b, c2, c3 = plain("a", 10), control("c1", 20, n=2), plain("b", 30), control("c2", 40), control("c3", 50)
        jobs = [a, c1, b, c2, c3, edit]
        for j in jobs:
            worker.submit(j)
        gate.set()
        results = [j.future.result(10) for j in [blocker, *jobs]]
    finally:
        gate.set()
        worker.stop()
    assert [c["prompts"] for c in engine.calls] == [["blocker"], ["a", "b"], ["c1", "c1"], ["c2"], ["c3"], ["e"]]
    assert engine.requests[2] is c1.request and engine.requests[5] is edit.request  # as built, not concatenated
    assert [r.batch_images for r in results[1:]] == [2, 2, 2, 1, 1, 1]
    assert [im.info["seed"] for im in c1.future.result().images] == ["20", "21"]


# -- bad input: a 422 naming the field, before anything is queued ------------------------------------------------


BAD_JSON = [
    (dict(control_image=DROP), "control_image", "is required: this service runs 1 ControlNet(s) (random:tiny-controlnet)"),
    (dict(control_image=None), "control_image", "is required"),
    (dict(control_image=[CONTROL_B64] * 2), "control_image", "got 2: this service runs 1 ControlNet(s)"),
    (dict(control_image=[]), "control_image", "1 to 8 images"),
    (dict(control_image=[CONTROL_B64] * 9), "control_image", "1 to 8 images"),
    (dict(control_image=12), "control_image", "must be an image"),
    (dict(control_image="not base64!"), "control_image", "not a file in base64"),
    (dict(control_image=_b64_bytes(_png_header_only(20000, 20000))), "control_image", "more than 16777216 pixels"),
    (dict(control_image=_b64(_noise(16, 16))), "control_image", "send width and height"),  # 16 x 16: too small alone
    (dict(controlnet_conditioning_scale=-1), "controlnet_conditioning_scale", "[0, 10]"),
    (dict(controlnet_conditioning_scale=11), "controlnet_conditioning_scale", "[0, 10]"),
    (dict(controlnet_conditioning_scale="0.5"), "controlnet_conditioning_scale", "must be a number"),
    (dict(controlnet_conditioning_scale=[True]), "controlnet_conditioning_scale", "must be a number"),
    (dict(controlnet_conditioning_scale=10**30), "controlnet_conditioning_scale", "31-digit integer is out of range"),
    (dict(controlnet_conditioning_scale=[1.0, 0.5]), "controlnet_conditioning_scale", "one per control image (1), got 2"),
    (dict(control_guidance_end=1.5), "control_guidance_end", "[0, 1]"),
    (dict(control_guidance_start=None), "control_guidance_start", "[0, 1]"),  # null is not 0
    (dict(control_guidance_start=0.5, control_guidance_end=0.5), "control_guidance_start",
     "must be below control_guidance_end"),
]


@pytest.mark.parametrize("change, field, hint", BAD_JSON, ids=[f"{f}-{i}" for i, (_, f, _) in enumerate(BAD_JSON)])
def test_bad_controlnet_json_answers_422_naming_the_field_before_queueing(client, app_one, change, field, hint):
    worker = app_one.state.service.worker
    before = worker.batches_run
    r = client.post("/v1/txt2img", json=_txt2img_json(**change))
    assert r.status_code == 422, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field}: ") and hint in err["message"], err
    assert r.json()["detail"][0]["field"] == field
    assert worker.batches_run == before and worker.depth == 0  # it took no batch slot


def test_a_nan_scale_is_refused(client):
    body = json.dumps(_txt2img_json(controlnet_conditioning_scale=float("nan"))).encode()  # Python's JSON writes NaN
    r = client.post("/v1/txt2img", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "controlnet_conditioning_scale", r.text


CONTROL_FILES = [b for b in BAD_FILES if b[0] != "too-small"]  # any size of at least 8 pixels is a control image


@pytest.mark.parametrize("what, data, hint", CONTROL_FILES, ids=[b[0] for b in CONTROL_FILES])
@pytest.mark.parametrize("path", ["/v1/txt2img", "/v1/img2img", "/v1/images/edits"])
def test_a_bad_control_file_answers_422_naming_control_image(client, path, what, data, hint):
    files = [("control_image", ("c.png", data, "image/png"))]
    if path != "/v1/txt2img":
        files.append(("image", ("a.png", _file(_transparent(IMAGE, MASK)), "image/png")))
    r = client.post(path, files=files, data={"prompt": PROMPT, "num_inference_steps": "2"})
    assert r.status_code == 422, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "control_image" and hint in err["message"], err


def test_bad_controlnet_forms_answer_422_naming_the_field(client, client_two):
    fields = {"prompt": PROMPT, "num_inference_steps": "2"}
    good = ("c.png", _file(CONTROL), "image/png")
    cases = [
        (client.post("/v1/img2img", files={"image": ("a.png", _file(IMAGE), "image/png")}, data=fields),
         "control_image", "is required"),
        (client.post("/v1/images/edits", files={"image": ("a.png", _file(_transparent(IMAGE, MASK)), "image/png")},
                     data=fields), "control_image", "is required"),
        (client.post("/v1/images/generations", json={"prompt": PROMPT}), "control_image", "is required"),
        (client.post("/v1/images/generations", files={"control_image": good}, data=fields), "body",
         "send a JSON object"),  # OpenAI's generations is JSON: control images in base64
        (client.post("/v1/txt2img", files=[("control_image", good), ("control_image[]", good)], data=fields),
         "control_image", "send control_image or control_image[], not both"),
        (client.post("/v1/txt2img", files={"control_image": good},
                     data={**fields, "controlnet_conditioning_scale": "abc"}), "controlnet_conditioning_scale",
         "numbers separated by commas"),
        (client.post("/v1/txt2img", files={"control_image": good},
                     data={**fields, "control_guidance_end": ["1", "0.5"]}), "control_guidance_end",
         "one per control image (1), got 2"),
        (client_two.post("/v1/txt2img", files={"control_image": good}, data=fields), "control_image",
         "got 1: this service runs 2 ControlNet(s)"),
        (client_two.post("/v1/txt2img", json=_txt2img_json(control_image=[CONTROL_B64, _b64_bytes(b"\x89PNG nope")])),
         "control_image[1]", "not a PNG, JPEG or WebP"),
    ]
    for r, field, hint in cases:
        assert r.status_code == 422, r.text[:300]
        err = r.json()["error"]
        assert err["param"] == field and hint in err["message"], err


def test_a_service_without_controlnet_refuses_the_controlnet_fields(plain):
    c, engine = plain
    image = ("a.png", _file(_transparent(IMAGE, MASK)), "image/png")
    control = ("c.png", _file(CONTROL), "image/png")
    fields = {"prompt": PROMPT, "num_inference_steps": "2"}
    cases = [
        (c.post("/v1/txt2img", json=_txt2img_json()), "control_image", "this service has no ControlNet"),
        (c.post("/v1/img2img", files={"image": image, "control_image": control}, data=fields), "control_image",
         "--controlnet MODEL"),
        (c.post("/v1/images/edits", files={"image": image, "control_image": control}, data=fields), "control_image",
         "no ControlNet"),
        (c.post("/v1/images/generations", json={"prompt": PROMPT, "control_image": CONTROL_B64}), "control_image",
         "no ControlNet"),
        (c.post("/v1/txt2img", json={"prompt": PROMPT, "controlnet_conditioning_scale": 0.5}),
         "controlnet_conditioning_scale", "only with control_image"),
        (c.post("/v1/txt2img", json={"prompt": PROMPT, "control_guidance_start": 0.0}), "control_guidance_start",
         "only with control_image"),
    ]
    for r, field, hint in cases:
        assert r.status_code == 422, r.text[:300]
        err = r.json()["error"]
        assert err["param"] == field and hint in err["message"], err
    assert engine.requests == [] and health(c)["controlnets"] == []


def test_oversized_bodies_are_413_and_many_small_json_values_a_422(client):
    big = b"x" * (schemas.MAX_UPLOAD_BYTES + 1)
    for path in ("/v1/txt2img", "/v1/images/generations"):
        r = client.post(path, content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "32 MiB" in r.json()["error"]["message"], (path, r.text)
    # Past 1 MiB (a body with control images), a txt2img body's JSON values are counted before it is parsed.
    body = ("{" + ",".join(f'"{i:x}":0' for i in range(300_000)) + "}").encode()
    assert (1 << 20) < len(body) < schemas.MAX_UPLOAD_BYTES
    r = client.post("/v1/txt2img", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "body" and "JSON values" in r.text, r.text


# -- what the service reports, and sdfast serve --controlnet ----------------------------------------------------


def test_health_and_the_schema_report_the_controlnets(client):
    assert health(client)["controlnets"] == [NET]
    assert health(client)["tasks"] == ["txt2img", "img2img", "inpaint"]
    paths = client.get("/openapi.json").json()["paths"]
    content = paths["/v1/txt2img"]["post"]["requestBody"]["content"]
    form = content["multipart/form-data"]["schema"]["properties"]["control_image"]
    assert form["type"] == "array" and form["items"]["format"] == "binary"
    assert "controlnet_conditioning_scale" in content["application/json"]["schema"]["properties"]
    generations = paths["/v1/images/generations"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"control_image", "control_guidance_start", "control_guidance_end"} <= set(generations["properties"])


class _ControlFake(FakeEngine):
    def __init__(self, nets: int):
        super().__init__()
        self.controlnets = [object()] * nets


@pytest.fixture
def served(monkeypatch):
    """``serve`` with a fake load and no real server: what ``sdfast.load`` was asked, and the app it served."""
    import sdfast
    import server.app as app_module

    built = {}

    def load(model, optimize=True, controlnet=None):
        built["load"] = dict(model=model, optimize=optimize, controlnet=controlnet)
        nets = 0 if controlnet is None else 1 if isinstance(controlnet, str) else len(controlnet)
        return _ControlFake(nets)

    class Stub:
        started = True

        def __init__(self, app, **kw):
            built["app"] = app

        def run(self):
            pass

    monkeypatch.setattr(sdfast, "load", load)
    monkeypatch.setattr(app_module, "_check_can_listen", lambda host, port: None)
    monkeypatch.setattr(app_module, "uvicorn_server", lambda app, **kw: Stub(app, **kw))
    return built


def test_sdfast_serve_controlnet_reaches_the_engine(served, capsys):
    from sdfast.cli import main

    assert main(["serve", "--model", "random:tiny", "--controlnet", NET]) == 0
    assert served["load"] == dict(model="random:tiny", optimize=True, controlnet=NET)  # one: not a list of one
    service = served["app"].state.service
    assert service.controlnets == [NET] and service.health(details=True).controlnets == [NET]
    assert f"with ControlNet(s) {NET}" in capsys.readouterr().err
    assert main(["serve", "--model", "random:tiny", "--controlnet", NET, "--controlnet", "./canny"]) == 0
    assert served["load"]["controlnet"] == [NET, "./canny"]
    assert served["app"].state.service.controlnets == [NET, "./canny"]
    assert main(["serve", "--model", "random:tiny"]) == 0
    assert served["load"]["controlnet"] is None and served["app"].state.service.controlnets == []


def test_sdfast_serve_refuses_an_unknown_builtin_controlnet_before_loading(served, capsys):
    from sdfast.cli import main

    assert main(["serve", "--model", "random:tiny", "--controlnet", "random:nope"]) == 2
    assert "--controlnet: unknown built-in ControlNet 'random:nope'" in capsys.readouterr().err
    assert "load" not in served
