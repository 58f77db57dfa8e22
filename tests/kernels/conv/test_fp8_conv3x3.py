"""kernels.conv.fp8_conv3x3 under TRITON_INTERPRET=1: both implicit-GEMM FP8 kernels (pointer and TMA) against
their dequantize + F.conv2d reference (both BLOCK_K branches of the interpreter's tiling, with and without a bias,
fast and promoted accumulation, fp32 / fp16 / bf16 out, pixels at every image border, tile rows wider than the
image), channels_last output, what they refuse, and the reference run (logged) where no Triton can run. The GPU
file checks SD's real shapes and the autotuned paths."""

import pytest
import torch

from kernels.conv import fp8_conv3x3 as fc

FP8 = torch.float8_e4m3fn
CL = torch.channels_last


def _operands(n, cin, cout, h, w, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    xq = (torch.randn(n, h, w, cin, generator=g) * 64).clamp(-448, 448).to(FP8)
    wq = (torch.randn(cout, 3, 3, cin, generator=g) * 64).clamp(-448, 448).to(FP8)
    a_scale = torch.tensor(0.02)
    w_scale = torch.rand(cout, generator=g) * 1e-3 + 1e-4
    b = torch.randn(cout, generator=g) if bias else None
    return xq, wq, a_scale, w_scale, b


# (N, Cin, Cout, H, W): Cin 32 and 96 take BLOCK_K 32, 64 and 128 take BLOCK_K 64; Cout 48 leaves a partial N tile;
# 5x7 and 3x6 images leave partial M tiles and put taps outside every border.
SHAPES = [(2, 32, 16, 5, 7), (1, 64, 48, 4, 4), (2, 96, 32, 3, 6), (1, 128, 64, 2, 9)]


@pytest.mark.parametrize("fast_accum", [True, False], ids=["fast_accum", "promoted"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("n,cin,cout,h,w", SHAPES, ids=str)
def test_matches_the_reference(n, cin, cout, h, w, bias, tma, fast_accum):
    xq, wq, a, ws, b = _operands(n, cin, cout, h, w, bias)
    if tma and not fast_accum:
        with pytest.raises(RuntimeError, match="pointer kernel only"):
            fc.fp8_conv3x3(xq, wq, a, ws, b, tma=True, fast_accum=False)
        return
    y = fc.fp8_conv3x3(xq, wq, a, ws, b, out_dtype=torch.float32, tma=tma, fast_accum=fast_accum)
    ref = fc.fp8_conv3x3_ref(xq, wq, a, ws, b, torch.float32)
    assert y.shape == (n, cout, h, w) and y.is_contiguous(memory_format=CL)
    # the same exact fp8 products summed in fp32 in another order
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_reference_is_the_dequantized_convolution():
    xq, wq, a, ws, b = _operands(1, 32, 16, 4, 4, True)
    x = (xq.float() * a).permute(0, 3, 1, 2)
    w = (wq.float() * ws.view(-1, 1, 1, 1)).permute(0, 3, 1, 2)
    want = torch.nn.functional.conv2d(x.double(), w.double(), b.double(), 1, 1)
    torch.testing.assert_close(fc.fp8_conv3x3_ref(xq, wq, a, ws, b, torch.float32).double(), want, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_outputs(dtype, tma):
    xq, wq, a, ws, b = _operands(2, 64, 32, 3, 5, True)
    y = fc.fp8_conv3x3(xq, wq, a, ws, b, out_dtype=dtype, tma=tma)
    ref = fc.fp8_conv3x3_ref(xq, wq, a, ws, b, torch.float32)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))


def test_refuses_what_it_cannot_run():
    xq, wq, a, ws, b = _operands(1, 32, 16, 4, 4, True)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fc.fp8_conv3x3(xq.float(), wq, a, ws, b)
    with pytest.raises(ValueError, match="multiple of 32"):
        fc.fp8_conv3x3(xq[..., :16].contiguous(), wq[..., :16].contiguous(), a, ws, b)
    with pytest.raises(ValueError, match=r"wq \(Cout, 3, 3, Cin\)"):
        fc.fp8_conv3x3(xq, wq[:, :2].contiguous(), a, ws, b)
    with pytest.raises(ValueError, match="w_scale"):
        fc.fp8_conv3x3(xq, wq, a, ws[:8], b)
    with pytest.raises(ValueError, match="bias"):
        fc.fp8_conv3x3(xq, wq, a, ws, b[:8])
    with pytest.raises(TypeError, match="out_dtype"):
        fc.fp8_conv3x3(xq, wq, a, ws, b, out_dtype=torch.int8)
    shifted = torch.empty(xq.numel() + 1, dtype=FP8)[1:].view(xq.shape)  # one byte off a 16-byte boundary
    shifted.copy_(xq)
    assert "16-byte" in fc.tma_problem(shifted, wq)
    with pytest.raises(RuntimeError, match="16-byte"):
        fc.fp8_conv3x3(shifted, wq, a, ws, b, tma=True)
    assert fc.tma_problem(xq, wq) is None and fc.tile_width(5, 32) == 8 and fc.tile_width(100, 64) == 64


def test_without_triton_the_reference_runs_logged(monkeypatch, caplog):
    from kernels import dispatch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dispatch._logged.clear()
    caplog.set_level("INFO", logger="sdfast.kernels")
    xq, wq, a, ws, b = _operands(1, 32, 16, 4, 4, True)
    y = fc.fp8_conv3x3(xq, wq, a, ws, b, out_dtype=torch.float32)
    assert torch.equal(y, fc.fp8_conv3x3_ref(xq, wq, a, ws, b, torch.float32))
    assert "fp8_conv3x3" in caplog.text and "TRITON_INTERPRET is not set" in caplog.text


def test_empty_batch():
    xq, wq, a, ws, b = _operands(1, 32, 16, 4, 4, True)
    y = fc.fp8_conv3x3(xq[:0], wq, a, ws, b)
    assert y.shape == (0, 16, 4, 4)


def test_tile_pruning_keeps_k_tiles_inside_one_tap_and_the_tma_boxes():
    """The autotuners keep the tiles whose BLOCK_K divides Cin; where none does (Cin a multiple of 32 only) the one
    32-wide fallback keeps the TMA configs' pre-hook, which sets the descriptors' boxes (without it the TMA kernel
    would read boxes of the placeholder shape)."""
    import triton

    cfgs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=nw, num_stages=st,
                          pre_hook=fc._set_boxes) for bm, bn, bk, st, nw in fc._TMA_CONFIGS]
    assert {c.kwargs["BLOCK_K"] for c in fc._prune(cfgs, {"CIN": 320, "COUT": 320})} == {64}
    assert len(fc._prune(cfgs, {"CIN": 1280, "COUT": 1280})) == len(cfgs)
    [fallback] = fc._prune(cfgs, {"CIN": 96, "COUT": 64})
    assert fallback.kwargs["BLOCK_K"] == 32 and fallback.pre_hook is fc._set_boxes

    class Desc:
        block_shape = None

    nargs = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "W": 12, "x_desc": Desc(), "w_desc": Desc()}
    fc._set_boxes(nargs)
    assert nargs["x_desc"].block_shape == [1, 4, 16, 32] and nargs["w_desc"].block_shape == [64, 32]
