"""GPTQ: Hessian-based int4 weight quantization (Frantar et al. 2022, arXiv:2210.17323).

Columns are quantized one at a time in order; the rounding error of column ``i`` is spread over
the not-yet-quantized columns through the inverse Hessian of the layer's reconstruction loss
``||X W^T - X W_q^T||²`` (``H = 2 X^T X / n``), using its upper Cholesky factor as in the paper's
Algorithm 1. Updates inside a block of ``block_size`` columns are immediate, those to later columns
are batched ("lazy batch updates"). Dead inputs (``H_ii = 0``) get weight 0; ``damp`` (fraction of
the mean diagonal) is added to the diagonal. Group parameters (asymmetric min/max, zero included,
as ``kernels.gemm.w4a16.quantize_int4_groups``) are computed when the sweep reaches a group's
first column, from the error-updated weights. No act-order (``desc_act``) permutation.
"""

from __future__ import annotations

import torch


def _minmax_params(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    wmin = w.amin(dim=1).clamp(max=0.0)
    wmax = w.amax(dim=1).clamp(min=0.0)
    scale = ((wmax - wmin) / 15.0).clamp_min(1e-8)
    zero = torch.round(-wmin / scale).clamp(0, 15)
    return scale, zero


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int = 128,
    damp: float = 0.01,
    block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ-quantize ``weight`` (N, K) with ``hessian`` (K, K) (``2 X^T X / n``; any positive multiple works).

    Returns ``q`` uint8 (N, K) in [0, 15], ``scales`` fp32 (N, G), ``zeros`` uint8 (N, G), G = ceil(K/group_size)
    (the format of ``kernels.gemm.w4a16``). Raises ValueError on shape mismatch, RuntimeError when the
    damped Hessian is not positive definite (raise ``damp``).
    """
    N, K = weight.shape
    if tuple(hessian.shape) != (K, K):
        raise ValueError(f"gptq_quantize: hessian must be ({K}, {K}), got {tuple(hessian.shape)}")
    if group_size <= 0:
        raise ValueError(f"gptq_quantize: group_size must be positive, got {group_size}")
    W = weight.float().clone()
    H = hessian.float().to(W.device).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(damp * torch.mean(torch.diag(H)))
    try:
        L = torch.linalg.cholesky(H)
        Hinv = torch.cholesky_inverse(L)
        Hinv = torch.linalg.cholesky(Hinv, upper=True)
    except RuntimeError as e:  # torch.linalg.LinAlgError subclasses RuntimeError
        raise RuntimeError(f"gptq_quantize: damped Hessian not positive definite (damp={damp}); raise damp") from e

    G = -(-K // group_size)
    Q = torch.zeros(N, K, device=W.device, dtype=torch.uint8)
    scales = torch.zeros(N, G, device=W.device, dtype=torch.float32)
    zeros = torch.zeros(N, G, device=W.device, dtype=torch.float32)
    scale = zero = None
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:
                gend = min(col + group_size, K)
                grp = W1[:, i: min(gend, i2) - i1]
                if gend > i2:
                    grp = torch.cat([grp, W[:, i2:gend]], dim=1)
                scale, zero = _minmax_params(grp)
                scales[:, col // group_size] = scale
                zeros[:, col // group_size] = zero
            w = W1[:, i]
            q = torch.clamp(torch.round(w / scale) + zero, 0, 15)
            Q[:, col] = q.to(torch.uint8)
            dq = (q - zero) * scale
            err = (w - dq) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return Q, scales, zeros.to(torch.uint8)


__all__ = ["gptq_quantize"]
