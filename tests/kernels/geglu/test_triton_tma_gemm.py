"""kernels.geglu.triton_tma_gemm (TMA GEMM with the GEGLU epilogue) against its fp32 reference on the CPU under
TRITON_INTERPRET=1 (where each program runs one tile: the persistent tile walk runs in the GPU file): partial tiles
in M, N and K, bias or none, SD's real K and N with few rows, both product variants; what it refuses. The choice
between it and cuBLAS is test_projection.py's; the GPU file runs every config at the real SD shapes."""

import pytest
import torch

from kernels.geglu.ref import geglu_linear_ref
from kernels.geglu.triton_tma_gemm import TileConfig, geglu_linear, unsupported
from kernels.testing import assert_close_rule, poison

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
