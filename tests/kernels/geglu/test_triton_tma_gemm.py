"""kernels.geglu.triton_tma_gemm (TMA GEMM with the GEGLU epilogue) against its fp32 reference on the CPU under
TRITON_INTERPRET=1 (where each program runs one tile: the persistent tile walk runs in the GPU file): partial tiles
in M, N and K, bias or none, SD's real K and N with few rows, both product variants; what it refuses. The choice
between it and cuBLAS is test_projection.py's; the GPU file runs every config at the real SD shapes."""

import pytest
import torch

from kernels.geglu.ref import geglu_linear_fp8_ref, geglu_linear_ref
from kernels.geglu.triton_tma_gemm import TileConfig, fp8_unsupported, geglu_linear, geglu_linear_fp8, unsupported
from kernels.testing import assert_close_rule, e4m3_far, poison

SMALL = TileConfig(32, 32, 32, 1, 4, group_m=2)
SMALL_ONE_DOT = TileConfig(32, 32, 32, 1, 4, group_m=2, single_dot=True)


def _inputs(M, K, N, bias=True, dtype=torch.float16):
    x = torch.randn(M, K).to(dtype)
    w = (torch.randn(2 * N, K) / K**0.5).to(dtype)
    b = (torch.randn(2 * N) * 0.5).to(dtype) if bias else None
    return x, w, b


def _check(ours, x, w, b, name):
    f = lambda t: None if t is None else t.float()  # noqa: E731
    ref32 = geglu_linear_ref(x.float(), w.float(), f(b))
    lowp = geglu_linear_ref(x, w, b, upcast=False)
    assert ours.dtype == x.dtype
    assert_close_rule(ours, ref32, lowp, 2e-3, name)


