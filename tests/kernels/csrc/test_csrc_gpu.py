"""GPU tests (marker ``gpu``) of the CUDA C++ cp.async W4A16 GEMM (kernels/csrc, built on first use) at the real
SD1.5 / SDXL linear shapes (benchmarks/sd_shapes.py) against the fp32 reference and the Triton kernel, its edges
and its errors. Run on the GPU machine: ``pytest -m gpu tests/kernels/csrc/test_csrc_gpu.py``."""

import pytest
import torch

from benchmarks.sd_shapes import SD_LINEAR_SHAPES
from kernels.gemm.w4a16 import quantize_w4, w4a16_linear, w4a16_linear_ref
from kernels.testing import assert_close_rule

pytestmark = pytest.mark.gpu

# distinct (M, K, N, epilogue) of the SD shapes
SHAPES = sorted({(M, K, N, epi) for _, _, M, K, N, epi, _ in SD_LINEAR_SHAPES}, key=str)
IDS = [f"M{M}-K{K}-N{N}-{epi}" for M, K, N, epi in SHAPES]
DEV = "cuda"


@pytest.fixture(scope="module")
def csrc():
    from kernels.csrc import build

    return build


@pytest.mark.parametrize("M,K,N,epi", SHAPES, ids=IDS)
def test_csrc_w4a16_sd_shapes(csrc, M, K, N, epi):
    torch.manual_seed(0)
    rows = 2 * N if epi == "geglu" else N
    x = torch.randn(M, K, device=DEV, dtype=torch.float16)
    w = torch.randn(rows, K, device=DEV) / K**0.5
    b = torch.randn(rows, device=DEV).half()
    qw, s, z = quantize_w4(w, 128, scale_dtype=torch.float16)
    ours = csrc.gemm_w4a16(x, qw, s, z, b, group_size=128)
    ref32 = w4a16_linear_ref(x.float(), qw, s, z, b.float(), group_size=128).float()
    lowp = w4a16_linear_ref(x, qw, s, z, b, group_size=128, upcast=False)
    assert_close_rule(ours, ref32, lowp, 2e-2, f"csrc w4a16 M{M} K{K} N{rows}")
    triton_out = w4a16_linear(x, qw, s, z, b, group_size=128)
    assert_close_rule(ours, ref32, triton_out, 2e-2, "csrc vs triton w4a16")


def test_csrc_w4a16_edges_and_errors(csrc):
    x = torch.randn(77, 96, device=DEV, dtype=torch.float16)  # K = 96: groups of 32, N tail
    qw, s, z = quantize_w4(torch.randn(45, 96, device=DEV), 32, scale_dtype=torch.float16)
    ours = csrc.gemm_w4a16(x, qw, s, z, group_size=32)
    ref32 = w4a16_linear_ref(x.float(), qw, s, z, group_size=32).float()
    assert_close_rule(ours, ref32, ref32.half(), 2e-2, "csrc w4a16 edge")
    with pytest.raises(ValueError, match="K % 32"):
        csrc.gemm_w4a16(torch.randn(4, 40, device=DEV).half(), *quantize_w4(torch.randn(8, 40, device=DEV), 16,
                                                                             scale_dtype=torch.float16), group_size=16)
