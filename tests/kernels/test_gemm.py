"""kernels.gemm.matmul.linear (Triton GEMM + fused epilogue) against its fp32 reference, on CPU
under TRITON_INTERPRET=1 (small shapes; odd M, N, K; every constexpr branch: bias, residual,
epilogue none/GELU/GEGLU, EVEN_K, fp32 IEEE dot). bf16 runs only on the GPU (the interpreter's
bf16 tl.dot is wrong) — see test_gemm_gpu.py."""

import logging

import pytest
import torch

from kernels.gemm.matmul import linear, linear_configs, linear_ref, smem_bytes
from kernels.testing import assert_close_rule

DTYPES = [(torch.float32, 1e-4), (torch.float16, 2e-3)]

# (lead shape, K, N): odd everything, K a multiple of BLOCK_K (EVEN_K), a single row, 3-D input
SHAPES = [((37,), 45, 19), ((64,), 64, 32), ((1,), 77, 33), ((2, 5), 40, 24)]


def _inputs(lead, K, N, dtype, epilogue, with_bias, with_res):
    n_rows = 2 * N if epilogue == "geglu" else N
    x = torch.randn(*lead, K).to(dtype)
    w = (torch.randn(n_rows, K) / K**0.5).to(dtype)
    b = torch.randn(n_rows).to(dtype) if with_bias else None
    r = torch.randn(*lead, N).to(dtype) if with_res else None
    return x, w, b, r


def _check(x, w, b, r, epilogue, out_scale, atol, name):
    ours = linear(x, w, b, epilogue=epilogue, residual=r, out_scale=out_scale)
    f = lambda t: None if t is None else t.float()  # noqa: E731
    ref32 = linear_ref(x.float(), w.float(), f(b), epilogue=epilogue, residual=f(r), out_scale=out_scale)
    lowp = linear_ref(x, w, b, epilogue=epilogue, residual=r, out_scale=out_scale, upcast=False)
    assert ours.dtype == x.dtype
    assert_close_rule(ours, ref32, lowp, atol, name)


@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("lead,K,N", SHAPES)
@pytest.mark.parametrize("epilogue", [None, "gelu", "geglu"])
def test_linear_matches_reference(dtype, atol, lead, K, N, epilogue):
    x, w, b, r = _inputs(lead, K, N, dtype, epilogue, True, True)
    _check(x, w, b, r, epilogue, 0.5, atol, f"{epilogue} {dtype} {lead} K={K} N={N}")


@pytest.mark.parametrize("with_bias,with_res,out_scale", [(False, False, 1.0), (True, False, 1.0), (False, True, 2.0)])
def test_linear_optional_parts(with_bias, with_res, out_scale):
    x, w, b, r = _inputs((29,), 50, 21, torch.float16, None, with_bias, with_res)
    _check(x, w, b, r, None, out_scale, 2e-3, f"bias={with_bias} res={with_res}")


def test_geglu_halves_are_value_and_gate():
    # diffusers GEGLU: proj(x).chunk(2) -> hidden * gelu(gate): rows [0, N) value, [N, 2N) gate
    x = torch.randn(9, 16)
    w = torch.randn(2 * 8, 16)
    y = linear(x, w, epilogue="geglu")
    h = x @ w.t()
    want = h[:, :8] * torch.nn.functional.gelu(h[:, 8:])
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
    swapped = h[:, 8:] * torch.nn.functional.gelu(h[:, :8])
    assert (y - swapped).abs().max() > 1e-2


def test_noncontiguous_input():
    base = torch.randn(40, 2 * 33)
    x = base[:, ::2]  # stride 2 along K
    w = torch.randn(17, 33)
    torch.testing.assert_close(linear(x, w), x @ w.t(), atol=1e-4, rtol=1e-4)


def test_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="epilogue"):
        linear(x, torch.randn(4, 8), epilogue="relu")
    with pytest.raises(ValueError, match="K=8"):
        linear(x, torch.randn(4, 9))
    with pytest.raises(ValueError, match="2N rows"):
        linear(x, torch.randn(5, 8), epilogue="geglu")
    with pytest.raises(TypeError, match="dtype"):
        linear(x, torch.randn(4, 8).half())
    with pytest.raises(TypeError, match="not supported"):
        linear(x.double(), torch.randn(4, 8).double())
    with pytest.raises(ValueError, match="residual"):
        linear(x, torch.randn(4, 8), residual=torch.randn(4, 5))
    with pytest.raises(ValueError, match="bias"):
        linear(x, torch.randn(4, 8), torch.randn(3))


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = linear(torch.empty(2, 5, 40), torch.empty(32, 40), epilogue="geglu")
        assert tuple(y.shape) == (2, 5, 16)
        y = linear(torch.empty(7, 40, dtype=torch.float16), torch.empty(9, 40, dtype=torch.float16))
        assert tuple(y.shape) == (7, 9) and y.dtype == torch.float16


def test_fallback_without_interpreter_is_logged(monkeypatch, caplog):
    import kernels.dispatch as d

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(d, "_logged", set())
    x, w = torch.randn(5, 12), torch.randn(7, 12)
    with caplog.at_level(logging.INFO, logger="sdfast.kernels"):
        y = linear(x, w, epilogue="gelu")
    torch.testing.assert_close(y, linear_ref(x, w, epilogue="gelu"))
    assert any("linear" in r.getMessage() and "reference" in r.getMessage() for r in caplog.records)


def test_configs_respect_shared_memory():
    assert smem_bytes(128, 128, 64, 4, 2) == 4 * (128 * 64 + 128 * 64) * 2
    cpu = linear_configs(torch.device("cpu"), 2)
    assert len(cpu) == 1 and cpu[0].num_stages == 1


@pytest.mark.parametrize("limit", [48 * 1024, 100 * 1024, 227 * 1024])
@pytest.mark.parametrize("elem_bytes,n_b", [(2, 1), (2, 2), (4, 1)])
def test_gpu_configs_fit_the_device(monkeypatch, limit, elem_bytes, n_b):
    import kernels.gemm.matmul as mm

    monkeypatch.setattr(mm, "device_smem_limit", lambda idx: limit)
    cfgs = mm.linear_configs(torch.device("cuda", 0), elem_bytes, n_b)
    assert cfgs
    for c in cfgs:
        k = c.kwargs
        used = smem_bytes(k["BLOCK_M"], k["BLOCK_N"], k["BLOCK_K"], c.num_stages, elem_bytes, n_b)
        assert used <= limit


@pytest.mark.parametrize("epilogue", [None, "geglu"])
def test_gemm_benchmark_candidates_run_on_cpu(epilogue):
    """The benchmark's backends (minus cuBLAS-only and CUDA C++ ones) give the product they claim."""
    from benchmarks.kernel_benches import gemm as bench

    shape = dict(model="t", layer="t", M=20, K=64, N=16, epilogue=epilogue, count=1)
    cands = bench._candidates(shape, "main", {}, device="cpu")
    refs = cands.pop("_refs")
    assert {"cublas_fp16", "triton_fp16", "w8a8_int8", "w8a8_fp8", "w4a16_triton", "int8_outlier"} <= set(cands)
    for name, (fn, kind) in cands.items():
        if kind not in refs:
            continue
        out = fn()
        ref = refs[kind]
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < (0.12 if "w4a16" in name or "fp8" in name else 0.03), f"{name}: rel err {rel:.3f}"
    assert bench.run.__doc__ and bench._shapes(True) and len(bench._shapes(False)) == 20
