"""CPU tests of kernels/sparse24/cusparselt.py: the cuSPARSELt / CUTLASS call plumbing against emulators of
the torch ops (tests/kernels/sparse24/fake_cusparselt.py), torch's semi-structured subclass on the CPU, the
runtime-version probe. The real ops run in the GPU tests (test_sparse24_gpu.py)."""

import os

import pytest
import torch
import torch.nn.functional as F

from kernels.sparse24 import cusparselt as cslt
from kernels.sparse24 import format as fmt
from kernels.sparse24 import prune
from tests.kernels.sparse24 import fake_cusparselt


def test_to_semi_structured_rejects_cpu_and_bad_backend():
    pruned, _ = prune.prune_24_magnitude(torch.randn(64, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="backend"):
        cslt.to_semi_structured(pruned, "cublas")
    with pytest.raises(RuntimeError, match="CUDA"):
        cslt.to_semi_structured(pruned, "cusparselt")


@pytest.fixture
def fake_cslt(monkeypatch):
    return fake_cusparselt.install(monkeypatch)


@pytest.mark.parametrize("m", [16, 154, 1])
def test_cusparselt_plumbing(fake_cslt, m):
    w, _ = prune.prune_24_magnitude(torch.randn(48, 64))
    x, b = torch.randn(m, 64), torch.randn(48)
    packed = torch._cslt_compress(w)
    plan = cslt.cusparselt_search(packed, cslt.pad_rows(x, 8), b)
    assert plan == cslt.CusparseltPlan(3, 2, 1)
    y = cslt.cusparselt_linear(x, packed, b, plan)
    assert y.shape == (m, 48) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    call = fake_cslt.calls[-1]
    # sparse weight on the left, x^T as a K-major view of the (padded) contiguous x, no copy
    assert call["shape"] == (64, m + (-m) % 8) and not call["contiguous"]
    assert call["transpose_result"] and call["alg_id"] == 3 and call["split_k"] == 2 and call["split_k_mode"] == 1


def test_searched_plan_is_searched_once_per_shape(fake_cslt, monkeypatch):
    """Layers of one shape share cuSPARSELt's search (its answer depends on the shape, not the values); another M
    searches again; ``search=False`` only reads."""
    calls = []
    real = cslt.cusparselt_search
    monkeypatch.setattr(cslt, "cusparselt_search", lambda *a: calls.append(a[1].shape) or real(*a))
    w1, _ = prune.prune_24_magnitude(torch.randn(48, 64))
    w2, _ = prune.prune_24_magnitude(torch.randn(48, 64))
    x, b = torch.randn(154, 64), torch.randn(48)
    assert cslt.searched_plan(torch._cslt_compress(w1), x, b, 48, search=False) is None and calls == []
    assert cslt.searched_plan(torch._cslt_compress(w1), x, b, 48) == cslt.CusparseltPlan(3, 2, 1)
    assert calls == [(160, 64)]  # M padded to a multiple of 8
    assert cslt.searched_plan(torch._cslt_compress(w2), x, b, 48) == cslt.CusparseltPlan(3, 2, 1)
    assert cslt.searched_plan(torch._cslt_compress(w2), x, b, 48, search=False) == cslt.CusparseltPlan(3, 2, 1)
    assert len(calls) == 1
    cslt.searched_plan(torch._cslt_compress(w2), x[:16], b, 48)
    assert calls == [(160, 64), (16, 64)]


def test_cutlass_plumbing(monkeypatch):
    def fake_linear(x, packed, meta, bias=None, activation=None, out_dtype=None):
        assert x.shape[0] % 8 == 0
        return F.linear(x, fmt.from_cutlass_format(packed, meta), bias)

    monkeypatch.setattr(torch, "_sparse_semi_structured_linear", fake_linear, raising=False)
    w, _ = prune.prune_24_magnitude(torch.randn(64, 128, dtype=torch.float16))
    packed, meta = fmt.to_cutlass_format(w)
    x, b = torch.randn(37, 128, dtype=torch.float16), torch.randn(64, dtype=torch.float16)
    y = cslt.cutlass_linear(x, packed, meta, b)
    assert y.shape == (37, 64)
    torch.testing.assert_close(y, F.linear(x, w, b))


def test_cusparselt_runtime_version_reads_the_loaded_library(monkeypatch):
    """The version comes from the library the process runs (torch reports the one it was built with): None
    without cuSPARSELt, else asked of the copy the global scope gives, else of the first mapped copy; a failing
    status gives None."""
    if os.path.exists("/proc/self/maps"):
        assert any(os.path.basename(p).startswith("libc.so") for p in cslt.loaded_libraries("libc.so"))
    assert cslt.loaded_libraries("libnot-a-library-sdfast") == []

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

    monkeypatch.setattr(cslt, "cusparselt_available", lambda: False)
    cslt.cusparselt_runtime_version.cache_clear()
    assert cslt.cusparselt_runtime_version() is None
    monkeypatch.setattr(cslt, "cusparselt_available", lambda: True)
    opened = []

    def cdll(path):
        opened.append(path)
        return fake_lib((0, 8, 1)) if path is None else fake_lib((0, 8, 0))

    monkeypatch.setattr(cslt.ctypes, "CDLL", cdll)
    cslt.cusparselt_runtime_version.cache_clear()
    assert cslt.cusparselt_runtime_version() == (0, 8, 1) and opened == [None]  # the global scope's copy
    monkeypatch.setattr(cslt.ctypes, "CDLL", lambda path: fake_lib((0, 8, 0), has_symbol=path is not None))
    monkeypatch.setattr(cslt, "loaded_libraries", lambda prefix: ["/x/libcusparseLt.so.0"])
    cslt.cusparselt_runtime_version.cache_clear()
    assert cslt.cusparselt_runtime_version() == (0, 8, 0)  # not in the global scope: the mapped copy
    monkeypatch.setattr(cslt.ctypes, "CDLL", lambda path: fake_lib((0, 8, 0), status=7))
    cslt.cusparselt_runtime_version.cache_clear()
    assert cslt.cusparselt_runtime_version() is None
    cslt.cusparselt_runtime_version.cache_clear()

