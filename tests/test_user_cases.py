"""Issue 10 (CPU, tiny architectures): what real users hit. Every size, guidance, prompt, seed and scheduler
gives stock diffusers' image on the optimized engine (or a clear error); LoRA, model variants and checkpoints are
tests/test_user_cases_models.py (the shared helpers: tests/user_cases.py).
"""

from __future__ import annotations

import pytest
import torch

import sdfast
from sdfast.engine import PromptTruncatedWarning
from sdfast.errors import InvalidRequestError, NonFiniteOutputError
from sdfast.prompts import encode_chunked, plan
from tests.user_cases import KW, LONG, PIPE_KW, TOL, _diff, _FakeGraphs, _unet_calls, warm_tiny_pair


@pytest.fixture(scope="module")
def tiny():
    """(stock, fast, warm-up image): every case runs on a warmed-up optimized engine."""
    return warm_tiny_pair()


# --- sizes ---------------------------------------------------------------------------------------


def test_sizes_multiple_of_8_not_64_odd_latents_many_in_a_row_match_stock(tiny):
    stock, fast, _ = tiny
    # latents 5x3 and 3x7: odd sides make the UNet upsample to explicit sizes; non-square both ways
    first = None
    for h, w in [(40, 24), (24, 56)]:
        a = fast.txt2img("a cat", seed=1, **dict(KW, height=h, width=w))
        assert a[0].size == (w, h)
        assert _diff(a, stock.txt2img("a cat", seed=1, **dict(KW, height=h, width=w))) <= TOL, (h, w)
        first = first or a
    again = fast.txt2img("a cat", seed=1, **dict(KW, height=40, width=24))
    assert _diff(again, first) == 0  # back to the first size: nothing stale


@pytest.mark.parametrize("shape", [(1, 4, 2, 2), (2, 4, 3, 5)])
def test_vae_decode_of_small_and_odd_latents_matches_stock(tiny, shape):
    """The VAE mid-block attention normalises (B, C, H*W) token views: exact on every latent shape."""
    stock, fast, _ = tiny
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ref = fast.pipe.vae.decode(z).sample, stock.pipe.vae.decode(z).sample
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_size_not_multiple_of_8_is_a_clear_error(tiny):
    with pytest.raises(InvalidRequestError) as e:
        tiny[1].txt2img("a cat", height=60, width=64)
    assert e.value.field == "height"


def test_batch_of_prompts_with_num_images_per_prompt_matches_stock(tiny):
    stock, fast, _ = tiny
    prompts = ["a cat", "a dog on a red chair"]
    kw = dict(KW, seed=100, num_images_per_prompt=2)
    a = fast.txt2img(prompts, **kw)
    assert len(a) == 4 and [im.info["seed"] for im in a] == [str(100 + i) for i in range(4)]
    assert _diff(a, stock.txt2img(prompts, **kw)) <= TOL
    # image k of the batch is the image its prompt and seed give alone
    assert _diff(a[3], fast.txt2img(prompts[1], **dict(KW, seed=103))) <= 1


@pytest.mark.parametrize("n_prompts, per_prompt", [(1, 8), (8, 1), (3, 2)])
def test_batch_and_num_images_per_prompt_up_to_8(tiny, n_prompts, per_prompt):
    """Counts, order and seeds (the optimized engine's parity at batch 4 is the test above; GPU: up to 8)."""
    stock, _, _ = tiny
    prompts = [f"a cat number {i}" for i in range(n_prompts)]
    a = stock.txt2img(prompts, seed=7, num_images_per_prompt=per_prompt, num_inference_steps=1, height=16, width=16)
    assert len(a) == n_prompts * per_prompt and all(im.size == (16, 16) for im in a)
    assert [im.info["seed"] for im in a] == [str(7 + i) for i in range(len(a))]
    assert [im.info["prompt_tokens"] for im in a] == [str(len(p.split())) for p in prompts for _ in range(per_prompt)]


# --- guidance ------------------------------------------------------------------------------------


def test_guidance_le_1_runs_one_unet_pass_without_cfg_batch_and_switches_back(tiny):
    stock, fast, _ = tiny
    calls, hook = _unet_calls(fast)
    try:
        for g in (1.0, 7.5):  # the engine was warmed up with CFG: off, then on again
            calls.clear()
            a = fast.txt2img("a dog", guidance_scale=g, seed=3, **KW)
            assert [c[0] for c in calls] == [2 if g > 1 else 1] * KW["num_inference_steps"], g
            assert _diff(a, stock.txt2img("a dog", guidance_scale=g, seed=3, **KW)) <= TOL, g
    finally:
        hook.remove()
    calls, hook = _unet_calls(stock)
    try:
        stock.txt2img("a cat", guidance_scale=0.0, seed=3, **KW)
        assert [c[0] for c in calls] == [1, 1]
    finally:
        hook.remove()


# --- prompts -------------------------------------------------------------------------------------


