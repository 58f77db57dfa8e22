"""The group-aligned GroupNorm kernels (``kernels.group_norm.triton_groups``: + channel bias, residual, SiLU,
return_sum) against the PyTorch reference, in Triton's interpreter on small shapes with SD's channel counts (32
groups of 10/20/30/40 channels), both memory layouts, every kernel path (one-pass, two-pass, H*W splits, finalize
kernel, L2 chunking, channel sub-blocks). The channels_last cases of the group-aligned two-pass paths run with
``nhwc_channel_tiles`` off; the default channels_last two-pass path ("nhwc_tiles") is test_triton_nhwc.py; input
checks, the fallback and the custom op are test_op.py, the planner's defaults test_plan.py."""

from __future__ import annotations

import pytest
import torch

from kernels.checks import is_channels_last
from kernels.group_norm import group_norm, group_norm_ref
from kernels.group_norm import plan as gn_plan
from kernels.testing import assert_close_rule

DTYPES = [(torch.float32, 1e-5), (torch.float16, 2e-3)]

# Tuning overrides that steer small shapes onto each path of group_norm_plan. The two-pass ones keep
# channels_last inputs on the group-aligned kernels (nhwc_channel_tiles off).
PATHS = {
    "onepass": {},
    "twopass": {"onepass_max_elems": 0, "nhwc_channel_tiles": False},
    # several H*W splits per group, several BLOCK_HW iterations per program, multi-block apply programs
    "split": {"onepass_max_elems": 0, "tile_elems": 256, "force_splits": 3, "apply_programs": 1,
              "nhwc_channel_tiles": False},
    # + the separate finalize kernel and one launch per channel tile (L2 chunking)
    "finalize": {"onepass_max_elems": 0, "tile_elems": 256, "force_splits": 3, "max_inline_partials": 0,
                 "l2_chunk_bytes": 1, "nhwc_channel_tiles": False},
}


@pytest.fixture
def path(request, monkeypatch):
    for k, v in PATHS[request.param].items():
        monkeypatch.setitem(gn_plan.TUNING, k, v)
    return request.param


