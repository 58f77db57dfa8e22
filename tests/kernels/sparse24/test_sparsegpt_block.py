"""CPU tests of kernels/sparse24/sparsegpt_block.py: SparseGPT's per-block loop as one Triton kernel
(interpreter) against the PyTorch loop."""

import pytest
import torch



def _groups(w):
    n, k = w.shape
    return w.reshape(n, k // 4, 4)


@pytest.mark.parametrize("n,nb", [(37, 32), (8, 12), (70, 128)], ids=["37x32", "8x12-not-pow2", "70x128"])
def test_sparsegpt_block_kernel_matches_torch_loop(n, nb, monkeypatch):
    """The Triton block (interpreter) against the PyTorch loop on the same (W1, U1): same 2:4 masks, same
    pruned weights, errors and losses up to fp32 rounding. Row counts that are not a multiple of the
    program's rows, a block narrower than its power of two."""
    from kernels.sparse24 import sparsegpt_block as sb

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(n)
    A = torch.randn(nb, nb, dtype=torch.float64, generator=g)
    H = A @ A.T / nb + 0.1 * torch.eye(nb, dtype=torch.float64)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    W = torch.randn(n, nb, generator=g)
    W_ref, W_tri = W.clone(), W.clone()
    loss_ref, loss_tri = torch.zeros(n), torch.full((n,), 0.5)  # the kernel adds to what is there
    err_ref = sb.sparsegpt_block_ref(W_ref, U, loss_ref)
    err_tri = sb.sparsegpt_block(W_tri, U, loss_tri)
    assert torch.equal(W_tri == 0, W_ref == 0)
    assert bool((_groups(W_tri != 0).sum(-1) == 2).all())
    torch.testing.assert_close(W_tri, W_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(err_tri, err_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss_tri - 0.5, loss_ref, rtol=1e-4, atol=1e-6)


def test_sparsegpt_block_rejects_bad_shapes():
    from kernels.sparse24.sparsegpt_block import sparsegpt_block

    with pytest.raises(ValueError, match="nb % 4"):
        sparsegpt_block(torch.zeros(4, 6), torch.eye(6), torch.zeros(4))

