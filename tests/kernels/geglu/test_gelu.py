"""The exact-GELU device function of the epilogues (``kernels.geglu.gelu.gelu_erf``) against erf in fp64."""

import pytest
import torch
import triton
import triton.language as tl

from kernels.geglu.gelu import gelu_erf, gelu_erf_ref


def _exact(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x * 0.5 * torch.erfc(-x / 2**0.5)


@triton.jit
def _gelu_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, gelu_erf(tl.load(x_ptr + offs)))


def test_fit_relative_error_everywhere():
    """erfcc's published bound (relative error < 1.2e-7), on the GELU itself, tails included."""
    x = torch.linspace(-14.0, 14.0, 280001, dtype=torch.float64)
    exact = _exact(x)
    keep = exact.abs() > 1e-300
    rel = (gelu_erf_ref(x) - exact).abs()[keep] / exact.abs()[keep]
    assert rel.max().item() < 1.2e-7


@pytest.mark.parametrize("lo,hi", [(-6.0, 6.0), (-14.0, -4.0), (-1e-3, 1e-3), (4.0, 60.0)])
def test_kernel_matches_erf_gelu(lo, hi):
    """The Triton function in fp32 (interpreter) against the exact GELU, on the bulk, the negative tail, near zero
    and the large positive side. The bound is fp32's: exp2's argument (up to ~140 in the tail) carries a relative
    rounding of 6e-8, so a few 1e-6; fp16 outputs need 2.4e-4. (The ``0.5 x (1 + erf(x / sqrt 2))`` form it replaces
    cancels in that tail: 1 + erf(-3.5) = erfc(3.5) = 7.4e-7, from fp32 numbers near -1.)"""
    x = torch.linspace(lo, hi, 4096, dtype=torch.float32)
    out = torch.empty_like(x)
    _gelu_kernel[(1,)](x, out, N=4096)
    exact = _exact(x)
    rel = (out.double() - exact).abs() / exact.abs().clamp_min(1e-30)
    assert rel.max().item() < 2e-5, (lo, hi, rel.max().item())


def test_special_values():
    x = torch.tensor([0.0, -0.0, float("inf"), float("nan"), -100.0, 100.0] + [0.0] * 10, dtype=torch.float32)
    out = torch.empty_like(x)
    _gelu_kernel[(1,)](x, out, N=16)
    assert out[0] == 0 and out[1] == 0 and out[2] == float("inf") and torch.isnan(out[3])
    assert out[4] == 0 and out[5] == 100.0
