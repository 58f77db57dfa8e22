"""The attention dispatcher on CPU: measured choice per key, exclusion of failing / wrong / too slow backends (logged
once), quiet probing, out-of-memory, capture, the bucket-mate narrowing, forced backends and candidates."""

import logging
import re
import time
import warnings

import pytest
import torch

from kernels import select
from sdfast.passes import attention as ap
from sdfast.passes.attention import dispatch as dp

from .helpers import random_qkv


def test_dispatcher_excludes_failing_and_wrong_backends(caplog):
    def boom(q, k, v, attn_mask, scale, upcast):
        raise RuntimeError("simulated kernel failure")

    def wrong(q, k, v, attn_mask, scale, upcast):
        return torch.zeros(q.shape, dtype=q.dtype)

    d = ap.AttentionDispatcher(
        candidates=("boom", "wrong", "math", "sdpa"), extra_backends={"boom": boom, "wrong": wrong},
        measure_cpu=True,
    )
    q, k, v = random_qkv()
    with caplog.at_level(logging.INFO, logger="sdfast.attention"):
        out = d(q, k, v)
        out2 = d(q, k, v)  # cached: measured once
    key = ap.AttentionDispatcher.key_for(q, k, None, False)
    assert key == (9, 13, 2, 16, torch.float32, torch.device("cpu"), False, False)
    decided = d.decision(key)  # kernels.select's record: the one decision made, measured
    assert [x.key for x in select.decisions("attention")] == [repr(d.choice_key(key))]
    assert decided.source == "measured" and decided.winner in ("math", "sdpa")
    assert set(decided.times_us) == {"math", "sdpa"}
    excl = d.excluded()[key]
    assert "simulated kernel failure" in excl["boom"] and "wrong result" in excl["wrong"]
    assert "'boom' excluded" in caplog.text and "'wrong' excluded" in caplog.text
    assert caplog.text.count("excluded") == 2
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out2, ref)


def test_dispatcher_probing_is_silent_and_logged_at_debug_but_run_time_warnings_show(caplog):
    # torch's forced SDPA backends warn their reasons ("Flash attention kernel not used because", ...) when a
    # probe cannot run the inputs; a first image at a new shape printed dozens of them.
    def refuses(q, k, v, attn_mask, scale, upcast):
        warnings.warn("Flash attention kernel not used because: head_dim should be no more than 256", UserWarning)
        raise RuntimeError("No available kernel. Aborting execution.")

    def picked(q, k, v, attn_mask, scale, upcast):
        warnings.warn("picked kernel says hello", UserWarning)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    d = ap.AttentionDispatcher(candidates=("refuses", "picked"), extra_backends={"refuses": refuses, "picked": picked},
                               measure_cpu=True)
    q, k, v = random_qkv()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG, logger="sdfast.attention"):
        warnings.simplefilter("always")
        d(q, k, v)  # probes both, then runs the winner
        assert [str(w.message) for w in caught] == ["picked kernel says hello"]  # the real call's, not the probes'
        d(q, k, v)
    key = d.key_for(q, k, None, False)
    assert d.decision(key).winner == "picked" and "No available kernel" in d.excluded()[key]["refuses"]
    assert [str(w.message) for w in caught] == ["picked kernel says hello"] * 2
    assert caplog.text.count("head_dim should be no more than 256") == 1  # once, at debug level
    assert caplog.text.count("picked kernel says hello") == 1  # each probe call warned; logged once
    assert "'refuses' excluded" in caplog.text


def test_dispatcher_winner_failing_later_falls_back(caplog):
    state = {"fail": False}

    def flaky(q, k, v, attn_mask, scale, upcast):
        if state["fail"]:
            raise RuntimeError("unsupported batch size")
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    d = ap.AttentionDispatcher(candidates=("flaky",), extra_backends={"flaky": flaky}, measure_cpu=True)
    q, k, v = random_qkv()
    d(q, k, v)
    key = d.key_for(q, k, None, False)
    assert d.decision(key).winner == "flaky"
    state["fail"] = True
    with caplog.at_level(logging.INFO, logger="sdfast.attention"):
        out = d(q[:1], k[:1], v[:1])
    assert d.decision(key).winner == "sdpa" and "'flaky' excluded" in caplog.text  # the service's record too
    assert "failed after being picked" in d.excluded()[key]["flaky"]
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q[:1], k[:1], v[:1]))


