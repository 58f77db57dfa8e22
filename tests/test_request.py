"""Issue 30, item 5: one request object, validated once and tokenized once, from the caller to the pipeline
(``sdfast.request.Txt2ImgRequest``, ``Engine.run``, ``sdfast.prompts.tokenize``), and the per-call steps in one
module (``sdfast.runtime.session``). ``random:tiny`` / ``random:tiny-xl``, stock pipelines (the kernels are not the
subject)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import sdfast
import sdfast.request
from sdfast import prompts
from sdfast.errors import InvalidRequestError, NonFiniteOutputError
from sdfast.request import MAX_IMAGES, Txt2ImgRequest

KW = dict(num_inference_steps=1, height=32, width=32)


@pytest.fixture(scope="module")
def stock():
    return sdfast.load("random:tiny", optimize=False)


@pytest.fixture(scope="module")
def stock_xl():
    return sdfast.load("random:tiny-xl", optimize=False)


@pytest.fixture
def tokenizer_calls(monkeypatch):
    """Every text each CLIP tokenizer (of any pipeline, copies too) is called on, diffusers' calls included."""
    from transformers import CLIPTokenizer, CLIPTokenizerFast

    calls = []
    for cls in {CLIPTokenizer, CLIPTokenizerFast}:  # one class in transformers 5
        original = cls.__call__

        def spy(self, text=None, *args, _original=original, **kwargs):
            calls.append(text)
            return _original(self, text, *args, **kwargs)

        monkeypatch.setattr(cls, "__call__", spy)
    return calls


@pytest.fixture
def validations(monkeypatch):
    calls = []
    check = sdfast.request.check_request
    monkeypatch.setattr(sdfast.request, "check_request", lambda **kw: calls.append(kw) or check(**kw))
    return calls


def _px(images) -> np.ndarray:
    return np.stack([np.asarray(im) for im in images])


@pytest.mark.parametrize("arch, tokenizers", [("tiny", 1), ("tiny-xl", 2)])
def test_txt2img_validates_once_and_tokenizes_each_text_once(request, arch, tokenizers, tokenizer_calls,
                                                              validations):
    """Before: ``plan`` tokenized every text, then diffusers' ``encode_prompt`` (or ``encode_chunked``) again."""
    engine = request.getfixturevalue("stock" if arch == "tiny" else "stock_xl")
    engine.txt2img(["a cat", "a dog", "a cat"], negative_prompt="blurry", seed=1, **KW)
    assert len(validations) == 1
    assert sorted(tokenizer_calls) == sorted(["a cat", "a dog", "blurry"] * tokenizers)


def test_run_takes_the_request_as_built_no_validation_and_no_tokenizer(stock, tokenizer_calls, validations):
    built = stock.request("a cat", negative_prompt="blurry", seed=2, **KW)
    assert built.tokens is not None and len(validations) == 1 and sorted(tokenizer_calls) == ["a cat", "blurry"]
    validations.clear()
    tokenizer_calls.clear()
    images = stock.run(built)
    assert not validations and not tokenizer_calls
    assert np.array_equal(_px(images), _px(stock.txt2img("a cat", negative_prompt="blurry", seed=2, **KW)))


