"""2:4 pruning of an ``nn.Linear`` weight (N, K): masks, magnitude pruning and SparseGPT.

Groups of four run along K (see :mod:`kernels.sparse24`). Magnitude pruning keeps the two largest |w| of each
group (NVIDIA ASP, Mishra et al. 2021); SparseGPT (Frantar & Alistarh, ICML 2023) chooses the mask column by
column from the Optimal-Brain-Surgeon saliency and compensates the error on the columns not yet pruned.
"""

from __future__ import annotations

import torch

from kernels.sparse24.sparsegpt_block import sparsegpt_block

__all__ = ["check_weight", "mask_24_from_scores", "prune_24_magnitude", "is_24_sparse", "sparsegpt_prune_24"]


def check_weight(weight: torch.Tensor, what: str = "weight") -> tuple[int, int]:
    """``(N, K)`` of a 2-D float ``weight`` whose K is a multiple of 4; TypeError / ValueError naming ``what``
    otherwise."""
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
    n, k = check_weight(scores, "scores")
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
    check_weight(weight)
    mask = mask_24_from_scores(weight.detach().abs().float())
    pruned = torch.where(mask, weight.detach(), torch.zeros((), dtype=weight.dtype, device=weight.device))
    return pruned, mask


def is_24_sparse(weight: torch.Tensor) -> bool:
    """True when every group of four consecutive K elements of ``weight`` (N, K) has at most two non-zeros."""
    n, k = check_weight(weight)
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
    is one Triton launch for float32, ``kernels.sparse24.sparsegpt_block``):

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
    n, k = check_weight(weight)
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