def test_dispatcher_out_of_memory_is_raised_and_nothing_is_cached():
    """An OOM is the request's size, not a backend's fault: while measuring or after the pick it is
    raised as is, no backend is excluded, no choice cached; the next call (memory freed) measures again."""
    state = {"oom": True}

    def big(q, k, v, attn_mask, scale, upcast):
        if state["oom"]:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    d = ap.AttentionDispatcher(candidates=("big", "math"), extra_backends={"big": big}, measure_cpu=True)
    q, k, v = random_qkv()
    key = d.key_for(q, k, None, False)
    with pytest.raises(torch.OutOfMemoryError):
        d(q, k, v)
    assert d.decision(key) is None and key not in d.excluded()
    state["oom"] = False
    d._time = lambda name, fn, device: {"big": 1.0, "math": 100.0}[name]  # "big" wins (CPU timings are noise)
    d(q, k, v)
    assert set(d.decision(key).times_us) == {"big", "math"} and key not in d.excluded()
    state["oom"] = True
    with pytest.raises(torch.OutOfMemoryError):
        d(q, k, v)
    assert d.decision(key).winner == "big" and key not in d.excluded()


def test_dispatcher_all_fail_raises():
    def boom(*a):
        raise RuntimeError("nope")

    d = ap.AttentionDispatcher(candidates=("boom",), extra_backends={"boom": boom}, measure_cpu=True)
    with pytest.raises(RuntimeError, match="no backend"):
        d(*random_qkv())


def test_dispatcher_cpu_default_and_keys():
    d = ap.AttentionDispatcher()
    q, k, v = random_qkv()
    mask = torch.ones(2, 1, 1, 13, dtype=torch.bool)
    torch.testing.assert_close(d(q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v))
    d(q, k, v, attn_mask=mask, upcast=True)
    assert select.decisions("attention") == []  # the CPU runs SDPA's default: nothing measured, nothing recorded
    keys = {d.key_for(q, k, None, False), d.key_for(q, k, mask, True)}
    assert len(keys) == 2 and {key.has_mask for key in keys} == {False, True} and {key.upcast for key in keys} == {False, True}
    assert len({d.choice_key(key) for key in keys}) == 2


def test_dispatchers_with_other_options_never_share_a_decision():
    """allow_tf32, triton, candidates and extra backends are part of the choice key; equal options share one."""
    q, k, _ = random_qkv()
    key = ap.AttentionDispatcher.key_for(q, k, None, False)
    same = {ap.AttentionDispatcher().choice_key(key), ap.AttentionDispatcher("auto").choice_key(key)}
    others = [ap.AttentionDispatcher(allow_tf32=True), ap.AttentionDispatcher(triton=False),
              ap.AttentionDispatcher(candidates=("math", "sdpa")),
              ap.AttentionDispatcher(extra_backends={"mine": lambda *a: None})]
    assert len(same) == 1 and len(same | {o.choice_key(key) for o in others}) == 1 + len(others)


