"""GPU tests of the cluster GroupNorm (``kernels.norm.group_norm_cluster``, sm_90+): every channels_last and NCHW
GroupNorm shape of the SD UNets it plans for, the ResNet-block fusion, bf16/fp32, odd H*W and channel counts,
every launch shape at a small size, the statistics of an input with a large mean, CUDA-graph replay, and the
fallbacks. Outputs are poisoned (NaN) before the call, so an element the kernel forgets stays NaN."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels import dispatch
from benchmarks import sd_shapes
from kernels.norm import group_norm, group_norm_cluster as gc, group_norm_ref
from kernels.testing import assert_close_rule

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("thread-block clusters need an sm_90+ GPU", allow_module_level=True)

ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 5e-5}
CL = torch.channels_last


def _inputs(shape, dtype, *, cb=None, res=False, G=32, shift=0.5, scale=2.0, fmt=CL):
    g = torch.Generator(device="cuda").manual_seed(0)
    B, C, H, W = shape

    def rnd(*s, scale=1.0, shift=0.0):
        return (torch.randn(*s, device="cuda", generator=g) * scale + shift).to(dtype)

    x = rnd(B, C, H, W, scale=scale, shift=shift).contiguous(memory_format=fmt)
    w, b = rnd(C, scale=0.5, shift=1.0), rnd(C)
    channel_bias = None if cb is None else (rnd(B, C) if cb == "BC" else rnd(C))
    r = rnd(B, C, H, W).contiguous(memory_format=fmt) if res else None
    return x, w, b, channel_bias, r


def _run_cluster(x, G, w, b, eps, cb, r, silu, return_sum):
    """The cluster kernel into NaN-filled outputs; asserts it ran (skips when no plan fits this GPU in one wave)."""
    B, C, H, W = x.shape
    nchw = gc.layout(x) == "nchw"
    if gc.TUNING["plan"] is None and gc.device_plan(B, C, H * W, G, x.dtype, nchw=nchw) is None:
        cands = gc.nchw_candidate_plans if nchw else gc.candidate_plans
        first = list(cands(B, C, H * W, G, x.element_size()))[:4]
        active = [(p, gc.max_active_clusters(p, C, G, x.dtype)) for p in first]
        pytest.skip(f"no one-wave cluster plan for {tuple(x.shape)} on this GPU: (plan, max_active) {active}")
    y = torch.full_like(x, float("nan"))
    pre = torch.full_like(x, float("nan")) if return_sum else None
    assert gc.try_group_norm(x, G, w, b, eps, cb, r, silu, y, pre), "the cluster path did not run"
    return y, pre


def _check(x, G, w, b, eps, cb, r, silu, return_sum, atol=None):
    y, pre = _run_cluster(x, G, w, b, eps, cb, r, silu, return_sum)
    act = "silu" if silu else None
    f32 = (lambda t: None if t is None else t.float())
    ref32 = group_norm_ref(x.float(), G, f32(w), f32(b), eps, channel_bias=f32(cb), residual=f32(r),
                           activation=act, return_sum=True)
    lowp = group_norm_ref(x, G, w, b, eps, channel_bias=cb, residual=r, activation=act, return_sum=True,
                          upcast=False)
    atol = atol or ATOL[x.dtype]
    assert y.stride() == x.stride()
    assert_close_rule(y, ref32[0], lowp[0], atol=atol, name=f"y {tuple(x.shape)}")
    if return_sum:
        assert_close_rule(pre, ref32[1], lowp[1], atol=atol, name=f"pre {tuple(x.shape)}")
    return y


_UNET = sorted({(s, eps, silu) for m, s, eps, silu, _ in sd_shapes.GROUP_NORM_SITES
                if m.endswith("unet") and gc.cluster_plan(*s[:2], s[2] * s[3], 32, 2) is not None})


@pytest.mark.parametrize("shape,eps,silu", _UNET, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_sd_unet_shapes(shape, eps, silu):
    x, w, b, _, _ = _inputs(shape, torch.float16)
    _check(x, 32, w, b, eps, None, None, silu, False)


@pytest.mark.parametrize("shape", sorted({s for s, _, silu in _UNET if silu}), ids=lambda s: "x".join(map(str, s)))
def test_resnet_fusion(shape):
    """channel bias (B, C) + residual + SiLU + the sum written out."""
    x, w, b, cb, r = _inputs(shape, torch.float16, cb="BC", res=True)
    _check(x, 32, w, b, 1e-5, cb, r, True, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 320, 64, 64), (2, 1280, 8, 8)], ids=lambda s: "x".join(map(str, s)))
def test_other_dtypes(shape, dtype):
    x, w, b, cb, r = _inputs(shape, dtype, cb="C", res=True)
    _check(x, 32, w, b, 1e-5, cb, r, True, True)


@pytest.mark.parametrize("shape,G", [((3, 320, 65, 65), 32), ((1, 320, 9, 7), 32), ((2, 96, 5, 5), 32),
                                     ((1, 64, 1, 1), 8), ((3, 640, 13, 11), 32), ((2, 48, 33, 17), 16)],
                         ids=str)
def test_odd_shapes(shape, G):
    x, w, b, cb, r = _inputs(shape, torch.float16, cb="BC", res=True, G=G)
    _check(x, G, w, b, 1e-5, cb, r, True, True)
    _check(x, G, None, None, 1e-6, None, None, False, False)


@pytest.mark.parametrize("fmt", [CL, torch.contiguous_format], ids=["nhwc", "nchw"])
def test_every_launch_shape_agrees(fmt):
    """Every candidate plan of the layout's kernel (clusters of 1 to 16 CTAs where the GPU can launch them) at a small
    shape."""
    B, C, H, W = 2, 320, 24, 20
    x, w, b, cb, r = _inputs((B, C, H, W), torch.float16, cb="BC", res=True, fmt=fmt)
    cands = gc.candidate_plans if fmt is CL else gc.nchw_candidate_plans
    old = gc.TUNING["max_cluster"]
    gc.TUNING["max_cluster"] = 16
    ran = 0
    try:
        for plan in cands(B, C, H * W, 32, 2):
            if gc.max_active_clusters(plan, C, 32, x.dtype) < 1:
                continue
            gc.TUNING["plan"] = plan
            _check(x, 32, w, b, 1e-5, cb, r, True, True)
            ran += 1
    finally:
        gc.TUNING["plan"], gc.TUNING["max_cluster"] = None, old
    assert ran >= 10


def test_large_mean_statistics():
    """|mean| = 3000 std: E[x^2] - mean^2 in fp32 would lose the variance (relative error about 0.5); the shifted
    sums keep it. Judged against an fp64 reference, with PyTorch's fp32 GroupNorm as the baseline of the rule (the
    fp32 rounding of the mean, ulp(300) / std = 3e-4, is a floor for any fp32 method)."""
    x, w, b, _, _ = _inputs((2, 320, 32, 32), torch.float32, shift=300.0, scale=0.1)
    y, _ = _run_cluster(x, 32, w, b, 1e-6, None, None, False, False)
    ref64 = group_norm_ref(x.double(), 32, w.double(), b.double(), 1e-6)
    torch32 = torch.nn.functional.group_norm(x, 32, w, b, 1e-6)
    assert_close_rule(y, ref64, torch32, atol=1e-4, name="y, |mean| >> std")


_NCHW_UNET = sorted({(s, eps, silu) for m, s, eps, silu, _ in sd_shapes.GROUP_NORM_SITES if m.endswith("unet")})
NCHW = torch.contiguous_format


@pytest.mark.parametrize("shape,eps,silu", _NCHW_UNET, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_nchw_sd_unet_shapes(shape, eps, silu):
    x, w, b, _, _ = _inputs(shape, torch.float16, fmt=NCHW)
    _check(x, 32, w, b, eps, None, None, silu, False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cb", ["BC", "C"])
def test_nchw_resnet_fusion(dtype, cb):
    """channel bias + residual + SiLU + the sum written out, NCHW, at SD1.5's 64x64 level."""
    x, w, b, cb, r = _inputs((2, 320, 64, 64), dtype, cb=cb, res=True, fmt=NCHW)
    _check(x, 32, w, b, 1e-5, cb, r, True, True)


