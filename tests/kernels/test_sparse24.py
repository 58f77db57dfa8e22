"""CPU tests of kernels/gemm/sparse24.py: 2:4 masks, magnitude and SparseGPT pruning, our compressed
format, torch's CUTLASS format, the Triton sparse24_linear kernel (interpreter), SparseLinear on CPU."""

import logging
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.gemm import sparse24 as s24
from kernels.testing import assert_close_rule

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _groups(w):
    n, k = w.shape
    return w.reshape(n, k // 4, 4)


# ---------------------------------------------------------------------------------------------
# masks and magnitude pruning
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(320, 320), (2560, 320), (320, 1280), (7, 12), (1, 4)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_magnitude_mask_exactly_two_per_group_along_k(shape, dtype):
    w = torch.randn(shape).to(dtype)
    pruned, mask = s24.prune_24_magnitude(w)
    assert mask.dtype == torch.bool and mask.shape == w.shape
    assert pruned.dtype == dtype and pruned.shape == w.shape
    assert bool((_groups(mask).sum(-1) == 2).all())
    assert torch.equal(pruned[mask], w[mask])
    assert bool((pruned[~mask] == 0).all())
    assert s24.is_24_sparse(pruned)


def test_magnitude_keeps_the_two_largest():
    w = torch.randn(64, 128)
    pruned, mask = s24.prune_24_magnitude(w)
    g, m = _groups(w.abs()), _groups(mask)
    kept = torch.where(m, g, torch.full_like(g, float("inf"))).min(-1).values
    dropped = torch.where(~m, g, torch.full_like(g, -float("inf"))).max(-1).values
    assert bool((kept >= dropped).all())
    # brute force on a few rows: the kept pair is the top-2 of |w|
    for r in range(4):
        for gi in range(32):
            top = set(g[r, gi].argsort(descending=True)[:2].tolist())
            assert set(m[r, gi].nonzero().flatten().tolist()) == top


def test_magnitude_sign_and_negative_values():
    w = torch.tensor([[-5.0, 1.0, 4.0, -0.5, 0.125, -0.25, 0.375, -0.5]])
    pruned, _ = s24.prune_24_magnitude(w)
    assert pruned.tolist() == [[-5.0, 0.0, 4.0, 0.0, 0.0, 0.0, 0.375, -0.5]]


@pytest.mark.parametrize("bad,exc,msg", [
    (torch.randn(8, 6), ValueError, "not a multiple of 4"),
    (torch.randn(8), ValueError, "2-D"),
    (torch.randn(2, 3, 4), ValueError, "2-D"),
    (torch.ones(8, 8, dtype=torch.int32), TypeError, "floating point"),
])
def test_pruning_rejects_bad_weights(bad, exc, msg):
    with pytest.raises(exc, match=msg):
        s24.prune_24_magnitude(bad)
    with pytest.raises(exc, match=msg):
        s24.compress_24(bad)


def test_is_24_sparse_detects_three_nonzeros():
    w = torch.zeros(2, 8)
    w[0, :2] = 1.0
    assert s24.is_24_sparse(w)
    w[1, 4:7] = 1.0
    assert not s24.is_24_sparse(w)


# ---------------------------------------------------------------------------------------------
# compression
# ---------------------------------------------------------------------------------------------


def test_compress_format_by_hand():
    w = torch.tensor([[0.0, 5.0, 0.0, 7.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 3.0, 4.0]])
    values, meta = s24.compress_24(w)
    assert values.tolist() == [[5.0, 7.0, 1.0, 2.0, 3.0, 4.0]]
    # group 0 keeps (1, 3): 1 | 3 << 2 = 13; group 1 keeps (0, 2): 8; group 2 keeps (2, 3): 14
    assert meta.dtype == torch.uint8 and meta.shape == (1, 2)
    assert meta.tolist() == [[13 | (8 << 4), 14]]
    assert s24.meta_to_indices(meta, 12).tolist() == [[[1, 3], [0, 2], [2, 3]]]


@pytest.mark.parametrize("shape", [(320, 320), (64, 1280), (5, 12), (3, 36), (1, 4)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_compress_decompress_round_trip_exact(shape, dtype):
    w = torch.randn(shape).to(dtype)
    pruned, _ = s24.prune_24_magnitude(w)
    # groups with fewer than two non-zeros (kept weights that are exactly zero) must survive too
    pruned[0, :4] = 0
    if shape[1] >= 8:
        pruned[-1, 4:8] = torch.tensor([0, 0, 0, 3], dtype=dtype)
    values, meta = s24.compress_24(pruned)
    n, k = shape
    assert values.shape == (n, k // 2) and values.dtype == dtype
    assert meta.shape == (n, (k // 4 + 1) // 2) and meta.dtype == torch.uint8
    back = s24.decompress_24(values, meta)
    assert back.dtype == dtype
    assert torch.equal(back.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       pruned.view(torch.int16 if dtype != torch.float32 else torch.int32))
    idx = s24.meta_to_indices(meta, k)
    assert bool((idx[..., 0] < idx[..., 1]).all())


def test_compress_rejects_non_24():
    w = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"not 2:4 sparse: row 0, group 0"):
        s24.compress_24(w)


def test_meta_and_values_validation():
    values, meta = s24.compress_24(s24.prune_24_magnitude(torch.randn(4, 16))[0])
    with pytest.raises(ValueError, match="bytes per row"):
        s24.meta_to_indices(meta, 32)
    with pytest.raises(TypeError, match="uint8"):
        s24.meta_to_indices(meta.to(torch.int16), 16)
    with pytest.raises(ValueError, match="rows"):
        s24.decompress_24(values, meta[:2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cutlass_format_round_trip_cpu(dtype):
    pruned, _ = s24.prune_24_magnitude(torch.randn(64, 128).to(dtype))
    packed, meta = s24.to_cutlass_format(pruned)
    assert packed.shape == (64, 64) and meta.dtype == torch.int16
    # the kept values are ours, in the same order; only the metadata layout differs
    values, _ = s24.compress_24(pruned)
    assert torch.equal(packed, values)
    assert torch.equal(s24.from_cutlass_format(packed, meta), pruned)


def test_cutlass_format_validation():
    with pytest.raises(ValueError, match="not 2:4"):
        s24.to_cutlass_format(torch.randn(64, 128, dtype=torch.float16))
    with pytest.raises(TypeError, match="float16/bfloat16"):
        s24.to_cutlass_format(s24.prune_24_magnitude(torch.randn(64, 128))[0])
    with pytest.raises(ValueError, match="N % 32"):
        s24.to_cutlass_format(s24.prune_24_magnitude(torch.randn(48, 128, dtype=torch.float16))[0])


def test_to_semi_structured_rejects_cpu_and_bad_backend():
    pruned, _ = s24.prune_24_magnitude(torch.randn(64, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="backend"):
        s24.to_semi_structured(pruned, "cublas")
    with pytest.raises(RuntimeError, match="CUDA"):
        s24.to_semi_structured(pruned, "cusparselt")


# ---------------------------------------------------------------------------------------------
# SparseGPT
# ---------------------------------------------------------------------------------------------

N_OUT, K_IN, N_SAMPLES = 32, 64, 512


def _paired_problem(seed, sigma=0.1):
    """X (512, 64): correlated base features (random mixing), each followed by a near-duplicate
    (x_{2i+1} = x_{2i} + sigma * eps): exactly what 2:4 with compensation can exploit."""
    g = torch.Generator().manual_seed(seed)
    half = K_IN // 2
    mix = torch.eye(half, dtype=torch.float64) + 0.5 * torch.randn(half, half, dtype=torch.float64, generator=g) / half**0.5
    base = torch.randn(N_SAMPLES, half, dtype=torch.float64, generator=g) @ mix
    X = torch.empty(N_SAMPLES, K_IN, dtype=torch.float64)
    X[:, 0::2] = base
    X[:, 1::2] = base + sigma * torch.randn(N_SAMPLES, half, dtype=torch.float64, generator=g)
    W = torch.randn(N_OUT, K_IN, dtype=torch.float64, generator=g)
    H = 2 * X.T @ X / N_SAMPLES
    return X, W, H


def _naive_sparsegpt(W, H, percdamp):
    """Independent, unblocked SparseGPT from the OBS formulas with explicit inverses of H_FF
    (F = columns not yet processed), no Cholesky: the reference for the blocked implementation."""
    W = W.clone()
    k = W.shape[1]
    Hd = H + percdamp * H.diagonal().mean() * torch.eye(k, dtype=H.dtype)
    inv_diag = torch.stack([torch.linalg.inv(Hd[j:, j:])[0, 0] for j in range(k)])
    prune = None
    for j in range(k):
        if j % 4 == 0:
            score = W[:, j : j + 4] ** 2 / inv_diag[j : j + 4]
            drop = score.topk(2, dim=1, largest=False).indices
            prune = torch.zeros(W.shape[0], 4, dtype=torch.bool).scatter_(1, drop, True)
        Hi = torch.linalg.inv(Hd[j:, j:])
        q = W[:, j].masked_fill(prune[:, j % 4], 0.0)
        W[:, j:] -= ((W[:, j] - q) / Hi[0, 0])[:, None] * Hi[0][None, :]
        W[:, j] = q
    return W


def _err(X, W, Ws):
    return ((X @ (W - Ws).T) ** 2).sum().item()


@pytest.mark.parametrize("seed", [0, 1])
def test_sparsegpt_matches_unblocked_obs_reference(seed):
    _, W, H = _paired_problem(seed)
    ref = _naive_sparsegpt(W, H, 0.01)
    for bs in (4, 12, 16, 128):  # 12: K=64 is not a multiple of the block; lazy updates are exact
        ours = s24.sparsegpt_prune_24(W, H, blocksize=bs, percdamp=0.01)
        assert (ours - ref).abs().max().item() < 1e-9, bs
    assert s24.is_24_sparse(ours)
    assert bool((_groups(ours != 0).sum(-1) == 2).all())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sparsegpt_error_below_bound_and_magnitude(seed):
    """Bound (derived in sparsegpt_prune_24's docstring): the OBS losses add up exactly to
    E = 0.5 * sum_r D_r (H + lambda I) D_r^T with D = W - W_s. Since H = 2 X^T X / n and
    lambda >= 0, ||X D^T||_F^2 = (n / 2) tr(D H D^T) <= n * E = n * sum(losses). Lower bound: the
    least-squares optimum over the same support (no 2:4 solution on that mask can do better)."""
    X, W, H = _paired_problem(seed)
    Ws, losses = s24.sparsegpt_prune_24(W, H, percdamp=0.01, return_losses=True)
    Wm, _ = s24.prune_24_magnitude(W)
    lam = 0.01 * H.diagonal().mean()
    D = W - Ws
    E = 0.5 * ((D @ (H + lam * torch.eye(K_IN, dtype=H.dtype))) * D).sum()
    assert torch.allclose(losses.sum(), E, rtol=1e-9)  # exact identity of the OBS updates
    err_sgpt, err_mag = _err(X, W, Ws), _err(X, W, Wm)
    assert err_sgpt <= N_SAMPLES * losses.sum().item() * (1 + 1e-9)
    assert err_sgpt * 4 < err_mag  # measured 8-10x on these problems
    opt_same_mask = 0.0
    for r in range(N_OUT):
        idx = (Ws[r] != 0).nonzero().flatten()
        sol = torch.linalg.lstsq(X[:, idx], X @ W[r], driver="gelsd").solution
        opt_same_mask += ((X @ W[r] - X[:, idx] @ sol) ** 2).sum().item()
    assert opt_same_mask <= err_sgpt * (1 + 1e-9)
    assert err_sgpt <= 2.0 * opt_same_mask  # measured 1.34-1.38x: near-optimal for its own mask


def test_sparsegpt_float32_and_fp16_weight():
    X, W, H = _paired_problem(3)
    w16 = W.to(torch.float16)
    out = s24.sparsegpt_prune_24(w16, H.float(), blocksize=32)  # float32 compute
    assert out.dtype == torch.float16 and s24.is_24_sparse(out)
    out64 = s24.sparsegpt_prune_24(w16.double(), H, blocksize=32)  # float64 compute
    W16 = w16.double()
    assert _err(X, W16, out.double()) <= 1.05 * _err(X, W16, out64)


def test_sparsegpt_dead_inputs():
    X, W, H = _paired_problem(4)
    H = H.clone()
    H[5, :] = 0
    H[:, 5] = 0
    out = s24.sparsegpt_prune_24(W, H)
    assert torch.isfinite(out).all() and s24.is_24_sparse(out)
    assert bool((out[:, 5] == 0).all())


def test_sparsegpt_validation():
    _, W, H = _paired_problem(0)
    with pytest.raises(ValueError, match=r"\(K, K\)"):
        s24.sparsegpt_prune_24(W, H[:10, :10])
    with pytest.raises(ValueError, match="multiple of 4"):
        s24.sparsegpt_prune_24(W, H, blocksize=6)
    with pytest.raises(ValueError, match="percdamp"):
        s24.sparsegpt_prune_24(W, H, percdamp=-1)
    x = torch.randn(3, K_IN, dtype=torch.float64)  # rank 3 << 64: singular without damping
    with pytest.raises(ValueError, match="positive definite"):
        s24.sparsegpt_prune_24(W, 2 * x.T @ x - 1e-3 * torch.eye(K_IN, dtype=torch.float64), percdamp=0.0)


# ---------------------------------------------------------------------------------------------
# Triton sparse24_linear (interpreter on CPU)
# ---------------------------------------------------------------------------------------------

# bf16 is GPU-only: Triton 3.6's interpreter computes bf16 tl.dot on raw bits (wrong by 1e10)
KERNEL_DTYPES = [(torch.float32, 1e-4), (torch.float16, 1e-2)]


@pytest.mark.parametrize("m,n,k", [(16, 32, 64), (37, 48, 96), (5, 16, 36)])
@pytest.mark.parametrize("dtype,atol", KERNEL_DTYPES)
@pytest.mark.parametrize("has_bias", [True, False])
def test_sparse24_linear_kernel(m, n, k, dtype, atol, has_bias):
    pruned, _ = s24.prune_24_magnitude(torch.randn(n, k).to(dtype))
    values, meta = s24.compress_24(pruned)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype) if has_bias else None
    ours = s24.sparse24_linear(x, values, meta, bias)
    ref32 = s24.sparse24_linear_ref(x, values, meta, bias, upcast=True)
    lowp = s24.sparse24_linear_ref(x, values, meta, bias)
    assert ours.dtype == dtype
    assert_close_rule(ours, ref32, lowp, atol, name=f"sparse24_linear {m}x{k}->{n} {dtype}")


def test_sparse24_linear_3d_input_and_custom_op():
    pruned, _ = s24.prune_24_magnitude(torch.randn(32, 64))
    values, meta = s24.compress_24(pruned)
    x = torch.randn(2, 9, 64)
    y = s24.sparse24_linear(x, values, meta)
    assert y.shape == (2, 9, 32)
    assert_close_rule(y, F.linear(x, pruned), F.linear(x, pruned), 1e-4)
    fake = torch.library.opcheck(torch.ops.sdfast.sparse24_linear.default, (x.reshape(-1, 64), values, meta, None),
                                 test_utils=("test_schema", "test_faketensor"))
    assert all(v == "SUCCESS" for v in fake.values())


def test_sparse24_linear_validation():
    pruned, _ = s24.prune_24_magnitude(torch.randn(32, 64))
    values, meta = s24.compress_24(pruned)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="imply K=64"):
        s24.sparse24_linear(torch.randn(4, 32), values, meta)
    with pytest.raises(TypeError, match="must equal x dtype"):
        s24.sparse24_linear(x.half(), values, meta)
    with pytest.raises(TypeError, match="meta must be uint8"):
        s24.sparse24_linear(x, values, meta.to(torch.int16))
    with pytest.raises(ValueError, match="bias"):
        s24.sparse24_linear(x, values, meta, torch.randn(31))


def test_sparse24_linear_configs_cpu():
    cfgs = s24.sparse24_linear_configs(torch.device("cpu"))
    assert len(cfgs) == 1 and cfgs[0]["BLOCK_K"] % 16 == 0


# ---------------------------------------------------------------------------------------------
# SparseLinear on CPU (reference path: dense matmul of the pruned weight)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_sparse_linear_cpu_equals_pruned_dense(bias):
    lin = nn.Linear(64, 48, bias=bias)
    sl = s24.SparseLinear.from_dense(lin)
    pruned, _ = s24.prune_24_magnitude(lin.weight)
    assert torch.equal(sl.weight, pruned) and not sl.weight.requires_grad
    x = torch.randn(2, 5, 64)
    assert torch.equal(sl(x), F.linear(x, pruned, lin.bias))
    assert sl.chosen == {}  # nothing measured on CPU


def test_sparse_linear_undo_with_and_without_dense_copy():
    lin = nn.Linear(32, 16)
    kept = s24.SparseLinear.from_dense(lin, keep_dense_copy=True)
    assert kept.dense_weight_cpu is not None and torch.equal(kept.to_linear().weight, lin.weight)
    plain = s24.SparseLinear.from_dense(lin)
    back = plain.to_linear()
    assert isinstance(back, nn.Linear) and torch.equal(back.weight, plain.weight)
    assert torch.equal(back.bias, lin.bias)
    assert "dense_weight_cpu" not in dict(kept.state_dict())


def test_sparse_linear_validation():
    lin = nn.Linear(32, 16)
    with pytest.raises(ValueError, match="not 2:4"):
        s24.SparseLinear.from_dense(lin, lin.weight.detach())
    with pytest.raises(ValueError, match="backend"):
        s24.SparseLinear(32, 16, backend="fast")
    with pytest.raises(ValueError, match="timing"):
        s24.SparseLinear(32, 16, timing="wall")
    with pytest.raises(ValueError, match="multiple of 4"):
        s24.SparseLinear(30, 16)


def test_sparse_linear_to_dtype_drops_cached_state():
    sl = s24.SparseLinear.from_dense(nn.Linear(32, 16))
    sl._data["triton"] = s24.compress_24(sl.weight.detach())
    sl.chosen[8] = "triton"
    sl.to(torch.float16)
    assert sl._data == {} and sl.chosen == {} and sl.weight.dtype == torch.float16
    assert s24.is_24_sparse(sl.weight)


# ---------------------------------------------------------------------------------------------
# SparseLinear's per-shape selection logic, on CPU with the Triton backend (interpreter) and a
# stand-in timer (the real timers need CUDA events; the GPU tests run them)
# ---------------------------------------------------------------------------------------------


def _fake_timer(times):
    def timer(fn, *a, **k):
        label = timer.order.pop(0)
        fn()
        return times[label]

    return timer


@pytest.fixture
def fresh_decisions():
    s24.clear_decisions()
    yield
    s24.clear_decisions()


@pytest.mark.parametrize("t_triton,min_speedup,expect", [(5.0, 1.03, "triton"), (9.9, 1.03, "dense"), (12.0, 1.0, "dense")])
def test_selection_keeps_fastest_and_requires_margin(monkeypatch, fresh_decisions, t_triton, min_speedup, expect):
    sl = s24.SparseLinear.from_dense(nn.Linear(64, 32), min_speedup=min_speedup)
    timer = _fake_timer({"dense": 10.0, "triton": t_triton})
    timer.order = ["dense", "triton"]
    monkeypatch.setattr(s24, "time_us_graph", timer)
    x2d = torch.randn(16, 64)
    choice = sl._decide(x2d)
    assert choice.backend == expect
    assert choice.timings_us == {"dense": 10.0, "triton": t_triton}
    assert set(sl._data) == ({"triton"} if expect == "triton" else set())  # losers' copies freed
    # a second layer of the same shape reuses the decision without measuring
    other = s24.SparseLinear.from_dense(nn.Linear(64, 32), min_speedup=min_speedup)
    assert other._decide(x2d) is choice
    assert torch.allclose(sl._run(choice, x2d), F.linear(x2d, sl.weight, sl.bias), atol=1e-4)


def test_selection_drops_a_backend_with_wrong_results(monkeypatch, fresh_decisions, caplog):
    sl = s24.SparseLinear.from_dense(nn.Linear(64, 32))
    timer = _fake_timer({"dense": 10.0, "triton": 1.0})
    timer.order = ["dense", "triton"]
    monkeypatch.setattr(s24, "time_us_graph", timer)
    real_run = s24.SparseLinear._run

    def bad_run(self, choice, x2d):
        y = real_run(self, choice, x2d)
        return y + 1.0 if choice.backend == "triton" else y

    monkeypatch.setattr(s24.SparseLinear, "_run", bad_run)
    with caplog.at_level("WARNING", logger="sdfast.kernels"):
        choice = sl._decide(torch.randn(16, 64))
    assert choice.backend == "dense" and "triton" not in choice.timings_us
    assert any("wrong result" in r.getMessage() for r in caplog.records)


def test_forced_backend_unsupported_falls_back_to_dense(fresh_decisions):
    sl = s24.SparseLinear.from_dense(nn.Linear(64, 32), backend="cusparselt")
    choice = sl._decide(torch.randn(16, 64))  # float32: no hardware 2:4 backend
    assert choice.backend == "dense" and "dtype" in choice.reason


# ---------------------------------------------------------------------------------------------
# The cuSPARSELt / CUTLASS call plumbing, on CPU against emulators of the torch ops' documented
# semantics (ATen cuSPARSELtOps.cpp: result = A_sparse (m, k) @ B (k, n), bias per row of A,
# transpose_result returns the (n, m) result row-major). The real ops run in the GPU tests.
# ---------------------------------------------------------------------------------------------


class _FakeCusparselt:
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


@pytest.fixture
def fake_cslt(monkeypatch):
    fake = _FakeCusparselt()
    monkeypatch.setattr(torch, "_cslt_compress", fake.compress, raising=False)
    monkeypatch.setattr(torch, "_cslt_sparse_mm", fake.mm, raising=False)
    monkeypatch.setattr(torch._C, "_cusparselt", fake, raising=False)
    monkeypatch.setattr(s24, "cusparselt_available", lambda: True)
    return fake


@pytest.mark.parametrize("m", [16, 154, 1])
def test_cusparselt_plumbing(fake_cslt, m):
    w, _ = s24.prune_24_magnitude(torch.randn(48, 64))
    x, b = torch.randn(m, 64), torch.randn(48)
    packed = torch._cslt_compress(w)
    plan = s24.cusparselt_search(packed, s24._pad_rows(x, 8), b)
    assert plan == s24.CusparseltPlan(3, 2, 1)
    y = s24.cusparselt_linear(x, packed, b, plan)
    assert y.shape == (m, 48) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    call = fake_cslt.calls[-1]
    # sparse weight on the left, x^T as a K-major view of the (padded) contiguous x, no copy
    assert call["shape"] == (64, m + (-m) % 8) and not call["contiguous"]
    assert call["transpose_result"] and call["alg_id"] == 3 and call["split_k"] == 2 and call["split_k_mode"] == 1


def test_cutlass_plumbing(monkeypatch):
    def fake_linear(x, packed, meta, bias=None, activation=None, out_dtype=None):
        assert x.shape[0] % 8 == 0
        return F.linear(x, s24.from_cutlass_format(packed, meta), bias)

    monkeypatch.setattr(torch, "_sparse_semi_structured_linear", fake_linear, raising=False)
    w, _ = s24.prune_24_magnitude(torch.randn(64, 128, dtype=torch.float16))
    packed, meta = s24.to_cutlass_format(w)
    x, b = torch.randn(37, 128, dtype=torch.float16), torch.randn(64, dtype=torch.float16)
    y = s24.cutlass_linear(x, packed, meta, b)
    assert y.shape == (37, 64)
    torch.testing.assert_close(y, F.linear(x, w, b))


def test_selection_flow_with_every_backend(monkeypatch, fake_cslt, fresh_decisions):
    """The whole auto-selection on CPU fp16 with emulated cuSPARSELt/CUTLASS and a stand-in timer:
    candidates, labels, plan, chosen backend and the cleanup of the losers' compressed copies
    (with cuSPARSELt's search switched on; off, its candidate is not built: next test). Our Triton
    kernel is not a candidate where a sparse-tensor-core backend runs the shape."""
    monkeypatch.setenv("SDFAST_CUSPARSELT_SEARCH", "1")
    monkeypatch.setattr(torch, "_sparse_semi_structured_linear",
                        lambda x, p, m, bias=None: F.linear(x, s24.from_cutlass_format(p, m), bias), raising=False)
    sl = s24.SparseLinear.from_dense(nn.Linear(128, 64, dtype=torch.float16))
    times = {"dense": 10.0, "cusparselt:alg0": 9.0, "cusparselt:search": 6.0, "cutlass": 8.0}
    timer = _fake_timer(times)
    timer.order = list(times)
    monkeypatch.setattr(s24, "time_us_graph", timer)
    x2d = torch.randn(32, 128, dtype=torch.float16)
    choice = sl._decide(x2d)
    assert choice.backend == "cusparselt" and choice.plan == s24.CusparseltPlan(3, 2, 1)
    assert choice.timings_us == times and set(sl._data) == {"cusparselt"}
    torch.testing.assert_close(sl._run(choice, x2d), F.linear(x2d, sl.weight, sl.bias))


def test_cusparselt_search_is_off_by_default(monkeypatch, fake_cslt, fresh_decisions):
    """cuSPARSELt's search broke the CUDA context on the H200: by default it never runs, and the
    default-algorithm cuSPARSELt still competes."""
    monkeypatch.delenv("SDFAST_CUSPARSELT_SEARCH", raising=False)
    assert not s24.cusparselt_search_enabled()
    monkeypatch.setattr(s24, "cusparselt_search", lambda *a, **k: pytest.fail("search ran"))
    monkeypatch.setattr(torch, "_sparse_semi_structured_linear",
                        lambda x, p, m, bias=None: F.linear(x, s24.from_cutlass_format(p, m), bias), raising=False)
    sl = s24.SparseLinear.from_dense(nn.Linear(128, 64, dtype=torch.float16))
    times = {"dense": 10.0, "cusparselt:alg0": 6.0, "cutlass": 8.0}
    timer = _fake_timer(times)
    timer.order = list(times)
    monkeypatch.setattr(s24, "time_us_graph", timer)
    choice = sl._decide(torch.randn(32, 128, dtype=torch.float16))
    assert choice.backend == "cusparselt" and choice.plan == s24.CusparseltPlan()
    assert choice.timings_us == times


def test_out_of_memory_while_measuring_decides_nothing(monkeypatch, fresh_decisions):
    """An OOM while a backend is measured is the input's size, not the backend's fault: it is raised and
    no decision is cached, so the next call (memory freed) measures again."""
    sl = s24.SparseLinear.from_dense(nn.Linear(128, 64, dtype=torch.float16))
    state = {"oom": True}

    def timer(fn, *a, **k):
        if state["oom"]:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        fn()
        return 1.0

    monkeypatch.setattr(s24, "time_us_graph", timer)
    x2d = torch.randn(32, 128, dtype=torch.float16)
    with pytest.raises(torch.OutOfMemoryError):
        sl._decide(x2d)
    assert sl._key(x2d) not in s24._DECISIONS
    state["oom"] = False
    assert sl._decide(x2d) is not None and sl._key(x2d) in s24._DECISIONS


def test_benchmark_module_shapes_and_cpu_guard():
    from benchmarks.kernel_benches import sparse as bench

    shapes = {(r["model"], r["M"], r["K"], r["N"]) for r in bench._shapes(quick=False)}
    for want in [("sd15", 8192, 320, 2560), ("sd15", 8192, 1280, 320), ("sd15", 2048, 640, 5120), ("sd15", 512, 1280, 10240),
                 ("sd15", 128, 5120, 1280), ("sd15", 154, 768, 320), ("sdxl", 8192, 640, 5120), ("sdxl", 2048, 1280, 10240),
                 ("sdxl", 2048, 5120, 1280), ("sdxl", 154, 2048, 1280)]:
        assert want in shapes, want
    assert {r["M"] for r in bench._shapes(quick=False) if r["model"] == "sdxl"} == {8192, 2048, 154}
    row = bench._row({"gpu": "x"}, bench="b", backend="dense", us_graph=1.0, extra=2)
    assert list(row)[:12] == list(bench._LEAD) and list(row)[-1] == "gpu"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            bench.run(quick=True)


def test_a_config_that_does_not_compile_falls_back_to_the_next(monkeypatch, caplog):
    """Triton 3.6 failed to compile some tiles on sm_90 ("Illegal shared layout"): the launcher remembers
    the failing config, logs it and runs the next one, with the same result."""
    small = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=4, num_warps=1, num_stages=1)
    broken = dict(small, BLOCK_N=32)
    monkeypatch.setattr(s24, "sparse24_linear_configs", lambda device=None: [dict(broken), dict(small)])
    monkeypatch.setattr(s24, "_FAILED_CONFIGS", set())
    real, tried = s24._launch_sparse24, []

    def launch(x2d, values, meta, bias, y, cfg):
        tried.append(cfg["BLOCK_N"])
        if cfg["BLOCK_N"] == 32:
            raise RuntimeError("PassManager::run failed")
        return real(x2d, values, meta, bias, y, cfg)

    monkeypatch.setattr(s24, "_launch_sparse24", launch)
    w, _ = s24.prune_24_magnitude(torch.randn(32, 64))
    values, meta = s24.compress_24(w)
    x = torch.randn(5, 64)
    with caplog.at_level(logging.INFO):
        y1 = s24.sparse24_linear(x, values, meta)
        y2 = s24.sparse24_linear(x, values, meta)
    torch.testing.assert_close(y1, F.linear(x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y2, y1)
    assert tried == [32, 16, 16]  # the broken config is not tried again
    assert "did not compile" in caplog.text

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(s24, "_launch_sparse24", oom)
    with pytest.raises(torch.OutOfMemoryError):  # an OOM is raised as is, and no config is blamed
        s24.sparse24_linear(x, values, meta)
    assert len(s24._FAILED_CONFIGS) == 1


def test_shape_decisions_report_the_choices():
    import kernels.gemm.sparse24 as mod

    mod.clear_decisions()
    assert mod.shape_decisions() == []
    key = (0, 5120, 640, 8192, torch.float16, True, "auto", "graph", 1.0)
    mod._DECISIONS[key] = mod._Choice("cusparselt", timings_us={"dense": 86.4, "cusparselt": 77.7}, reason="fastest")
    try:
        assert mod.shape_decisions() == [{"N": 5120, "K": 640, "M": 8192, "dtype": "float16", "backend": "cusparselt",
                                          "reason": "fastest", "timings_us": {"dense": 86.4, "cusparselt": 77.7}}]
    finally:
        mod.clear_decisions()


# ---------------------------------------------------------------------------------------------
# SparseGPT's per-block loop as one Triton kernel (kernels.gemm.sparsegpt_block)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,nb", [(37, 32), (8, 12), (70, 128)], ids=["37x32", "8x12-not-pow2", "70x128"])
def test_sparsegpt_block_kernel_matches_torch_loop(n, nb, monkeypatch):
    """The Triton block (interpreter) against the PyTorch loop on the same (W1, U1): same 2:4 masks, same
    pruned weights, errors and losses up to fp32 rounding. Row counts that are not a multiple of the
    program's rows, a block narrower than its power of two."""
    from kernels.gemm import sparsegpt_block as sb

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


def test_sparsegpt_float32_uses_the_block_kernel(monkeypatch):
    """End to end in fp32 (the kernel's path under the interpreter) against float64 (the PyTorch loop)."""
    from kernels.gemm import sparsegpt_block as sb

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    real = sb._sparsegpt_block_kernel

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setattr(sb, "_sparsegpt_block_kernel", Spy())
    X, W, H = _paired_problem(5)
    out32 = s24.sparsegpt_prune_24(W.float(), H.float(), blocksize=32)
    out64 = s24.sparsegpt_prune_24(W, H, blocksize=32)
    assert len(calls) == K_IN // 32  # one launch per block
    assert s24.is_24_sparse(out32)
    assert _err(X, W, out32.double()) <= 1.01 * _err(X, W, out64)


def test_sparsegpt_block_rejects_bad_shapes():
    from kernels.gemm.sparsegpt_block import sparsegpt_block

    with pytest.raises(ValueError, match="nb % 4"):
        sparsegpt_block(torch.zeros(4, 6), torch.eye(6), torch.zeros(4))


def test_cusparselt_runtime_version_reads_the_loaded_library(monkeypatch):
    """The version comes from the library the process runs (torch reports the one it was built with): None
    without cuSPARSELt, else asked of the copy the global scope gives, else of the first mapped copy; a failing
    status gives None."""
    if os.path.exists("/proc/self/maps"):
        assert any(os.path.basename(p).startswith("libc.so") for p in s24._loaded_libraries("libc.so"))
    assert s24._loaded_libraries("libnot-a-library-sdfast") == []

    def fake_lib(version, status=0, has_symbol=True):
        class Lib:
            pass

        def get_property(prop, ref):
            ref._obj.value = version[prop]
            return status

        lib = Lib()
        if has_symbol:
            lib.cusparseLtGetProperty = get_property
        return lib

    monkeypatch.setattr(s24, "cusparselt_available", lambda: False)
    s24.cusparselt_runtime_version.cache_clear()
    assert s24.cusparselt_runtime_version() is None
    monkeypatch.setattr(s24, "cusparselt_available", lambda: True)
    opened = []

    def cdll(path):
        opened.append(path)
        return fake_lib((0, 8, 1)) if path is None else fake_lib((0, 8, 0))

    monkeypatch.setattr(s24.ctypes, "CDLL", cdll)
    s24.cusparselt_runtime_version.cache_clear()
    assert s24.cusparselt_runtime_version() == (0, 8, 1) and opened == [None]  # the global scope's copy
    monkeypatch.setattr(s24.ctypes, "CDLL", lambda path: fake_lib((0, 8, 0), has_symbol=path is not None))
    monkeypatch.setattr(s24, "_loaded_libraries", lambda prefix: ["/x/libcusparseLt.so.0"])
    s24.cusparselt_runtime_version.cache_clear()
    assert s24.cusparselt_runtime_version() == (0, 8, 0)  # not in the global scope: the mapped copy
    monkeypatch.setattr(s24.ctypes, "CDLL", lambda path: fake_lib((0, 8, 0), status=7))
    s24.cusparselt_runtime_version.cache_clear()
    assert s24.cusparselt_runtime_version() is None
    s24.cusparselt_runtime_version.cache_clear()
