"""CPU tests of kernels/sparse24/kernel.py: the Triton sparse24_linear kernel (interpreter) against its
reference and its launch configs (the benchmark module's shapes: test_benchmark.py)."""

import logging

import pytest
import torch
import torch.nn.functional as F

from kernels.sparse24 import format as fmt
from kernels.sparse24 import kernel as k24
from kernels.sparse24 import prune
from kernels.testing import assert_close_rule



# ---------------------------------------------------------------------------------------------
# Triton sparse24_linear (interpreter on CPU)
# ---------------------------------------------------------------------------------------------

# bf16 is GPU-only: Triton 3.6's interpreter computes bf16 tl.dot on raw bits (wrong by 1e10)
KERNEL_DTYPES = [(torch.float32, 1e-4), (torch.float16, 1e-2)]


@pytest.mark.parametrize("m,n,k", [(16, 32, 64), (37, 48, 96), (5, 16, 36)])
@pytest.mark.parametrize("dtype,atol", KERNEL_DTYPES)
@pytest.mark.parametrize("has_bias", [True, False])
def test_sparse24_linear_kernel(m, n, k, dtype, atol, has_bias):
    pruned, _ = prune.prune_24_magnitude(torch.randn(n, k).to(dtype))
    values, meta = fmt.compress_24(pruned)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype) if has_bias else None
    ours = k24.sparse24_linear(x, values, meta, bias)
    ref32 = k24.sparse24_linear_ref(x, values, meta, bias, upcast=True)
    lowp = k24.sparse24_linear_ref(x, values, meta, bias)
    assert ours.dtype == dtype
    assert_close_rule(ours, ref32, lowp, atol, name=f"sparse24_linear {m}x{k}->{n} {dtype}")


def test_sparse24_linear_3d_input_and_custom_op():
    pruned, _ = prune.prune_24_magnitude(torch.randn(32, 64))
    values, meta = fmt.compress_24(pruned)
    x = torch.randn(2, 9, 64)
    y = k24.sparse24_linear(x, values, meta)
    assert y.shape == (2, 9, 32)
    assert_close_rule(y, F.linear(x, pruned), F.linear(x, pruned), 1e-4)
    fake = torch.library.opcheck(torch.ops.sdfast.sparse24_linear.default, (x.reshape(-1, 64), values, meta, None),
                                 test_utils=("test_schema", "test_faketensor"))
    assert all(v == "SUCCESS" for v in fake.values())


def test_sparse24_linear_validation():
    pruned, _ = prune.prune_24_magnitude(torch.randn(32, 64))
    values, meta = fmt.compress_24(pruned)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="imply K=64"):
        k24.sparse24_linear(torch.randn(4, 32), values, meta)
    with pytest.raises(TypeError, match="must equal x dtype"):
        k24.sparse24_linear(x.half(), values, meta)
    with pytest.raises(TypeError, match="meta must be uint8"):
        k24.sparse24_linear(x, values, meta.to(torch.int16))
    with pytest.raises(ValueError, match="bias"):
        k24.sparse24_linear(x, values, meta, torch.randn(31))


def test_sparse24_linear_configs_cpu():
    cfgs = k24.sparse24_linear_configs(torch.device("cpu"))
    assert len(cfgs) == 1 and cfgs[0]["BLOCK_K"] % 16 == 0


def test_a_config_that_does_not_compile_falls_back_to_the_next(monkeypatch, caplog):
    """Triton 3.6 failed to compile some tiles on sm_90 ("Illegal shared layout"): the launcher remembers
    the failing config, logs it and runs the next one, with the same result."""
    small = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=4, num_warps=1, num_stages=1)
    broken = dict(small, BLOCK_N=32)
    monkeypatch.setattr(k24, "sparse24_linear_configs", lambda device=None: [dict(broken), dict(small)])
    monkeypatch.setattr(k24, "_FAILED_CONFIGS", set())
    real, tried = k24._launch_sparse24, []

    def launch(x2d, values, meta, bias, y, cfg):
        tried.append(cfg["BLOCK_N"])
        if cfg["BLOCK_N"] == 32:
            raise RuntimeError("PassManager::run failed")
        return real(x2d, values, meta, bias, y, cfg)

    monkeypatch.setattr(k24, "_launch_sparse24", launch)
    w, _ = prune.prune_24_magnitude(torch.randn(32, 64))
    values, meta = fmt.compress_24(w)
    x = torch.randn(5, 64)
    with caplog.at_level(logging.INFO):
        y1 = k24.sparse24_linear(x, values, meta)
        y2 = k24.sparse24_linear(x, values, meta)
    torch.testing.assert_close(y1, F.linear(x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y2, y1)
    assert tried == [32, 16, 16]  # the broken config is not tried again
    assert "did not compile" in caplog.text

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(k24, "_launch_sparse24", oom)
    with pytest.raises(torch.OutOfMemoryError):  # an OOM is raised as is, and no config is blamed
        k24.sparse24_linear(x, values, meta)
    assert len(k24._FAILED_CONFIGS) == 1
