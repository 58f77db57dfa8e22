"""Exact (erf) GELU for Triton epilogues, without libdevice's ``erff``.

``gelu(x) = x * Phi(x)`` with ``Phi(x) = erfc(-x / sqrt(2)) / 2``, and ``erfc(z)`` for ``z = |x| / sqrt(2)`` from
Numerical Recipes' ``erfcc`` (Press et al., Numerical Recipes in C, 2nd ed., section 6.2): a Chebyshev fit
``t * exp(-z^2 + P(t))``, ``t = 1 / (1 + z / 2)``, P of degree 9, whose relative error is below 1.2e-7 for every
z >= 0. So ``Phi`` keeps that relative accuracy down to the far negative tail (what fp16 GELU outputs of small
magnitude need), and on x >= 0 its absolute error is below 6e-8. Evaluated in fp32, the exponent's rounding (its
argument reaches ~140 at x = -14) adds relative errors of a few 1e-6 on [-5, -1] and up to 2e-5 near x = -13 (fp16's
half ulp is 2.4e-4; the ``1 + erf`` form it replaces has no correct digit there).

Why not ``tl.math.erf``: libdevice's ``erff`` blends two polynomials by a branch-free select, so its coefficients
live in registers. Inside a GEMM epilogue whose accumulators hold most registers, the compiler reloads them per
element: the GEGLU TMA GEMM's epilogue ran about 50 instructions per output, a dozen of them moves (SASS, sm_90), and
that epilogue, not the MMAs, set the kernel's time (Nsight Compute: the tensor pipe mostly idle). Here every
coefficient is an FFMA immediate: one approximate reciprocal, nine FFMAs, one exp2 and a select. The GEGLU GEMMs
measured faster with it on sm_90 (README; ``benchmarks/results/h200-2026-12-01-run18/``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.dispatch import interpret_mode

LOG2E = 1.4426950408889634
SQRT1_2 = 0.7071067811865476


# erfcc's coefficients (highest degree first) times log2(e), so the polynomial lands in exp2's base; the constant
# term also carries the 1/2 of Phi = erfc / 2 (log2(1/2) = -1)
_C = (0.24651729790196045, -1.1861149450768025, 2.147474463933521, -1.637753152343414, 0.40232158165127635,
      -0.2687568603388257, 0.1396300565225048, 0.5397006155284324, 1.4427292039075317, -2.825748218405333)


# Triton's interpreter (CPU tests) has no libdevice: it divides instead. Read once at import, as the kernels are.
_INTERPRET = tl.constexpr(interpret_mode())


@triton.jit
def _reciprocal(d):
    """1 / d for d >= 1: the approximate MUFU reciprocal on the GPU (relative error about 1e-7)."""
    if _INTERPRET:
        return 1.0 / d
    else:
        return libdevice.fast_dividef(1.0, d)


@triton.jit
def gelu_erf(x):
    """Exact GELU of an fp32 tensor, ``x * Phi(x)`` (module docstring: the erfc fit and its accuracy)."""
    z = tl.abs(x) * 0.7071067811865476
    t = _reciprocal(1.0 + 0.5 * z)
    p = 0.24651729790196045
    p = p * t - 1.1861149450768025
    p = p * t + 2.147474463933521
    p = p * t - 1.637753152343414
    p = p * t + 0.40232158165127635
    p = p * t - 0.2687568603388257
    p = p * t + 0.1396300565225048
    p = p * t + 0.5397006155284324
    p = p * t + 1.4427292039075317
    p = p * t - 2.825748218405333
    half_erfc = t * tl.math.exp2((z * -1.4426950408889634) * z + p)  # erfc(z) / 2 = Phi(-|x|)
    phi = tl.where(x >= 0.0, 1.0 - half_erfc, half_erfc)
    return x * phi


def gelu_erf_ref(x: torch.Tensor) -> torch.Tensor:
    """The same fit in PyTorch (fp64 math), for tests: ``x * Phi(x)`` through ``erfcc``. x: any shape, any float
    dtype; returns fp64."""
    x = x.double()
    z = x.abs() * SQRT1_2
    t = 1.0 / (1.0 + 0.5 * z)
    p = torch.full_like(t, _C[0])
    for c in _C[1:]:
        p = p * t + c
    half_erfc = t * torch.exp2(p - z * z * LOG2E)
    return x * torch.where(x >= 0, 1.0 - half_erfc, half_erfc)


__all__ = ["gelu_erf", "gelu_erf_ref"]