def test_a_built_request_round_trips(stock):
    kwargs = dict(prompt=["a cat", "a dog"], negative_prompt=["blurry", "dark"], num_inference_steps=2,
                  guidance_scale=5.0, height=32, width=40, seed=[3, 9, 4, 8], num_images_per_prompt=2,
                  scheduler="ddim", long_prompt="truncate")
    built = Txt2ImgRequest.build(**kwargs)
    assert built.as_kwargs() == kwargs and Txt2ImgRequest.build(**built.as_kwargs()) == built
    assert built.num_images == 4 and built.seeds == (3, 9, 4, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.height = 64
    # normalised: numpy scalars become Python numbers, a string prompt a tuple, an int seed one seed per image
    same = Txt2ImgRequest.build("a cat", num_inference_steps=np.int64(2), guidance_scale=np.float32(7.5),
                                height=np.int32(32), seed=np.int64(5), num_images_per_prompt=2)
    assert same == Txt2ImgRequest.build(["a cat"], num_inference_steps=2, guidance_scale=7.5, height=32, seed=[5, 6],
                                        num_images_per_prompt=2)
    assert type(same.num_inference_steps) is int and type(same.guidance_scale) is float and same.width is None
    # and through the engine: the same images as txt2img with the same arguments
    assert np.array_equal(_px(stock.run(built)), _px(stock.txt2img(**kwargs)))


@pytest.mark.parametrize("kwargs, field", [
    ({"height": 100}, "height"), ({"width": 0}, "width"), ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"guidance_scale": float("nan")}, "guidance_scale"), ({"seed": [1, 2]}, "seed"), ({"scheduler": "nope"}, "scheduler"),
    ({"negative_prompt": ["a", "b"]}, "negative_prompt"), ({"long_prompt": "wrap"}, "long_prompt"),
    ({"num_images_per_prompt": MAX_IMAGES + 1}, "num_images_per_prompt"), ({"prompt": 3}, "prompt"),
])
def test_build_names_the_field(kwargs, field):
    kwargs = {"prompt": "a cat", **kwargs}
    with pytest.raises(InvalidRequestError) as e:
        Txt2ImgRequest.build(kwargs.pop("prompt"), **kwargs)
    assert e.value.field == field


def test_run_refuses_what_is_not_a_built_request_and_checks_the_models_step_limit(stock):
    with pytest.raises(TypeError, match="Txt2ImgRequest"):
        stock.run({"prompt": "a cat"})
    with pytest.raises(InvalidRequestError) as e:
        stock.run(Txt2ImgRequest.build("a cat", num_inference_steps=60, scheduler="lcm"))
    assert e.value.field == "num_inference_steps"


def test_tokens_of_another_vocabulary_are_made_again(stock, tokenizer_calls):
    """A textual inversion loaded after the request was tokenized adds tokens: the engine does not encode stale ids."""
    built = stock.request("a cat", seed=4, **KW)
    stale = dataclasses.replace(built, tokens=dataclasses.replace(built.tokens, vocab=(built.tokens.vocab[0] - 1,)))
    tokenizer_calls.clear()
    assert np.array_equal(_px(stock.run(stale)), _px(stock.run(built)))
    assert tokenizer_calls == ["a cat"]  # once, for the stale request only


def test_concat_batches_requests_with_their_tokens(stock):
    tokenize = lambda p, n: prompts.tokenize(stock.pipe, p, n)  # noqa: E731
    a = Txt2ImgRequest.build(["a cat"], negative_prompt=["blurry"], seed=[1], tokenize=tokenize, **KW)
    b = Txt2ImgRequest.build(["a red dog", "a red dog"], negative_prompt=["dark"] * 2, seed=[7, 8], tokenize=tokenize,
                             **KW)
    both = Txt2ImgRequest.concat([a, b])
    assert both.prompts == ("a cat", "a red dog", "a red dog") and both.seeds == (1, 7, 8)
    assert both.negative_prompts == ("blurry", "dark", "dark")
    assert both.tokens == prompts.tokenize(stock.pipe, list(both.prompts), list(both.negative_prompts))
    assert both.tokens.windows() == (1, 1)
    assert Txt2ImgRequest.concat([a, dataclasses.replace(b, tokens=None)]).tokens is None  # the engine tokenizes
    with pytest.raises(ValueError, match="same size"):
        Txt2ImgRequest.concat([a, Txt2ImgRequest.build("a cat", seed=2, **dict(KW, width=40))])
    with pytest.raises(ValueError, match="seeds"):
        Txt2ImgRequest.concat([a, Txt2ImgRequest.build("a cat", negative_prompt="x", **KW)])
    many = [Txt2ImgRequest.build("a cat", seed=i, **KW) for i in range(MAX_IMAGES + 1)]
    with pytest.raises(InvalidRequestError) as e:
        Txt2ImgRequest.concat(many)
    assert e.value.field == "num_images_per_prompt"


