"""``kernels.arrival``: eager launches take zeroed counters from their stream's ring (wrapping), captured launches
from the device's arena (never handed out twice); inside a capture with no arena there are none. And the GroupNorm
statistics kernel leaves every counter it used at zero."""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels import arrival

gn_mod = importlib.import_module("kernels.norm.group_norm")


@pytest.fixture(autouse=True)
def fresh_pools(monkeypatch):
    monkeypatch.setattr(arrival, "_rings", {})
    monkeypatch.setattr(arrival, "_arenas", {})
    monkeypatch.setattr(arrival, "RING", 64)
    monkeypatch.setattr(arrival, "ARENA", 100)


def test_eager_ring_wraps_and_capture_arena_does_not(monkeypatch):
    cpu = torch.device("cpu")
    first = arrival.counters(cpu, 1)  # the first eager call allocates the ring and the arena
    assert first.shape == (1,) and cpu in arrival._arenas
    a = arrival.counters(cpu, 40)
    b = arrival.counters(cpu, 40)  # does not fit after the first 41: wraps to the start
    ring = arrival._rings[(cpu, 0)][0]
    assert a.data_ptr() == ring.data_ptr() + 4 and b.data_ptr() == ring.data_ptr()
    assert not a.any() and not b.any() and a.dtype == torch.int32
    monkeypatch.setattr(arrival, "_capturing", lambda device: True)
    arena = arrival._arenas[cpu][0]
    c, d = arrival.counters(cpu, 60), arrival.counters(cpu, 30)
    assert c.data_ptr() == arena.data_ptr() and d.data_ptr() == arena.data_ptr() + 4 * 60
    assert arrival.counters(cpu, 30) is None  # used up: never handed out again
    with pytest.raises(ValueError, match="1..64"):
        arrival.counters(cpu, 65)


def test_capture_before_any_eager_call_gets_none(monkeypatch):
    monkeypatch.setattr(arrival, "_capturing", lambda device: True)
    assert arrival.counters(torch.device("cpu"), 8) is None
    assert not arrival._arenas


def test_group_norm_leaves_its_counters_at_zero(monkeypatch):
    """Three NHWC two-pass calls (groups straddling channel tiles, 3 splits): every counter back at zero."""
    for k, v in {"nhwc_onepass": False, "tile_elems": 256, "force_splits": 3}.items():
        monkeypatch.setitem(gn_mod._TUNING, k, v)
    x = torch.randn(2, 80, 9, 7).contiguous(memory_format=torch.channels_last)
    for _ in range(3):
        y = gn_mod.group_norm(x, 8, torch.ones(80), torch.zeros(80), activation="silu")
        torch.testing.assert_close(y, gn_mod.group_norm_ref(x, 8, torch.ones(80), torch.zeros(80), activation="silu"),
                                   atol=1e-5, rtol=1e-5)
    (ring, used), = arrival._rings.values()
    assert used == 3 * 2 * 8 and not ring.any()


def test_group_norm_without_counters_launches_the_finalize_kernel(monkeypatch, caplog):
    """No counters (a capture without an arena): the separate finalize kernel runs, logged once per device."""
    import logging

    launched = []
    real = gn_mod._gn_nhwc_finalize_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(gn_mod, "_gn_nhwc_finalize_kernel", Spy())
    monkeypatch.setattr(gn_mod, "_no_counters_logged", set())
    monkeypatch.setattr(arrival, "_capturing", lambda device: True)
    for k, v in {"nhwc_onepass": False, "tile_elems": 256, "force_splits": 3}.items():
        monkeypatch.setitem(gn_mod._TUNING, k, v)
    x = torch.randn(2, 80, 9, 7).contiguous(memory_format=torch.channels_last)
    with caplog.at_level(logging.INFO, logger="sdfast.kernels"):
        for _ in range(2):
            y = gn_mod.group_norm(x, 8, None, None)
    assert launched == [(8, 2)] * 2
    assert caplog.text.count("separate finalize kernel") == 1
    torch.testing.assert_close(y, gn_mod.group_norm_ref(x, 8, None, None), atol=1e-5, rtol=1e-5)
