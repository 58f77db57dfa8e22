"""The channels_last two-pass path of the GroupNorm ("nhwc_tiles": per-channel statistics in
BLOCK_C-channel tiles that ignore the groups, a finalize kernel that makes per-channel mean and scale
vectors, a group-free apply kernel) against the PyTorch reference, in Triton's interpreter on small
shapes: SD's channel counts with 32 groups, channel counts that are not multiples of the tile, groups
that straddle tiles or are wider than the finalize block, batch 1 and 3, every fusion, several H*W
splits with a partial last one, a large-mean input; plus the planner knobs (``nhwc_channel_tiles``
off gives back the group-aligned plans exactly: test_plan.py) and which kernels a call launches.

Every floating tensor that ``torch.empty``/``torch.empty_strided`` hands out during a checked call is
NaN first (outputs and the fp32 partials): an element no kernel writes stays NaN and fails the
finiteness check of ``assert_close_rule``."""

from __future__ import annotations

import inspect

import pytest
import torch

import tests.kernels.group_norm.test_triton_groups as base
from kernels.checks import is_channels_last
from kernels.group_norm import group_norm, group_norm_ref, triton_groups, triton_nhwc
from kernels.group_norm import plan as gn_plan
from kernels.testing import assert_close_rule, poison

# Tuning overrides; "nhwc_onepass" off keeps the small test shapes off the one-pass kernel.
CONFIGS = {
    "tiles": {"nhwc_onepass": False},
    # BLOCK_HW = 4 at BLOCK_C = 64, 3 H*W splits (the last one partial on most shapes here), apply
    # programs of several BLOCK_HW blocks (a finalize over several loop iterations: test_splits)
    "split": {"nhwc_onepass": False, "tile_elems": 256, "force_splits": 3, "apply_programs": 1},
}


