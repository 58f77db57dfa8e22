"""GPU tests (marker ``gpu``, sm_90+): the TMA GEGLU GEMM's every tile config at SD1.5's and SDXL's GEGLU shapes
against the fp32 reference (flash-attention's rule, kernels.testing, against cuBLAS fp16 + GEGLU), bf16, CUDA graph
replay on new inputs. ``geglu_projection``'s measured choice is test_projection_gpu.py's."""

import pytest
import torch

from kernels.geglu.ref import geglu_linear_ref
from kernels.geglu.triton_tma_gemm import CONFIGS, geglu_linear
from kernels.testing import assert_close_rule, poison

pytestmark = pytest.mark.gpu
if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("the TMA GEGLU GEMM needs sm_90", allow_module_level=True)

DEV = "cuda"
# (M, K, N): SD1.5 levels 0-2 and mid, SDXL levels 1-2 (batch 2 with CFG)
SHAPES = [(8192, 320, 1280), (2048, 640, 2560), (512, 1280, 5120), (128, 1280, 5120), (8192, 640, 2560),
          (2048, 1280, 5120)]


def _inputs(M, K, N, dtype=torch.float16):
    x = torch.randn(M, K, device=DEV).to(dtype)
    w = (torch.randn(2 * N, K, device=DEV) / K**0.5).to(dtype)
    b = (torch.randn(2 * N, device=DEV) * 0.1).to(dtype)
    return x, w, b


def _check(ours, x, w, b, atol, name):
    ref32 = geglu_linear_ref(x.float(), w.float(), b.float())
    lowp = geglu_linear_ref(x, w, b, upcast=False)
    assert_close_rule(ours, ref32, lowp, atol, name)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("M,K,N", SHAPES, ids=lambda v: str(v))
def test_every_config_at_sd_shapes(M, K, N, config):
    x, w, b = _inputs(M, K, N)
    out = poison(torch.empty(M, N, device=DEV, dtype=x.dtype))
    _check(geglu_linear(x, w, b, config, out=out), x, w, b, 1e-2, f"M{M} K{K} N{N} {config}")


def test_bf16():
    x, w, b = _inputs(2048, 640, 2560, torch.bfloat16)
    _check(geglu_linear(x, w, b), x, w, b, 5e-2, "bf16")


def test_graph_replay_sees_new_inputs():
    x, w, b = _inputs(2048, 640, 2560)
    geglu_linear(x, w, b)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = geglu_linear(x, w, b)
    x.copy_(torch.randn_like(x))
    w.mul_(0.5)  # an in-place weight change (a fused LoRA) is seen too
    g.replay()
    _check(y, x, w, b, 1e-2, "replay")
