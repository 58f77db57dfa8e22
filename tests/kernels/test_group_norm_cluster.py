"""CPU tests of the cluster GroupNorm's planner and dispatch (``kernels.norm.group_norm_cluster``); the kernel
itself needs an sm_90 GPU (``test_group_norm_cluster_gpu.py``) and its source compiles in
``test_csrc_compile.py``."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels import dispatch
from benchmarks import sd_shapes
from kernels.norm import group_norm_cluster as gc


def _valid(plan, B, C, HW, G, elem_size):
    vec = 16 // elem_size
    Cg = C // G
    assert C % plan.CS == 0 and plan.CS % Cg == 0 and plan.CS % vec == 0
    assert plan.nt == plan.CS // vec * plan.R <= gc.nhwc_max_threads(plan.J)
    assert 1 <= plan.J <= 8 and 1 <= plan.K <= 16
    assert plan.K * plan.R * plan.J >= HW  # the cluster covers every pixel
    assert plan.K == 1 or (plan.K - 1) * plan.R * plan.J < HW  # and no CTA owns none
    assert plan.ctas == B * (C // plan.CS) * plan.K


@pytest.mark.parametrize("elem_size", [2, 4])
def test_plans_are_valid_on_every_sd_shape(elem_size):
    planned = 0
    for _, (B, C, H, W), *_ in sd_shapes.GROUP_NORM_SITES:
        plan = gc.cluster_plan(B, C, H * W, 32, elem_size)
        if plan is not None:
            _valid(plan, B, C, H * W, 32, elem_size)
            planned += 1
    assert planned >= 20


def test_plans_cover_the_sd15_unet_but_not_the_largest_vae_shapes():
    missing = {s for m, s, *_ in sd_shapes.GROUP_NORM_SITES
               if m == "sd15-unet" and gc.cluster_plan(s[0], s[1], s[2] * s[3], 32, 2) is None}
    assert missing == {(2, 960, 64, 64)}  # a 120-channel unit of 4096 pixels needs clusters of 16
    assert gc.cluster_plan(1, 128, 512 * 512, 32, 2) is None


@pytest.mark.parametrize("B,C,HW,G", [(3, 320, 65 * 65, 32), (1, 320, 63, 32), (2, 96, 25, 32), (1, 64, 1, 8)])
def test_odd_shapes_plan(B, C, HW, G):
    plan = gc.cluster_plan(B, C, HW, G, 2)
    assert plan is not None
    _valid(plan, B, C, HW, G, 2)


def test_no_plan_when_channels_do_not_fill_the_vector():
    assert gc.cluster_plan(1, 36, 64, 6, 2) is None  # 36 channels: not a multiple of 8 fp16 values
    assert gc.cluster_plan(1, 36, 64, 6, 4) is not None  # fp32 vectors hold 4


def test_cpu_tensors_never_take_the_cluster_path(caplog, monkeypatch):
    monkeypatch.setattr(dispatch, "_logged", set())
    x = torch.randn(1, 64, 4, 4).contiguous(memory_format=torch.channels_last)
    with caplog.at_level(logging.INFO, logger="sdfast.kernels"):
        assert not gc.try_group_norm(x, 8, None, None, 1e-5, None, None, False, torch.empty_like(x), None)
    assert "not a CUDA tensor" in caplog.text


def test_a_failed_build_falls_back_once_with_the_reason(caplog, monkeypatch):
    """The one logged place: a library that does not build sends every call to the Triton kernels."""
    monkeypatch.setattr(dispatch, "_logged", set())
    monkeypatch.setattr(gc, "_unsupported", lambda *a: None)
    monkeypatch.setattr(gc, "_device_ok", lambda index: (True, 132))

    def broken():
        raise RuntimeError("nvcc failed: boom")

    monkeypatch.setattr(gc, "library", broken)
    x = torch.randn(1, 64, 4, 4).contiguous(memory_format=torch.channels_last)
    with caplog.at_level(logging.INFO, logger="sdfast.kernels"):
        for _ in range(2):
            assert not gc.try_group_norm(x, 8, None, None, 1e-5, None, None, False, torch.empty_like(x), None)
    assert caplog.text.count("library build failed: nvcc failed: boom") == 1


def test_disabled_knob_skips_the_path(monkeypatch):
    monkeypatch.setitem(gc.TUNING, "enabled", False)
    monkeypatch.setattr(gc, "_unsupported", lambda *a: pytest.fail("must not be consulted"))
    x = torch.randn(1, 64, 4, 4).contiguous(memory_format=torch.channels_last)
    assert not gc.try_group_norm(x, 8, None, None, 1e-5, None, None, False, torch.empty_like(x), None)


def test_layouts_the_kernel_cannot_take_are_named():
    """A strided weight or bias, another dtype, a strided x, NCHW with H*W not a multiple of the vector, a residual
    laid out otherwise: each is a logged reason, so the call runs the Triton kernels (which make their own
    contiguous copies)."""
    cl = torch.channels_last
    x = torch.randn(2, 64, 4, 4).contiguous(memory_format=cl)
    w = torch.randn(128)[::2]
    assert gc._layout_problem(x, None, None, None, None) is None
    assert "weight is not contiguous" in gc._layout_problem(x, w, None, None, None)
    assert "bias is not contiguous" in gc._layout_problem(x, None, w, None, None)
    assert "dtype" in gc._layout_problem(x, torch.randn(64, dtype=torch.float64), None, None, None)
    assert gc._layout_problem(x.contiguous(), None, None, None, None) is None  # NCHW: the NCHW kernel
    assert "NCHW with H*W = 9" in gc._layout_problem(torch.randn(2, 64, 3, 3), None, None, None, None)
    assert "neither" in gc._layout_problem(x.contiguous()[:, ::2], None, None, None, None)
    assert "residual" in gc._layout_problem(x, None, None, None, x.contiguous())
    assert "residual" in gc._layout_problem(x.contiguous(), None, None, None, x)


def test_layout_prefers_channels_last_when_both_hold():
    assert gc.layout(torch.randn(2, 64, 1, 1)) == "nhwc"  # H*W = 1: both layouts; the NHWC kernel takes it
    assert gc.layout(torch.randn(2, 64, 4, 4)) == "nchw"
    assert gc.layout(torch.randn(2, 64, 4, 4).contiguous(memory_format=torch.channels_last)) == "nhwc"
    assert gc.layout(torch.randn(2, 64, 4, 8)[..., ::2]) is None


def _valid_nchw(plan, B, C, HW, G, elem_size):
    nvec = C // G * HW // (16 // elem_size)
    assert 1 <= plan.J <= 8 and 1 <= plan.K <= gc.TUNING["max_cluster"] and plan.nt <= 1024 and plan.nt % 32 == 0
    assert plan.K * plan.nt * plan.J >= nvec  # the cluster covers the group
    assert (plan.K - 1) * plan.nt * plan.J < nvec  # and no CTA owns none
    assert plan.ctas == B * G * plan.K


@pytest.mark.parametrize("elem_size", [2, 4])
def test_nchw_plans_are_valid_on_every_sd_unet_shape(elem_size):
    unet = {s for m, s, *_ in sd_shapes.GROUP_NORM_SITES if m.endswith("unet")}
    for B, C, H, W in unet:
        plans = list(gc.nchw_candidate_plans(B, C, H * W, 32, elem_size))
        too_big = C // 32 * H * W > gc.TUNING["max_cluster"] * 1024 * 8 * (16 // elem_size)
        assert plans or (elem_size == 4 and too_big), (B, C, H, W)  # fp16: every UNet shape
        for plan in plans:
            _valid_nchw(plan, B, C, H * W, 32, elem_size)
        assert gc.nchw_plan(B, C, H * W, 32, elem_size) in (plans or [None])


def test_nchw_has_no_plan_when_a_vector_would_cross_channels_or_a_group_is_too_large():
    assert gc.nchw_plan(1, 64, 9, 8, 2) is None  # H*W = 9 is not a multiple of 8 fp16 values
    assert gc.nchw_plan(1, 64, 12, 8, 4) is not None  # fp32 vectors hold 4
    assert gc.nchw_plan(1, 128, 1024 * 1024, 32, 2) is None  # SDXL's VAE: 4 M values, over 16 x 1024 x 8 vectors


def test_a_failed_build_is_remembered(monkeypatch):
    """nvcc runs once per process: a failure is kept and raised again, not rebuilt at every call."""
    calls = []

    def load():
        calls.append(1)
        raise RuntimeError("nvcc failed: boom")

    monkeypatch.setattr(gc, "_built", {})
    monkeypatch.setattr(gc, "_load", load)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="boom"):
            gc.library()
    assert len(calls) == 1


def test_compile_only_pass_starts_the_build_and_goes_on_to_triton(monkeypatch):
    """Inside ``kernels.precompile.dry_run`` the first eligible call starts nvcc on a thread (beside Triton's
    compilations) instead of building on the launching thread, and declines, so that the pass reaches the Triton
    kernels and queues their compilation too (the real pass times both)."""
    import threading

    from kernels import precompile

    started = threading.Event()
    monkeypatch.setattr(gc, "_unsupported", lambda *a: None)
    monkeypatch.setattr(gc, "_built", {})
    monkeypatch.setattr(gc, "_builder", [])
    monkeypatch.setattr(gc, "library", lambda: started.set())
    monkeypatch.setattr(precompile, "active", lambda: True)
    x = torch.randn(1, 64, 4, 4).contiguous(memory_format=torch.channels_last)
    y = torch.empty_like(x)
    assert not gc.try_group_norm(x, 8, None, None, 1e-5, None, None, False, y, None)
    assert started.wait(5) and len(gc._builder) == 1
    assert not gc.try_group_norm(x, 8, None, None, 1e-5, None, None, False, y, None)
    assert len(gc._builder) == 1  # one build thread, however many calls


def test_the_faster_kernel_is_measured_once_per_signature(monkeypatch):
    runs, measured = [], []
    monkeypatch.setattr(gc, "_choices", {})
    consulted = []
    monkeypatch.setattr(gc, "launcher", lambda *a: consulted.append(1) or (lambda: runs.append("cluster")))
    verdict = {"faster": False}

    def measure(key, launch, triton_call):
        measured.append(key)
        return verdict["faster"]

    monkeypatch.setattr(gc, "_measure", measure)
    x = torch.randn(1, 64, 4, 4).contiguous(memory_format=torch.channels_last)
    y = torch.empty_like(x)

    def call(x):
        return gc.run_if_faster(x, 8, None, None, 1e-5, None, None, True, y, None, lambda: runs.append("triton"))

    assert not call(x) and not call(x)  # Triton measured faster: the caller runs Triton, nothing timed again
    assert len(measured) == 1 and runs == []
    assert len(consulted) == 1  # after a Triton verdict the launcher is not consulted again
    verdict["faster"] = True
    x2 = torch.randn(2, 64, 4, 4).contiguous(memory_format=torch.channels_last)  # another signature
    assert call(x2) and call(x2)
    assert len(measured) == 2 and runs == ["cluster", "cluster"]
