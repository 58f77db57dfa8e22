"""Quantized linear kernels (W8A8 int8 / FP8 / ZeroQuant groups, W4A16, LLM.int8()) against their
dequantize-then-matmul references, plus the quantizers (packing, SmoothQuant, AWQ, GPTQ). CPU,
TRITON_INTERPRET=1, small shapes with odd K and N and group boundaries."""

import pytest
import torch

from kernels.gemm.int8_outlier import int8_outlier_linear, int8_outlier_linear_ref, outlier_columns
from kernels.gemm.w4a16 import (
    dequantize_w4,
    pack_int4,
    quantize_int4_groups,
    quantize_w4,
    unpack_int4,
    w4a16_configs,
    w4a16_linear,
    w4a16_linear_ref,
)
from kernels.gemm.w8a8 import (
    dequantize_weight,
    gemm8_configs,
    quantize_per_token,
    quantize_per_token_ref,
    quantize_weight_per_channel,
    smoothquant_scales,
    w8a8_gemm,
    w8a8_linear,
    w8a8_linear_ref,
)
from kernels.testing import assert_close_rule
from sdfast.quantization.awq import awq_quantize, awq_search_scales
from sdfast.quantization.gptq import gptq_quantize

FP8 = torch.float8_e4m3fn


def _rule(ours, ref_fn, x, atol, name):
    """flash-attention rule against the reference run on fp32 inputs (ref32) and on x.dtype (lowp)."""
    ref32 = ref_fn(x.float()).float()
    lowp = ref_fn(x)
    assert ours.dtype == x.dtype
    assert_close_rule(ours, ref32, lowp, atol, name)


# ------------------------------------------------------------------------------------------
# W8A8: activation quantization kernel
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,K", [(37, 101), (3, 64), (40, 130)])
@pytest.mark.parametrize("with_smooth", [False, True])
def test_quantize_per_token_int8_exact(dtype, M, K, with_smooth):
    x = (torch.randn(M, K) * torch.linspace(0.1, 8, K)).to(dtype)
    x[1] = 0.0  # an all-zero row: scale floor, q = 0
    sm = torch.rand(K) + 0.5 if with_smooth else None
    q, s = quantize_per_token(x, sm)
    qr, sr = quantize_per_token_ref(x, sm)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    torch.testing.assert_close(s, sr, rtol=1e-6, atol=0)
    assert (q.int() - qr.int()).abs().max() <= 1  # identical up to a rare tie in the last bit
    assert (q.int() != qr.int()).float().mean() < 1e-3
    assert q[1].abs().max() == 0 and q.abs().max() == 127
    # error bound: |x*smooth - q*scale| <= scale/2 per element
    xs = x.float() * (sm if sm is not None else 1.0)
    assert ((xs - q.float() * s[:, None]).abs() <= s[:, None] * 0.5 + 1e-6).all()


def test_quantize_per_token_strided_and_fp8():
    base = torch.randn(20, 2 * 45)
    x = base[:, ::2]
    q, s = quantize_per_token(x)
    qr, sr = quantize_per_token_ref(x)
    assert torch.equal(q, qr) and torch.allclose(s, sr)
    q8, s8 = quantize_per_token(x, None, FP8)
    assert q8.dtype == FP8
    rel = (q8.float() * s8[:, None] - x).abs() / x.abs().amax(1, keepdim=True)
    assert rel.max() < 2**-4  # e4m3: 3 mantissa bits


def test_round_half_even():
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -2.5, 127.0, 3.49, -3.51]]) / 127.0
    q, s = quantize_per_token(x)
    assert s.item() == pytest.approx(1.0 / 127.0)
    assert q.tolist() == [[0, 2, 2, 0, -2, 127, 3, -4]]


