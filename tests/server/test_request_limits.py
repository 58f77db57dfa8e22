"""Issue 30, item 5: the service's limits are a subset of the engine's, and a request is built once (its texts
tokenized once) and handed through the worker to ``Engine.run`` as it is."""

from __future__ import annotations

import httpx
import pytest

import sdfast.request as engine
from sdfast.request import Txt2ImgRequest
from server import schemas
from server.app import create_app

from .helpers import FakeEngine, serving


def test_every_service_limit_is_within_the_engines():
    assert engine.MIN_SIDE <= schemas.MIN_SIDE <= schemas.MAX_SIDE <= engine.MAX_SIDE
    assert 1 <= schemas.MAX_IMAGES <= engine.MAX_IMAGES
    assert 0 <= schemas.MAX_GUIDANCE <= engine.MAX_GUIDANCE
    assert 0 <= schemas.MAX_SEED <= engine.MAX_SEED
    assert (schemas.MIN_SIDE, schemas.MAX_SIDE, schemas.MAX_STEPS, schemas.MAX_IMAGES, schemas.MAX_GUIDANCE,
            schemas.MAX_SEED) == (schemas.SERVICE_MIN_SIDE, schemas.SERVICE_MAX_SIDE, schemas.SERVICE_MAX_STEPS,
                                  schemas.SERVICE_MAX_IMAGES, schemas.SERVICE_MAX_GUIDANCE, schemas.SERVICE_MAX_SEED)
    with pytest.raises(ValueError, match="may only tighten"):
        schemas._within("SERVICE_MAX_SIDE", engine.MAX_SIDE + 8, schemas.MIN_SIDE, engine.MAX_SIDE)


@pytest.mark.parametrize("side", [schemas.MIN_SIDE, schemas.MAX_SIDE])
def test_the_schemas_extremes_build_an_engine_request(side):
    """What the schema accepts at its edges, the engine's one constructor accepts too (no second set of limits
    that could refuse it after the queue)."""
    body = schemas.Txt2ImgRequest(prompt="x" * schemas.MAX_PROMPT_CHARS, negative_prompt="y" * schemas.MAX_PROMPT_CHARS,
                                  num_inference_steps=schemas.MAX_STEPS, guidance_scale=schemas.MAX_GUIDANCE,
                                  width=side, height=side, num_images=schemas.MAX_IMAGES,
                                  seed=schemas.MAX_SEED - schemas.MAX_IMAGES + 1, response_format="b64_json")
    n = body.num_images
    built = Txt2ImgRequest.build([body.prompt] * n, negative_prompt=[body.negative_prompt] * n,
                                 seed=[body.seed + i for i in range(n)], width=body.width, height=body.height,
                                 num_inference_steps=body.num_inference_steps, guidance_scale=body.guidance_scale)
    assert built.num_images == schemas.MAX_IMAGES and built.seeds[-1] == schemas.MAX_SEED


def test_the_worker_hands_the_services_built_requests_to_engine_run():
    engine_ = FakeEngine()
    with serving(create_app(engine_, api_key="")) as url, httpx.Client(base_url=url, timeout=20) as c:
        r = c.post("/v1/txt2img", json={"prompt": "a cat", "negative_prompt": "dark", "num_inference_steps": 2,
                                        "seed": 11, "num_images": 2, "response_format": "b64_json"})
        assert r.status_code == 200, r.text
    (request,) = engine_.requests
    assert isinstance(request, Txt2ImgRequest)
    assert request.prompts == ("a cat", "a cat") and request.negative_prompts == ("dark", "dark")
    assert request.seeds == (11, 12) and request.width == request.height == FakeEngine.default_size
    assert request.tokens is None  # a fake engine has no tokenizer: the engine would tokenize


def test_a_service_request_is_tokenized_once_on_the_real_engine(monkeypatch):
    """Before: the service counted windows (tokenizing each text), then the engine's ``plan`` tokenized again, then
    diffusers' ``encode_prompt`` a third time."""
    import torch
    from transformers import CLIPTokenizer, CLIPTokenizerFast

    import sdfast

    stock = sdfast.load("random:tiny", optimize=False)
    calls = []
    for cls in {CLIPTokenizer, CLIPTokenizerFast}:  # one class in transformers 5
        def spy(self, text=None, *args, _original=cls.__call__, **kwargs):
            calls.append(text)
            return _original(self, text, *args, **kwargs)

        monkeypatch.setattr(cls, "__call__", spy)
    runs = []  # the requests the engine prepared (Engine.prepare: static batching's run and the step batch's join)
    prepare = stock.prepare
    monkeypatch.setattr(stock, "prepare", lambda request, **kw: runs.append(request) or prepare(request, **kw))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with serving(create_app(stock, api_key="")) as url, httpx.Client(base_url=url, timeout=60) as c:
            r = c.post("/v1/txt2img", json={"prompt": "a cat", "negative_prompt": "dark", "num_inference_steps": 1,
                                            "seed": 1, "width": 64, "height": 64, "num_images": 2,
                                            "response_format": "b64_json"})
            assert r.status_code == 200, r.text
    finally:
        torch.set_num_threads(threads)
    assert sorted(calls) == ["a cat", "dark"]
    (request,) = runs
    assert request.tokens is not None and request.tokens.windows() == (1, 1)
