"""kernels.dispatch.launch_autotuned: a failed autotuned launch leaves no reference to its tensors."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kernels.dispatch import launch_autotuned


class FakeAutotuner:
    """Does what Triton 3.6's Autotuner.run does with its arguments: keeps them in ``nargs`` and
    drops them only when the launch returns normally."""

    def __init__(self, fail: bool):
        self.fail, self.nargs = fail, None

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.nargs = dict(enumerate(args))
            if self.fail:
                raise torch.OutOfMemoryError("CUDA out of memory while benchmarking configs (test)")
            self.nargs = None

        return run


@pytest.mark.parametrize("fail", [False, True])
def test_launch_autotuned_drops_the_arguments(fail):
    kernel = FakeAutotuner(fail)
    out = torch.empty(1 << 16)
    ref = weakref.ref(out)
    if fail:
        with pytest.raises(torch.OutOfMemoryError):
            launch_autotuned(kernel, (1,), out)
    else:
        launch_autotuned(kernel, (1,), out)
    del out
    gc.collect()
    assert kernel.nargs is None and ref() is None


def test_a_dry_run_applies_each_configs_pre_hook_before_compiling_it(monkeypatch):
    """In a precompile dry run every config is compiled with what its pre-hook sets (a TMA descriptor's box is part
    of the compiled specialization), in config order."""
    import triton

    from kernels import precompile

    seen = []

    class Desc:
        box = None

    def hook(nargs):
        nargs["desc"].box = nargs["BLOCK"]

    class Fn:
        def run(self, *args, **kwargs):
            seen.append((kwargs["BLOCK"], args[0].box))

    class Tuner:
        arg_names = ["desc"]
        configs = [triton.Config({"BLOCK": 16}, pre_hook=hook), triton.Config({"BLOCK": 32}, pre_hook=hook)]
        fn, nargs = Fn(), None

        def prune_configs(self, meta):
            return self.configs

    monkeypatch.setattr(precompile, "active", lambda: True)
    launch_autotuned(Tuner(), (1,), Desc())
    assert seen == [(16, 16), (32, 32)]