# (M, K, N): partial M tiles, K not a multiple of BLOCK_K (zero-filled), N not a multiple of BLOCK_N, SD's real
# K/N pairs (320 -> 2x1280, 640 -> 2x2560) with a few rows, many tiles
@pytest.mark.parametrize("M,K,N", [(37, 40, 24), (64, 64, 32), (5, 320, 1280), (3, 640, 2560), (200, 48, 96)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("config", [SMALL, SMALL_ONE_DOT], ids=["two-products", "one-product"])
def test_matches_reference(M, K, N, bias, config):
    x, w, b = _inputs(M, K, N, bias)
    out = poison(torch.empty(M, N, dtype=x.dtype))
    ours = geglu_linear(x, w, b, config, out=out)
    assert ours.data_ptr() == out.data_ptr()
    _check(ours, x, w, b, f"geglu_tma M{M} K{K} N{N} bias={bias} {config}")


def test_leading_dims():
    x, w, b = _inputs(12, 64, 40)
    x = x.reshape(2, 6, 64)
    ours = geglu_linear(x, w, b, SMALL)
    assert ours.shape == (2, 6, 40)
    _check(ours, x, w, b, "3-D x")


def test_refuses_what_it_cannot_run():
    x, w, b = _inputs(8, 36, 16)  # K = 36: not a multiple of 8
    assert "multiples of 8" in unsupported(x, w, b)
    with pytest.raises(RuntimeError, match="multiples of 8"):
        geglu_linear(x, w, b, SMALL)
    x, w, b = _inputs(8, 32, 16)
    assert "dtype" in unsupported(x.float(), w.float(), b)
    assert "contiguous" in unsupported(x.t().contiguous().t(), w, b)
    with pytest.raises(ValueError, match="2N, K"):
        geglu_linear(x, w[:-1], b)
    with pytest.raises(ValueError, match="bias"):
        geglu_linear(x, w, b[:-2])
    with pytest.raises(ValueError, match="out must be"):
        geglu_linear(x, w, b, SMALL, out=torch.empty(8, 15, dtype=x.dtype))
    strided_bias = torch.randn(64).half()[::2]  # read as if contiguous, it would be a wrong answer
    for bad in (strided_bias, b.float()):  # the cuBLAS path rejects an fp32 bias too
        assert "bias" in unsupported(x, w, bad)
        with pytest.raises(RuntimeError, match="bias"):
            geglu_linear(x, w, bad, SMALL)


def test_refuses_tensor_subclasses():
    """A wrapper subclass (e.g. a quantized weight that still reports fp16) has no plain memory for TMA."""

    class Wrapped(torch.Tensor):
        pass

    x, w, b = _inputs(8, 32, 16)
    assert "subclass" in unsupported(x, w.as_subclass(Wrapped), b)
    assert unsupported(x, torch.nn.Parameter(w), b) is None


# --------------------------------------------------------------------------------------------
# the FP8 variant (E4M3 operands, per-tensor scales, optional E4M3 output)
# --------------------------------------------------------------------------------------------
SMALL_FP8 = TileConfig(32, 32, 32, 1, 4, group_m=2)
SMALL_FP8_ONE_DOT = TileConfig(32, 32, 32, 1, 4, group_m=2, single_dot=True)


def _fp8_inputs(M, K, N, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(2 * N, K, generator=g) / K**0.5
    a_scale = torch.tensor(float(x.abs().max()) / 448.0)
    w_scale = torch.tensor(float(w.abs().max()) / 448.0)
    q = (x / a_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    qw = (w / w_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    b = (torch.randn(2 * N, generator=g) * 0.5).half() if bias else None
    return q, qw, a_scale, w_scale, b


@pytest.mark.parametrize("M,K,N", [(37, 48, 32), (5, 320, 1280), (64, 640, 64), (200, 32, 96)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("config", [SMALL_FP8, SMALL_FP8_ONE_DOT], ids=["two-products", "one-product"])
def test_fp8_16bit_output_matches_reference(M, K, N, bias, config):
    q, qw, sa, sw, b = _fp8_inputs(M, K, N, bias)
    out = poison(torch.empty(M, N, dtype=torch.float16))
    ours = geglu_linear_fp8(q, qw, sa, sw, b, config=config, out=out)
    assert ours.data_ptr() == out.data_ptr() and ours.dtype == torch.float16
    ref = geglu_linear_fp8_ref(q, qw, sa, sw, b, out_dtype=torch.float32)
    err = (ours.float() - ref).abs().max().item()
    assert err <= 2e-3 * ref.abs().max().item() + 1e-3, f"max err {err}"


@pytest.mark.parametrize("M,K,N", [(37, 48, 32), (5, 320, 1280), (200, 32, 96)])
@pytest.mark.parametrize("config", [SMALL_FP8, SMALL_FP8_ONE_DOT], ids=["two-products", "one-product"])
def test_fp8_output_is_the_next_layers_quantized_input(M, K, N, config):
    """With ``out_scale_inv`` the E4M3 output is the reference's within one grid step (where the fp32 sum
    and the float64 one fall on either side of a rounding boundary), and saturates at +-448."""
    q, qw, sa, sw, b = _fp8_inputs(M, K, N)
    ref16 = geglu_linear_fp8_ref(q, qw, sa, sw, b, out_dtype=torch.float32)
    inv = torch.tensor(448.0 / (0.5 * float(ref16.abs().max())))  # half the range: the top values saturate
    ours = geglu_linear_fp8(q, qw, sa, sw, b, out_scale_inv=inv, config=config)
    ref = geglu_linear_fp8_ref(q, qw, sa, sw, b, out_scale_inv=inv)
    assert ours.dtype == torch.float8_e4m3fn
    assert not e4m3_far(ours, ref).any(), f"{int(e4m3_far(ours, ref).sum())} elements more than one E4M3 step off"
    assert float((ours.float() != ref.float()).float().mean()) < 0.02
    assert float(ours.float().abs().max()) == 448.0


def test_fp8_refuses_what_it_cannot_run():
    q, qw, sa, sw, b = _fp8_inputs(8, 40, 16)  # K = 40: not a multiple of 16
    assert "multiples of 16" in fp8_unsupported(q, qw, b)
    with pytest.raises(RuntimeError, match="multiples of 16"):
        geglu_linear_fp8(q, qw, sa, sw, b, config=SMALL_FP8)
    q, qw, sa, sw, b = _fp8_inputs(8, 32, 16)
    assert "float8_e4m3fn" in fp8_unsupported(q.half(), qw, b)
    assert fp8_unsupported(q, qw, b.float()) is None
    assert "bias" in fp8_unsupported(q, qw, torch.randn(64).half()[::2])
    with pytest.raises(TypeError, match="a_scale"):
        geglu_linear_fp8(q, qw, sa.reshape(1), sw, b, config=SMALL_FP8)
    with pytest.raises(TypeError, match="out_dtype"):
        geglu_linear_fp8(q, qw, sa, sw, b, out_dtype=torch.float32, config=SMALL_FP8)
    with pytest.raises(ValueError, match="out must be"):
        geglu_linear_fp8(q, qw, sa, sw, b, config=SMALL_FP8, out=torch.empty(8, 16, dtype=torch.float8_e4m3fn))