# ------------------------------------------------------------------------------------------
# W8A8: weights, SmoothQuant, GEMM
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group_size", [None, 32])
def test_weight_quantization_error_bound(group_size):
    w = torch.randn(13, 75)
    q, s = quantize_weight_per_channel(w, torch.int8, group_size)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert s.shape == ((13,) if group_size is None else (13, 3))  # 75 = 32 + 32 + 11
    err = (dequantize_weight(q, s, group_size) - w).abs()
    bound = (s if group_size is None else s[:, torch.arange(75) // group_size].squeeze(0))
    bound = bound[:, None] if group_size is None else bound
    assert (err <= bound * 0.5 + 1e-7).all()


def test_smoothquant_leaves_product_unchanged():
    torch.manual_seed(1)
    x = torch.randn(50, 40, dtype=torch.float64) * torch.logspace(-1, 1.5, 40, dtype=torch.float64)
    w = torch.randn(30, 40, dtype=torch.float64)
    s = smoothquant_scales(x.abs().amax(0), w, alpha=0.5).double()
    torch.testing.assert_close((x / s) @ (w * s).t(), x @ w.t(), rtol=1e-12, atol=1e-12)
    # alpha = 0.5 equalises the channel ranges of activation and weight
    torch.testing.assert_close((x / s).abs().amax(0), (w * s).abs().amax(0), rtol=1e-5, atol=1e-6)
    # in fp32 too
    x32, w32, s32 = x.float(), w.float(), s.float()
    torch.testing.assert_close((x32 / s32) @ (w32 * s32).t(), x32 @ w32.t(), rtol=1e-4, atol=1e-4)


def test_smoothquant_reduces_error_with_outlier_channels():
    torch.manual_seed(2)
    x = torch.randn(64, 96)
    x[:, [3, 50]] *= 40.0  # activation outlier channels, as in the paper
    w = torch.randn(48, 96) / 10
    exact = x @ w.t()
    q0, s0 = quantize_weight_per_channel(w)
    plain = w8a8_linear_ref(x, q0, s0)
    sq = smoothquant_scales(x.abs().amax(0), w, 0.5)
    q1, s1 = quantize_weight_per_channel(w * sq)
    smooth = w8a8_linear_ref(x, q1, s1, smooth=1.0 / sq)
    assert (smooth - exact).norm() < 0.7 * (plain - exact).norm()


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.float16, 2e-3)])
@pytest.mark.parametrize("qdtype", [torch.int8, FP8])
@pytest.mark.parametrize("M,K,N,group_size", [(37, 101, 45, None), (40, 96, 33, 32), (5, 70, 17, 32)])
def test_w8a8_linear_matches_reference(dtype, atol, qdtype, M, K, N, group_size):
    x = torch.randn(M, K).to(dtype)
    w = torch.randn(N, K)
    sm = torch.rand(K) + 0.5
    b = torch.randn(N)
    qw, ws = quantize_weight_per_channel(w * (1 / sm), qdtype, group_size)
    ours = w8a8_linear(x, qw, ws, b, smooth=sm, group_size=group_size)
    _rule(ours, lambda xx: w8a8_linear_ref(xx, qw, ws, b, smooth=sm, group_size=group_size), x, atol,
          f"w8a8 {qdtype} {dtype} {M}x{K}x{N} g={group_size}")
    # and close to the unquantized product (the method works)
    exact = x.float() @ w.t() + b
    rel = (ours.float() - exact).norm() / exact.norm()
    assert rel < (0.02 if qdtype == torch.int8 else 0.08)


def test_w8a8_gemm_int32_accumulation_is_exact():
    a = torch.full((16, 300), 127, dtype=torch.int8)
    b = torch.full((8, 300), -127, dtype=torch.int8)
    one = torch.ones(16), torch.ones(8)
    y = w8a8_gemm(a, b, *one, out_dtype=torch.float32)
    assert torch.all(y == -127 * 127 * 300)


def test_w8a8_errors():
    a = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(TypeError, match="int8"):
        w8a8_gemm(a, torch.zeros(4, 64, dtype=FP8), torch.ones(4), torch.ones(4))
    with pytest.raises(ValueError, match="b_scale"):
        w8a8_gemm(a, a, torch.ones(4), torch.ones(4, 2), group_size=None)
    with pytest.raises(ValueError, match="multiple of 32"):
        w8a8_gemm(a, a, torch.ones(4), torch.ones(4, 4), group_size=16)
    with pytest.raises(ValueError, match="K=65"):
        w8a8_linear(torch.randn(3, 65), a, torch.ones(4))
    with pytest.raises(TypeError):
        quantize_per_token(torch.randn(3, 8), None, torch.float16)


