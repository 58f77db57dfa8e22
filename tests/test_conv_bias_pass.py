"""The convolution bias pass (``sdfast.passes.conv_bias``): the convolutions outside the fused blocks add their bias
in ``bias_residual_add``; the ResNet blocks' and transformers' convolutions stay plain; output kept; undo."""

import pytest
import torch
from torch import nn

import sdfast
from sdfast.passes import conv_bias, norms
from sdfast.passes._modules import runs_as_its_class


@pytest.fixture
def inputs():
    g = torch.Generator().manual_seed(0)
    return dict(sample=torch.randn(2, 4, 8, 8, generator=g), timestep=torch.tensor(10),
                encoder_hidden_states=torch.randn(2, 7, 32, generator=g))


def _count_adds(monkeypatch):
    calls = []
    real = conv_bias.bias_residual_add

    def counting(x, bias):
        calls.append(x.shape[1])
        return real(x, bias)

    monkeypatch.setattr(conv_bias, "bias_residual_add", counting)
    return calls


def test_unet_convs_outside_blocks_add_their_bias_in_the_kernel(inputs, monkeypatch):
    from diffusers.models.downsampling import Downsample2D
    from diffusers.models.upsampling import Upsample2D

    unet = sdfast.load("random:tiny", optimize=False).pipe.unet
    norms.apply(unet)
    with torch.no_grad():
        want = unet(**inputs, return_dict=False)[0]
    samplers = [m for m in unet.modules() if isinstance(m, (Downsample2D, Upsample2D))]
    assert conv_bias.apply(unet) == 2 + len(samplers) == 4
    calls = _count_adds(monkeypatch)
    with torch.no_grad():
        got = unet(**inputs, return_dict=False)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(calls) == 4
    resnet = unet.down_blocks[0].resnets[0]
    assert runs_as_its_class(resnet.conv1, nn.Conv2d)  # the fused blocks still fold their own biases
    assert conv_bias.undo(unet) == 4 and "forward" not in unet.conv_in.__dict__


def test_vae_decoder_and_post_quant_conv():
    vae = sdfast.load("random:tiny", optimize=False).pipe.vae
    z = torch.randn(1, vae.config.latent_channels, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = vae.decode(z).sample
    n = conv_bias.apply(vae)
    dec = vae.decoder
    assert all("forward" in c.__dict__ for c in (dec.conv_in, dec.conv_out, vae.post_quant_conv))
    assert n >= 3
    with torch.no_grad():
        torch.testing.assert_close(vae.decode(z).sample, want, atol=1e-5, rtol=1e-5)
    assert conv_bias.undo(vae) == n


def test_autocast_and_gradients_run_the_module_forward(monkeypatch):
    conv = nn.Conv2d(8, 16, 3, padding=1).requires_grad_(False)
    x = torch.randn(1, 8, 5, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = conv(x)
    conv.forward = conv_bias.conv_bias_forward.__get__(conv)
    calls = _count_adds(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = conv(x)  # the bf16 output, the fp32 bias: nn.Conv2d's own path, as stock under autocast
    assert torch.equal(got, want) and not calls
    torch.testing.assert_close(conv(x), nn.Conv2d.forward(conv, x), atol=1e-5, rtol=1e-5)
    assert calls == [16]
    conv.requires_grad_(True)
    conv(x).sum().backward()  # gradients: the module's own forward, which has a backward
    assert conv.weight.grad is not None and calls == [16]


def test_optimize_counts_the_pass_unless_turned_off():
    pipe = sdfast.load("random:tiny", optimize=False).pipe
    sdfast.optimize(pipe)
    assert pipe._sdfast.counts["conv_bias"] >= 7
    sdfast.unoptimize(pipe)
    assert not any(getattr(m, "_sdfast_conv_bias", False) for m in [*pipe.unet.modules(), *pipe.vae.modules()])
    sdfast.optimize(pipe, sdfast.OptimizeConfig(conv_bias=False))
    assert "conv_bias" not in pipe._sdfast.counts


def test_controlnet_zero_convs_run_as_linears_on_channels_last(monkeypatch):
    """A ControlNet's conv_in and its 1x1 output convolutions are covered; on channels_last input the 1x1 ones run
    as one linear each (``pointwise_forward``), giving the convolution's residuals in channels_last memory."""
    from sdfast.controlnet import build_random_controlnet
    from sdfast.passes import layout

    net = build_random_controlnet("tiny-controlnet")
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 4, 8, 8, generator=g), torch.tensor(10), torch.randn(2, 7, 32, generator=g),
            torch.rand(2, 3, 64, 64, generator=g))
    with torch.no_grad():
        want = net(*args, return_dict=False)
    from diffusers.models.downsampling import Downsample2D

    zero = [*net.controlnet_down_blocks, net.controlnet_mid_block]
    samplers = [m for m in net.modules() if isinstance(m, Downsample2D)]
    layout.apply(net)
    n = 1 + len(samplers) + len(zero)  # conv_in, the downsamplers' and the zero convolutions
    assert conv_bias.apply(net) == n
    linears = []
    real = conv_bias.F.linear
    monkeypatch.setattr(conv_bias.F, "linear", lambda *a: linears.append(a[0].shape) or real(*a))
    with torch.no_grad():
        got = net(*args, return_dict=False)
    assert len([shape for shape in linears if len(shape) == 4]) == len(zero)  # (B, H, W, C) views: the zero convs
    for a, b in zip([*got[0], got[1]], [*want[0], want[1]]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert got[1].is_contiguous(memory_format=torch.channels_last)
    assert conv_bias.undo(net) == n and all("forward" not in c.__dict__ for c in zero)
