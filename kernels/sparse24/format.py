"""2:4 compression formats of a pruned weight (N, K): ours (what the Triton kernel reads) and torch's CUTLASS layout.

Our format (``compress_24`` / ``decompress_24``):

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
``kernels.sparse24.cusparselt.to_semi_structured`` (cuSPARSELt's opaque compressed buffer via
``torch._cslt_compress``, or CUTLASS's reordered int16 metadata) and :func:`to_cutlass_format`.
"""

from __future__ import annotations

import torch

from kernels.sparse24.prune import check_weight

__all__ = ["kept_indices", "compress_24", "decompress_24", "meta_to_indices", "to_cutlass_format", "from_cutlass_format"]


def kept_indices(pruned: torch.Tensor) -> torch.Tensor:
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
    """Compress a 2:4-sparse weight into ``(values, meta)`` (the format in this module's docstring).

    pruned: (N, K), K % 4 == 0, at most two non-zeros per group of four along K (ValueError
    otherwise). Returns ``values: (N, K // 2)`` in ``pruned``'s dtype and ``meta: (N, ceil(K / 8))``
    uint8, on ``pruned``'s device. ``decompress_24(*compress_24(w))`` equals ``w`` bit for bit.
    """
    n, k = check_weight(pruned, "pruned")
    idx = kept_indices(pruned)  # (N, G, 2)
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

    n, k = check_weight(pruned, "pruned")
    if pruned.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"CUTLASS 2:4 format supports float16/bfloat16 weights, got {pruned.dtype}")
    if n % 32 or k % 64:
        raise ValueError(f"CUTLASS 2:4 format needs N % 32 == 0 and K % 64 == 0, got (N, K) = ({n}, {k})")
    kept_indices(pruned)  # raises if not 2:4
    return sparse_semi_structured_from_dense_cutlass(pruned.contiguous())


def from_cutlass_format(packed: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """Inverse of ``to_cutlass_format``: dense (N, K) weight."""
    from torch.sparse._semi_structured_conversions import sparse_semi_structured_to_dense_cutlass

    return sparse_semi_structured_to_dense_cutlass(packed, meta)
