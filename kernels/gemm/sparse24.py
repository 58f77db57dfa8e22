"""2:4 structured sparsity for linear layers: pruning, compression, and a sparse linear that runs
on the GPU's sparse tensor cores when (and only when) that is measured to be faster than dense.

2:4 ("semi-structured") sparsity keeps two non-zeros in every group of four consecutive weights
along the reduction dimension K. Ampere and Hopper tensor cores skip the zeros (``mma.sp``), for up
to twice the dense rate (NVIDIA, "Accelerating Sparse Deep Neural Networks", Mishra et al. 2021).

Layout conventions (all of this module):

- ``weight: (N, K)`` as in ``nn.Linear`` (N = out_features, K = in_features); groups of four run
  along K: elements ``weight[n, 4g : 4g + 4]`` form group ``g`` of row ``n``.
- ``x: (..., K)``, output ``(..., N)``, i.e. ``y = x @ weight.T + bias``.
- Dtypes: pruning/compression any float dtype; hardware backends float16/bfloat16; the Triton
  kernel float16/bfloat16/float32 (bf16 is tested on the GPU only: Triton 3.6's interpreter
  computes bf16 ``tl.dot`` on raw bits). K is a ``constexpr`` of the kernel (one compile per K;
  a runtime loop bound breaks the interpreter under numpy >= 2.4).
- K must be a multiple of 4. A weight whose K is not raises ``ValueError``: we do not pad, because
  every linear of SD 1.x/2.x/SDXL has K a multiple of 64, and the hardware backends need K to be a
  multiple of 16 (cuSPARSELt) or 64 (CUTLASS) anyway. The pass (``sdfast.passes.sparsity``) skips
  such layers instead of calling these functions.

Our compressed format (``compress_24`` / ``decompress_24``; what the Triton kernel reads):

- ``values: (N, K // 2)``, same dtype as the weight: the two kept elements of each group, in
  ascending column order (``values[n, 2g]`` is the lower column of group ``g``).
- ``meta: (N, ceil(K / 8))`` uint8, 2 bits per kept element: the in-group index (0..3) of each kept
  element. Byte ``b`` of row ``n`` holds groups ``2b`` (low nibble) and ``2b + 1`` (high nibble);
  within a nibble, bits 1:0 are the index of the first kept element and bits 3:2 that of the second
  (so ``idx0 < idx1``). When K % 8 == 4 the last high nibble is 0 and unused.
- A group with fewer than two non-zeros (a kept weight that is exactly 0) keeps the non-zero one(s)
  plus the lowest zero positions, so the format is total and the round trip is exact.

This is the logical layout of NVIDIA's metadata (a 4-bit code per group of four, 2 bits per index)
without the hardware's reordering/interleaving; the hardware layouts come from torch:
``to_semi_structured`` (cuSPARSELt's opaque compressed buffer via ``torch._cslt_compress``, or
CUTLASS's reordered int16 metadata) and ``to_cutlass_format``.

Why torch's default 2:4 path was 15-40x slower than dense on the H200 (see DESIGN.md and
``benchmarks/kernel_benches/sparse.py``, which measures each point):

1. Host overhead: every ``torch._cslt_sparse_mm`` call rebuilds all cuSPARSELt descriptors and the
   matmul plan (``cusparseLtMatmulPlanInit``) and allocates a workspace; the PyTorch PR that caches
   plans (pytorch/pytorch#179642) reports 50-200 us of CPU per call. ``nn.Linear`` with a
   ``SparseSemiStructuredTensor`` weight adds ``__torch_dispatch__`` and a custom-op hop on top.
   Eager timing (``do_bench`` records events around each call) therefore measures the CPU, not
   the GPU. Inside a CUDA graph (which sdfast uses for the UNet) that cost disappears, so
   ``SparseLinear`` times candidates by default in a CUDA graph (``timing="graph"``).
2. Algorithm selection: the default ``alg_id=0`` is not tuned for the shape; we run cuSPARSELt's
   search (``torch._C._cusparselt.mm_search`` / ``torch._cslt_sparse_mm_search``) per shape with
   the layer's real M, bias and layout, and keep split-K settings it finds.
3. Operand order and layout: the hardware sparse operand is the LEFT one. For ``y = x W^T`` we
   compute ``y^T = W_s x^T`` with ``x^T`` passed as a transposed view of the contiguous ``x``
   (K-major, no copy) and ask cuSPARSELt for a transposed result so ``y`` comes out ``(M, N)``
   row-major with no extra copy; bias is fused (``_cslt_sparse_mm(..., bias=...)``).
4. Alignment/dtype: fp16/bf16 only; N, K multiples of the backend's minimum (read from torch's
   ``_DTYPE_SHAPE_CONSTRAINTS``); M is padded to a multiple of 8 when needed (SD's text-token rows,
   2 x 77 = 154, are the only such case; those GEMMs are tiny and stay dense anyway).
5. CUTLASS (``_FORCE_CUTLASS`` / ``SparseSemiStructuredTensorCUTLASS``) runs Ampere-generation
   ``mma.sp`` kernels, which on Hopper compete with cuBLAS's ``wgmma`` dense kernels; it is
   measured, not assumed.

Sources: SparseGPT, Frantar & Alistarh, "SparseGPT: Massive Language Models Can Be Accurately
Pruned in One-Shot", ICML 2023 (IST-DASLab/sparsegpt); Optimal Brain Surgeon, Hassibi & Stork 1993;
PyTorch ``torch.sparse.semi_structured``; NVIDIA cuSPARSELt documentation.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import math
import os
import warnings
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import precompile
from kernels.dispatch import log_fallback, use_triton
from kernels.gemm.sparsegpt_block import sparsegpt_block

try:  # triton is installed in CI and on the GPU machine; the reference path works without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

log = logging.getLogger("sdfast.kernels")

__all__ = [
    "shape_decisions",
    "prune_24_magnitude",
    "mask_24_from_scores",
    "is_24_sparse",
    "sparsegpt_prune_24",
    "compress_24",
    "decompress_24",
    "meta_to_indices",
    "to_cutlass_format",
    "from_cutlass_format",
    "to_semi_structured",
    "sparse24_linear_ref",
    "sparse24_linear",
    "sparse24_linear_configs",
    "CusparseltPlan",
    "cusparselt_available",
    "cusparselt_runtime_version",
    "backend_supports",
    "cusparselt_search",
    "cusparselt_search_enabled",
    "cusparselt_linear",
    "cutlass_linear",
    "time_us_eager",
    "time_us_graph",
    "clear_decisions",
    "SparseLinear",
]


# ----------------------------------------------------------------------------------------------
# Pruning
# ----------------------------------------------------------------------------------------------


def _check_weight(weight: torch.Tensor, what: str = "weight") -> tuple[int, int]:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"{what} must be 2-D (N, K) as in nn.Linear, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if k % 4 != 0:
        raise ValueError(
            f"2:4 sparsity groups four consecutive elements along K (in_features); {what} has "
            f"shape {tuple(weight.shape)} with K={k}, which is not a multiple of 4 (no padding is done)"
        )
    if not weight.is_floating_point():
        raise TypeError(f"{what} must be floating point (float32/float16/bfloat16/float64), got {weight.dtype}")
    return n, k


def mask_24_from_scores(scores: torch.Tensor) -> torch.Tensor:
    """Boolean keep-mask with exactly two ``True`` per group of four along the last dimension.

    scores: (N, K), K % 4 == 0; the two largest scores of each group ``[4g, 4g + 4)`` are kept
    (ties are broken by ``torch.topk``, deterministically for a given input and device).
    Returns a bool tensor of shape (N, K).
    """
    n, k = _check_weight(scores, "scores")
    groups = scores.reshape(n, k // 4, 4)
    keep = groups.topk(2, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return mask.reshape(n, k)


def prune_24_magnitude(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Magnitude 2:4 pruning: in every group of four consecutive K elements keep the two of largest |w|.

    weight: (N, K) as ``nn.Linear.weight`` (any float dtype, any device), K % 4 == 0.
    Returns ``(pruned, mask)``: ``pruned`` (N, K), same dtype/device, zero where ``mask`` is False;
    ``mask`` (N, K) bool with exactly two True per group. Raises ValueError/TypeError on a non-2-D
    weight, a K that is not a multiple of 4, or a non-float dtype.
    Source: Mishra et al. 2021 (NVIDIA ASP), the baseline pruning of the 2:4 sparse tensor cores.
    """
    _check_weight(weight)
    mask = mask_24_from_scores(weight.detach().abs().float())
    pruned = torch.where(mask, weight.detach(), torch.zeros((), dtype=weight.dtype, device=weight.device))
    return pruned, mask


