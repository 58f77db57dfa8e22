"""AWQ: activation-aware weight quantization (Lin et al. 2023, arXiv:2306.00978).

Salient input channels (large mean |x|) are protected by scaling them up before group-wise int4
round-to-nearest quantization and dividing the activations by the same factor:

    s = absmean(X)^r / sqrt(max * min),    W_q = Q(W diag(s)),    y = (X diag(1/s)) W_q^T

The exponent ``r`` is searched over a grid ``{0, 1/n, ..., (n-1)/n}`` to minimise the output MSE
``||X W^T - X diag(1/s) Q(W diag(s))^T||²`` on calibration input rows; ``r = 0`` is plain
round-to-nearest, so the search never does worse than RTN on the calibration rows. The ``1/s``
multiply is kept as the module's ``smooth`` vector, fused into the W4A16 kernel's activation load
(instead of being folded into the previous op). AWQ's weight-clipping search is not implemented.
"""

from __future__ import annotations

import torch

from kernels.gemm.w4a16 import quantize_int4_groups


def _fake_quant(w: torch.Tensor, group_size: int) -> torch.Tensor:
    q, s, z = quantize_int4_groups(w, group_size)
    idx = torch.arange(w.shape[1], device=w.device) // group_size
    return (q.float() - z.float()[:, idx]) * s[:, idx]


@torch.no_grad()
def awq_search_scales(
    weight: torch.Tensor,
    x_absmean: torch.Tensor,
    samples: torch.Tensor,
    group_size: int = 128,
    n_grid: int = 20,
) -> tuple[torch.Tensor, float, list[float]]:
    """Grid-search AWQ's per-input-channel scale.

    weight: (N, K); x_absmean: (K,) mean |x| per channel; samples: (S, K) calibration input rows.
    Returns ``(s (K,) fp32, best ratio r, losses per grid point)``.
    """
    if samples.dim() != 2 or samples.shape[1] != weight.shape[1] or samples.shape[0] == 0:
        raise ValueError(f"awq_search_scales: samples must be (S>0, {weight.shape[1]}), got {tuple(samples.shape)}")
    w = weight.float()
    x = samples.float().to(w.device)
    ref = x @ w.t()
    xm = x_absmean.float().to(w.device).clamp_min(1e-4)
    best, best_r, best_s, losses = float("inf"), 0.0, torch.ones_like(xm), []
    for i in range(n_grid):
        r = i / n_grid
        s = xm.pow(r)
        s = s / (s.max() * s.min()).sqrt()
        wq = _fake_quant(w * s[None, :], group_size) / s[None, :]
        loss = (x @ wq.t() - ref).pow(2).mean().item()
        losses.append(loss)
        if loss < best:
            best, best_r, best_s = loss, r, s
    return best_s, best_r, losses


@torch.no_grad()
def awq_quantize(
    weight: torch.Tensor,
    x_absmean: torch.Tensor,
    samples: torch.Tensor,
    group_size: int = 128,
    n_grid: int = 20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ-quantize ``weight`` (N, K): returns unpacked ``q`` uint8 (N, K), ``scales`` fp32 (N, G),
    ``zeros`` uint8 (N, G) of ``W diag(s)``, and ``smooth = 1/s`` (K,) fp32 for the activations."""
    s, _, _ = awq_search_scales(weight, x_absmean, samples, group_size, n_grid)
    q, sc, z = quantize_int4_groups(weight.float() * s[None, :], group_size)
    return q, sc, z, 1.0 / s


__all__ = ["awq_search_scales", "awq_quantize"]
