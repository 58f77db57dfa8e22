"""The Triton GroupNorm planner (``kernels.group_norm.plan``): its tuned defaults, the ``nhwc_channel_tiles``
knob (off gives back the group-aligned plans exactly) and the ``nhwc_onepass`` knob. Pure functions of the shapes:
no kernels run here (the paths' results are test_triton_groups.py and test_triton_nhwc.py)."""

from __future__ import annotations

import pytest

from kernels.group_norm import plan as gn_plan


@pytest.mark.parametrize("tiles,expected", [(False, "twopass"), (True, "nhwc_tiles")])
def test_plan_defaults_measured_on_the_h200(tiles, expected, monkeypatch):
    # the tuned defaults (benchmarks.ops.group_norm tune): no L2 chunking, 2-warp statistics programs from 16 MB
    monkeypatch.setitem(gn_plan.TUNING, "nhwc_channel_tiles", tiles)
    big = gn_plan.group_norm_plan(2, 640, 128 * 128, 32, True, 2, False)  # SDXL 128² ResNet norm, 42 MB
    assert big.path == expected and big.chunk_ct == big.n_ct and big.num_warps == 2
    small = gn_plan.group_norm_plan(2, 320, 64 * 64, 32, True, 2, False)  # SD1.5 64², 5 MB
    assert small.path == expected and small.num_warps == 4
P = gn_plan.GroupNormPlan
# The plans of the group-aligned kernels before "nhwc_tiles" existed (commit 901267c, same TUNING).
OLD_PLANS = {
    (2, 320, 4096, 32, True, 2, False): P("twopass", True, 64, 4, 1, 8, 64, S=32, HWS=128, finalize=False, HWP=64,
                                          chunk_ct=8, num_warps=4, apply_warps=4),
    (2, 640, 16384, 32, True, 2, False): P("twopass", True, 64, 2, 1, 16, 64, S=16, HWS=1024, finalize=False,
                                           HWP=128, chunk_ct=16, num_warps=2, apply_warps=4),
    (2, 1280, 1024, 32, True, 2, True): P("twopass", True, 64, 1, 1, 32, 64, S=8, HWS=128, finalize=False, HWP=64,
                                          chunk_ct=32, num_warps=4, apply_warps=4),
    (1, 128, 262144, 32, True, 2, False): P("twopass", True, 64, 16, 1, 2, 64, S=256, HWS=1024, finalize=True,
                                            HWP=128, chunk_ct=2, num_warps=2, apply_warps=4),
    (2, 2560, 256, 32, True, 2, False): P("twopass", True, 128, 1, 1, 32, 32, S=8, HWS=32, finalize=False, HWP=32,
                                          chunk_ct=32, num_warps=4, apply_warps=4),
    (2, 1280, 256, 32, True, 2, False): P("onepass", True, 64, 1, 1, 32, 256, num_warps=16),
    (2, 320, 4096, 32, False, 2, False): P("twopass", False, 64, 4, 1, 8, 64, S=32, HWS=128, finalize=False, HWP=64,
                                           chunk_ct=8, num_warps=4, apply_warps=4),
}


@pytest.mark.parametrize("args", list(OLD_PLANS), ids=lambda a: f"{a[0]}x{a[1]}x{a[2]}-{'nhwc' if a[4] else 'nchw'}")
def test_knob_off_gives_the_old_plans(args, monkeypatch):
    monkeypatch.setitem(gn_plan.TUNING, "nhwc_channel_tiles", False)
    assert gn_plan.group_norm_plan(*args) == OLD_PLANS[args]
    monkeypatch.setitem(gn_plan.TUNING, "nhwc_channel_tiles", True)
    new = gn_plan.group_norm_plan(*args)
    if OLD_PLANS[args].path == "twopass" and args[4]:
        assert new.path == "nhwc_tiles"
    else:  # NCHW and the one-pass shapes are not the knob's business
        assert new == OLD_PLANS[args]


def test_default_nhwc_tiles_plan():
    """SD1.5's 64² ResNet norm in NHWC: 5 full 64-channel tiles, about target_programs (528) statistics
    programs, one BLOCK_HW block per apply program."""
    T = gn_plan.TUNING
    assert T["nhwc_channel_tiles"] is True and T["nhwc_block_c"] == 64 and T["nhwc_onepass"] is True
    plan = gn_plan.group_norm_plan(2, 320, 64 * 64, 32, True, 2, False)
    assert plan == P("nhwc_tiles", True, 64, 0, 1, 5, 64, S=32, HWS=128, finalize=True, HWP=64, chunk_ct=5,
                     num_warps=4, apply_warps=4)


@pytest.mark.parametrize("onepass", [True, False])
def test_nhwc_onepass_knob(onepass, monkeypatch):
    monkeypatch.setitem(gn_plan.TUNING, "nhwc_onepass", onepass)
    nhwc = gn_plan.group_norm_plan(2, 1280, 16 * 16, 32, True, 2, False)
    assert nhwc.path == ("onepass" if onepass else "nhwc_tiles")
    assert gn_plan.group_norm_plan(2, 1280, 16 * 16, 32, False, 2, False).path == "onepass"  # NCHW: unchanged