def test_long_prompt_is_chunked_in_75_token_windows_reported_and_matches_stock(tiny):
    stock, fast, _ = tiny
    calls, hook = _unet_calls(fast)
    try:
        a = fast.txt2img(LONG, negative_prompt="blurry", seed=4, **KW)
    finally:
        hook.remove()
    info = a[0].info
    assert (info["prompt_tokens"], info["prompt_chunks"], info["prompt_truncated_tokens"]) == ("180", "3", "0")
    assert {c[1] for c in calls} == {3 * 77}  # the UNet cross-attends to every window
    ref = stock.txt2img(LONG, negative_prompt="blurry", seed=4, **KW)
    assert _diff(a, ref) <= TOL
    cut = stock.txt2img(LONG, negative_prompt="blurry", seed=4, long_prompt="truncate", **KW)
    assert _diff(ref, cut) > TOL  # the tokens after the 75th changed the image


def test_long_prompt_truncate_mode_warns_reports_and_equals_stock_diffusers(tiny):
    stock, _, _ = tiny
    with pytest.warns(PromptTruncatedWarning, match=r"dropped 105 token\(s\)"):
        a = stock.txt2img(LONG, seed=5, long_prompt="truncate", **PIPE_KW)
    assert a[0].info["prompt_truncated_tokens"] == "105" and a[0].info["prompt_chunks"] == "1"
    with pytest.warns(PromptTruncatedWarning, match=r"and 25 of the negative"):
        stock.txt2img("a cat", negative_prompt="blurry, ugly, " * 25, seed=5, long_prompt="truncate", **PIPE_KW)
    ref = stock.pipe(LONG, generator=[torch.Generator().manual_seed(5)], guidance_scale=7.5, **PIPE_KW).images
    assert _diff(a, ref) == 0


def test_long_prompt_bad_policy_is_a_clear_error(tiny):
    with pytest.raises(InvalidRequestError) as e:
        tiny[0].txt2img("a cat", long_prompt="wrap")
    assert e.value.field == "long_prompt"


def test_prompt_of_75_tokens_is_stock_diffusers_exactly_and_76_needs_two_windows(tiny):
    stock, fast, _ = tiny
    p75, p76 = "cat " * 75, "cat " * 76
    assert plan(fast.pipe, [p75], None, "chunk").chunks == 1
    assert plan(fast.pipe, [p76], None, "chunk").chunks == 2
    img = stock.txt2img(p75, seed=6, **PIPE_KW)
    assert img[0].info["prompt_chunks"] == "1"
    ref = stock.pipe(p75, generator=[torch.Generator().manual_seed(6)], guidance_scale=7.5, **PIPE_KW).images
    assert _diff(img, ref) == 0


def test_windows_of_counts_77_token_windows(tiny):
    from sdfast.prompts import windows_of

    pipe = tiny[0].pipe
    assert [windows_of(pipe, t) for t in ("", "a cat", "cat " * 75, "cat " * 76, LONG)] == [1, 1, 1, 2, 3]


@pytest.mark.parametrize("arch", ["tiny", "tiny-xl"])
def test_chunked_window_equals_diffusers_encode_prompt(arch):
    pipe = sdfast.load(f"random:{arch}", optimize=False).pipe
    is_xl = arch == "tiny-xl"
    # one window: exactly diffusers' encoding
    ours = encode_chunked(pipe, ["a cat"], ["blurry"], 1, do_cfg=True)
    ref = pipe.encode_prompt("a cat", device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=True,
                             negative_prompt="blurry")
    names = ["prompt_embeds", "negative_prompt_embeds"] + (["pooled_prompt_embeds", "negative_pooled_prompt_embeds"] if is_xl else [])
    for name, r in zip(names, ref):
        assert torch.equal(ours[name], r), name
    # prompt and negative prompt in one encoder batch (what a graphed pipeline runs): the same embeddings
    both = encode_chunked(pipe, ["a cat"], ["blurry"], 1, do_cfg=True, batch_cfg=True)
    assert sorted(both) == sorted(names)
    for name in names:
        torch.testing.assert_close(both[name], ours[name], rtol=0, atol=1e-6)
    # a long prompt: window 0 is diffusers' (truncating) encoding; the others are new tokens
    ours = encode_chunked(pipe, [LONG], None, 3, do_cfg=True)
    ref = pipe.encode_prompt(LONG, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=True)
    assert ours["prompt_embeds"].shape[1] == 3 * 77
    torch.testing.assert_close(ours["prompt_embeds"][:, :77], ref[0], rtol=0, atol=1e-6)
    if is_xl:  # no negative prompt: diffusers zeroes the negative embeddings itself (force_zeros_for_empty_prompt)
        assert "negative_prompt_embeds" not in ours
        torch.testing.assert_close(ours["pooled_prompt_embeds"], ref[2], rtol=0, atol=1e-6)
    else:  # the empty negative prompt in every window
        empty = pipe.encode_prompt("", device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=False)[0]
        torch.testing.assert_close(ours["negative_prompt_embeds"], empty.repeat(1, 3, 1), rtol=0, atol=1e-6)


