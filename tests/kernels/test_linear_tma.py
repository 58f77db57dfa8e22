"""kernels.gemm.linear_tma (TMA GEMM with bias and residual in its epilogue) against its fp32 reference on the CPU
under TRITON_INTERPRET=1 (one tile per program): partial tiles in M, N and K, bias and residual present or not,
SD's real K/N pairs with few rows; what it refuses. The GPU file runs every config at SD's shapes."""

import pytest
import torch

from kernels.gemm.linear_tma import LinearTile, linear_ref, linear_tma, unsupported
from kernels.testing import assert_close_rule

SMALL = LinearTile(32, 32, 32, 1, 4, group_m=2)


def _inputs(M, K, N, dtype=torch.float16):
    x = torch.randn(M, K).to(dtype)
    w = (torch.randn(N, K) / K**0.5).to(dtype)
    b = (torch.randn(N) * 0.5).to(dtype)
    r = torch.randn(M, N).to(dtype)
    return x, w, b, r


@pytest.mark.parametrize("M,K,N", [(37, 40, 24), (64, 64, 32), (5, 320, 320), (3, 640, 1920), (70, 48, 96)])
@pytest.mark.parametrize("bias,residual", [(True, False), (False, False), (True, True), (False, True)])
def test_matches_reference(M, K, N, bias, residual):
    x, w, b, r = _inputs(M, K, N)
    b, r = (b if bias else None), (r if residual else None)
    out = linear_tma(x, w, b, r, config=SMALL)
    assert out.shape == (M, N) and out.dtype == x.dtype
    ref32 = linear_ref(x.float(), w.float(), None if b is None else b.float(), None if r is None else r.float())
    lowp = torch.nn.functional.linear(x, w, b) + (0 if r is None else r)
    assert_close_rule(out, ref32, lowp, 2e-3, f"linear_tma {M}x{K}x{N} bias={bias} residual={residual}")


def test_leading_dims_and_residual_view():
    """(B, L, K) input, and a residual that is the token view of a channels_last (B, C, H, W) tensor."""
    x = torch.randn(2, 16, 64).half()
    w = (torch.randn(32, 64) / 8).half()
    res_nchw = torch.randn(2, 32, 4, 4).half().contiguous(memory_format=torch.channels_last)
    res = res_nchw.permute(0, 2, 3, 1).reshape(2, 16, 32)  # no copy: channels_last memory is the token matrix
    out = linear_tma(x, w, None, res, config=SMALL)
    assert out.shape == (2, 16, 32)
    ref = linear_ref(x, w, None, res)
    assert (out.float() - ref.float()).abs().max() < 2e-2


def test_refusals():
    x, w, b, r = _inputs(8, 40, 24)
    with pytest.raises(ValueError, match="bias"):
        linear_tma(x, w, b[:5])
    with pytest.raises(ValueError, match="residual"):
        linear_tma(x, w, b, r[:, :5])
    assert "multiples of 8" in unsupported(x[:, :36], w[:, :36], b)
    assert "contiguous" in unsupported(x.t().contiguous().t(), w, b)
    assert "residual" in unsupported(x, w, b, r.float())
    assert "fp16 or bf16" in unsupported(x.float(), w.float(), b.float())
