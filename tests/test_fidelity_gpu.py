"""The fp32 fidelity check (``benchmarks.fidelity``) on the GPU at SD1.5's and SDXL's real architectures: sdfast passes
it, and a deliberately wrong kernel (GroupNorm with eps 1e-2) fails it."""

import gc

import pytest
import torch

import sdfast
import sdfast.passes.norms as norms
from benchmarks import fidelity

pytestmark = pytest.mark.gpu

PROMPT = "a photo of an astronaut riding a horse on mars"


def _free():
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("arch", ["sd15", "sdxl"])
def test_sdfast_passes_and_wrong_kernel_fails(arch, monkeypatch, record_property):
    stock = sdfast.load(f"random:{arch}", optimize=False)
    ref = fidelity.reference(stock, prompt=PROMPT, guidance_scale=7.5, height=None, width=None)
    del stock
    _free()
    fast = sdfast.load(f"random:{arch}")
    good = fidelity.compare(fast, ref)
    del fast
    _free()
    right = norms.group_norm
    monkeypatch.setattr(norms, "group_norm", lambda x, G, w, b, eps, **kw: right(x, G, w, b, 1e-2, **kw))
    bad_engine = sdfast.load(f"random:{arch}")
    bad = fidelity.compare(bad_engine, ref)
    del bad_engine
    _free()
    for key in ("err_fp32_step_ratio", "err_fp32_steps_ratio"):
        record_property(f"sdfast_{key}", good[key])
        record_property(f"wrong_gn_{key}", bad[key])
    print(f"{arch}: stock fp16 err {ref.stock_err_step:.2e} / {ref.stock_err_steps:.2e}; sdfast {good}; wrong GN {bad}")
    assert good["fp32_check"] == "pass", good
    assert bad["fp32_check"] == "fail", bad