def is_24_sparse(weight: torch.Tensor) -> bool:
    """True when every group of four consecutive K elements of ``weight`` (N, K) has at most two non-zeros."""
    n, k = _check_weight(weight)
    return bool(((weight.reshape(n, k // 4, 4) != 0).sum(-1) <= 2).all())


def sparsegpt_prune_24(
    weight: torch.Tensor,
    H: torch.Tensor,
    *,
    blocksize: int = 128,
    percdamp: float = 0.01,
    return_losses: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT one-shot 2:4 pruning with OBS error compensation (Frantar & Alistarh, ICML 2023).

    weight: (N, K) as ``nn.Linear.weight``, K % 4 == 0. H: (K, K) the layer's Hessian of the
    reconstruction loss, ``H = 2 X^T X / n`` accumulated over the calibration inputs X (n, K).
    Computes in float64 when ``weight`` or ``H`` is float64, else float32, on ``weight``'s device.

    Algorithm (column by column, lazily batched in blocks of ``blocksize`` columns; the loop inside a block
    is one Triton launch for float32, ``kernels.gemm.sparsegpt_block``):

    - dead inputs (``diag(H) == 0``) get ``H_jj = 1`` and ``W[:, j] = 0``; damping
      ``lambda = percdamp * mean(diag(H))`` is added to the diagonal;
    - ``U = cholesky(H^{-1})`` (upper); ``U_jj^2 = [(H_{F_j F_j})^{-1}]_jj`` where ``F_j`` are the
      columns not yet processed, so row j of U gives the Optimal-Brain-Surgeon update;
    - at the first column of each group of four, the 2:4 mask of the group is chosen per row from
      the current (already compensated) weights: prune the two smallest ``w^2 / U_jj^2``;
    - each column is quantized to its mask (pruned -> 0, kept -> unchanged) and the error
      ``(w - q) / U_jj`` is spread over the remaining columns with row j of U.

    Returns the pruned weight (N, K) in ``weight``'s dtype, 2:4 along K (at most two non-zeros per
    group; exactly two kept positions). With ``return_losses=True`` also returns ``losses: (N,)``,
    the OBS loss of each row, ``sum_j (w_j - q_j)^2 / (2 U_jj^2)``, which equals
    ``0.5 * (W - W_s)_r (H + lambda I) (W - W_s)_r^T`` exactly (each OBS step is the exact
    minimiser over the free columns, so the per-step increases add up; tested).

    Raises ValueError for a bad shape, a ``blocksize`` that is not a positive multiple of 4, a
    negative ``percdamp``, or a Hessian that is not positive definite after damping.
    """
    n, k = _check_weight(weight)
    if not isinstance(H, torch.Tensor) or tuple(H.shape) != (k, k):
        raise ValueError(f"H must be a (K, K) = ({k}, {k}) tensor, got {getattr(H, 'shape', type(H).__name__)}")
    if blocksize <= 0 or blocksize % 4 != 0:
        raise ValueError(f"blocksize must be a positive multiple of 4 (groups must not straddle blocks), got {blocksize}")
    if percdamp < 0:
        raise ValueError(f"percdamp must be >= 0, got {percdamp}")
    cdtype = torch.float64 if torch.float64 in (weight.dtype, H.dtype) else torch.float32
    W = weight.detach().to(cdtype).clone()
    Hm = H.detach().to(device=W.device, dtype=cdtype).clone()

    dead = torch.diagonal(Hm) == 0
    Hm[dead, dead] = 1.0
    W[:, dead] = 0.0
    damp = percdamp * torch.diagonal(Hm).mean()
    Hm.diagonal().add_(damp)
    L, info = torch.linalg.cholesky_ex(Hm)
    if int(info) != 0:
        raise ValueError(
            f"H + {percdamp} * mean(diag(H)) * I is not positive definite (cholesky failed at column {int(info)}); "
            "use more calibration samples or a larger percdamp"
        )
    Hinv = torch.cholesky_inverse(L)
    U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
    if int(info) != 0:
        raise ValueError("inverse Hessian is not positive definite in working precision; increase percdamp")

    losses = torch.zeros(n, dtype=cdtype, device=W.device)
    for b0 in range(0, k, blocksize):
        b1 = min(b0 + blocksize, k)
        W1 = W[:, b0:b1].clone()
        # the column-by-column OBS loop of this block: one Triton launch (fp32), or PyTorch (sparsegpt_block)
        Err1 = sparsegpt_block(W1, U[b0:b1, b0:b1], losses)
        W[:, b0:b1] = W1
        if b1 < k:
            W[:, b1:] -= Err1 @ U[b0:b1, b1:]
    pruned = W.to(weight.dtype)
    return (pruned, losses) if return_losses else pruned


# ----------------------------------------------------------------------------------------------
# Compression (our format) and hardware formats
# ----------------------------------------------------------------------------------------------


def _kept_indices(pruned: torch.Tensor) -> torch.Tensor:
    """(N, K/4, 2) int64 in-group indices (ascending) of the kept elements; raises if not 2:4."""
    n, k = pruned.shape
    nz = pruned.reshape(n, k // 4, 4) != 0
    if bool((nz.sum(-1) > 2).any()):
        bad = (nz.sum(-1) > 2).nonzero()[0].tolist()
        raise ValueError(
            f"weight is not 2:4 sparse: row {bad[0]}, group {bad[1]} (columns {4 * bad[1]}..{4 * bad[1] + 3}) "
            "has more than two non-zeros; prune it first (prune_24_magnitude / sparsegpt_prune_24)"
        )
    # non-zeros first, then the lowest positions: score = 8 * nonzero + (3 - position)
    pos = torch.arange(4, device=pruned.device)
    score = nz.to(torch.int64) * 8 + (3 - pos)
    idx = score.topk(2, dim=-1).indices
    return idx.sort(dim=-1).values


def compress_24(pruned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress a 2:4-sparse weight into ``(values, meta)`` (the format in the module docstring).

    pruned: (N, K), K % 4 == 0, at most two non-zeros per group of four along K (ValueError
    otherwise). Returns ``values: (N, K // 2)`` in ``pruned``'s dtype and ``meta: (N, ceil(K / 8))``
    uint8, on ``pruned``'s device. ``decompress_24(*compress_24(w))`` equals ``w`` bit for bit.
    """
    n, k = _check_weight(pruned, "pruned")
    idx = _kept_indices(pruned)  # (N, G, 2)
    groups = pruned.reshape(n, k // 4, 4)
    values = groups.gather(-1, idx).reshape(n, k // 2).contiguous()
    nib = (idx[..., 0] | (idx[..., 1] << 2)).to(torch.uint8)  # (N, G)
    g = k // 4
    if g % 2:
        nib = torch.cat([nib, torch.zeros(n, 1, dtype=torch.uint8, device=nib.device)], dim=1)
    nib = nib.reshape(n, -1, 2)
    meta = (nib[..., 0] | (nib[..., 1] << 4)).contiguous()
    return values, meta


def meta_to_indices(meta: torch.Tensor, k: int) -> torch.Tensor:
    """Unpack ``meta: (N, ceil(K / 8))`` uint8 into in-group indices ``(N, K // 4, 2)`` int64."""
    if meta.dtype != torch.uint8 or meta.dim() != 2:
        raise TypeError(f"meta must be a 2-D uint8 tensor, got {meta.dtype} with shape {tuple(meta.shape)}")
    if k % 4 != 0 or meta.shape[1] != (k // 4 + 1) // 2:
        raise ValueError(f"meta has {meta.shape[1]} bytes per row; K={k} needs {(k // 4 + 1) // 2} (and K % 4 == 0)")
    m = meta.to(torch.int64)
    nib = torch.stack([m & 15, m >> 4], dim=-1).reshape(meta.shape[0], -1)[:, : k // 4]
    return torch.stack([nib & 3, nib >> 2], dim=-1)


def decompress_24(values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """Inverse of ``compress_24``: ``values: (N, K // 2)``, ``meta: (N, ceil(K / 8))`` uint8 -> dense (N, K)."""
    if values.dim() != 2 or values.shape[1] % 2 != 0:
        raise ValueError(f"values must be (N, K // 2) with K % 4 == 0, got shape {tuple(values.shape)}")
    n, k = values.shape[0], values.shape[1] * 2
    if meta.shape[0] != n:
        raise ValueError(f"values has {n} rows but meta has {meta.shape[0]}")
    idx = meta_to_indices(meta, k).to(values.device)
    dense = torch.zeros(n, k // 4, 4, dtype=values.dtype, device=values.device)
    dense.scatter_(-1, idx, values.reshape(n, k // 4, 2))
    return dense.reshape(n, k)


def to_cutlass_format(pruned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CUTLASS layout of a 2:4 weight: ``(packed (N, K // 2), meta int16 (reordered for the kernel))``.

    Works on CPU and CUDA (torch's ``sparse_semi_structured_from_dense_cutlass``). fp16/bf16 only
    (torch treats float32 as 1:2 sparsity); N % 32 == 0 and K % 64 == 0 (ValueError otherwise).
    The weight is validated first: torch's conversion silently drops excess non-zeros.
    """
    from torch.sparse._semi_structured_conversions import sparse_semi_structured_from_dense_cutlass

    n, k = _check_weight(pruned, "pruned")
    if pruned.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"CUTLASS 2:4 format supports float16/bfloat16 weights, got {pruned.dtype}")
    if n % 32 or k % 64:
        raise ValueError(f"CUTLASS 2:4 format needs N % 32 == 0 and K % 64 == 0, got (N, K) = ({n}, {k})")
    _kept_indices(pruned)  # raises if not 2:4
    return sparse_semi_structured_from_dense_cutlass(pruned.contiguous())


def from_cutlass_format(packed: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """Inverse of ``to_cutlass_format``: dense (N, K) weight."""
    from torch.sparse._semi_structured_conversions import sparse_semi_structured_to_dense_cutlass

    return sparse_semi_structured_to_dense_cutlass(packed, meta)


def to_semi_structured(pruned: torch.Tensor, backend: str = "cusparselt"):
    """torch ``SparseSemiStructuredTensor`` of a 2:4 weight (N, K) on CUDA, for ``backend`` in
    ``{"cusparselt", "cutlass"}``.

    Equivalent to ``torch.sparse.to_sparse_semi_structured`` with ``SparseSemiStructuredTensor._FORCE_CUTLASS``
    False/True, without touching that class-wide flag. Raises ValueError (not 2:4, unknown backend)
    or torch's RuntimeError (CPU tensor, unsupported dtype/shape).
    """
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    _check_weight(pruned, "pruned")
    _kept_indices(pruned)
    cls = {"cusparselt": SparseSemiStructuredTensorCUSPARSELT, "cutlass": SparseSemiStructuredTensorCUTLASS}.get(backend)
    if cls is None:
        raise ValueError(f"backend must be 'cusparselt' or 'cutlass', got {backend!r}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*prototype stage.*")
        return cls.from_dense(pruned.contiguous())


# ----------------------------------------------------------------------------------------------
# sparse24_linear: y = x @ decompress(values, meta)^T + bias  (reference, Triton kernel, launcher)
# ----------------------------------------------------------------------------------------------


def sparse24_linear_ref(
    x: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    upcast: bool = False,
) -> torch.Tensor:
    """Plain-PyTorch reference: ``x: (..., K)`` @ ``decompress_24(values, meta)^T`` ``(K, N)`` + ``bias (N,)``.

    With ``upcast=True`` computes in float32 and returns float32 (the ``ref32`` of the tests).
    """
    w = decompress_24(values, meta)
    if upcast:
        return F.linear(x.float(), w.float(), None if bias is None else bias.float())
    return F.linear(x, w, bias)


if triton is not None:

    @triton.jit
    def _sparse24_linear_kernel(
        x_ptr,  # (M, K) activations, unit stride along K, row stride stride_xm
        v_ptr,  # (N, K // 2) kept values, unit stride along K // 2, row stride stride_vn
        meta_ptr,  # (N, ceil(K / 8)) uint8 metadata, unit stride, row stride stride_en
        bias_ptr,  # (N,) bias; not read when HAS_BIAS is False
        y_ptr,  # (M, N) output, unit stride along N, row stride stride_ym
        M,
        N,
        K: tl.constexpr,  # constexpr: a runtime loop bound breaks Triton 3.6's interpreter under numpy >= 2.4
        stride_xm,
        stride_vn,
        stride_en,
        stride_ym,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,  # dense K per step; multiple of 16
        GROUP_M: tl.constexpr,
    ):
        # grouped program order for L2 reuse (Triton tutorial 03-matrix-multiplication)
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        HALF: tl.constexpr = BLOCK_K // 2
        GROUPS: tl.constexpr = BLOCK_K // 4
        BYTES: tl.constexpr = BLOCK_K // 8
        offs_k = tl.arange(0, BLOCK_K)
        offs_h = tl.arange(0, HALF)
        offs_b = tl.arange(0, BYTES)
        k_half = K // 2
        k_bytes = (K + 7) // 8

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                mask=mask_m[:, None] & (kk[None, :] < K),
                other=0.0,
            )
            hh = k0 // 2 + offs_h
            vals = tl.load(
                v_ptr + offs_n[:, None] * stride_vn + hh[None, :],
                mask=mask_n[:, None] & (hh[None, :] < k_half),
                other=0.0,
            )  # (BLOCK_N, HALF)
            bb = k0 // 8 + offs_b
            meta = tl.load(
                meta_ptr + offs_n[:, None] * stride_en + bb[None, :],
                mask=mask_n[:, None] & (bb[None, :] < k_bytes),
                other=0,
            ).to(tl.int32)  # (BLOCK_N, BYTES)
            # one 4-bit code per group: even group in the low nibble, odd group in the high nibble
            nib = tl.reshape(tl.join(meta & 15, meta >> 4), (BLOCK_N, GROUPS))
            i0 = nib & 3
            i1 = nib >> 2
            v0, v1 = tl.split(tl.reshape(vals, (BLOCK_N, GROUPS, 2)))
            zero = tl.zeros_like(v0)
            d0 = tl.where(i0 == 0, v0, tl.where(i1 == 0, v1, zero))
            d1 = tl.where(i0 == 1, v0, tl.where(i1 == 1, v1, zero))
            d2 = tl.where(i0 == 2, v0, tl.where(i1 == 2, v1, zero))
            d3 = tl.where(i0 == 3, v0, tl.where(i1 == 3, v1, zero))
            # join(join(d0, d2), join(d1, d3)) flattens to d0, d1, d2, d3 per group
            w = tl.reshape(tl.join(tl.join(d0, d2), tl.join(d1, d3)), (BLOCK_N, BLOCK_K))
            acc = tl.dot(x, tl.trans(w), acc)

        if HAS_BIAS:
            b = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc += b[None, :]
        tl.store(
            y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_n[None, :],
        )


def sparse24_linear_configs(device: torch.device | None = None) -> list[dict]:
    """Launch configs valid on ``device`` (dicts of BLOCK_M/BLOCK_N/BLOCK_K/GROUP_M/num_warps/num_stages),
    in the launcher's order of preference for small, medium and large M.

    Under the interpreter (CPU) a single small config. On CUDA, those whose shared memory
    (x tile + compressed weight tile + metadata, per stage) fits the device's opt-in limit.
    """
    if device is None or torch.device(device).type != "cuda":
        return [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=4, num_warps=1, num_stages=1)]
    return [dict(c) for c in _cuda_configs(torch.device(device).index or 0)]


@functools.lru_cache(maxsize=None)
def _cuda_configs(index: int) -> tuple[dict, ...]:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    # BLOCK_K 64 for the small-M tiles: with BLOCK_K 128 Triton 3.6 failed to compile them on sm_90
    # ("Illegal shared layout", H200, 2026-11-29)
    cands = [(16, 128, 64, 4, 4), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 2)]
    out = []
    for bm, bn, bk, warps, stages in cands:
        need = stages * (bm * bk * 2 + bn * (bk + bk // 8))
        if need <= smem:
            out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages))
    return tuple(out)


def _launch_sparse24(x2d, values, meta, bias, y, cfg) -> None:
    M, K = x2d.shape
    N = values.shape[0]
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _sparse24_linear_kernel[grid](
        x2d,
        values,
        meta,
        bias if bias is not None else values,
        y,
        M,
        N,
        K,
        x2d.stride(0),
        values.stride(0),
        meta.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def _pick_configs(m: int, device: torch.device) -> list[dict]:
    """Heuristic, no autotuning (K is a constexpr, so each config compiles once per K): BLOCK_M 16
    for M <= 32, 64 for M <= 256, else 128, then the other valid configs (tried in order when one
    does not compile here, see ``_launch_first_compiling``)."""
    cfgs = sparse24_linear_configs(device)
    if not cfgs:
        raise RuntimeError(f"sparse24_linear: no launch config fits the shared memory of {device}")
    want = 16 if m <= 32 else 64 if m <= 256 else 128
    return sorted(cfgs, key=lambda c: c["BLOCK_M"] != want)


_FAILED_CONFIGS: set = set()  # (device index, K, dtype, config) that Triton failed to compile


def _launch_first_compiling(x2d, values, meta, bias, y) -> None:
    """Launch with the preferred config; a config that Triton fails to compile (a compiler error is an
    exception, raised before anything runs) is remembered and the next one is tried, logged once."""
    errors = []
    for cfg in _pick_configs(x2d.shape[0], x2d.device):
        key = (x2d.device.index, x2d.shape[1], x2d.dtype, tuple(sorted(cfg.items())))
        if key in _FAILED_CONFIGS:
            continue
        try:
            _launch_sparse24(x2d, values, meta, bias, y, cfg)
            return
        except torch.OutOfMemoryError:
            raise  # not the config's fault
        except RuntimeError as e:  # Triton's "PassManager::run failed" and kin
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            _FAILED_CONFIGS.add(key)
            errors.append(f"{cfg}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            log_fallback("sparse24_linear", f"config {cfg} did not compile for K={x2d.shape[1]}; trying the next")
    raise RuntimeError("sparse24_linear: no launch config compiled: " + "; ".join(errors))


@torch.library.custom_op("sdfast::sparse24_linear", mutates_args=())
def _sparse24_linear_op(
    x2d: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if not use_triton("sparse24_linear", x2d, values, meta, bias):
        return sparse24_linear_ref(x2d, values, meta, bias)
    M = x2d.shape[0]
    N = values.shape[0]
    y = torch.empty(M, N, dtype=x2d.dtype, device=x2d.device)
    if M == 0:
        return y
    _launch_first_compiling(x2d, values, meta, bias, y)
    return y


@_sparse24_linear_op.register_fake
def _(x2d, values, meta, bias):
    return x2d.new_empty(x2d.shape[0], values.shape[0])


def sparse24_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y = x @ W^T + bias`` with W given compressed 2:4 (``compress_24``), decompressed inside the kernel.

    x: (..., K) float16/bfloat16/float32, last dim contiguous (copied otherwise);
    values: (N, K // 2) same dtype; meta: (N, ceil(K / 8)) uint8; bias: (N,) same dtype or None.
    Returns (..., N) in x's dtype (fp32 accumulation). Runs the Triton kernel on CUDA (or on CPU
    under ``TRITON_INTERPRET=1``), else the reference (logged once by ``kernels.dispatch``).
    The kernel reads half the weight bytes plus 1/8 of metadata but computes on dense tensor cores
    (Triton has no ``mma.sp``), so it can only pay where the weight read dominates (small M).
    Registered as ``torch.ops.sdfast.sparse24_linear`` (x flattened to 2-D). Raises TypeError /
    ValueError on dtype/shape/device mismatches.
    """
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (..., K)")
    if values.dim() != 2 or meta.dim() != 2:
        raise ValueError(f"values (N, K//2) and meta (N, ceil(K/8)) must be 2-D, got {tuple(values.shape)}, {tuple(meta.shape)}")
    N, K = values.shape[0], values.shape[1] * 2
    if x.shape[-1] != K:
        raise ValueError(f"x has K={x.shape[-1]} but values (N, K//2)={tuple(values.shape)} imply K={K}")
    if K % 4 != 0:
        raise ValueError(f"K={K} must be a multiple of 4")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x dtype {x.dtype} not supported (float16, bfloat16, float32)")
    if values.dtype != x.dtype:
        raise TypeError(f"values dtype {values.dtype} must equal x dtype {x.dtype}")
    if meta.dtype != torch.uint8 or tuple(meta.shape) != (N, (K // 4 + 1) // 2):
        raise TypeError(f"meta must be uint8 of shape {(N, (K // 4 + 1) // 2)}, got {meta.dtype} {tuple(meta.shape)}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be ({N},) in {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    devs = {t.device for t in (x, values, meta, bias) if t is not None}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")
    x2d = x.reshape(-1, K)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    values = values if values.stride(-1) == 1 else values.contiguous()
    meta = meta if meta.stride(-1) == 1 else meta.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.ops.sdfast.sparse24_linear(x2d, values, meta, bias)
    return y.reshape(*x.shape[:-1], N)


# ----------------------------------------------------------------------------------------------
# cuSPARSELt and CUTLASS through torch
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CusparseltPlan:
    """cuSPARSELt matmul settings found by its search: algorithm id and split-K."""

    alg_id: int = 0
    split_k: int = 1
    split_k_mode: int = -1  # int (torch >= 2.6 style) or bool one-kernel flag stored as 0/1


def cusparselt_available() -> bool:
    """True when torch was built with cuSPARSELt (does not touch the GPU)."""
    return bool(getattr(torch._C, "_has_cusparselt", False))


def _loaded_libraries(soname_prefix: str) -> list[str]:
    """Paths of the shared libraries this process has mapped whose file name starts with ``soname_prefix``, in
    the order of /proc/self/maps (empty where there is no such file)."""
    found: list[str] = []
    try:
        with open("/proc/self/maps", errors="surrogateescape") as f:
            for line in f:
                fields = line.rstrip("\n").split(maxsplit=5)
                path = fields[5].removesuffix(" (deleted)") if len(fields) == 6 else ""
                if os.path.basename(path).startswith(soname_prefix) and path not in found:
                    found.append(path)
    except OSError:  # not Linux
        pass
    return found


@functools.lru_cache(maxsize=None)
def cusparselt_runtime_version() -> tuple[int, int, int] | None:
    """(major, minor, patch) of the cuSPARSELt library this process runs, asked of the loaded library itself
    (``cusparseLtGetProperty``); ``torch.backends.cusparselt.version()`` gives the version torch was built with.
    None when torch has no cuSPARSELt or the library is not loaded (e.g. a CPU build); cached, like the library.
    Two copies can be mapped (an ``LD_PRELOAD``: ``_loaded_libraries`` lists them); the global scope's answer is the
    one torch's calls bind to (checked with ``LD_DEBUG=bindings`` on the H200, run 10)."""
    if not cusparselt_available():
        return None
    try:  # the definition the process's global scope gives (an LD_PRELOADed copy first): what torch binds to
        get_property = ctypes.CDLL(None).cusparseLtGetProperty
    except (AttributeError, TypeError, OSError):  # loaded locally (not in the global scope), or no dlopen(NULL)
        paths = _loaded_libraries("libcusparseLt.so")
        if not paths:
            return None
        try:
            get_property = ctypes.CDLL(paths[0]).cusparseLtGetProperty  # dlopen of a loaded path loads nothing
        except (OSError, AttributeError):
            return None
    out = []
    for prop in (0, 1, 2):  # libraryPropertyType: MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
        v = ctypes.c_int()
        if get_property(prop, ctypes.byref(v)) != 0:
            return None
        out.append(v.value)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _cslt_mm_arg_names() -> frozenset[str]:
    names: set[str] = set()
    for s in torch._C._jit_get_schemas_for_operator("aten::_cslt_sparse_mm"):
        names.update(a.name for a in s.arguments)
    return frozenset(names)


def _backend_constraints(backend: str, dtype: torch.dtype):
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    cls = SparseSemiStructuredTensorCUSPARSELT if backend == "cusparselt" else SparseSemiStructuredTensorCUTLASS
    return cls._DTYPE_SHAPE_CONSTRAINTS.get(dtype)


def backend_supports(backend: str, n: int, k: int, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether a hardware 2:4 backend ("cusparselt", "cutlass") can run an (N, K) weight of ``dtype``."""
    if dtype not in (torch.float16, torch.bfloat16):
        return False, f"dtype {dtype} (2:4 backends here: float16, bfloat16)"
    if backend == "cusparselt" and not cusparselt_available():
        return False, "torch built without cuSPARSELt"
    if backend == "cutlass" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 8:
        # torch's CUTLASS 2:4 kernels are built for sm_8x only ("Supported only on GPUs with compute
        # capability 8.x" on the H200, sm_90)
        major, minor = torch.cuda.get_device_capability()
        return False, f"torch's CUTLASS 2:4 kernels run only on sm_8x GPUs, this one is sm_{major}{minor}"
    c = _backend_constraints(backend, dtype)
    if c is None:
        return False, f"{backend} has no constraints entry for {dtype}"
    if n % c.sparse_min_rows or k % c.sparse_min_cols or n < c.sparse_min_rows or k < c.sparse_min_cols:
        return False, f"(N, K)=({n}, {k}) not multiples of ({c.sparse_min_rows}, {c.sparse_min_cols})"
    return True, ""


def _pad_rows(x2d: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x2d.shape[0]) % multiple
    return F.pad(x2d, (0, 0, 0, pad)) if pad else x2d


def _aligned_rows(x2d: torch.Tensor) -> torch.Tensor:
    """Contiguous (M, K) with a 16-byte aligned base pointer (cuSPARSELt/CUTLASS descriptors assume both;
    under torch.compile tracing the pointer is unknown and only contiguity is enforced)."""
    if not x2d.is_contiguous():
        return x2d.contiguous()
    if not _compiling() and x2d.data_ptr() % 16:
        return x2d.clone(memory_format=torch.contiguous_format)
    return x2d


def cusparselt_search_enabled() -> bool:
    """Whether cuSPARSELt's own algorithm search runs (``SDFAST_CUSPARSELT_SEARCH=1``). Off by default:
    on the H200 with torch 2.11 (cuSPARSELt of its CUDA 13.0 build) ``cusparseLtMatmulSearch`` failed with
    "internal error" on SD shapes and left the CUDA context broken (illegal instruction on every later
    kernel), which no fallback can recover from. Without it, cuSPARSELt runs its default algorithm."""
    return os.environ.get("SDFAST_CUSPARSELT_SEARCH", "0") == "1"


def cusparselt_search(packed: torch.Tensor, x2d: torch.Tensor, bias: torch.Tensor | None = None) -> CusparseltPlan:
    """Run cuSPARSELt's algorithm search for ``y = x2d @ W^T (+ bias)`` in our layout (transposed
    result, x^T as a view). packed: ``torch._cslt_compress(W)``; x2d: (M, K) CUDA, M % 8 == 0."""
    xt = _aligned_rows(x2d).t()
    mod = getattr(torch._C, "_cusparselt", None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecated.*")
        if mod is not None and hasattr(mod, "mm_search"):
            alg, split_k, mode, _max_alg = mod.mm_search(packed, xt, bias, None, None, True)
            return CusparseltPlan(int(alg), int(split_k), int(mode))
        alg = torch._cslt_sparse_mm_search(packed, xt, bias=bias, transpose_result=True)
    return CusparseltPlan(int(alg), 1, -1)


def cusparselt_linear(
    x2d: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, plan: CusparseltPlan = CusparseltPlan()
) -> torch.Tensor:
    """``(M, K) @ W^T + bias -> (M, N)`` with cuSPARSELt: computes ``W_s @ x^T`` (sparse operand left),
    ``x^T`` as a K-major view (no copy), transposed result written as (M, N) row-major, bias fused.
    packed: ``torch._cslt_compress(W)`` of the fp16/bf16 (N, K) weight. M is padded to a multiple of 8."""
    m = x2d.shape[0]
    xp = _aligned_rows(_pad_rows(x2d, 8))
    kwargs = dict(bias=bias, transpose_result=True, alg_id=plan.alg_id)
    if plan.split_k != 1:
        names = _cslt_mm_arg_names()
        kwargs["split_k"] = plan.split_k
        if "split_k_mode" in names:
            kwargs["split_k_mode"] = plan.split_k_mode
        elif "split_k_one_kernel" in names:
            kwargs["split_k_one_kernel"] = bool(plan.split_k_mode)
    y = torch._cslt_sparse_mm(packed, xp.t(), **kwargs)
    return y[:m] if y.shape[0] != m else y


def cutlass_linear(x2d: torch.Tensor, packed: torch.Tensor, meta: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(M, K) @ W^T + bias -> (M, N)`` with torch's CUTLASS 2:4 kernel (``to_cutlass_format`` data).
    Uses ``torch._sparse_semi_structured_linear`` (deprecated but direct: (M, N) out, bias fused);
    where it is gone, ``_sparse_semi_structured_(add)mm`` on x^T plus a transpose copy."""
    m = x2d.shape[0]
    xp = _aligned_rows(_pad_rows(x2d, 8))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecated.*")
        if hasattr(torch, "_sparse_semi_structured_linear"):
            y = torch._sparse_semi_structured_linear(xp, packed, meta, bias=bias)
        elif bias is None:
            y = torch._sparse_semi_structured_mm(packed, meta, xp.t()).t().contiguous()
        else:
            y = torch._sparse_semi_structured_addmm(bias, packed, meta, xp.t()).t().contiguous()
    return y[:m] if y.shape[0] != m else y


# ----------------------------------------------------------------------------------------------
# Timing (GPU only; used by SparseLinear's selection and by the benchmark)
# ----------------------------------------------------------------------------------------------


def time_us_eager(fn: Callable[[], object], iters: int = 20, trials: int = 5) -> float:
    """Median over ``trials`` of the GPU time of ``iters`` back-to-back eager calls, per call (us).
    Includes host overhead whenever the host is slower than the GPU (as in eager inference)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1000.0 / iters)
    return sorted(times)[len(times) // 2]


def time_us_graph(fn: Callable[[], object], iters: int = 20, trials: int = 5) -> float:
    """Median GPU time per call (us) of ``fn`` captured ``iters`` times in one CUDA graph and replayed:
    kernel time only, no host overhead (how sdfast runs the UNet). Raises what capture raises."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1000.0 / iters)
    del graph
    return sorted(times)[len(times) // 2]


# ----------------------------------------------------------------------------------------------
# SparseLinear
# ----------------------------------------------------------------------------------------------

SPARSE_BACKENDS = ("cusparselt", "cutlass", "triton")
BACKEND_CHOICES = ("auto", "dense") + SPARSE_BACKENDS
TIMING_CHOICES = ("graph", "eager")


@dataclasses.dataclass
class _Choice:
    backend: str  # "dense" or one of SPARSE_BACKENDS
    plan: CusparseltPlan | None = None
    timings_us: dict = dataclasses.field(default_factory=dict)
    reason: str = ""


# per-shape decisions shared by all layers of the same shape (speed does not depend on values):
# key = (device index, N, K, M, dtype, has_bias, backend, timing, min_speedup)
_DECISIONS: dict[tuple, _Choice] = {}


def clear_decisions() -> None:
    """Forget the per-shape backend measurements (layers re-measure at their next GPU call)."""
    _DECISIONS.clear()


def shape_decisions() -> list[dict]:
    """The per-shape backend choices made so far: one dict per (N, K, M, dtype) with ``backend``
    ("dense" or a sparse backend), ``reason`` and the measured ``timings_us`` (for reports)."""
    return [
        {"N": k[1], "K": k[2], "M": k[3], "dtype": str(k[4]).replace("torch.", ""), "backend": c.backend,
         "reason": c.reason, "timings_us": dict(c.timings_us)}
        for k, c in _DECISIONS.items()
    ]


class SparseLinear(nn.Module):
    """A linear layer with a 2:4-sparse weight, run by the fastest correct backend.

    ``y = x @ weight.T + bias`` with x: (..., in_features), y: (..., out_features). ``weight`` is the
    pruned dense weight (N, K) (a frozen Parameter; it is what ``state_dict`` saves). Numerics: every
    backend computes with exactly this pruned weight, so they differ only by accumulation order.

    - CPU (or any non-CUDA tensor): ``F.linear`` with the pruned weight (the reference).
    - CUDA, ``backend="auto"``: at the first call with a given number of rows M (and dtype), the
      layer measures dense cuBLAS and every sparse backend available for its shape (cuSPARSELt with
      the default and the searched algorithm, CUTLASS; our Triton kernel only where neither of those runs
      the shape, and when M <= ``triton_max_m``)
      on its real input, checks each sparse result against fp32 (a wrong backend is dropped and
      logged), and keeps the fastest; a sparse backend must be at least
      ``min_speedup`` times faster than dense, else the layer stays dense for that M (counted in
      ``chosen``). Measurements are shared by layers of the same (N, K, M, dtype, bias) shape.
      ``timing="graph"`` (default) measures kernels replayed in a CUDA graph (how sdfast runs the
      UNet, host overhead excluded); ``timing="eager"`` includes host overhead (eager inference).
    - CUDA, a forced backend (``"cusparselt"``, ``"cutlass"``, ``"triton"``, ``"dense"``): used
      without timing where the shape/dtype allow it, else dense (logged once, recorded in ``chosen``).

    Run one eager forward before CUDA-graph capture or ``torch.compile``: a layer reaching its first
    call inside a capture or a compile trace cannot measure, so it runs dense for that call (logged).
    The compressed copies live as plain attributes on the weight's device (not in ``state_dict``);
    moving/casting the module (``.to``) drops them and the measurements of this layer.

    Attributes: ``chosen: dict[int, str]`` backend per measured M; ``timings_us: dict[int, dict]``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        backend: str = "auto",
        timing: str = "graph",
        min_speedup: float = 1.03,
        triton_max_m: int = 256,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if backend not in BACKEND_CHOICES:
            raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {backend!r}")
        if timing not in TIMING_CHOICES:
            raise ValueError(f"timing must be one of {TIMING_CHOICES}, got {timing!r}")
        if in_features % 4 != 0:
            raise ValueError(f"in_features={in_features} must be a multiple of 4 for 2:4 sparsity")
        self.in_features = in_features
        self.out_features = out_features
        self.backend = backend
        self.timing = timing
        self.min_speedup = float(min_speedup)
        self.triton_max_m = int(triton_max_m)
        fk = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, **fk), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, **fk), requires_grad=False) if bias else None
        self.dense_weight_cpu: torch.Tensor | None = None  # original dense weight (keep_dense_copy)
        self.method = "given"  # how the weight was pruned (set by sdfast.passes.sparsity)
        self.chosen: dict[int, str] = {}
        self.timings_us: dict[int, dict] = {}
        self._choices: dict[tuple, _Choice] = {}
        self._data: dict[str, tuple] = {}

    # -- construction / undo -------------------------------------------------------------------

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        pruned_weight: torch.Tensor | None = None,
        *,
        backend: str = "auto",
        timing: str = "graph",
        min_speedup: float = 1.03,
        keep_dense_copy: bool = False,
    ) -> "SparseLinear":
        """Build from an ``nn.Linear``. ``pruned_weight`` (N, K) must be 2:4 (ValueError otherwise);
        None prunes by magnitude. ``keep_dense_copy`` keeps the original weight on CPU for ``to_linear``."""
        w = linear.weight
        if pruned_weight is None:
            pruned_weight, _ = prune_24_magnitude(w)
        if tuple(pruned_weight.shape) != tuple(w.shape):
            raise ValueError(f"pruned_weight shape {tuple(pruned_weight.shape)} != linear weight {tuple(w.shape)}")
        if not is_24_sparse(pruned_weight):
            raise ValueError("pruned_weight is not 2:4 sparse along K (more than two non-zeros in a group of four)")
        mod = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            backend=backend,
            timing=timing,
            min_speedup=min_speedup,
            device=w.device,
            dtype=w.dtype,
        )
        with torch.no_grad():
            mod.weight.copy_(pruned_weight.to(device=w.device, dtype=w.dtype))
            if linear.bias is not None:
                mod.bias.copy_(linear.bias)
        if keep_dense_copy:
            mod.dense_weight_cpu = w.detach().to("cpu", copy=True)
        return mod

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` with the original dense weight when it was kept (``keep_dense_copy``),
        else with the pruned weight; same device and dtype as this module."""
        w = self.weight
        lin = nn.Linear(self.in_features, self.out_features, self.bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            src = self.dense_weight_cpu if self.dense_weight_cpu is not None else w
            lin.weight.copy_(src.to(device=w.device, dtype=w.dtype))
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        lin.weight.requires_grad_(w.requires_grad)
        return lin

    def _apply(self, fn, *args, **kwargs):
        self._data.clear()
        self._choices.clear()
        self.chosen.clear()
        self.timings_us.clear()
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"backend={self.backend}, chosen={self.chosen}"
        )

    # -- backend data ---------------------------------------------------------------------------

    def _backend_data(self, name: str) -> tuple:
        data = self._data.get(name)
        if data is None:
            w = self.weight.detach()
            if not is_24_sparse(w):  # e.g. a dense state_dict loaded into this module
                raise ValueError("SparseLinear.weight is not 2:4 sparse along K; prune it before running a sparse backend")
            if name == "cusparselt":
                data = (torch._cslt_compress(w.contiguous()),)
            elif name == "cutlass":
                data = tuple(to_cutlass_format(w))
            elif name == "triton":
                data = compress_24(w)
            else:
                raise ValueError(f"no compressed data for backend {name!r}")
            self._data[name] = data
        return data

    def _run(self, choice: _Choice, x2d: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias
        if choice.backend == "dense":
            return F.linear(x2d, self.weight, b)
        if choice.backend == "cusparselt":
            (packed,) = self._backend_data("cusparselt")
            return cusparselt_linear(x2d, packed, b, choice.plan or CusparseltPlan())
        if choice.backend == "cutlass":
            packed, meta = self._backend_data("cutlass")
            return cutlass_linear(x2d, packed, meta, b)
        if choice.backend == "triton":
            values, meta = self._backend_data("triton")
            return sparse24_linear(x2d, values, meta, b)
        raise ValueError(f"unknown backend {choice.backend!r}")

    def _supported(self, name: str, x2d: torch.Tensor) -> tuple[bool, str]:
        if x2d.dtype != self.weight.dtype:
            return False, f"input dtype {x2d.dtype} != weight dtype {self.weight.dtype}"
        if name == "triton":
            if triton is None:
                return False, "triton is not installed"
            if self.backend == "auto" and x2d.shape[0] > self.triton_max_m:
                # dense tensor cores + in-register decompression cannot beat cuBLAS once the GEMM
                # is compute-bound; skip the candidate (and its per-K compile) above this M
                return False, f"M={x2d.shape[0]} > triton_max_m={self.triton_max_m}"
            if self.backend == "auto" and any(
                backend_supports(hw, self.out_features, self.in_features, x2d.dtype)[0] for hw in ("cusparselt", "cutlass")
            ):
                # our kernel runs dense tensor cores: it is the fallback where no sparse-tensor-core backend
                # runs the shape (H200, 2026-11-30: 0.15-0.33x of dense at every SD shape, and several of its
                # configs fail to compile on sm_90, which made the 2:4 presets' warm-up minutes long)
                return False, "a sparse-tensor-core backend runs this shape"
            if x2d.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                return False, f"dtype {x2d.dtype}"
            return True, ""
        return backend_supports(name, self.out_features, self.in_features, x2d.dtype)

    # -- selection ------------------------------------------------------------------------------

    def _key(self, x2d: torch.Tensor) -> tuple:
        return (
            x2d.device.index,
            self.out_features,
            self.in_features,
            x2d.shape[0],
            x2d.dtype,
            self.bias is not None,
            self.backend,
            self.timing,
            self.min_speedup,
        )

    def _decide(self, x2d: torch.Tensor) -> _Choice | None:
        """The backend for this input's (M, dtype); None when it cannot be decided now (capture/compile)."""
        key = self._key(x2d)
        shared = _DECISIONS.get(key)
        if shared is not None:
            return shared
        if self.backend == "dense":
            return _Choice("dense", reason="forced")
        if self.backend != "auto":
            ok, why = self._supported(self.backend, x2d)
            if not ok:
                log_fallback(f"SparseLinear[{self.backend}]", f"dense for {tuple(key[1:5])}: {why}")
                choice = _Choice("dense", reason=why)
            elif self.backend == "cusparselt":
                if _capturing_or_compiling():
                    return None
                (packed,) = self._backend_data("cusparselt")
                plan = cusparselt_search(packed, _pad_rows(x2d, 8), self.bias) if cusparselt_search_enabled() else CusparseltPlan()
                choice = _Choice("cusparselt", plan=plan, reason="forced")
            else:
                choice = _Choice(self.backend, reason="forced")
            _DECISIONS[key] = choice
            return choice
        if _capturing_or_compiling():
            return None
        choice = self._measure(x2d)
        _DECISIONS[key] = choice
        return choice

    def _measure(self, x2d: torch.Tensor) -> _Choice:
        x2d = x2d.detach().clone()
        b = self.bias
        timer = time_us_graph if self.timing == "graph" else time_us_eager
        cands: dict[str, _Choice] = {"dense": _Choice("dense")}
        for name in SPARSE_BACKENDS:
            ok, why = self._supported(name, x2d)
            if not ok:
                log.info("SparseLinear %s: %s unavailable: %s", tuple(self._key(x2d)[1:5]), name, why)
                continue
            try:
                self._backend_data(name)
                if name == "cusparselt":
                    (packed,) = self._data[name]
                    cands["cusparselt:alg0"] = _Choice("cusparselt", plan=CusparseltPlan())
                    plan = cusparselt_search(packed, _pad_rows(x2d, 8), b) if cusparselt_search_enabled() else CusparseltPlan()
                    if plan != CusparseltPlan():
                        cands["cusparselt:search"] = _Choice("cusparselt", plan=plan)
                else:
                    cands[name] = _Choice(name)
            except torch.OutOfMemoryError:
                raise  # transient: nothing is decided, the next call measures again
            except Exception as e:  # a backend that cannot even be prepared here is measured out, and said so
                _log_backend_error(name, e)
                self._data.pop(name, None)

        with torch.no_grad():
            ref32 = F.linear(x2d.float(), self.weight.float(), None if b is None else b.float())
            dense_out = F.linear(x2d, self.weight, b)
            base_err = (dense_out.float() - ref32).abs().max().item()
            tol = 2 * base_err + 1e-3 * ref32.abs().max().item() + 1e-6
            timings: dict[str, float] = {}
            for label, cand in cands.items():
                try:
                    out = self._run(cand, x2d)
                    if label != "dense":
                        err = (out.float() - ref32).abs().max().item()
                        if not math.isfinite(err) or err > tol:
                            raise RuntimeError(f"wrong result: max|sparse - ref32| = {err:.3e} > {tol:.3e}")
                    del out
                    timings[label] = timer(lambda c=cand: self._run(c, x2d))
                except torch.OutOfMemoryError:
                    raise
                except Exception as e:
                    _log_backend_error(label, e)
        if "dense" not in timings:  # dense itself failed to time (e.g. capture failed): do not guess
            return _Choice("dense", timings_us=timings, reason="dense could not be timed")
        t_dense = timings["dense"]
        best_label, best_t = "dense", t_dense
        for label, t in timings.items():
            if label != "dense" and t * self.min_speedup <= t_dense and t < best_t:
                best_label, best_t = label, t
        choice = dataclasses.replace(cands[best_label], timings_us=timings)
        sparse = {k: t for k, t in timings.items() if k != "dense"}
        if best_label != "dense":
            choice.reason = f"{best_label}: {best_t:.1f} us vs dense {t_dense:.1f} us"
        elif sparse:
            fastest = min(sparse, key=sparse.get)
            choice.reason = (f"dense {t_dense:.1f} us; fastest sparse {fastest} {sparse[fastest]:.1f} us "
                             f"(needs <= dense / {self.min_speedup:g})")
        else:
            choice.reason = f"dense {t_dense:.1f} us; no sparse backend ran"
        for name in list(self._data):  # keep only the compressed copy we use
            if name != choice.backend:
                del self._data[name]
        log.info(
            "SparseLinear (N=%d, K=%d, M=%d, %s): %s",
            self.out_features, self.in_features, x2d.shape[0], x2d.dtype, choice.reason,
        )
        return choice

    # -- forward --------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda":
            return F.linear(x, self.weight, self.bias)
        x2d = x.reshape(-1, self.in_features)
        m = x2d.shape[0]
        if m == 0:
            return F.linear(x, self.weight, self.bias)
        ck = (m, x2d.dtype)
        choice = self._choices.get(ck)
        if choice is None:
            if precompile.active():  # compile-only pass (kernels.precompile): no timing is real, decide later
                return F.linear(x, self.weight, self.bias)
            choice = self._decide(x2d)
            if choice is None:
                log_fallback("SparseLinear", "dense: first call with this M happened inside CUDA-graph capture or torch.compile")
                return F.linear(x, self.weight, self.bias)
            self._choices[ck] = choice
            self.chosen[m] = choice.backend
            if choice.timings_us:
                self.timings_us[m] = dict(choice.timings_us)
        if choice.backend != "dense" and choice.backend not in self._data and _capturing_or_compiling():
            return F.linear(x, self.weight, self.bias)  # compressing here would be recorded in the graph
        y = self._run(choice, x2d)
        return y.reshape(*x.shape[:-1], self.out_features)


_logged_errors: set[tuple[str, str]] = set()


def _log_backend_error(name: str, e: BaseException) -> None:
    key = (name, f"{type(e).__name__}: {e}"[:300])
    if key not in _logged_errors:
        _logged_errors.add(key)
        log.warning("SparseLinear: backend %s dropped from the measurement: %s", name, key[1])


def _compiling() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except AttributeError:  # pragma: no cover - old torch
        return False


def _capturing_or_compiling() -> bool:
    return _compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
