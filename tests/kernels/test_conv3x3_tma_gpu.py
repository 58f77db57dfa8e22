"""GPU tests (marker ``gpu``, sm_90+): the TMA 3x3 convolution's every tile config at SD1.5's and SDXL's convolution
shapes against the fp32 reference (DESIGN.md's rule against cuDNN fp16), bias, bf16, the persistent tile walk over
more tiles than SMs, and CUDA graph replay on new inputs and an in-place weight change."""

import pytest
import torch
import torch.nn.functional as F

from kernels.conv.conv3x3_tma import CONFIGS, conv3x3_ref, tma_conv3x3
from kernels.testing import assert_close_rule, poison

pytestmark = pytest.mark.gpu
if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("the TMA convolution needs sm_90", allow_module_level=True)

DEV = "cuda"
CL = torch.channels_last
# (Cin, Cout, H, W), batch 2: one per SD1.5 level and SDXL's 128x128 level, with the concatenated-skip widths
SHAPES = [(320, 320, 64, 64), (960, 320, 64, 64), (640, 640, 32, 32), (1920, 640, 32, 32), (1280, 1280, 16, 16),
          (2560, 1280, 8, 8), (320, 320, 128, 128)]


def _inputs(cin, cout, h, w, dtype=torch.float16, n=2):
    x = torch.randn(n, cin, h, w, device=DEV).to(dtype).contiguous(memory_format=CL)
    wt = (torch.randn(cout, cin, 3, 3, device=DEV) / (9 * cin) ** 0.5).to(dtype).contiguous(memory_format=CL)
    b = (torch.randn(cout, device=DEV) * 0.1).to(dtype)
    return x, wt, b


def _check(ours, x, wt, b, atol, name):
    ref32 = conv3x3_ref(x.float(), wt.float(), None if b is None else b.float())
    lowp = F.conv2d(x, wt, b, 1, 1)
    assert ours.is_contiguous(memory_format=CL), f"{name}: output not channels_last"
    assert_close_rule(ours, ref32, lowp, atol, name)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("cin,cout,h,w", SHAPES, ids=lambda v: str(v))
def test_every_config_at_sd_shapes(cin, cout, h, w, config):
    x, wt, _ = _inputs(cin, cout, h, w)
    out = poison(torch.empty(2, cout, h, w, device=DEV, dtype=x.dtype).contiguous(memory_format=CL))
    _check(tma_conv3x3(x, wt, None, config, out=out), x, wt, None, 1e-2, f"{cin}->{cout} {h}x{w} {config}")


@pytest.mark.parametrize("h,w", [(65, 65), (9, 7), (96, 96)])
def test_bias_and_sizes_off_the_tile(h, w):
    x, wt, b = _inputs(320, 320, h, w, n=1)
    _check(tma_conv3x3(x, wt, b), x, wt, b, 1e-2, f"{h}x{w}")


def test_bf16():
    x, wt, b = _inputs(640, 640, 32, 32, torch.bfloat16)
    _check(tma_conv3x3(x, wt, b), x, wt, b, 5e-2, "bf16")


def test_graph_replay_sees_new_inputs_and_weights():
    x, wt, b = _inputs(640, 320, 64, 64)
    tma_conv3x3(x, wt, b)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = tma_conv3x3(x, wt, b)
    x.copy_(torch.randn_like(x))
    wt.mul_(0.5)  # an in-place weight change (a fused LoRA) is seen too
    g.replay()
    _check(y, x, wt, b, 1e-2, "replay")
