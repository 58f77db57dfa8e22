"""``kernels.precompile``: the compile-only pass skips launches of uncompiled kernels, compiles each launch's
specialization once on the pool, restores Triton's hook, never raises for the pass, and keeps measuring code
(``launch_autotuned``, the attention dispatcher) from timing skipped launches. Triton's side is faked here
(the CPU has no compiler target); ``test_precompile_gpu.py`` runs the real thing."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import torch
import triton

from kernels import precompile
from kernels.dispatch import launch_autotuned


class FakeJit:
    """Stands for a ``JITFunction``: ``preload`` records the specialization and the thread it ran on."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.preloaded: list[tuple[str, int]] = []

    def preload(self, data):
        self.preloaded.append((data, threading.get_ident()))
        if self.fail:
            raise RuntimeError("ptxas error (test)")
        return None


def _launch(jit: FakeJit, key: str):
    """What ``JITFunction.run`` does for an uncompiled kernel: call the hook, launch unless it says skip."""
    hook = triton.knobs.runtime.jit_cache_hook
    skip = hook is not None and hook(key=key, repr=key, fn=SimpleNamespace(jit_function=jit),
                                     compile={"specialization_data": f"spec:{key}", "device": 0},
                                     is_manual_warmup=False, already_compiled=False)
    return "skipped" if skip else "launched"


def test_launches_are_skipped_and_each_specialization_compiles_once_on_the_pool():
    jit, seen = FakeJit(), []

    def forward():
        seen.append(precompile.active())
        seen.extend(_launch(jit, k) for k in ("a", "b", "a"))

    previous = triton.knobs.runtime.jit_cache_hook
    precompile.dry_run(forward, workers=2)
    assert seen == [True, "skipped", "skipped", "skipped"]
    assert sorted(d for d, _ in jit.preloaded) == ["spec:a", "spec:b"]
    assert all(t != threading.get_ident() for _, t in jit.preloaded)
    assert triton.knobs.runtime.jit_cache_hook is previous and not precompile.active()
    assert _launch(jit, "c") == "launched"


class FakeCompiled:
    """Stands for a ``CompiledKernel``: records the thread that loaded it (``_init_handles``)."""

    def __init__(self):
        self.loaded_on = None

    def _init_handles(self):
        self.loaded_on = threading.get_ident()


def test_the_pool_loads_each_kernel_it_compiled():
    kernels = []

    class LoadingJit(FakeJit):
        def preload(self, data):
            super().preload(data)
            kernels.append(FakeCompiled())
            return kernels[-1]

    jit = LoadingJit()
    precompile.dry_run(lambda: [_launch(jit, k) for k in ("a", "b")], workers=2)
    assert len(kernels) == 2 and all(k.loaded_on not in (None, threading.get_ident()) for k in kernels)


def test_the_compiler_key_is_computed_once_before_the_pool_starts(monkeypatch):
    calls = []
    key = lambda: calls.append(threading.get_ident())  # noqa: E731 - stands for triton_key (lru_cached there)
    monkeypatch.setattr(precompile, "_triton_key", lambda: key)
    monkeypatch.setattr(precompile, "_key_thread", None)
    precompile.prefetch_compiler_key()
    prefetch = precompile._key_thread
    precompile.prefetch_compiler_key()  # once per process
    assert precompile._key_thread is prefetch
    prefetch.join()
    assert calls == [prefetch.ident]
    jit = FakeJit()
    precompile.dry_run(lambda: _launch(jit, "a"), workers=2)
    assert calls[1:] == [threading.get_ident()]  # the caller's thread, before the pool's threads ran
    assert jit.preloaded


def test_the_pass_never_raises_and_failed_compiles_are_logged(caplog):
    jit = FakeJit(fail=True)

    def forward():
        _launch(jit, "x")
        raise torch.OutOfMemoryError("garbage values asked for too much (test)")

    with caplog.at_level(logging.INFO, logger="sdfast.kernels"):
        precompile.dry_run(forward, workers=1, label="unet")
    text = caplog.text
    assert "dry pass of unet stopped early" in text and "failed to compile ahead" in text
    assert jit.preloaded and not precompile.active()


def test_other_threads_and_manual_warmups_compile_as_usual():
    jit, results = FakeJit(), []

    def forward():
        t = threading.Thread(target=lambda: results.append(_launch(jit, "other-thread")))
        t.start()
        t.join()
        hook = triton.knobs.runtime.jit_cache_hook
        results.append(hook(key="w", repr="w", fn=SimpleNamespace(jit_function=jit), compile={},
                            is_manual_warmup=True, already_compiled=False))

    precompile.dry_run(forward, workers=1)
    assert results == ["launched", None] and jit.preloaded == []


