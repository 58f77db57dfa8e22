"""The graph runtime's warm-up on the GPU: one warm-up pass before a capture when it timed no kernel choice, two when
it did (the winners then run once on their own), and the seconds of each phase in ``stats.setup_s``; and the
process warm start's library calls (``sdfast.runtime.warm_start``)."""

from __future__ import annotations

import pytest
import torch

from kernels import select
from sdfast.runtime.cuda_graphs import GraphCache

pytestmark = pytest.mark.gpu

CHOICE = select.Choice("test_graph_warmup", default="mul", margin=0.97)


class Doubler(torch.nn.Module):
    """``2 x``; with ``choose``, through a kernel choice between two ways of writing it (measured once per shape)."""

    def __init__(self, choose: bool):
        super().__init__()
        self.choose = choose
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if not self.choose:
            return x * 2
        ways = {"mul": lambda: x * 2, "add": lambda: x + x}
        winner = select.decide(CHOICE, select.signature(x), candidates=ways, device=x.device)
        return ways[winner]()


@pytest.mark.parametrize("choose", [False, True])
def test_warmups_repeat_only_after_a_measurement(choose, fresh_choices):
    module = Doubler(choose).cuda()
    cache = GraphCache(parallel_compile=False)
    runner = cache.install("doubler", module)
    with torch.no_grad():
        x = torch.randn(64, 128, device="cuda")
        torch.testing.assert_close(module(x), 2 * x)
        warmups = 2 if choose else 1
        assert runner.stats.captures == 1 and runner.stats.setup_s["warmups"] == warmups
        assert module.calls == warmups + 1  # the warm-ups and the capture
        assert set(runner.stats.setup_s) == {"warmup", "warmups", "capture"}
        assert all(runner.stats.setup_s[k] > 0 for k in ("warmup", "capture"))
        y = torch.randn(64, 128, device="cuda")
        torch.testing.assert_close(module(y), 2 * y)  # a replay: no Python
        assert module.calls == warmups + 1 and runner.stats.replays == 2
        module(torch.randn(32, 128, device="cuda"))  # a new signature: its choice is measured again
        assert runner.stats.setup_s["warmups"] == 2 * warmups
    cache.uninstall()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_warm_starts_library_calls_all_run_and_leave_the_global_generator(dtype, monkeypatch):
    """Every kind of ``sdfast.runtime.warm_start.LIBRARY_CALLS`` runs on the GPU in each engine dtype (a failure
    there is only logged, so this is what shows that it works), and none draws from the global CUDA generator
    (``load`` builds seeded weights with it at the same time)."""
    from sdfast.runtime import warm_start

    monkeypatch.setattr(warm_start, "_report", {})
    state = torch.cuda.get_rng_state()
    warm_start._warm_libraries(torch.device("cuda", torch.cuda.current_device()), dtype)
    assert set(warm_start._report) == set(warm_start.LIBRARY_CALLS)
    assert torch.equal(torch.cuda.get_rng_state(), state)


def test_the_warm_starts_kernel_steps_all_run(monkeypatch):
    """Every step of ``sdfast.runtime.warm_start.KERNEL_STEPS`` runs on the GPU (a failure there is only logged)."""
    from sdfast.runtime import warm_start

    monkeypatch.setattr(warm_start, "_report", {})
    warm_start._warm_kernels(torch.device("cuda", torch.cuda.current_device()))
    assert set(warm_start._report) == set(warm_start.KERNEL_STEPS)


class Normed(torch.nn.Module):
    """A LayerNorm through sdfast's Triton kernel (``kernels.norm.layer_norm``)."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(320, device="cuda", dtype=torch.float16)

    def forward(self, x):
        from kernels.norm.layer_norm import layer_norm

        return layer_norm(x, self.norm.weight, self.norm.bias, self.norm.eps)


def test_a_pass_whose_kernels_an_earlier_process_listed_skips_its_dry_run(tmp_path, monkeypatch, fresh_choices):
    """The first process's capture runs the dry run and lists the pass and its kernels; the next process (its state
    reset here, the file kept) loads the listed kernels and captures the same pass without a dry run, with the
    same output."""
    from kernels import precompile
    from kernels.select import store

    monkeypatch.setenv("SDFAST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(store, "_persist", True)
    monkeypatch.setattr(store, "_saved", None)
    for name, value in (("_listed", None), ("_passes", {}), ("_loaded_on", set())):
        monkeypatch.setattr(precompile, name, value)
    from collections import defaultdict

    from kernels.norm import layer_norm as ln

    for kernel in (ln._ln_fwd_kernel, ln._ln_fwd_looped_kernel):  # not compiled yet in this process
        monkeypatch.setattr(kernel, "device_caches", defaultdict(kernel.create_binder))
    x = torch.randn(2, 77, 320, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        module = Normed()
        runner = GraphCache().install("normed", module)
        expected = module.eval()(x)
        assert "dry_run" in runner.stats.setup_s
        assert precompile.list_path().exists() and precompile._passes

        precompile._listed, precompile._passes = None, {}
        precompile._loaded_on.clear()
        loaded, failed = precompile.load_saved(torch.cuda.current_device())
        assert loaded >= 1 and failed == 0
        again = Normed()
        again.load_state_dict(module.state_dict())
        runner = GraphCache().install("normed", again)
        torch.testing.assert_close(again(x), expected, rtol=0, atol=0)
        assert runner.stats.captures == 1 and "dry_run" not in runner.stats.setup_s