def test_fp8_needs_sm89(monkeypatch):
    import kernels.gemm.w8a8 as w8

    class FakeCuda:
        is_cuda = True
        device = "cuda:0"

    monkeypatch.setattr(w8, "interpret_mode", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(NotImplementedError, match="sm_89"):
        w8.check_fp8_supported(FakeCuda(), "w8a8_gemm")


def test_gemm8_configs_divide_group_size():
    assert gemm8_configs(torch.device("cpu"))[0].kwargs["BLOCK_K"] == 32


# ------------------------------------------------------------------------------------------
# W4A16
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("K", [1, 8, 29, 64])
def test_int4_pack_unpack_round_trip(K):
    q = torch.randint(0, 16, (7, K), dtype=torch.uint8)
    p = pack_int4(q)
    assert p.dtype == torch.int32 and p.shape == (7, -(-K // 8))
    assert torch.equal(unpack_int4(p, K), q)


def test_int4_packing_order():
    # element k lives in bits [4*(k%8), 4*(k%8)+4) of word k // 8 (lowest nibble first)
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15, 9]], dtype=torch.uint8)
    p = pack_int4(q)
    assert p[0, 0].item() == int("F7654321", 16) - 2**32
    assert p[0, 1].item() == 9
    with pytest.raises(ValueError, match="0, 15"):
        pack_int4(torch.tensor([[16]]))


@pytest.mark.parametrize("K,group_size", [(64, 16), (75, 32), (200, 128)])
def test_int4_group_quantization_error_bound(K, group_size):
    w = torch.randn(9, K)
    q, s, z = quantize_int4_groups(w, group_size)
    G = -(-K // group_size)
    assert q.shape == (9, K) and s.shape == (9, G) and z.shape == (9, G) and z.dtype == torch.uint8
    assert int(q.max()) <= 15
    g = torch.arange(K) // group_size
    err = ((q.float() - z.float()[:, g]) * s[:, g] - w).abs()
    assert (err <= s[:, g] * 0.5 + 1e-6).all()
    qw, sc, zz = quantize_w4(w, group_size)
    torch.testing.assert_close(dequantize_w4(qw, sc, zz, K, group_size), (q.float() - z.float()[:, g]) * s[:, g])


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.float16, 2e-3)])
@pytest.mark.parametrize("M,K,N,group_size", [(37, 101, 45, 32), (16, 64, 20, 16), (9, 160, 33, 128)])
@pytest.mark.parametrize("with_smooth", [False, True])
def test_w4a16_linear_matches_reference(dtype, atol, M, K, N, group_size, with_smooth):
    x = torch.randn(2, M, K).to(dtype)
    w = torch.randn(N, K)
    b = torch.randn(N).to(dtype)
    qw, s, z = quantize_w4(w, group_size, scale_dtype=dtype)
    sm = (torch.rand(K) + 0.5) if with_smooth else None
    ours = w4a16_linear(x, qw, s, z, b, group_size=group_size, smooth=sm)
    assert ours.shape == (2, M, N)
    _rule(ours, lambda xx: w4a16_linear_ref(xx, qw, s, z, b.to(xx.dtype), group_size=group_size, smooth=sm,
                                            upcast=xx.dtype == torch.float32), x, atol,
          f"w4a16 {dtype} {M}x{K}x{N} g={group_size} smooth={with_smooth}")


