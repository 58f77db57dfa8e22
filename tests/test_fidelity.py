"""The fp32 fidelity check (``benchmarks.fidelity``) on the CPU, in fp16: the optimized pipeline passes it, and a
deliberately wrong kernel (GroupNorm with eps 1e-2 instead of the model's 1e-5) fails it."""

import pytest
import torch

import sdfast
import sdfast.passes.norms as norms
from benchmarks import fidelity


@pytest.fixture(scope="module")
def tiny_fp16_reference():
    stock = sdfast.load("random:tiny", device="cpu", dtype=torch.float16, optimize=False)
    stock.pipe.set_progress_bar_config(disable=True)
    return fidelity.reference(stock, prompt="a photo of a cat", guidance_scale=7.5, height=32, width=32)


def _optimized():
    engine = sdfast.load("random:tiny", device="cpu", dtype=torch.float16)
    engine.pipe.set_progress_bar_config(disable=True)
    return engine


def test_reference_measures_a_real_fp16_error(tiny_fp16_reference):
    ref = tiny_fp16_reference
    assert len(ref.unet_inputs) == fidelity.FEW_STEPS + 1  # tiny's PNDM (skip_prk_steps): steps + 1 UNet calls
    assert 0 < ref.stock_err_step < 0.01 and 0 < ref.stock_err_steps < 0.01
    assert ref.unet_out32[0].dtype == torch.float32 and ref.latents32.dtype == torch.float32


def test_optimized_pipeline_passes(tiny_fp16_reference):
    row = fidelity.compare(_optimized(), tiny_fp16_reference)
    assert row["fp32_check"] == "pass", row
    assert row["err_fp32_step_ratio"] <= fidelity.MAX_RATIO and row["err_fp32_steps_ratio"] <= fidelity.MAX_RATIO


def test_wrong_group_norm_kernel_fails(tiny_fp16_reference, monkeypatch):
    right = norms.group_norm
    monkeypatch.setattr(norms, "group_norm", lambda x, G, w, b, eps, **kw: right(x, G, w, b, 1e-2, **kw))
    row = fidelity.compare(_optimized(), tiny_fp16_reference)
    assert row["fp32_check"] == "fail", row
    assert row["err_fp32_step_ratio"] > 3


def test_fp32_engine_has_no_ratio():
    stock = sdfast.load("random:tiny", device="cpu", dtype=torch.float32, optimize=False)
    stock.pipe.set_progress_bar_config(disable=True)
    ref = fidelity.reference(stock, prompt="a cat", guidance_scale=1.0, height=32, width=32)
    row = fidelity.compare(stock, ref)
    assert row["fp32_check"] == "n/a" and row["err_fp32_step_ratio"] is None and row["err_fp32_step"] == 0
