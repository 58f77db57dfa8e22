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
