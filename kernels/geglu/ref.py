"""Plain-PyTorch references of GEGLU (diffusers' ``GEGLU``: ``a, g = proj(x).chunk(2, -1); a * gelu(g)``).

* :func:`geglu_ref`: the activation alone, ``h (..., 2D) -> (..., D)``, what :func:`kernels.geglu.geglu` computes;
* :func:`geglu_linear_ref`: projection and activation, what the TMA GEMM (``kernels.geglu.triton_tma_gemm``) and
  :func:`kernels.geglu.projection.geglu_projection` compute.

Both use the exact (erf) GELU of ``F.gelu``. Method: Shazeer 2020, "GLU Variants Improve Transformer"; GELU:
Hendrycks & Gimpel 2016.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def geglu_ref(h: torch.Tensor, *, upcast: bool = True) -> torch.Tensor:
    """Plain-PyTorch GEGLU: h (..., 2D) -> (..., D) = ``a * gelu(g)``, ``a, g = h.chunk(2, -1)``.

    With ``upcast`` the math runs in fp32 and the result is cast to h.dtype.
    """
    dt = h.dtype
    hidden, gate = h.chunk(2, dim=-1)
    if upcast:
        cdt = torch.promote_types(dt, torch.float32)
        hidden, gate = hidden.to(cdt), gate.to(cdt)
    return (hidden * F.gelu(gate)).to(dt)


def geglu_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     upcast: bool = True) -> torch.Tensor:
    """Plain PyTorch: ``a * gelu(g)`` with ``a, g = (x @ weight^T + bias).chunk(2, -1)``.

    x: (..., K); weight: (2N, K); bias: (2N,) or None. With ``upcast`` the math runs in fp32, else in ``x.dtype``
    (the "torch low precision" baseline of the tests' tolerance rule). Returns (..., N) in ``x.dtype``."""
    ct = torch.float32 if upcast else x.dtype
    y = F.linear(x.to(ct), weight.to(ct), None if bias is None else bias.to(ct))
    a, g = y.chunk(2, dim=-1)
    return (a * F.gelu(g)).to(x.dtype)


def geglu_linear_fp8_ref(q: torch.Tensor, qweight: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None = None, *, out_scale_inv: torch.Tensor | None = None,
                         out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Plain PyTorch in float64 of :func:`kernels.geglu.triton_tma_gemm.geglu_linear_fp8`: ``a * gelu(g)`` of
    ``(q * a_scale) @ (qweight * w_scale)^T + bias``; with ``out_scale_inv`` saturated to +-448 after the multiply
    and cast to ``float8_e4m3fn`` (nearest, ties to even), else cast to ``out_dtype``.

    q: (..., K) float8_e4m3fn; qweight: (2N, K) float8_e4m3fn; a_scale, w_scale, out_scale_inv: 0-dim fp32;
    bias: (2N,) or None. Returns (..., N)."""
    s = a_scale.double() * w_scale.double()
    y = (q.double() @ qweight.double().t()) * s
    if bias is not None:
        y = y + bias.double()
    a, g = y.chunk(2, dim=-1)
    y = a * F.gelu(g)
    if out_scale_inv is None:
        return y.to(out_dtype)
    return (y * out_scale_inv.double()).clamp(-448.0, 448.0).float().to(torch.float8_e4m3fn)


__all__ = ["geglu_ref", "geglu_linear_ref", "geglu_linear_fp8_ref"]