def _inputs(B, C, H, W, dtype, channels_last, *, cb=None, res=False, res_channels_last=None, affine=True, scale=2.0):
    x = torch.randn(B, C, H, W, dtype=torch.float32) * scale + 0.5
    x = x.to(dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = (torch.rand(C) + 0.5).to(dtype) if affine else None
    b = torch.randn(C).to(dtype) if affine else None
    channel_bias = None
    if cb == "C":
        channel_bias = torch.randn(C).to(dtype)
    elif cb == "BC":
        channel_bias = torch.randn(B, C).to(dtype)
    r = None
    if res:
        r = torch.randn(B, C, H, W).to(dtype)
        rcl = channels_last if res_channels_last is None else res_channels_last
        if rcl:
            r = r.to(memory_format=torch.channels_last)
    return x, w, b, channel_bias, r


def _f32(t):
    return None if t is None else t.float()


def _check(x, G, w, b, cb, r, activation, return_sum, atol, eps=1e-5):
    out = group_norm(x, G, w, b, eps, channel_bias=cb, residual=r, activation=activation, return_sum=return_sum)
    ref32 = group_norm_ref(x.float(), G, _f32(w), _f32(b), eps, channel_bias=_f32(cb), residual=_f32(r),
                           activation=activation, return_sum=return_sum)
    lowp = group_norm_ref(x, G, w, b, eps, channel_bias=cb, residual=r, activation=activation,
                          return_sum=return_sum, upcast=False)
    if not return_sum:
        out, ref32, lowp = (out,), (ref32,), (lowp,)
    fmt = torch.channels_last if is_channels_last(x) else torch.contiguous_format
    for name, o, r32, lp in zip(("y", "pre"), out, ref32, lowp):
        assert o.dtype == x.dtype
        assert o.is_contiguous(memory_format=fmt), f"{name} not in x's layout: strides {o.stride()}"
        # The sum is exact up to one rounding in x's dtype.
        assert_close_rule(o, r32, lp, atol=atol, name=name)
    return out


# SD's channel counts with 32 groups (10/20/30/40 channels per group), tiny H*W (9x7 is not a
# multiple of any block), batch 1 and 3.
SD_SHAPES = [(1, 320, 9, 7), (3, 640, 5, 5), (1, 960, 4, 3), (1, 1280, 3, 3)]


@pytest.mark.parametrize(
    "dtype,atol,path",
    [(torch.float32, 1e-5, "onepass"), (torch.float16, 2e-3, "onepass"), (torch.float16, 2e-3, "twopass")],
    ids=["fp32-onepass", "fp16-onepass", "fp16-twopass"],
    indirect=["path"],
)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("shape", SD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sd_channels_all_fusions(shape, channels_last, dtype, atol, path):
    """bias (B, C) + residual + SiLU + return_sum, the full ResNet-block pattern."""
    x, w, b, cb, r = _inputs(*shape, dtype, channels_last, cb="BC", res=True)
    plan = gn_plan.group_norm_plan(shape[0], shape[1], shape[2] * shape[3], 32, channels_last, x.element_size(), True)
    assert plan.path == path
    _check(x, 32, w, b, cb, r, "silu", True, atol)


FUSIONS = {
    "none": dict(cb=None, res=False),
    "bias_c": dict(cb="C", res=False),
    "bias_bc": dict(cb="BC", res=False),
    "residual": dict(cb=None, res=True),
    "bias_residual": dict(cb="BC", res=True),
}


@pytest.mark.parametrize("path", ["twopass"], indirect=True)
@pytest.mark.parametrize("return_sum", [False, True], ids=["y", "sum"])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("fusion", list(FUSIONS))
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_fusion_variants(fusion, activation, return_sum, channels_last, path):
    # 80 channels in 8 groups of 10 (not a power of two), batch 2, 9x7.
    x, w, b, cb, r = _inputs(2, 80, 9, 7, torch.float16, channels_last, **FUSIONS[fusion])
    out = _check(x, 8, w, b, cb, r, activation, return_sum, 2e-3)
    if return_sum and cb is None and r is None:
        assert out[1] is x  # nothing added: the sum is x itself, no copy


@pytest.mark.parametrize("path", ["onepass", "split"], indirect=True)
@pytest.mark.parametrize("fusion", list(FUSIONS))
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_fusion_variants_other_paths(fusion, channels_last, path):
    x, w, b, cb, r = _inputs(2, 80, 9, 7, torch.float16, channels_last, **FUSIONS[fusion])
    _check(x, 8, w, b, cb, r, "silu", True, 2e-3)


@pytest.mark.parametrize("path", ["split", "finalize"], indirect=True)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_split_and_finalize_paths(channels_last, path):
    # 30 channels per group, H*W = 63 in 3 splits
    x, w, b, cb, r = _inputs(1, 120, 9, 7, torch.float32, channels_last, cb="C", res=True)
    plan = gn_plan.group_norm_plan(1, 120, 63, 4, channels_last, 4, True)
    assert plan.S == 3 and plan.HWS // plan.BLOCK_HW > 1
    assert plan.finalize == (path == "finalize")
    assert (plan.chunk_ct < plan.n_ct) == (path == "finalize")
    _check(x, 4, w, b, cb, r, "silu", True, 1e-5)


@pytest.mark.parametrize("channels_last,tiles,expected", [(False, True, "twopass"), (True, False, "twopass"),
                                                         (True, True, "nhwc_tiles")],
                         ids=["nchw", "nhwc-groups", "nhwc-tiles"])
def test_65x65_two_pass(channels_last, tiles, expected, monkeypatch):
    """H*W = 4225 (odd, no block divides it) on the default two-pass plans with a few splits."""
    monkeypatch.setitem(gn_plan.TUNING, "target_programs", 8)
    monkeypatch.setitem(gn_plan.TUNING, "apply_programs", 1)
    monkeypatch.setitem(gn_plan.TUNING, "nhwc_channel_tiles", tiles)
    x, w, b, cb, r = _inputs(1, 40, 65, 65, torch.float16, channels_last, res=True)
    plan = gn_plan.group_norm_plan(1, 40, 65 * 65, 4, channels_last, 2, True)
    assert plan.path == expected and plan.S > 1
    _check(x, 4, w, b, None, r, "silu", False, 2e-3)


@pytest.mark.parametrize("path", ["onepass", "split"], indirect=True)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_group_wider_than_channel_block(channels_last, path, monkeypatch):
    """A group of 300 channels (> 256): one group per tile, looped in channel sub-blocks (N_CB = 2)."""
    monkeypatch.setitem(gn_plan.TUNING, "nhwc_channel_tiles", False)  # nhwc_tiles: test_triton_nhwc.py
    x, w, b, cb, r = _inputs(2, 600, 3, 3, torch.float32, channels_last, cb="BC")
    plan = gn_plan.group_norm_plan(2, 600, 9, 2, channels_last, 4, False)
    assert plan.N_CB == 2 and plan.path == "twopass"  # never one-pass: the tile does not hold a group
    _check(x, 2, w, b, cb, None, None, False, 1e-5)


@pytest.mark.parametrize("x_cl,r_cl", [(False, True), (True, False)], ids=["x_nchw-r_nhwc", "x_nhwc-r_nchw"])
@pytest.mark.parametrize("path", ["onepass", "twopass"], indirect=True)
def test_residual_in_the_other_layout(x_cl, r_cl, path):
    x, w, b, cb, r = _inputs(2, 80, 5, 6, torch.float16, x_cl, res=True, res_channels_last=r_cl)
    assert is_channels_last(r) == r_cl
    _check(x, 8, w, b, None, r, "silu", True, 2e-3)


@pytest.mark.parametrize("path", ["onepass", "twopass"], indirect=True)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_no_affine(channels_last, path):
    # (bf16 is in the GPU tests: the interpreter rounds fp32 -> bf16 toward zero, not to nearest)
    x, w, b, cb, r = _inputs(2, 80, 5, 6, torch.float16, channels_last, affine=False, cb="C")
    _check(x, 8, None, None, cb, None, "silu", False, 2e-3)


@pytest.mark.parametrize("path", ["onepass", "split"], indirect=True)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_large_mean_small_std(channels_last, path):
    """fp32 statistics must not cancel: mean 100, std 0.01 (a sum/sum-of-squares kernel gets NaN or
    errors of order 1 here). Compared with an fp64 reference, within 2x eager fp32 (NCHW Welford)."""
    x = 100 + 0.01 * torch.randn(1, 40, 9, 7)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = torch.ones(40), torch.zeros(40)
    y = group_norm(x, 4, w, b)
    ref64 = group_norm_ref(x.double(), 4, w.double(), b.double())
    eager32 = torch.nn.functional.group_norm(x.contiguous(), 4, w, b)
    assert_close_rule(y, ref64, eager32, atol=1e-4)


@pytest.mark.parametrize("token_shape", ["B,C,L,1", "B,C,1,L"])
@pytest.mark.parametrize("path", ["onepass", "twopass"], indirect=True)
def test_token_layout_with_a_size_one_spatial_dim(token_shape, path):
    """A (B, L, C) token tensor (the transformer block's layout) seen as (B, C, L, 1) or (B, C, 1, L) counts
    as channels_last for PyTorch whatever the size-1 dim's stride is; the kernel must step over the
    positions with the stride of the dim that is not 1."""
    B, L, C, G = 2, 21, 320, 32
    tokens = torch.randn(B, L, C)
    x = tokens.transpose(1, 2).unsqueeze(-1 if token_shape == "B,C,L,1" else 2)
    w, b = torch.rand(C) + 0.5, torch.randn(C)
    out = group_norm(x, G, w, b, 1e-6, activation="silu")
    ref = group_norm_ref(x.contiguous(), G, w, b, 1e-6, activation="silu")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