class FakeAutotuner:
    """The parts of ``triton.runtime.Autotuner`` that ``launch_autotuned`` uses."""

    def __init__(self):
        self.configs = [SimpleNamespace(all_kwargs=lambda i=i: {"BLOCK": 16 * (i + 1)}) for i in range(3)]
        self.arg_names = ["x"]
        self.nargs = None
        self.runs, self.tuned = [], 0
        self.fn = SimpleNamespace(run=lambda *a, **kw: self.runs.append(kw))

    def prune_configs(self, kwargs):
        return self.configs[:2]

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.tuned += 1

        return run


def test_launch_autotuned_compiles_every_config_and_tunes_none_in_a_dry_run():
    kernel = FakeAutotuner()
    precompile.dry_run(lambda: launch_autotuned(kernel, (4,), torch.zeros(2), N=2))
    assert kernel.tuned == 0 and kernel.nargs is None
    assert [r["BLOCK"] for r in kernel.runs] == [16, 32]
    assert all(r["grid"] == (4,) and r["warmup"] is False and r["N"] == 2 for r in kernel.runs)
    launch_autotuned(kernel, (4,), torch.zeros(2), N=2)
    assert kernel.tuned == 1


def test_attention_dispatcher_measures_and_caches_nothing_in_a_dry_run():
    from sdfast.passes.attention import AttentionDispatcher

    calls = []

    def counting(q, k, v, attn_mask, scale, upcast):
        calls.append(1)
        return torch.zeros_like(q)

    d = AttentionDispatcher(measure_cpu=True, candidates=["math", "triton"], extra_backends={"triton": counting})
    q = torch.randn(1, 2, 8, 16)
    out = []
    precompile.dry_run(lambda: out.append(d(q, q, q)))
    key = d.key_for(q, q, None, False)
    assert calls == [1] and d.decision(key) is None
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    torch.testing.assert_close(out[0], ref)  # the pass got SDPA's answer (SAFE_DEFAULT)
    d(q, q, q)  # outside the dry run: measured (the fake kernel's zeros are excluded) and cached
    assert d.decision(key).winner == "math" and "triton" in d.excluded()[key] and len(calls) == 2


def test_a_dry_run_inside_a_dry_run_just_runs():
    jit = FakeJit()
    inner = []
    precompile.dry_run(lambda: precompile.dry_run(lambda: inner.append(_launch(jit, "n"))))
    assert inner == ["skipped"] and [d for d, _ in jit.preloaded] == ["spec:n"]


def test_pool_compiles_see_the_session_hook_and_the_callers_hook_sees_none():
    """Triton's preload calls the current hook (as a manual warm-up); the session waits for its pool before it
    gives the hook back, so the caller's hook never sees the dry run's compiles."""
    seen = []

    class CallsHook(FakeJit):
        def preload(self, data):
            hook = triton.knobs.runtime.jit_cache_hook
            seen.append(hook(key=data, repr=data, fn=SimpleNamespace(jit_function=self), compile={},
                             is_manual_warmup=True, already_compiled=False))

    callers = []
    previous = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = lambda **kw: callers.append(kw["key"])
    try:
        jit = CallsHook()
        precompile.dry_run(lambda: [_launch(jit, k) for k in "abcdef"], workers=3)
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
    assert seen == [None] * 6 and callers == []


def test_a_second_threads_dry_run_does_nothing_while_one_is_on():
    jit, other = FakeJit(), []
    started, release = threading.Event(), threading.Event()

    def first():
        started.set()
        release.wait(5)

    t = threading.Thread(target=lambda: precompile.dry_run(first))
    t.start()
    started.wait(5)
    precompile.dry_run(lambda: other.append(_launch(jit, "x")))  # lock held: not even run
    release.set()
    t.join()
    assert other == [] and jit.preloaded == []
    precompile.dry_run(lambda: other.append(_launch(jit, "x")))
    assert other == ["skipped"]


def test_dry_rows_keep_divisibility_and_stay_small():
    from sdfast.passes.attention.dispatch import _dry_rows

    for lq in (1, 77, 256, 257, 1024, 4096, 5120, 16384, 4608, 1000, 18432):
        m = _dry_rows(lq)
        assert m == lq if lq <= 256 else (128 <= m < 256 and m % 128 == lq % 128)
