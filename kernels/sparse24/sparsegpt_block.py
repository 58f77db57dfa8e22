"""SparseGPT's inner loop over one block of columns, as one Triton kernel (Frantar & Alistarh, ICML 2023).

``kernels.sparse24.prune.sparsegpt_prune_24`` walks the columns of W in blocks of ``BS`` (128): inside a block each
column is pruned to its 2:4 mask and its error is spread over the block's remaining columns with one row
of U (the upper Cholesky factor of H^-1), one column after the other. In PyTorch that is about ten small
kernels per column, so pruning SDXL's 722 linears (about a million columns) is launch-bound. Rows are
independent inside a block, so here one program keeps a (BLOCK_R, BS) tile of W in registers and walks the
block's columns itself: one launch per block.

Per group of four columns (the first column's turn), the mask drops the two smallest ``w^2 / U_jj^2`` of
the current, already compensated weights (ties: the lower column first); then for each column j of the
group: ``q = w_j`` masked, ``err = (w_j - q) / U_jj``, ``loss += (w_j - q)^2 / (2 U_jj^2)``,
``W -= err * U[j, :]`` (U is upper triangular, so columns before j are untouched), ``W[:, j] = q``.

``sparsegpt_block_ref`` is the same loop in PyTorch (what ``sparsegpt_prune_24`` runs where Triton
cannot, and the tests' reference). fp32 only.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is installed in CI and on the GPU machine
    triton = None

from kernels.dispatch import use_triton


def sparsegpt_block_ref(W1: torch.Tensor, U1: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
    """One block in PyTorch. W1: (N, nb) current weights of the block (updated in place to the pruned
    values); U1: (nb, nb) the block of U; losses: (N,) accumulated in place. nb % 4 == 0.
    Returns Err1: (N, nb), the OBS error of each column (for the lazy update of the later columns)."""
    n, nb = W1.shape
    d1 = torch.diagonal(U1)
    err1 = torch.zeros_like(W1)
    prune = None
    for j in range(nb):
        if j % 4 == 0:
            score = W1[:, j : j + 4].square() / d1[j : j + 4].square()
            drop = score.topk(2, dim=1, largest=False).indices
            prune = torch.zeros(n, 4, dtype=torch.bool, device=W1.device).scatter_(1, drop, True)
        w = W1[:, j]
        q = w.masked_fill(prune[:, j % 4], 0.0)
        err = (w - q) / d1[j]
        losses += (w - q).square() / (2 * d1[j].square())
        W1[:, j:] -= err[:, None] * U1[j, j:][None, :]
        W1[:, j] = q
        err1[:, j] = err
    return err1


if triton is not None:

    @triton.jit
    def _sparsegpt_block_kernel(
        w_ptr,  # (N, nb) fp32, row stride sw: in, the block's weights; out, the pruned weights
        e_ptr,  # (N, nb) fp32, row stride se: out, the OBS errors
        u_ptr,  # (nb, nb) fp32, row stride su: the block of U (upper triangular)
        loss_ptr,  # (N,) fp32, accumulated
        N,
        NB,  # columns in this block, a multiple of 4, <= BS
        sw,
        se,
        su,
        BS: tl.constexpr,  # power of two >= NB
        BLOCK_R: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BS)
        rmask = rows < N
        cmask = cols < NB
        m2 = rmask[:, None] & cmask[None, :]
        W = tl.load(w_ptr + rows[:, None] * sw + cols[None, :], mask=m2, other=0.0)
        d = tl.load(u_ptr + cols * su + cols, mask=cmask, other=1.0)
        E = tl.zeros((BLOCK_R, BS), dtype=tl.float32)
        loss = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for g in range(BS // 4):
            c0 = g * 4
            if c0 < NB:
                # Scores of the group's four columns, from the weights as compensated so far.
                w0 = tl.sum(tl.where(cols[None, :] == c0, W, 0.0), axis=1)
                w1 = tl.sum(tl.where(cols[None, :] == c0 + 1, W, 0.0), axis=1)
                w2 = tl.sum(tl.where(cols[None, :] == c0 + 2, W, 0.0), axis=1)
                w3 = tl.sum(tl.where(cols[None, :] == c0 + 3, W, 0.0), axis=1)
                d0 = tl.sum(tl.where(cols == c0, d, 0.0))
                d1 = tl.sum(tl.where(cols == c0 + 1, d, 0.0))
                d2 = tl.sum(tl.where(cols == c0 + 2, d, 0.0))
                d3 = tl.sum(tl.where(cols == c0 + 3, d, 0.0))
                s0 = w0 * w0 / (d0 * d0)
                s1 = w1 * w1 / (d1 * d1)
                s2 = w2 * w2 / (d2 * d2)
                s3 = w3 * w3 / (d3 * d3)
                # Rank of each score among the four (ties: the lower column ranks first); the two lowest are pruned.
                r0 = (s1 < s0).to(tl.int32) + (s2 < s0).to(tl.int32) + (s3 < s0).to(tl.int32)
                r1 = (s0 <= s1).to(tl.int32) + (s2 < s1).to(tl.int32) + (s3 < s1).to(tl.int32)
                r2 = (s0 <= s2).to(tl.int32) + (s1 <= s2).to(tl.int32) + (s3 < s2).to(tl.int32)
                r3 = (s0 <= s3).to(tl.int32) + (s1 <= s3).to(tl.int32) + (s2 <= s3).to(tl.int32)
                for i in tl.static_range(4):
                    c = c0 + i
                    if i == 0:
                        rank = r0
                        dc = d0
                    elif i == 1:
                        rank = r1
                        dc = d1
                    elif i == 2:
                        rank = r2
                        dc = d2
                    else:
                        rank = r3
                        dc = d3
                    w = tl.sum(tl.where(cols[None, :] == c, W, 0.0), axis=1)
                    q = tl.where(rank < 2, 0.0, w)
                    err = (w - q) / dc
                    loss += (w - q) * (w - q) / (2.0 * dc * dc)
                    urow = tl.load(u_ptr + c * su + cols, mask=cmask, other=0.0)
                    W = W - err[:, None] * urow[None, :]
                    W = tl.where(cols[None, :] == c, q[:, None], W)
                    E = tl.where(cols[None, :] == c, err[:, None], E)
        tl.store(w_ptr + rows[:, None] * sw + cols[None, :], W, mask=m2)
        tl.store(e_ptr + rows[:, None] * se + cols[None, :], E, mask=m2)
        prev = tl.load(loss_ptr + rows, mask=rmask, other=0.0)
        tl.store(loss_ptr + rows, prev + loss, mask=rmask)


def sparsegpt_block(W1: torch.Tensor, U1: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
    """One block (see the module docstring): the Triton kernel for fp32 tensors where Triton runs (CUDA, or
    the interpreter), else :func:`sparsegpt_block_ref`. Same arguments, in-place updates and return value."""
    n, nb = W1.shape
    if nb % 4 or tuple(U1.shape) != (nb, nb) or tuple(losses.shape) != (n,):
        raise ValueError(f"sparsegpt_block: W1 (N, nb) with nb % 4 == 0, U1 (nb, nb), losses (N,); got "
                         f"{tuple(W1.shape)}, {tuple(U1.shape)}, {tuple(losses.shape)}")
    if any(t.dtype != torch.float32 for t in (W1, U1, losses)) or not losses.is_contiguous():
        return sparsegpt_block_ref(W1, U1, losses)  # float64 compute (by design: the kernel is fp32)
    if triton is None or not use_triton("sparsegpt_block", W1, U1, losses):  # logged there
        return sparsegpt_block_ref(W1, U1, losses)
    w = W1 if W1.stride(1) == 1 else W1.contiguous()
    u = U1 if U1.stride(1) == 1 else U1.contiguous()
    err = torch.empty_like(w)
    bs = triton.next_power_of_2(nb)
    block_r = max(1, min(64, 4096 // bs))
    _sparsegpt_block_kernel[(triton.cdiv(n, block_r),)](
        w, err, u, losses, n, nb, w.stride(0), err.stride(0), u.stride(0),
        BS=bs, BLOCK_R=block_r, num_warps=4,
    )
    if w is not W1:
        W1.copy_(w)
    return err