@pytest.mark.parametrize("shape,G", [((3, 320, 8, 7), 32), ((1, 320, 24, 20), 32), ((2, 96, 4, 2), 32),
                                     ((1, 64, 2, 4), 8), ((3, 640, 16, 11), 32), ((2, 48, 33, 8), 16),
                                     ((1, 120, 8, 8), 40)], ids=str)
def test_nchw_odd_shapes(shape, G):
    """Channels per group 3 to 10 (not powers of two), H*W not a power of two, batch 1 and 3."""
    x, w, b, cb, r = _inputs(shape, torch.float16, cb="BC", res=True, G=G, fmt=NCHW)
    _check(x, G, w, b, 1e-5, cb, r, True, True)
    _check(x, G, None, None, 1e-6, None, None, False, False)


def test_nchw_large_mean_statistics():
    """As test_large_mean_statistics, NCHW: the unit's shifted sums keep the variance at |mean| = 3000 std."""
    x, w, b, _, _ = _inputs((2, 320, 32, 32), torch.float32, shift=300.0, scale=0.1, fmt=NCHW)
    y, _ = _run_cluster(x, 32, w, b, 1e-6, None, None, False, False)
    ref64 = group_norm_ref(x.double(), 32, w.double(), b.double(), 1e-6)
    torch32 = torch.nn.functional.group_norm(x, 32, w, b, 1e-6)
    assert_close_rule(y, ref64, torch32, atol=1e-4, name="y, |mean| >> std, NCHW")