def test_a_decision_is_shared_by_dispatchers_with_the_same_options():
    """The decision lives in kernels.select: another dispatcher (another pipeline) measures nothing for the key."""
    calls = []

    def spy(q, k, v, attn_mask, scale, upcast):
        calls.append(1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    def make():
        return ap.AttentionDispatcher(candidates=("spy", "math"), extra_backends={"spy": spy}, measure_cpu=True)

    q, k, v = random_qkv()
    make()(q, k, v)
    measured = len(calls)
    assert measured >= 2  # checked and timed
    d2 = make()
    d2(q, k, v)
    winner = d2.decision(d2.key_for(q, k, None, False)).winner
    assert len(calls) == measured + (winner == "spy")  # only the winner's real call, no measuring
    assert len(select.decisions("attention")) == 1


def test_dispatcher_forced_backend_and_no_environment(monkeypatch):
    # the kernel policy (sdfast.optimize) reads SDFAST_ATTENTION_*; the dispatcher takes arguments only
    monkeypatch.setenv("SDFAST_ATTENTION_BACKEND", "nonsense")
    monkeypatch.setenv("SDFAST_ATTENTION_TRITON", "0")
    assert ap.AttentionDispatcher().forced is None and ap.AttentionDispatcher().triton
    d = ap.AttentionDispatcher("math")
    assert d.forced == "math"
    q, k, v = random_qkv()
    torch.testing.assert_close(d(q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert select.decisions("attention") == []  # forced: nothing measured
    assert ap.AttentionDispatcher("auto").forced is None
    with pytest.raises(ValueError, match="unknown attention backend"):
        ap.AttentionDispatcher("nonsense")
    with pytest.raises(ValueError, match="unknown attention backends"):
        ap.AttentionDispatcher("math", candidates=("math", "nope"))


def test_a_forced_backend_that_cannot_run_a_shape_raises_naming_it():
    """A forced backend is never swapped silently for another: one that cannot run a shape (torch's flash at the VAE's
    head dim 512 raises "No available kernel") raises a RuntimeError naming the backend, the switch and the shapes;
    out of memory is raised as it is."""

    def no_kernel(q, k, v, attn_mask, scale, upcast):
        raise RuntimeError("No available kernel. Aborting execution.")

    def oom(q, k, v, attn_mask, scale, upcast):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    q, k, v = random_qkv()
    d = ap.AttentionDispatcher("no_kernel", extra_backends={"no_kernel": no_kernel, "oom": oom})
    with pytest.raises(RuntimeError, match=r"forced backend 'no_kernel' .*SDFAST_ATTENTION_BACKEND.* cannot run q "
                                           + re.escape(str(tuple(q.shape))) + ".*No available kernel") as info:
        d(q, k, v)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(torch.OutOfMemoryError, match="test"):
        ap.AttentionDispatcher("oom", extra_backends={"oom": oom})(q, k, v)


def test_dispatcher_capture_uses_safe_default(monkeypatch, caplog):
    calls = []

    def spy(q, k, v, attn_mask, scale, upcast):
        calls.append(1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    d = ap.AttentionDispatcher(candidates=("spy",), extra_backends={"spy": spy}, measure_cpu=True)
    monkeypatch.setattr(dp, "_capturing_or_compiling", lambda device: True)
    monkeypatch.setattr(select.rules, "measuring_blocked", lambda device, measure_cpu=False: "CUDA graph capture")
    with caplog.at_level(logging.WARNING, logger="sdfast.attention"):
        d(*random_qkv())
    assert calls == [] and select.decisions("attention") == [] and "capture" in caplog.text


def test_dispatcher_skips_a_much_slower_backend_after_a_probe_on_a_query_slice(caplog):
    """With a long best time, a candidate first runs on 1/64 of the queries; if that extrapolates past
    slow_factor x the best, it is excluded (logged) without a full-size run or a timing loop."""
    full_calls = []

    def slow(q, k, v, attn_mask, scale, upcast):
        if q.shape[2] == 1024:
            full_calls.append(1)
        time.sleep(q.shape[2] * 2e-5)  # 20 ms at 1024 queries
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    d = ap.AttentionDispatcher(candidates=("sdpa", "slow"), extra_backends={"slow": slow}, measure_cpu=True)
    d.probe_us = 0.0  # the CPU's SDPA is fast: probe whatever the best time
    q, k, v = random_qkv(B=1, H=1, Lq=1024, Lk=16)
    with caplog.at_level(logging.INFO, logger="sdfast.attention"):
        d(q, k, v)
    key = d.key_for(q, k, None, False)
    assert d.decision(key).winner == "sdpa" and "too slow" in d.excluded()[key]["slow"]
    assert not full_calls and "'slow' excluded" in caplog.text
    d2 = ap.AttentionDispatcher(candidates=("sdpa", "slow"), extra_backends={"slow": slow}, measure_cpu=True)
    d2.slow_factor = 1e9  # never too slow: measured in full
    select.clear("attention")  # d2 has d's options: its decision would be d's
    d2(q, k, v)
    assert full_calls and "slow" in d2.decision(key).times_us


def test_dispatcher_measures_a_new_length_in_a_measured_bucket_on_the_near_best_backends_only(caplog):
    """Another image size gives keys whose lengths fall in the power-of-two buckets of keys already measured:
    only the backends within mate_factor of that key's best are checked and timed; another bucket, or another
    head count, measures every candidate."""
    calls = []

    def spied(name):
        def run(q, k, v, attn_mask, scale, upcast):
            calls.append((name, q.shape[2]))
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        return run

    backends = {name: spied(name) for name in ("fast", "near", "slow")}
    d = ap.AttentionDispatcher(candidates=tuple(backends), extra_backends=backends, measure_cpu=True)
    d._time = lambda name, fn, device: {"fast": 10.0, "near": 12.0, "slow": 40.0}[name]  # CPU timings are noise (µs)
    q, k, v = random_qkv(B=1, H=2, Lq=64, Lk=64)  # self-attention at SD1.5's 8x8 latents
    d(q, k, v)
    key = d.key_for(q, k, None, False)
    assert set(d.decision(key).times_us) == {"fast", "near", "slow"}
    calls.clear()
    q2, k2, v2 = random_qkv(B=1, H=2, Lq=80, Lk=80)  # the same layer at 10x8 latents: the buckets of 64
    with caplog.at_level(logging.INFO, logger="sdfast.attention"):
        out = d(q2, k2, v2)
    key2 = d.key_for(q2, k2, None, False)
    assert set(d.decision(key2).times_us) == {"fast", "near"} and ("slow", 80) not in calls
    assert "the backends within 1.25x" in caplog.text
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q2, k2, v2))
    for other in (dict(Lq=64, Lk=77),  # cross-attention over 77 tokens: the same buckets, not a mate
                  dict(Lq=128, Lk=128),  # another bucket
                  dict(Lq=80, Lk=80, H=3)):  # another head count
        q3, k3, v3 = random_qkv(**{"B": 1, "H": 2, **other})
        d(q3, k3, v3)
        assert set(d.decision(d.key_for(q3, k3, None, False)).times_us) == {"fast", "near", "slow"}, other


def test_dispatcher_measures_the_rest_when_the_near_best_backends_fail_at_the_new_length(caplog):
    """The bucket mate's best backend raising at the new length (say, a kernel with a length limit) is excluded
    there, and the backends left out by the narrowing are measured instead of the key failing."""
    def picky(q, k, v, attn_mask, scale, upcast):
        if q.shape[2] != 64:
            raise NotImplementedError("only 64 queries")
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    d = ap.AttentionDispatcher(candidates=("picky", "math"), extra_backends={"picky": picky}, measure_cpu=True)
    d._time = lambda name, fn, device: {"picky": 10.0, "math": 100.0}[name]  # fixed (µs): "math" is left out next
    q, k, v = random_qkv(B=1, H=2, Lq=64, Lk=64)
    d(q, k, v)
    q2, k2, v2 = random_qkv(B=1, H=2, Lq=80, Lk=80)
    with caplog.at_level(logging.INFO, logger="sdfast.attention"):
        out = d(q2, k2, v2)
    key2 = d.key_for(q2, k2, None, False)
    assert d.decision(key2).winner == "math" and set(d.decision(key2).times_us) == {"math"}
    assert "only 64 queries" in d.excluded()[key2]["picky"] and "measures ['picky']" in caplog.text
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q2, k2, v2))
    # a mate's backend excluded after it was timed there (it failed after being picked) is not kept
    d._excluded.setdefault(d.key_for(q, k, None, False), {})["picky"] = "failed after being picked"
    q3, k3, v3 = random_qkv(B=1, H=2, Lq=96, Lk=96)
    with caplog.at_level(logging.INFO, logger="sdfast.attention"):
        d(q3, k3, v3)
    assert "measures ['math']" in caplog.text