def test_windows_count_the_longest_prompt_and_negative_prompt(stock):
    long = "a photo of a cat, " * 30  # 180 tokens: three windows
    tokens = prompts.tokenize(stock.pipe, ["a cat", long], None)
    assert tokens.windows() == (3, 1)
    assert prompts.tokenize(stock.pipe, ["a cat"], ["blurry, " * 40]).windows() == (1, 2)
    assert prompts.tokenize(stock.pipe, [""], None).prompts == (((),),)  # the empty text has no content tokens


def test_every_text_is_encoded_from_its_ids_as_diffusers_encodes_it(stock_xl):
    """The engine always hands the pipeline embeddings (no second tokenization): a text of one window must give
    diffusers' own ``encode_prompt`` exactly, SDXL's pooled embeddings and zeroed negative included."""
    pipe = stock_xl.pipe
    tokens = prompts.tokenize(pipe, ["a cat"], None)
    ours = prompts.encode_chunked(pipe, ["a cat"], None, 1, do_cfg=True, tokens=tokens)
    ref = pipe.encode_prompt("a cat", device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=True)
    assert sorted(ours) == ["pooled_prompt_embeds", "prompt_embeds"]  # diffusers zeroes the negative itself
    assert torch.equal(ours["prompt_embeds"], ref[0]) and torch.equal(ours["pooled_prompt_embeds"], ref[2])


def test_the_call_session_is_what_engine_and_optimizer_call(monkeypatch, stock):
    """The per-call steps live in ``sdfast.runtime.session``: the engine opens a ``CallSession`` per call, and an
    optimized pipeline's ``check_inputs`` calls ``before_denoising`` (time-embedding refresh, then graph check)."""
    from sdfast.runtime import session

    calls = []

    from tests.user_cases import _FakeGraphs

    class Graphs(_FakeGraphs):  # a stand-in GraphCache: the CPU captures no graphs
        def check(self, names=None):
            calls.append(("check", names))
            return 0

        def mark(self):
            return 7

        def drop_since(self, mark):
            calls.append(("drop_since", mark))
            return 0

    from sdfast.passes import time_embedding

    monkeypatch.setattr(time_embedding, "refresh", lambda unet: calls.append(("refresh", None)) or False)
    pipe = stock.pipe
    session.before_denoising(pipe, Graphs())
    assert calls == [("refresh", None), ("check", None)]
    calls.clear()
    s = session.CallSession(pipe)
    s.graphs = Graphs()
    s.before_text_encoders()
    assert calls == [("check", session.TEXT_ENCODERS)]
    calls.clear()
    with pytest.raises(torch.OutOfMemoryError, match="out of host memory for 1 image"):
        with s.call(pipe.scheduler, what="1 image of 32x32"):
            raise MemoryError("no room")
    assert calls == [("drop_since", 7)]  # the graphs captured by the failed call are dropped
    with pytest.raises(RuntimeError, match="unrelated"):
        with s.call(pipe.scheduler, what="1 image"):
            raise RuntimeError("unrelated")
    assert calls == [("drop_since", 7)]  # not an out-of-memory error: nothing dropped
    with s.call(pipe.scheduler, what="1 image") as finite:
        pipe.vae.decoder(torch.full((1, pipe.vae.config.latent_channels, 4, 4), float("nan")))
    assert len(finite) == 1 and not bool(finite[0])
    with pytest.raises(NonFiniteOutputError):
        s.check_finite(bool(finite[0]), 7.5)
    assert not pipe.vae.decoder._forward_hooks  # the hook is gone after the call