def test_negative_prompt_of_different_length(tiny):
    stock, fast, _ = tiny
    long_negative = "blurry, ugly, " * 25  # 100 tokens: two windows for a short prompt
    a = fast.txt2img("a cat", negative_prompt=long_negative, seed=7, **KW)
    assert a[0].info["prompt_chunks"] == "2"
    assert _diff(a, stock.txt2img("a cat", negative_prompt=long_negative, seed=7, **KW)) <= TOL
    # one negative string for a batch of prompts of other lengths (diffusers itself refuses str vs list)
    prompts = ["a cat", "a very small dog sitting on a red chair"]
    a = stock.txt2img(prompts, negative_prompt="blurry", seed=8, **PIPE_KW)
    ref = stock.pipe(prompts, negative_prompt=["blurry", "blurry"], guidance_scale=7.5,
                     generator=[torch.Generator().manual_seed(s) for s in (8, 9)], **PIPE_KW).images
    assert _diff(a, ref) == 0
    with pytest.raises(InvalidRequestError) as e:
        stock.txt2img(prompts, negative_prompt=["blurry"], **KW)
    assert e.value.field == "negative_prompt"


def test_empty_and_non_ascii_prompts_match_stock(tiny):
    stock, fast, _ = tiny
    prompts = ["", "猫がソファで寝ている — café ☕ 🐱"]
    negatives = ["", "ünïcödé, размыто"]
    a = fast.txt2img(prompts, negative_prompt=negatives, seed=9, **KW)
    assert a[0].info["prompt_tokens"] == "0" and int(a[1].info["prompt_tokens"]) > 10
    assert _diff(a, stock.txt2img(prompts, negative_prompt=negatives, seed=9, **KW)) <= TOL


# --- seeds ---------------------------------------------------------------------------------------


def test_per_image_seeds_image_k_equals_alone_with_its_seed(tiny):
    _, fast, _ = tiny
    batch = fast.txt2img(["a cat", "a dog"], seed=[5, 42], **KW)
    assert [im.info["seed"] for im in batch] == ["5", "42"]
    assert _diff(batch[1], fast.txt2img("a dog", seed=42, **KW)) <= 1


# --- schedulers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(sdfast.SCHEDULERS))
def test_every_scheduler_swapped_after_warm_up_matches_stock(tiny, name):
    stock, fast, _ = tiny
    kw = dict(KW, scheduler=name)
    a = fast.txt2img("a cat", seed=12, **kw)
    assert _diff(a, stock.txt2img("a cat", seed=12, **kw)) <= TOL


def test_scheduler_swapped_back_gives_the_warm_up_image(tiny):
    stock, fast, warm = tiny
    fast.txt2img("a cat", seed=0, **dict(KW, scheduler="dpmpp_2m_karras"))
    assert _diff(fast.txt2img("a cat", seed=0, **KW), warm) == 0


# --- numerics ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_vae_output_is_an_error_never_a_black_image(tiny, monkeypatch, bad):
    _, fast, _ = tiny
    decoder = fast.pipe.vae.decoder
    real = decoder.forward

    def poisoned(*args, **kwargs):
        out = real(*args, **kwargs)
        out[:, :, :4, :4] = bad  # a few pixels: clamping to [0, 1] would hide an Inf
        return out

    monkeypatch.setattr(decoder, "forward", poisoned)
    with pytest.raises(NonFiniteOutputError, match="NaN/Inf"):
        fast.txt2img("a cat", seed=20, **dict(KW, num_inference_steps=1))


def test_graph_cache_check_runs_before_any_text_encoder_call_of_a_long_prompt(tiny, monkeypatch):
    """A long prompt is encoded by sdfast (in 75-token windows) before the pipeline's own input check: the
    CUDA-graph cache must drop stale graphs before that encoder runs, not after (a graph replayed over
    replaced text-encoder weights would read freed storage)."""
    _, fast, _ = tiny
    order = []

    class Graphs(_FakeGraphs):
        def check(self, names=None):
            order.append("check")
            return 0

    monkeypatch.setattr(fast.pipe._sdfast, "graphs", Graphs())
    h = fast.pipe.text_encoder.register_forward_pre_hook(lambda m, a: order.append("text_encoder"))
    try:
        fast.txt2img("a photo of a cat " * 30, seed=0, **dict(KW, num_inference_steps=1))
    finally:
        h.remove()
    assert order[0] == "check" and order.count("text_encoder") >= 2, order


@pytest.mark.parametrize("negative", [None, "blurry"])
def test_a_graphed_pipeline_encodes_prompt_and_negative_prompt_in_one_text_encoder_batch(tiny, monkeypatch, negative):
    """With CUDA graphs (a stand-in here), a short prompt and its negative prompt go through the text encoder as
    one batch of 2, one call (one graph replay) instead of diffusers' two, and the image is the one diffusers'
    own encoding gives."""
    _, fast, _ = tiny
    ref = fast.txt2img("a cat", negative_prompt=negative, seed=3, **KW)
    batches = []
    h = fast.pipe.text_encoder.register_forward_pre_hook(lambda m, a: batches.append(a[0].shape[0]))
    monkeypatch.setattr(fast.pipe._sdfast, "graphs", _FakeGraphs())
    try:
        img = fast.txt2img("a cat", negative_prompt=negative, seed=3, **KW)
    finally:
        h.remove()
    assert batches == [2]
    assert _diff(img, ref) <= 1