@pytest.fixture
def config(request, monkeypatch):
    monkeypatch.setitem(gn_plan.TUNING, "nhwc_channel_tiles", True)
    for k, v in CONFIGS[request.param].items():
        monkeypatch.setitem(gn_plan.TUNING, k, v)
    return request.param


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    """NaN-filled floating tensors from torch.empty / torch.empty_strided for the whole test."""
    empty, empty_strided = torch.empty, torch.empty_strided

    def _poisoned(t):
        return poison(t) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poisoned(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_strided", lambda *a, **k: _poisoned(empty_strided(*a, **k)))
    assert torch.isnan(torch.empty(3)).all() and torch.isnan(torch.empty_strided((2,), (1,))).all()


def _inputs(B, C, H, W, dtype, **kwargs):
    """``test_triton_groups``'s inputs, channels_last (the residual too unless ``res_channels_last=False``)."""
    return base._inputs(B, C, H, W, dtype, True, **kwargs)


def _plan(x, G, has_res):
    B, C, H, W = x.shape
    return gn_plan.group_norm_plan(B, C, H * W, G, is_channels_last(x), x.element_size(), has_res)


def _check(x, G, w, b, cb, r, activation, return_sum, atol, eps=1e-5):
    """``test_triton_groups``'s check (y and pre against the fp32 reference under the tolerance rule, in x's
    layout), on a call that plans the "nhwc_tiles" path; returns the op's outputs."""
    assert _plan(x, G, r is not None).path == "nhwc_tiles"
    return base._check(x, G, w, b, cb, r, activation, return_sum, atol, eps)


def _split_sizes(plan, HW):
    return [min(plan.HWS, HW - s * plan.HWS) for s in range(plan.S)]


# SD's channel counts with 32 groups (10/20/30/40 channels per group: none divides BLOCK_C = 64, so
# groups straddle tiles), tiny H*W, batch 1 and 3.
SD_SHAPES = [(1, 320, 9, 7), (3, 640, 5, 5), (1, 960, 4, 3), (1, 1280, 3, 3)]


@pytest.mark.parametrize("config", ["split"], indirect=True)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sd_channels_all_fusions(shape, dtype, atol, config):
    """channel_bias (B, C) + residual + SiLU + return_sum (the ResNet block) on SD's channel counts."""
    x, w, b, cb, r = _inputs(*shape, dtype, cb="BC", res=True)
    plan = _plan(x, 32, True)
    assert plan.BLOCK_C == 64 and plan.n_ct == shape[1] // 64 and plan.S == 3
    assert plan.HWP > plan.BLOCK_HW  # apply programs loop over several H*W blocks
    _check(x, 32, w, b, cb, r, "silu", True, atol)


@pytest.mark.parametrize("config", ["split"], indirect=True)
@pytest.mark.parametrize("block_c", [64, 128])
@pytest.mark.parametrize(
    "B,C,G",
    [(3, 96, 32), (2, 40, 8), (1, 30, 3), (2, 600, 2), (1, 24, 24), (1, 320, 32)],
    ids=["96c-32g", "40c-8g", "30c-3g", "600c-2g", "24c-24g", "320c-32g"],
)
def test_channel_counts_off_the_tile(B, C, G, block_c, config, monkeypatch):
    """C not a multiple of BLOCK_C (masked last tile), Cg not dividing BLOCK_C (groups straddle tiles),
    Cg = 300 (> 256: the finalize walks the group in two channel blocks), Cg = 1, and C = 320 in
    128-channel tiles (the last tile half empty)."""
    monkeypatch.setitem(gn_plan.TUNING, "nhwc_block_c", block_c)
    x, w, b, cb, r = _inputs(B, C, 9, 7, torch.float32, cb="C", res=True)
    plan = _plan(x, G, True)
    assert plan.BLOCK_C == min(block_c, gn_plan.p2(C)) and plan.n_ct == -(-C // plan.BLOCK_C)
    _check(x, G, w, b, cb, r, "silu", True, 1e-5)


FUSIONS = base.FUSIONS


@pytest.mark.parametrize("config", ["split"], indirect=True)
@pytest.mark.parametrize("return_sum", [False, True], ids=["y", "sum"])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_fusion_variants(fusion, activation, return_sum, config):
    # 80 channels in 8 groups of 10 (group 6 spans both 64-channel tiles), batch 3, 9x7.
    x, w, b, cb, r = _inputs(3, 80, 9, 7, torch.float16, **FUSIONS[fusion])
    out = _check(x, 8, w, b, cb, r, activation, return_sum, 2e-3)
    if return_sum and cb is None and r is None:
        assert out[1] is x  # nothing added: the sum is x itself, no copy


@pytest.mark.parametrize("config", ["tiles", "split"], indirect=True)
@pytest.mark.parametrize("fusion", ["none", "bias_c", "bias_residual"])
def test_no_affine(fusion, config):
    # (bf16 is in the GPU tests: the interpreter rounds fp32 -> bf16 toward zero, not to nearest)
    x, w, b, cb, r = _inputs(2, 80, 5, 6, torch.float16, affine=False, **FUSIONS[fusion])
    _check(x, 8, None, None, cb, r, "silu", fusion == "bias_residual", 2e-3)


@pytest.mark.parametrize("config", ["tiles"], indirect=True)
@pytest.mark.parametrize(
    "splits,sizes,finalize_elems",
    [(1, [63], 4096), (2, [32, 31], 4096), (3, [24, 24, 15], 4096), (5, [16, 16, 16, 15], 4096),
     (16, [4] * 15 + [3], 4096), (3, [24, 24, 15], 32), (16, [4] * 15 + [3], 64)],
    ids=["S1", "S2", "S3", "S4", "S16", "S3-fin-loop", "S16-fin-loop"],
)
def test_splits(splits, sizes, finalize_elems, config, monkeypatch):
    """H*W = 63 in 1..16 splits (the last one shorter), combined in one finalize block or over several
    loop iterations (BLOCK_S = 2 or 4 splits of the 16-channel block at a time)."""
    monkeypatch.setitem(gn_plan.TUNING, "tile_elems", 256)
    monkeypatch.setitem(gn_plan.TUNING, "force_splits", splits)
    monkeypatch.setitem(gn_plan.TUNING, "nhwc_finalize_elems", finalize_elems)
    x, w, b, cb, r = _inputs(2, 80, 9, 7, torch.float32, cb="BC")
    plan = _plan(x, 8, False)
    assert _split_sizes(plan, 63) == sizes
    _check(x, 8, w, b, cb, None, "silu", True, 1e-5)


@pytest.mark.parametrize("config", ["tiles", "split"], indirect=True)
def test_large_mean_small_std(config):
    """fp32 statistics must not cancel: mean 100, std 0.01 (a sum/sum-of-squares kernel gets NaN or
    errors of order 1 here). Compared with an fp64 reference, within 2x eager fp32 (NCHW Welford)."""
    x = (100 + 0.01 * torch.randn(2, 80, 9, 7)).contiguous(memory_format=torch.channels_last)
    w, b = torch.ones(80), torch.zeros(80)
    assert _plan(x, 8, False).path == "nhwc_tiles"
    y = group_norm(x, 8, w, b)
    ref64 = group_norm_ref(x.double(), 8, w.double(), b.double())
    eager32 = torch.nn.functional.group_norm(x.contiguous(), 8, w, b)
    assert_close_rule(y, ref64, eager32, atol=1e-4)


def test_outlying_first_partial(monkeypatch):
    """The finalize kernel's combination of S x Cg partials must not cancel when the partial it shifts by (split 0
    of the group's first channel) is the one outlier: 64 splits of 4 positions, +1 on those 4 values. A one-pass
    "sum about the first partial, minus the square of the mean shift" combination erred by 2e-3 here (fp32);
    within 2x eager fp32 of an fp64 reference."""
    for k, v in {"nhwc_onepass": False, "tile_elems": 256, "force_splits": 64}.items():
        monkeypatch.setitem(gn_plan.TUNING, k, v)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, 16, 16, generator=g)
    x[:, 0, 0, :4] += 1.0
    x = x.contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(64, generator=g), torch.randn(64, generator=g)
    plan = _plan(x, 4, False)
    assert plan.path == "nhwc_tiles" and plan.S == 64
    y = group_norm(x, 4, w, b, activation="silu")
    ref64 = group_norm_ref(x.double(), 4, w.double(), b.double(), activation="silu")
    eager32 = torch.nn.functional.silu(torch.nn.functional.group_norm(x.contiguous(), 4, w, b))
    assert_close_rule(y, ref64, eager32, atol=1e-5)


@pytest.mark.parametrize("config", ["split"], indirect=True)
def test_residual_in_nchw(config):
    x, w, b, cb, r = _inputs(2, 80, 5, 6, torch.float16, cb="C", res=True, res_channels_last=False)
    assert r.is_contiguous() and not r.is_contiguous(memory_format=torch.channels_last)
    _check(x, 8, w, b, cb, r, "silu", True, 2e-3)


@pytest.mark.parametrize("config", ["tiles"], indirect=True)
@pytest.mark.parametrize("token_shape", ["B,C,L,1", "B,C,1,L"])
def test_token_layout_with_a_size_one_spatial_dim(token_shape, config):
    """A (B, L, C) token tensor seen as (B, C, L, 1) or (B, C, 1, L): channels_last whatever the size-1
    dim's stride; the kernels must step over positions with the stride of the dim that is not 1."""
    B, L, C, G = 2, 21, 320, 32
    x = torch.randn(B, L, C).transpose(1, 2).unsqueeze(-1 if token_shape == "B,C,L,1" else 2)
    w, b = torch.rand(C) + 0.5, torch.randn(C)
    assert _plan(x, G, False).path == "nhwc_tiles"
    out = group_norm(x, G, w, b, 1e-6, activation="silu")
    torch.testing.assert_close(out, group_norm_ref(x.contiguous(), G, w, b, 1e-6, activation="silu"),
                               atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# launches
# ---------------------------------------------------------------------------------------------
class _Spy:
    """Stands in for a @triton.jit kernel in the module: records (name, grid) per launch."""

    def __init__(self, name, kernel, log):
        self.name, self.kernel, self.log = name, kernel, log

    def __getitem__(self, grid):
        self.log.append((self.name, tuple(grid)))
        return self.kernel[grid]


_KERNELS = [(triton_groups, n) for n in ("_gn_onepass_kernel", "_gn_stats_kernel", "_gn_finalize_kernel",
                                         "_gn_apply_kernel")]
_KERNELS += [(triton_nhwc, n) for n in ("_gn_nhwc_stats_kernel", "_gn_nhwc_finalize_kernel", "_gn_nhwc_apply_kernel")]


@pytest.mark.parametrize("tiles", [True, False])
def test_launches(tiles, monkeypatch):
    """With the knob on, an NHWC two-pass call runs exactly the three nhwc_tiles kernels with the plan's
    grids; off, the group-aligned statistics and apply kernels (with the result right either way)."""
    log = []
    for mod, name in _KERNELS:
        monkeypatch.setattr(mod, name, _Spy(name, getattr(mod, name), log))
    monkeypatch.setitem(gn_plan.TUNING, "nhwc_channel_tiles", tiles)
    monkeypatch.setitem(gn_plan.TUNING, "onepass_max_elems", 0)
    monkeypatch.setitem(gn_plan.TUNING, "tile_elems", 256)
    monkeypatch.setitem(gn_plan.TUNING, "force_splits", 2)
    B, C, G, HW = 3, 96, 32, 9 * 7
    x, w, b, cb, r = _inputs(B, C, 9, 7, torch.float32, cb="BC", res=True)
    plan = _plan(x, G, True)
    y, pre = group_norm(x, G, w, b, channel_bias=cb, residual=r, activation="silu", return_sum=True)
    ref_y, ref_pre = group_norm_ref(x, G, w, b, channel_bias=cb, residual=r, activation="silu", return_sum=True)
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pre, ref_pre, atol=0, rtol=0)
    if tiles:
        assert plan.path == "nhwc_tiles" and plan.S == 2
        assert log == [("_gn_nhwc_stats_kernel", (2, 2, B)), ("_gn_nhwc_finalize_kernel", (G, B)),
                       ("_gn_nhwc_apply_kernel", (2, -(-HW // plan.HWP), B))]
    else:
        assert plan.path == "twopass"
        assert [name for name, _ in log] == ["_gn_stats_kernel", "_gn_apply_kernel"]


class _ArgSpy(_Spy):
    """A ``_Spy`` that records each launch's keyword arguments instead of its grid."""

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.log.append((self.name, kwargs))
            return launch(*args, **kwargs)

        return run


def _constexpr_names(kernel) -> set:
    return {n for n, p in inspect.signature(kernel.fn).parameters.items() if "constexpr" in str(p.annotation)}


def test_another_image_size_launches_the_same_specializations(monkeypatch):
    """Two H*W sizes whose plans differ in split count S and in the statistics and apply loop trip counts
    (ITERS, from 3 up: runtime loops; 1 or 2 run unrolled) launch the nhwc_tiles kernels with the same
    constexpr arguments: those counts are runtime arguments (and left out of Triton's integer specialization),
    so an engine's second image size compiles no new GroupNorm kernel. Both results are right."""
    assert [triton_nhwc._unroll(i) for i in (1, 2, 3, 7)] == [1, 2, 0, 0]
    names = ["_gn_nhwc_stats_kernel", "_gn_nhwc_finalize_kernel", "_gn_nhwc_apply_kernel"]
    consts = {n: _constexpr_names(getattr(triton_nhwc, n)) for n in names}
    assert {"BLOCK_C", "BLOCK_HW"} <= consts[names[0]] and "ITERS" not in consts[names[0]]
    # left out of Triton's integer specialization (S = 32 and S = 40 would otherwise compile two variants); H*W and
    # HWS are not: without their divisibility ptxas serialized the loads (the module's comment)
    unspecialized = [set(getattr(triton_nhwc, n).kwargs["do_not_specialize"]) for n in names]
    assert unspecialized == [{"S", "ITERS"}, {"S", "N_S"}, {"ITERS"}]
    log = []
    for name in names:
        monkeypatch.setattr(triton_nhwc, name, _ArgSpy(name, getattr(triton_nhwc, name), log))
    for k, v in {"nhwc_onepass": False, "tile_elems": 256, "target_programs": 6, "nhwc_finalize_elems": 8,
                 "apply_programs": 4}.items():
        monkeypatch.setitem(gn_plan.TUNING, k, v)
    launches = []
    for H, W in ((8, 8), (8, 10)):
        log.clear()
        x, w, b, cb, r = _inputs(1, 64, H, W, torch.float32, cb="BC", res=True)
        _check(x, 32, w, b, cb, r, "silu", True, 1e-5)
        launches.append(list(log))
    first, second = ([(n, {k: v for k, v in kw.items() if k in consts[n]}) for n, kw in one] for one in launches)
    assert [n for n, _ in first] == names and first == second
    runtime = [[kw.get(k) for _, kw in one for k in ("ITERS", "N_S") if k in kw] for one in launches]
    assert runtime == [[3, 2, 4], [4, 2, 5]]  # stats ITERS, finalize N_S, apply ITERS
