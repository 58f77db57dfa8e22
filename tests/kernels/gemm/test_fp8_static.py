"""FP8 static per-tensor quantization (``kernels.gemm.fp8_static``) against its reference: the quantize kernel
in Triton's interpreter (every E4M3 value, every rounding tie, saturation, subnormals, smoothing, input dtypes
and strides), the GEMM wrapper's CPU reference path and the launchers' errors. The GPU side (bit-exactness
against torch's cast, cuBLASLt against the reference at SD's shapes) is in test_gemm_gpu.py."""

import pytest
import torch

from kernels.gemm.fp8_static import FP8, fp8_linear, quantize_static, quantize_static_ref


def _grid_and_ties() -> torch.Tensor:
    """Every finite E4M3 value and every midpoint between neighbours (the ties of round-to-nearest-even)."""
    vals = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    vals = vals[torch.isfinite(vals)].unique().sort().values
    return torch.cat([vals, (vals[1:] + vals[:-1]) / 2])


def _assert_same_values(q: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal as values (the interpreter drops the sign of zero; the GPU test checks the bits)."""
    assert q.dtype == FP8 and ref.dtype == FP8 and q.shape == ref.shape and q.is_contiguous()
    a, b = q.float(), ref.float()
    bad = a != b
    assert not bad.any(), f"{int(bad.sum())} of {q.numel()} differ, e.g. {a[bad][:4].tolist()} vs {b[bad][:4].tolist()}"


def test_quantize_every_value_tie_and_saturation():
    x = torch.cat([
        _grid_and_ties(),
        torch.tensor([448.0, 449.0, 463.9, 464.0, 1e6, -1e6, float("inf"), -float("inf"), 0.0, -0.0]),
        torch.randn(3000) * 100, torch.randn(500) * 1e-3, torch.rand(200) * 2**-9,  # subnormals and below
    ])
    x = x[: x.numel() // 16 * 16].reshape(-1, 16)
    inv = torch.tensor(1.0)
    _assert_same_values(quantize_static(x, inv), quantize_static_ref(x, inv))
    assert quantize_static(x, inv).float().abs().max() == 448.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,K", [(1, 16), (37, 48), (130, 320)])
def test_quantize_scale_smooth_dtypes(dtype, M, K):
    x = (torch.randn(M, K) * 20).to(dtype)
    inv = torch.tensor(1 / 0.37)
    sm = torch.rand(K) + 0.5
    _assert_same_values(quantize_static(x, inv), quantize_static_ref(x, inv))
    _assert_same_values(quantize_static(x, inv, sm), quantize_static_ref(x, inv, sm))


def test_quantize_non_contiguous_input():
    x = torch.randn(64, 40)[:, 4:36] * 30  # rows of 32 with a 40-element stride
    inv = torch.tensor(2.0)
    _assert_same_values(quantize_static(x, inv), quantize_static_ref(x, inv))


def test_quantize_errors():
    inv = torch.tensor(1.0)
    with pytest.raises(ValueError, match="M, K"):
        quantize_static(torch.randn(2, 3, 16), inv)
    with pytest.raises(TypeError, match="dtype"):
        quantize_static(torch.ones(2, 16, dtype=torch.int32), inv)
    with pytest.raises(TypeError, match="inv_scale"):
        quantize_static(torch.randn(2, 16), torch.ones(1))
    with pytest.raises(TypeError, match="inv_scale"):
        quantize_static(torch.randn(2, 16), torch.tensor(1.0, dtype=torch.float16))
    with pytest.raises(ValueError, match="smooth"):
        quantize_static(torch.randn(2, 16), inv, torch.ones(8))


def _operands(M, K, N):
    x = torch.randn(M, K)
    w = torch.randn(N, K) / K**0.5
    sa = (x.abs().amax() / 448).reshape(())
    sw = (w.abs().amax() / 448).reshape(())
    return quantize_static_ref(x, 1 / sa), quantize_static_ref(w, 1 / sw), sa, sw, x, w


def test_fp8_linear_cpu_reference_path():
    """On CPU tensors fp8_linear is its reference (the dispatch; the GPU test compares cuBLASLt with it): check the
    reference's arithmetic against the unquantized product and a hand-dequantized one."""
    q, qw, sa, sw, x, w = _operands(33, 64, 48)
    b = torch.randn(48)
    y = fp8_linear(q, qw, sa, sw, b, out_dtype=torch.float32)
    hand = torch.stack([torch.stack([(q[i].float() * sa * qw[j].float() * sw).sum() for j in range(48)]) for i in range(33)])
    torch.testing.assert_close(y, hand + b, rtol=1e-5, atol=1e-5)
    # the quantization error of per-tensor E4M3 on Gaussian data: a few percent
    ref = x @ w.t() + b
    assert ((y - ref).norm() / ref.norm()).item() < 0.06
    assert fp8_linear(q, qw, sa, sw, None, out_dtype=torch.float16).dtype == torch.float16


def test_fp8_linear_errors():
    q, qw, sa, sw, _, _ = _operands(8, 32, 16)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_linear(q[:, :24], qw[:, :24], sa, sw)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_linear(q, torch.cat([qw, qw[:8]]), sa, sw)
    with pytest.raises(TypeError, match="float8"):
        fp8_linear(q.float(), qw, sa, sw)
    with pytest.raises(ValueError, match="0-dim"):
        fp8_linear(q, qw, sa.reshape(1), sw)
    with pytest.raises(ValueError, match="bias"):
        fp8_linear(q, qw, sa, sw, torch.zeros(8))
    with pytest.raises(ValueError, match="expected"):
        fp8_linear(q, qw[:, :16], sa, sw)
