"""The upsampling pass (issue 5): counted, reversible, diffusers' Upsample2D output on the tiny UNet and VAE
(kernel in Triton's interpreter), and diffusers' own forward where the kernel does not apply."""

import pytest
import torch

import sdfast
from sdfast.passes import upsample


def _upsamplers(model):
    from diffusers.models.upsampling import Upsample2D

    return [m for m in model.modules() if isinstance(m, Upsample2D)]


def test_pass_counts_keeps_output_and_undoes():
    pipe = sdfast.load("random:tiny", optimize=False).pipe
    vae, unet = pipe.vae, pipe.unet
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, vae.config.latent_channels, 8, 8, generator=g)
    sample, ctx = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 7, 32, generator=g)
    with torch.no_grad():
        stock = vae.decoder(z), unet(sample, 10, ctx).sample
        n = upsample.apply(vae) + upsample.apply(unet)
        assert n == len(_upsamplers(vae)) + len(_upsamplers(unet)) > 0
        assert upsample.apply(vae) == 0  # already rebound
        ours = vae.decoder(z), unet(sample, 10, ctx).sample
        # The upsampled values are identical (tests/kernels/elementwise/test_upsample.py). On the CPU, F.interpolate turns
        # the VAE's channels_last mid-block output into NCHW, the kernel keeps channels_last (as CUDA's
        # F.interpolate does), and the conv after it then rounds differently.
        for o, s in zip(ours, stock):
            torch.testing.assert_close(o, s, atol=2e-5, rtol=1e-5)
        assert upsample.undo(vae) + upsample.undo(unet) == n
        assert all("forward" not in m.__dict__ for m in _upsamplers(vae) + _upsamplers(unet))


def test_kernel_runs_and_other_output_sizes_run_diffusers(monkeypatch):
    from diffusers.models.upsampling import Upsample2D

    from sdfast.passes import upsample as mod

    calls = []
    real = mod.upsample_nearest2x
    monkeypatch.setattr(mod, "upsample_nearest2x", lambda x: calls.append(tuple(x.shape)) or real(x))
    torch.manual_seed(0)
    m = Upsample2D(8, use_conv=True).eval()
    x = torch.randn(1, 8, 5, 3).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        stock = [m(x), m(x, output_size=(10, 6)), m(x, output_size=(11, 7))]
        assert upsample.apply(m) == 1
        ours = [m(x), m(x, output_size=(10, 6)), m(x, output_size=(11, 7))]
    assert calls == [(1, 8, 5, 3)] * 2  # twice the input: the kernel; 11x7: F.interpolate(size=...)
    assert all(torch.equal(o, s) for o, s in zip(ours, stock))
    x3 = torch.randn(1, 8, 5)  # (B, C, L): F.interpolate upsamples it in 1-D; the kernel takes 4-D only
    m2 = Upsample2D(8, use_conv=False).eval()
    stock3 = m2(x3)
    upsample.apply(m2)
    assert torch.equal(m2(x3), stock3) and len(calls) == 2


@pytest.mark.parametrize("kwargs", [dict(use_conv_transpose=True), dict(interpolate=False, use_conv=True)])
def test_unsupported_configurations_stay_stock(kwargs):
    from diffusers.models.upsampling import Upsample2D

    assert upsample.apply(Upsample2D(8, **kwargs)) == 0


def test_optimize_counts_and_config_switch():
    engine = sdfast.load("random:tiny", optimize=sdfast.OptimizeConfig(cuda_graphs=False))
    assert engine.pipe._sdfast.config.upsample and engine.pipe._sdfast.counts["upsample"] > 0
    off = sdfast.load("random:tiny", optimize=sdfast.OptimizeConfig(upsample=False))
    assert "upsample" not in off.pipe._sdfast.counts
    assert not any("forward" in m.__dict__ for m in _upsamplers(off.pipe.vae) + _upsamplers(off.pipe.unet))
    sdfast.unoptimize(engine.pipe)
    ups = _upsamplers(engine.pipe.vae) + _upsamplers(engine.pipe.unet)
    assert ups and all("forward" not in m.__dict__ and not hasattr(m, "_sdfast_upsample") for m in ups)
