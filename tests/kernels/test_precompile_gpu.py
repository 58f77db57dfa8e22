"""``kernels.precompile`` on the GPU: after a dry run over real kernels (GroupNorm's plain launches, flash
attention's autotuned ones) the real call compiles nothing, the dry run wrote nothing, and the real call's
answer is right. Each GPU test file runs in its own process, so these specializations are new to it."""

from __future__ import annotations

import importlib

import pytest
import torch
import triton

from kernels import precompile
from kernels.group_norm import group_norm, group_norm_ref

pytestmark = pytest.mark.gpu


@pytest.fixture
def compiles(monkeypatch):
    """Kernels compiled outside a dry run while the test runs (Triton's pre-compile hook, passing through)."""
    seen = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
        seen.append(repr)
        return None

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", hook)
    return seen


@pytest.mark.parametrize("channels_last", [False, True])
def test_group_norm_compiles_in_the_dry_run_and_not_after(compiles, channels_last):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 96, 13, 11, device="cuda", generator=g).half()
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = torch.randn(96, device="cuda", generator=g).half()
    b = torch.randn(96, device="cuda", generator=g).half()
    dry = []
    precompile.dry_run(lambda: dry.append(group_norm(x, 32, w, b, activation="silu")))
    assert compiles == [] and dry[0].shape == x.shape  # the dry run's hook stood in for ours
    out = group_norm(x, 32, w, b, activation="silu")
    assert compiles == [], f"compiled after the dry run: {compiles}"
    ref = group_norm_ref(x.float(), 32, w.float(), b.float(), activation="silu")
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


def test_skipped_launches_write_nothing():
    # fp32: no other test of this process compiled GroupNorm for fp32, so every launch here is skipped
    x = torch.randn(2, 64, 7, 9, device="cuda")
    w, b = torch.ones(64, device="cuda"), torch.zeros(64, device="cuda")
    poison = [torch.empty(x.numel() * 4, dtype=torch.uint8, device="cuda").fill_(0xFF) for _ in range(64)]
    del poison  # the allocator's next blocks of this size hold NaN
    dry = []
    precompile.dry_run(lambda: dry.append(group_norm(x, 16, w, b)))
    assert torch.isnan(dry[0]).all()  # never written: the launch was skipped


def test_autotuned_flash_attention_compiles_every_config_in_the_dry_run(compiles):
    from kernels.attention.flash_attention import flash_attention

    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 5, 333, 40, device="cuda", generator=g).half() for _ in range(3))
    fa = importlib.import_module("kernels.attention.flash_attention")  # the module (the package re-exports the function)

    precompile.dry_run(lambda: flash_attention(q, k, v))
    assert not any(key[3] == 333 for key in fa._tuned_keys)  # nothing was tuned in the dry run
    out = flash_attention(q, k, v)  # autotunes now: every config is already compiled
    assert compiles == [], f"compiled after the dry run: {compiles}"
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