def test_tf32_is_a_candidate_only_when_allowed_for_fp32_and_checked_at_fp16_tolerance():
    from types import SimpleNamespace

    def on_cuda(dtype):  # what _candidate_names reads of a tensor
        return SimpleNamespace(shape=(1, 1, 4, 8), dtype=dtype, device=torch.device("cuda"))

    q32, q16 = on_cuda(torch.float32), on_cuda(torch.float16)
    assert "tf32" in ap.AttentionDispatcher(allow_tf32=True)._candidate_names(q32, q32)
    assert "tf32" not in ap.AttentionDispatcher(allow_tf32=True)._candidate_names(q16, q16)
    assert "tf32" not in ap.AttentionDispatcher()._candidate_names(q32, q32)


def test_triton_false_leaves_our_kernel_out_of_the_candidates(monkeypatch):
    from types import SimpleNamespace

    q = SimpleNamespace(shape=(1, 1, 4, 8), dtype=torch.float16, device=torch.device("cuda"))
    assert "triton" in ap.AttentionDispatcher()._candidate_names(q, q)
    assert "triton" not in ap.AttentionDispatcher(triton=False)._candidate_names(q, q)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # on CPU the interpreter runs our kernel: also left out
    c = SimpleNamespace(shape=(1, 1, 4, 8), dtype=torch.float32, device=torch.device("cpu"))
    assert "triton" in ap.AttentionDispatcher()._candidate_names(c, c)
    assert "triton" not in ap.AttentionDispatcher(triton=False)._candidate_names(c, c)
    assert dp._COMPUTE_DTYPE["tf32"] is torch.float16


def test_saved_choices_let_a_second_process_measure_nothing(tmp_path, monkeypatch):
    """The decision goes to kernels.select's saved-choices file; read back (a second process: nothing in memory),
    it is the key's decision and nothing is measured. The store runs as on a GPU named "Test GPU"."""
    from kernels.select import store

    monkeypatch.setenv("SDFAST_CACHE_DIR", str(tmp_path))
    for name, value in (("_persist", True), ("_saved", None), ("_dirty", False)):
        monkeypatch.setattr(store, name, value)
    for module in (store, dp):
        monkeypatch.setattr(module, "device_name", lambda device: "Test GPU")
    calls = []

    def spy(q, k, v, attn_mask, scale, upcast):
        calls.append(1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    def make():
        return ap.AttentionDispatcher(candidates=("spy", "math"), extra_backends={"spy": spy}, measure_cpu=True)

    q, k, v = random_qkv()
    make()(q, k, v)
    path = select.save()
    assert path is not None and path.exists() and "attention" in path.read_text()
    select.clear()  # a second process: no decision in memory, the file read again
    monkeypatch.setattr(store, "_saved", None)
    before = len(calls)
    d2 = make()
    out = d2(q, k, v)
    decided = d2.decision(d2.key_for(q, k, None, False))
    assert decided.source == "saved" and len(calls) == before + (decided.winner == "spy")
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