@pytest.mark.parametrize("fmt", [CL, torch.contiguous_format], ids=["nhwc", "nchw"])
def test_public_op_routes_here_and_replays_in_a_graph(monkeypatch, fmt):
    """With the cluster kernel measured faster, the public op runs it (either layout), also replayed from a CUDA
    graph."""
    monkeypatch.setattr(gc, "_choices", {})
    monkeypatch.setattr(gc, "_measure", lambda *a: True)
    x, w, b, cb, r = _inputs((2, 320, 32, 32), torch.float16, cb="BC", res=True, fmt=fmt)
    expect_y, expect_pre = _run_cluster(x, 32, w, b, 1e-5, cb, r, True, True)
    y, pre = group_norm(x, 32, w, b, 1e-5, channel_bias=cb, residual=r, activation="silu", return_sum=True)
    assert torch.equal(y, expect_y) and torch.equal(pre, expect_pre) and y.stride() == x.stride()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        group_norm(x, 32, w, b, 1e-5, channel_bias=cb, residual=r, activation="silu", return_sum=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gy, gpre = group_norm(x, 32, w, b, 1e-5, channel_bias=cb, residual=r, activation="silu", return_sum=True)
    for _ in range(5):
        gy.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gy, expect_y) and torch.equal(gpre, expect_pre)


def test_fallbacks_are_logged_and_correct(caplog, monkeypatch):
    """What the kernel cannot take runs the Triton kernels, with the reason logged once."""
    monkeypatch.setattr(dispatch, "_logged", set())
    x, w, b, _, _ = _inputs((2, 320, 16, 16), torch.float16)
    y = torch.empty_like(x)
    with caplog.at_level(logging.INFO, logger="sdfast.kernels"):
        assert not gc.try_group_norm(x, 32, w.float(), b, 1e-5, None, None, True, y, None)
        x36 = torch.randn(1, 36, 8, 8, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
        assert not gc.try_group_norm(x36, 6, None, None, 1e-5, None, None, False, torch.empty_like(x36), None)
        odd = torch.randn(2, 320, 5, 5, device="cuda", dtype=torch.float16)  # NCHW, H*W = 25
        assert not gc.try_group_norm(odd, 32, w, b, 1e-5, None, None, False, torch.empty_like(odd), None)
    text = caplog.text
    assert "weight dtype torch.float32" in text and "no cluster plan" in text and "NCHW with H*W = 25" in text
    # and the public op still gives the reference there
    out = group_norm(x, 32, w.float(), b, 1e-5, activation="silu")
    ref = group_norm_ref(x.float(), 32, w.float(), b.float(), 1e-5, activation="silu")
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=2e-3)


def test_the_choice_is_measured_and_logged(caplog, monkeypatch):
    """The public op times both kernels once per signature, logs the times, and gives the reference either way."""
    monkeypatch.setattr(gc, "_choices", {})
    x, w, b, cb, r = _inputs((2, 640, 32, 32), torch.float16, cb="BC", res=True)
    with caplog.at_level(logging.INFO, logger="sdfast.kernels"):
        y, pre = group_norm(x, 32, w, b, 1e-5, channel_bias=cb, residual=r, activation="silu", return_sum=True)
        group_norm(x, 32, w, b, 1e-5, channel_bias=cb, residual=r, activation="silu", return_sum=True)
    assert caplog.text.count("cluster kernel") == 1 and len(gc._choices) == 1
    f32 = (lambda t: t.float())
    ref = group_norm_ref(x.float(), 32, f32(w), f32(b), 1e-5, channel_bias=f32(cb), residual=f32(r),
                         activation="silu", return_sum=True)
    low = group_norm_ref(x, 32, w, b, 1e-5, channel_bias=cb, residual=r, activation="silu", return_sum=True,
                         upcast=False)
    assert_close_rule(y, ref[0], low[0], atol=ATOL[x.dtype], name="y")
    assert_close_rule(pre, ref[1], low[1], atol=ATOL[x.dtype], name="pre")


def test_first_call_inside_a_capture_runs_the_cluster_kernel_untimed(monkeypatch):
    """A signature first seen inside a CUDA graph capture cannot be timed there: the cluster kernel is captured,
    the choice is not kept, and the replay gives the kernel's own output."""
    monkeypatch.setattr(gc, "_choices", {})
    monkeypatch.setattr(gc, "_measure", lambda *a: pytest.fail("nothing may be timed inside a capture"))
    x, w, b, _, _ = _inputs((2, 640, 16, 16), torch.float16)
    expect, _ = _run_cluster(x, 32, w, b, 1e-5, None, None, True, False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = group_norm(x, 32, w, b, 1e-5, activation="silu")
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, expect) and gc._choices == {}


def test_strided_weight_runs_triton_and_is_right():
    x, w, b, _, _ = _inputs((2, 320, 32, 32), torch.float16)
    w2 = torch.stack([w, torch.zeros_like(w)], dim=1).flatten()[::2]  # w's values with stride 2
    assert w2.stride() == (2,) and torch.equal(w2, w)
    y = torch.empty_like(x)
    assert not gc.try_group_norm(x, 32, w2, b, 1e-5, None, None, True, y, None)
    out = group_norm(x, 32, w2, b, 1e-5, activation="silu")
    ref = group_norm_ref(x.float(), 32, w.float(), b.float(), 1e-5, activation="silu")
    low = group_norm_ref(x, 32, w, b, 1e-5, activation="silu", upcast=False)
    assert_close_rule(out, ref, low, atol=ATOL[x.dtype], name="strided weight")
