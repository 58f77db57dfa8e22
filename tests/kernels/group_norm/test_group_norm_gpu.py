"""GPU tests of GroupNorm on the real SD shapes (``benchmarks.sd_shapes``): every GroupNorm shape of the SD1.5
UNet/VAE at 512² and the SDXL UNet at 1024² in both layouts, the ResNet-block fusion, bf16/fp32 spot checks, odd
latent sides, torch.compile, and one CUDA graph that captures GroupNorm with LayerNorm and GEGLU (the three norm-family
ops of a transformer block together). Outputs are allocated by the ops, so the caching allocator is first filled with
NaN (``kernels.testing.poison_allocator``): an element a kernel forgets to write stays NaN. LayerNorm's own GPU tests:
tests/kernels/norm/test_norm_gpu.py; GEGLU's: tests/kernels/geglu/test_triton_elementwise_gpu.py."""

from __future__ import annotations

import pytest
import torch

from benchmarks import sd_shapes
from kernels.geglu import geglu
from kernels.group_norm import group_norm, group_norm_ref
from kernels.norm import layer_norm
from kernels.testing import assert_close_rule, poison_allocator

pytestmark = pytest.mark.gpu

ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 5e-5}


def _f32(t):
    return None if t is None else t.float()


def _gn_inputs(shape, dtype, channels_last, *, cb=False, res=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    B, C, H, W = shape

    def rnd(*s, scale=1.0, shift=0.0):
        return (torch.randn(*s, device="cuda", generator=g) * scale + shift).to(dtype)

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = rnd(B, C, H, W, scale=2.0, shift=0.5).contiguous(memory_format=fmt)
    w, b = rnd(C, scale=0.5, shift=1.0), rnd(C)
    channel_bias = rnd(B, C) if cb else None
    r = rnd(B, C, H, W).contiguous(memory_format=fmt) if res else None
    return x, w, b, channel_bias, r


def _check_gn(x, w, b, cb, r, activation, return_sum, eps):
    poison_allocator(4 * x.numel() * x.element_size())
    out = group_norm(x, 32, w, b, eps, channel_bias=cb, residual=r, activation=activation, return_sum=return_sum)
    ref32 = group_norm_ref(x.float(), 32, _f32(w), _f32(b), eps, channel_bias=_f32(cb), residual=_f32(r),
                           activation=activation, return_sum=return_sum)
    lowp = group_norm_ref(x, 32, w, b, eps, channel_bias=cb, residual=r, activation=activation,
                          return_sum=return_sum, upcast=False)
    if not return_sum:
        out, ref32, lowp = (out,), (ref32,), (lowp,)
    fmt = torch.channels_last if (not x.is_contiguous()) else torch.contiguous_format
    for name, o, r32, lp in zip(("y", "pre"), out, ref32, lowp):
        assert o.is_contiguous(memory_format=fmt), f"{name}: strides {o.stride()}"
        assert_close_rule(o, r32, lp, atol=ATOL[x.dtype], name=f"{name} {tuple(x.shape)}")


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("shape,silu,eps", sd_shapes.unique_group_norm_cases(),
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_group_norm_sd_shapes(shape, silu, eps, channels_last):
    x, w, b, _, _ = _gn_inputs(shape, torch.float16, channels_last)
    _check_gn(x, w, b, None, None, "silu" if silu else None, False, eps)


_RESNET_SHAPES = sorted({s for s, silu, _ in sd_shapes.unique_group_norm_cases() if silu and s[0] == 2})


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("shape", _RESNET_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_group_norm_resnet_fusion(shape, channels_last):
    """channel_bias (B, C) + residual + SiLU + return_sum at every UNet ResNet shape."""
    x, w, b, cb, r = _gn_inputs(shape, torch.float16, channels_last, cb=True, res=True)
    _check_gn(x, w, b, cb, r, "silu", True, 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("shape", [(2, 320, 64, 64), (2, 1280, 8, 8), (1, 512, 128, 128), (1, 128, 512, 512)],
                         ids=lambda s: "x".join(map(str, s)))
def test_group_norm_other_dtypes(shape, channels_last, dtype):
    x, w, b, cb, r = _gn_inputs(shape, dtype, channels_last, cb=True, res=True)
    _check_gn(x, w, b, cb, r, "silu", True, 1e-6)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_group_norm_odd_spatial(channels_last):
    """Latent sides that are not multiples of 8 (e.g. 520x600 images: 65x75 latents)."""
    x, w, b, cb, r = _gn_inputs((2, 320, 65, 75), torch.float16, channels_last, cb=True, res=True)
    _check_gn(x, w, b, cb, r, "silu", True, 1e-5)


def test_cuda_graph_capture():
    """All three ops captured in one CUDA graph; replays follow new inputs copied into the static ones."""
    x, w, b, cb, r = _gn_inputs((2, 320, 64, 64), torch.float16, True, cb=True, res=True)
    hs = torch.randn(2, 4096, 320, device="cuda", dtype=torch.float16)
    hr = torch.randn_like(hs)
    gg = torch.randn(2, 4096, 2560, device="cuda", dtype=torch.float16)

    def step():
        y, pre = group_norm(x, 32, w, b, channel_bias=cb, residual=r, activation="silu", return_sum=True)
        y2 = group_norm(pre, 32, w, b, activation="silu")  # the next block's norm on the residual stream
        ln, s = layer_norm(hs, w, b, residual=hr, return_sum=True)
        return y, pre, y2, ln, s, geglu(gg)

    s_ = torch.cuda.Stream()
    s_.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s_):
        step()
    torch.cuda.current_stream().wait_stream(s_)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(2):
        for t in (x, cb, r, hs, hr, gg):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        for o, e in zip(outs, want):
            assert torch.equal(o, e), "graph replay differs from an eager call of the same kernels"


def test_torch_compile_fullgraph():
    x, w, b, cb, r = _gn_inputs((2, 640, 32, 32), torch.float16, True, cb=True, res=True)

    def block(x, cb, r):
        y, pre = group_norm(x, 32, w, b, channel_bias=cb, residual=r, activation="silu", return_sum=True)
        return y * 2, pre

    compiled = torch.compile(block, fullgraph=True)
    y, pre = compiled(x, cb, r)
    ey, epre = block(x, cb, r)
    assert torch.equal(y, ey) and torch.equal(pre, epre)
    assert y.is_contiguous(memory_format=torch.channels_last)
