"""Shared comparison helpers for kernel tests: flash-attention's tolerance rule (its tests compare the kernel and
PyTorch in low precision against an fp32 reference: ``max|ours - ref32| <= 2 * max|torch_lowp - ref32| + atol``)."""

from __future__ import annotations

import torch


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (floating) in place, so an element a kernel forgot to write is caught."""
    return t.fill_(float("nan"))


def poison_allocator(nbytes: int, device: str = "cuda") -> None:
    """Fill a freed block of the caching allocator with NaN so the next allocations of that size class
    start as NaN (fp16/bf16/fp32 NaN bit patterns all come from 0xFF bytes)."""
    t = torch.empty(nbytes, dtype=torch.uint8, device=device)
    t.fill_(0xFF)
    del t


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def assert_close_rule(
    ours: torch.Tensor,
    ref32: torch.Tensor,
    torch_lowp: torch.Tensor,
    atol: float,
    name: str = "",
) -> None:
    """Assert ``max|ours - ref32| <= 2 * max|torch_lowp - ref32| + atol`` and that no element is NaN/Inf.

    ``ref32`` is the reference computed in fp32 (or fp64); ``torch_lowp`` is the same reference
    computed in the low-precision dtype under test. Raises ``AssertionError`` with the figures.
    """
    assert ours.shape == ref32.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref32.shape)}"
    assert torch.isfinite(ours).all(), f"{name}: output has NaN/Inf (unwritten or overflowed elements)"
    err = max_abs_err(ours, ref32)
    base = max_abs_err(torch_lowp, ref32)
    bound = 2 * base + atol
    assert err <= bound, f"{name}: max|ours-ref32|={err:.3e} > 2*{base:.3e}+{atol:.1e}={bound:.3e}"



def e4m3_far(ours: torch.Tensor, ref: torch.Tensor, atol: float = 0.0) -> torch.Tensor:
    """Mask of the elements of two ``float8_e4m3fn`` tensors (or their float values) more than one E4M3 grid step
    (the spacing at ``ref``'s magnitude: 2^(e-3) in the binade [2^e, 2^(e+1)), 2^-9 among the subnormals) plus
    ``atol`` apart: a kernel and its reference summing in different orders may round to neighbouring values."""
    o, r = ours.float(), ref.float()
    step = torch.exp2(torch.floor(torch.log2(r.abs().clamp_min(2.0**-6))) - 3)
    return ~((o - r).abs() <= step + atol) & ~(o.isnan() & r.isnan())  # a NaN on one side only is far
