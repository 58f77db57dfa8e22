"""GPU tests (marker ``gpu``, sm_90+): the TMA GEGLU GEMM's every tile config at SD1.5's and SDXL's GEGLU shapes
against the fp32 reference (flash-attention's rule, kernels.testing, against cuBLAS fp16 + GEGLU), bf16, CUDA graph
replay on new inputs. ``geglu_projection``'s measured choice is test_projection_gpu.py's."""

import pytest
import torch

from kernels.geglu.ref import geglu_linear_fp8_ref, geglu_linear_ref
from kernels.geglu.triton_tma_gemm import CONFIGS, FP8_CONFIGS, geglu_linear, geglu_linear_fp8
from kernels.testing import assert_close_rule, e4m3_far, poison

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


# --------------------------------------------------------------------------------------------
# the FP8 kernel (E4M3 operands, per-tensor scales; 16-bit or E4M3 output)
# --------------------------------------------------------------------------------------------
def _fp8_inputs(M, K, N):
    from kernels.gemm.fp8_static import quantize_static

    x = torch.randn(M, K, device=DEV)
    w = torch.randn(2 * N, K, device=DEV) / K**0.5
    sa = (x.abs().max() / 448).float().reshape(())
    sw = (w.abs().max() / 448).float().reshape(())
    q = quantize_static(x, 1 / sa)
    qw = quantize_static(w, 1 / sw)
    b = (torch.randn(2 * N, device=DEV) * 0.1).half()
    return q, qw, sa, sw, b


@pytest.mark.parametrize("config", FP8_CONFIGS, ids=str)
@pytest.mark.parametrize("M,K,N", SHAPES, ids=lambda v: str(v))
def test_fp8_every_config_at_sd_shapes(M, K, N, config):
    """16-bit output within 1 % of the output's range of the float64 reference (fast accumulation, as
    ``torch._scaled_mm(use_fast_accum=True)``), no worse than cuBLASLt's FP8 GEMM + the GEGLU kernel; the E4M3 output
    within one grid step (plus that error) of the reference's."""
    from kernels.geglu.projection import scaled_mm_geglu

    q, qw, sa, sw, b = _fp8_inputs(M, K, N)
    ref = geglu_linear_fp8_ref(q, qw, sa, sw, b, out_dtype=torch.float64)
    rng = float(ref.abs().max())
    out = poison(torch.empty(M, N, device=DEV, dtype=torch.float16))
    ours = geglu_linear_fp8(q, qw, sa, sw, b, config=config, out=out)
    err = float((ours.double() - ref).abs().max())
    cublas = float((scaled_mm_geglu(q, qw, sa, sw, b, None, torch.float16).double() - ref).abs().max())
    assert err <= 1e-2 * rng and err <= 2 * cublas + 1e-3 * rng, (err, cublas, rng)
    inv = torch.tensor(448.0 / rng, device=DEV)
    out8 = poison(torch.empty(M, N, device=DEV, dtype=torch.float8_e4m3fn))
    ours8 = geglu_linear_fp8(q, qw, sa, sw, b, out_scale_inv=inv, config=config, out=out8)
    ref8 = geglu_linear_fp8_ref(q, qw, sa, sw, b, out_scale_inv=inv)
    assert not e4m3_far(ours8, ref8, atol=1e-2 * 448).any()
    assert float((ours8.float() != ref8.float()).float().mean()) < 0.05


def test_fp8_graph_replay_sees_new_inputs_and_scales():
    q, qw, sa, sw, b = _fp8_inputs(2048, 1280, 5120)
    inv = torch.tensor(60.0, device=DEV)
    geglu_linear_fp8(q, qw, sa, sw, b, out_scale_inv=inv)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = geglu_linear_fp8(q, qw, sa, sw, b, out_scale_inv=inv)
    q2, *_ = _fp8_inputs(2048, 1280, 5120)
    q.copy_(q2)
    inv.fill_(30.0)  # a recalibrated scale is read at replay
    g.replay()
    ref = geglu_linear_fp8_ref(q, qw, sa, sw, b, out_scale_inv=inv)
    assert not e4m3_far(y, ref, atol=1e-2 * 448).any()
