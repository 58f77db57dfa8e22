"""The skip-concatenation pass (``sdfast.passes.skip_concat``): the up blocks concatenate on ``cat_channels``,
the UNet's output is bit-identical, FreeU and the other paths it does not cover run diffusers' forward, undo."""

import pytest
import torch

import sdfast
from sdfast.passes import skip_concat


@pytest.fixture
def inputs():
    g = torch.Generator().manual_seed(0)
    return dict(sample=torch.randn(2, 4, 8, 8, generator=g), timestep=torch.tensor(10),
                encoder_hidden_states=torch.randn(2, 7, 32, generator=g))


def _run(unet, inputs):
    with torch.no_grad():
        return unet(**inputs, return_dict=False)[0]


def _count_cats(monkeypatch):
    calls = []
    real = skip_concat.cat_channels

    def counting(a, b):
        calls.append((a.shape[1], b.shape[1]))
        return real(a, b)

    monkeypatch.setattr(skip_concat, "cat_channels", counting)
    return calls


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_up_blocks_concatenate_on_the_kernel_bit_identically(inputs, monkeypatch, channels_last):
    unet = sdfast.load("random:tiny", optimize=False).pipe.unet
    if channels_last:
        unet.to(memory_format=torch.channels_last)
        inputs = {**inputs, "sample": inputs["sample"].contiguous(memory_format=torch.channels_last)}
    want = _run(unet, inputs)
    assert skip_concat.apply(unet) == len(unet.up_blocks) == 2
    assert skip_concat.apply(unet) == 0
    calls = _count_cats(monkeypatch)
    assert torch.equal(_run(unet, inputs), want)
    # channels_last: the kernel for each up-block ResNet; NCHW (not what the kernel is tuned for): torch.cat
    assert len(calls) == (sum(len(b.resnets) for b in unet.up_blocks) if channels_last else 0)
    assert not channels_last or len(calls) == 4
    assert skip_concat.undo(unet) == 2 and "forward" not in unet.up_blocks[0].__dict__
    calls.clear()
    assert torch.equal(_run(unet, inputs), want) and not calls


def test_freeu_runs_diffusers_forward(inputs, monkeypatch):
    unet = sdfast.load("random:tiny", optimize=False).pipe.unet.to(memory_format=torch.channels_last)
    unet.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    want = _run(unet, inputs)
    skip_concat.apply(unet)
    calls = _count_cats(monkeypatch)
    assert torch.equal(_run(unet, inputs), want)
    assert not calls  # FreeU rescales the skip tensors inside diffusers' forward


def test_optimize_counts_the_pass_unless_turned_off():
    pipe = sdfast.load("random:tiny", optimize=False).pipe
    sdfast.optimize(pipe)
    assert pipe._sdfast.counts["skip_concat"] == 2
    sdfast.unoptimize(pipe)
    assert not any(getattr(b, "_sdfast_skip_concat", False) for b in pipe.unet.up_blocks)
    sdfast.optimize(pipe, sdfast.OptimizeConfig(skip_concat=False))
    assert "skip_concat" not in pipe._sdfast.counts