def test_w4a16_errors():
    x = torch.randn(3, 64)
    qw, s, z = quantize_w4(torch.randn(8, 64), 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        w4a16_linear(x, qw, s, z, group_size=24)
    with pytest.raises(ValueError, match="qweight"):
        w4a16_linear(torch.randn(3, 72), qw, s, z, group_size=32)
    with pytest.raises(ValueError, match="zeros"):
        w4a16_linear(x, qw, s, z.int(), group_size=32)
    with pytest.raises(TypeError):
        w4a16_linear(x.double(), qw, s, z, group_size=32)


def test_w4a16_configs_divide_group_size():
    for gs in (16, 32, 128):
        for c in w4a16_configs(torch.device("cpu"), gs):
            assert gs % c.kwargs["BLOCK_K"] == 0


# ------------------------------------------------------------------------------------------
# AWQ and GPTQ
# ------------------------------------------------------------------------------------------
def _correlated_inputs(n, K, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, K // 4, generator=g) @ torch.randn(K // 4, K, generator=g)
    x = base + 0.1 * torch.randn(n, K, generator=g)
    x = x * torch.logspace(-0.5, 0.7, K)[torch.randperm(K, generator=g)]  # salient channels
    return x


def _rtn_error(w, x, group_size):
    q, s, z = quantize_int4_groups(w, group_size)
    g = torch.arange(w.shape[1]) // group_size
    wq = (q.float() - z.float()[:, g]) * s[:, g]
    return (x @ wq.t() - x @ w.t()).pow(2).mean().item()


def test_awq_not_worse_than_rtn_and_reconstructs():
    x = _correlated_inputs(256, 64, 0)
    w = torch.randn(24, 64)
    s, r, losses = awq_search_scales(w, x.abs().mean(0), x, group_size=16, n_grid=10)
    assert len(losses) == 10 and min(losses) <= losses[0]  # grid point 0 is plain RTN
    assert losses[0] == pytest.approx(_rtn_error(w, x, 16), rel=1e-4)
    q, sc, z, smooth = awq_quantize(w, x.abs().mean(0), x, 16, n_grid=10)
    torch.testing.assert_close(smooth, 1.0 / s)
    g = torch.arange(64) // 16
    w_eff = (q.float() - z.float()[:, g]) * sc[:, g] * smooth[None, :]
    err = (x @ w_eff.t() - x @ w.t()).pow(2).mean().item()
    assert err == pytest.approx(min(losses), rel=1e-3)


def test_gptq_beats_round_to_nearest():
    K, group_size = 96, 32
    x = _correlated_inputs(512, K, 1)
    w = torch.randn(40, K)
    H = 2 * x.t() @ x / x.shape[0]
    q, s, z = gptq_quantize(w, H, group_size=group_size, block_size=48)  # blocks not aligned to groups
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and s.shape == (40, 3)
    g = torch.arange(K) // group_size
    wq = (q.float() - z.float()[:, g]) * s[:, g]
    gptq_err = (x @ wq.t() - x @ w.t()).pow(2).mean().item()
    assert gptq_err < 0.7 * _rtn_error(w, x, group_size)


def test_gptq_partial_last_group_and_dead_inputs():
    K = 40  # groups of 16: 16 + 16 + 8
    x = _correlated_inputs(128, K, 2)
    x[:, 5] = 0.0  # dead input channel
    H = x.t() @ x
    q, s, z = gptq_quantize(torch.randn(8, K), H, group_size=16)
    assert s.shape == (8, 3) and torch.isfinite(s).all()
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize(torch.randn(8, K), torch.eye(K + 1))


# ------------------------------------------------------------------------------------------
# LLM.int8()
# ------------------------------------------------------------------------------------------
def _outlier_x(M, K, dtype):
    x = torch.randn(M, K)
    x[:, 5] *= 20.0
    x[3, K - 2] = -9.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.float16, 2e-3)])
@pytest.mark.parametrize("M,K,N", [(37, 101, 45), (8, 64, 16)])
def test_int8_outlier_matches_reference(dtype, atol, M, K, N):
    x = _outlier_x(M, K, dtype)
    w = torch.randn(N, K)
    b = torch.randn(N)
    qw, ws = quantize_weight_per_channel(w)
    assert outlier_columns(x).nonzero().flatten().tolist() == [5, K - 2]
    ours = int8_outlier_linear(x, qw, ws, b)
    _rule(ours, lambda xx: int8_outlier_linear_ref(xx, qw, ws, b), x, atol, f"int8 outlier {dtype} {M}x{K}x{N}")


def test_int8_outlier_beats_plain_int8_and_static_mask():
    x = _outlier_x(40, 96, torch.float32)
    w = torch.randn(24, 96)
    qw, ws = quantize_weight_per_channel(w)
    exact = x @ (qw.float() * ws[:, None]).t()
    plain = w8a8_linear_ref(x, qw, ws)
    ours = int8_outlier_linear(x, qw, ws)
    assert (ours - exact).norm() < 0.5 * (plain - exact).norm()
    # a static mask (from calibration) gives the same result as the dynamic one when they agree
    mask = outlier_columns(x)
    torch.testing.assert_close(int8_outlier_linear(x, qw, ws, outlier_mask=mask), ours)
    # no outliers at all: the int8 part alone, identical to W8A8 without smoothing
    small = torch.randn(40, 96)
    torch.testing.assert_close(int8_outlier_linear(small, qw, ws), w8a8_linear(small, qw, ws), atol=1e-4, rtol=1e-4)


def test_int8_outlier_errors():
    with pytest.raises(ValueError, match="outlier_mask"):
        int8_outlier_linear(torch.randn(3, 8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4),
                            outlier_mask=torch.zeros(7, dtype=torch.bool))
    with pytest.raises(ValueError, match="int8"):
        int8_outlier_linear(torch.randn(3, 8), torch.zeros(4, 8), torch.ones(4))
