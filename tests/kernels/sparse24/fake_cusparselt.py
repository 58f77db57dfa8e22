"""An emulator of torch's cuSPARSELt ops for CPU tests, after their documented semantics (ATen
cuSPARSELtOps.cpp: result = A_sparse (m, k) @ B (k, n), bias per row of A, transpose_result returns the (n, m)
result row-major)."""

import torch

from kernels.sparse24 import cusparselt as cslt


class FakeCusparselt:
    calls: list

    def __init__(self):
        self.calls = []

    def compress(self, w):
        return w.detach().clone()  # emulated "compressed" buffer: the pruned weight itself

    def mm(self, packed, dense_b, bias=None, alpha=None, out_dtype=None, transpose_result=False, alg_id=0,
           split_k=1, split_k_mode=-1):
        self.calls.append(dict(shape=tuple(dense_b.shape), contiguous=dense_b.is_contiguous(), alg_id=alg_id,
                               split_k=split_k, split_k_mode=split_k_mode, transpose_result=transpose_result))
        assert packed.shape[1] == dense_b.shape[0] and dense_b.shape[1] % 8 == 0
        res = packed.float() @ dense_b.float()
        if bias is not None:
            res += bias.float()[:, None]
        res = res.to(dense_b.dtype)
        return res.t().contiguous() if transpose_result else res

    def mm_search(self, packed, dense_b, bias, alpha, out_dtype, transpose_result):
        assert transpose_result and not dense_b.is_contiguous()  # our layout: x^T view, (M, N) result
        return 3, 2, 1, 10


def install(monkeypatch) -> FakeCusparselt:
    """Route torch's cuSPARSELt ops to a new emulator (for the test: ``monkeypatch`` undoes it), with no plan
    searched before; returns the emulator (its ``calls`` record each matmul)."""
    fake = FakeCusparselt()
    monkeypatch.setattr(cslt, "_SEARCHED", {})
    monkeypatch.setattr(torch, "_cslt_compress", fake.compress, raising=False)
    monkeypatch.setattr(torch, "_cslt_sparse_mm", fake.mm, raising=False)
    monkeypatch.setattr(torch._C, "_cusparselt", fake, raising=False)
    monkeypatch.setattr(cslt, "cusparselt_available", lambda: True)
    return fake

