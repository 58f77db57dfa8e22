"""GEGLU activation kernel: ``h (..., 2D) -> h[..., :D] * gelu(h[..., D:])`` with the exact (erf) GELU.

This is the activation half of diffusers' ``GEGLU`` (``hidden, gate = proj(x).chunk(2, -1);
hidden * F.gelu(gate)``) as one memory pass: read 2D, write D per row, math in fp32; its launch config
(:func:`geglu_config`) and the ``torch.ops.sdfast.geglu`` custom op. The reference is ``kernels.geglu.ref``; the
version fused into the projection GEMM's epilogue is ``kernels.geglu.triton_tma_gemm``.
Method: Shazeer 2020, "GLU Variants Improve Transformer"; GELU: Hendrycks & Gimpel 2016.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import use_triton
from kernels.geglu.gelu import gelu_erf
from kernels.geglu.ref import geglu_ref

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _geglu_kernel(
    h_ptr,  # (M, 2D) input, row stride shm, unit column stride
    out_ptr,  # (M, D) output, contiguous
    M,
    D,
    shm,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    h_offs = rows[:, None] * shm + cols[None, :]
    a = tl.load(h_ptr + h_offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(h_ptr + h_offs + D, mask=mask, other=0.0).to(tl.float32)
    y = a * gelu_erf(g)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------
def geglu_config(M: int, D: int) -> dict:
    """Column block: the largest power of two <= 1024 that divides D (no masked lanes on SD's widths,
    e.g. 1280 -> 256, 5120 -> 1024), else the padded width; rows fill a 1024-element tile; 2 warps.

    Over one UNet step's GEGLU calls this measured within 2 % of the best config per shape and faster than
    4096-element tiles of 4 warps (``python -m benchmarks.ops.geglu sweep`` on sm_90; ``benchmarks/results/h200-2026-11-30-run13/``)."""
    block_d = 1024
    while block_d > 64 and D % block_d:
        block_d //= 2
    if D % block_d:
        block_d = min(1024, 1 << max(0, (D - 1).bit_length()))
    rows = max(1, min(1 << max(0, (M - 1).bit_length()), 1024 // block_d))
    return {"ROWS": rows, "BLOCK_D": block_d, "num_warps": 2}


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------
def _check_inputs(h) -> None:
    if not isinstance(h, torch.Tensor) or h.dim() < 1:
        raise ValueError(f"geglu: h must be (..., 2D), got {getattr(h, 'shape', type(h).__name__)}")
    if h.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"geglu: h dtype {h.dtype} not supported; use one of {_SUPPORTED_DTYPES}")
    if h.shape[-1] % 2:
        raise ValueError(f"geglu: the last dim must be even (2D), got {h.shape[-1]}")


def _geglu_impl(h: torch.Tensor) -> torch.Tensor:
    _check_inputs(h)
    if not use_triton("geglu", h):
        return geglu_ref(h)
    D = h.shape[-1] // 2
    out = torch.empty((*h.shape[:-1], D), dtype=h.dtype, device=h.device)
    if out.numel() == 0:
        return out
    if h.stride(-1) != 1:
        raise ValueError(f"geglu: h must have a contiguous last dim, got strides {h.stride()}")
    try:
        h2 = h.view(-1, 2 * D)
    except RuntimeError as e:
        raise ValueError(f"geglu: h of shape {tuple(h.shape)} strides {h.stride()} cannot be viewed as rows") from e
    M = h2.shape[0]
    cfg = geglu_config(M, D)
    grid = (triton.cdiv(M, cfg["ROWS"]), triton.cdiv(D, cfg["BLOCK_D"]))
    _geglu_kernel[grid](
        h2, out, M, D, h2.stride(0), ROWS=cfg["ROWS"], BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"]
    )
    return out


# --------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("sdfast::geglu", mutates_args=())
def _geglu_op(h: torch.Tensor) -> torch.Tensor:
    return _geglu_impl(h)


@_geglu_op.register_fake
def _geglu_fake(h):
    _check_inputs(h)
    return h.new_empty((*h.shape[:-1], h.shape[-1] // 2))


def geglu(h: torch.Tensor) -> torch.Tensor:
    """GEGLU: h (..., 2D) fp16/bf16/fp32 with a contiguous last dim -> (..., D) contiguous, h's dtype;
    ``h[..., :D] * gelu(h[..., D:])`` with the exact erf GELU (diffusers' ``GEGLU``), fp32 math.

    Raises ValueError (odd last dim, non-unit last stride) or TypeError (dtype). Falls back to the
    PyTorch reference where Triton cannot run. Registered as ``torch.ops.sdfast.geglu``.
    """
    return torch.ops.sdfast.geglu(h)


__all__ = ["geglu", "geglu_config"]
