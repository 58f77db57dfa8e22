"""``runtime.async_upload``: diffusers' blocking host-to-GPU copies (noise from a CPU generator, SDXL's time ids,
timesteps) made without a wait. The copy itself needs CUDA (``tests/test_async_upload_gpu.py``); here: what the mode
leaves alone, the values it keeps, and the per-instance wrappers."""

import copy
import inspect

import torch
from diffusers import EulerAncestralDiscreteScheduler, LCMScheduler

from sdfast.runtime import async_upload, host_timesteps
from sdfast.runtime.async_upload import AsyncUpload


def test_copies_that_are_not_blocking_cpu_to_cuda_ones_pass_through():
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    with AsyncUpload() as mode:
        assert mode._upload(x, ("cpu",), {}) is None
        assert mode._upload(x, (torch.float16,), {}) is None
        assert mode._upload(x, (), {"device": "cuda", "non_blocking": True}) is None  # asked for already
        assert mode._upload(x, ("cuda",), {"copy": True}) is None
        assert mode._upload(x, ("cuda",), {"memory_format": torch.contiguous_format}) is None
        assert mode._upload(x.to(torch.float64), (x,), {}) is None  # .to(other): other is on the CPU
        assert mode._upload(torch.nn.Parameter(x), ("cuda",), {}) is None  # subclasses: their own to()
        y = x.to(torch.float16)
        z = x.to(device="cpu", dtype=torch.float64)
    assert y.dtype == torch.float16 and torch.equal(y.float(), x)
    assert z.dtype == torch.float64 and torch.equal(z, x.double())
    assert torch.equal(mode.host_copy(y), y)  # not an upload of the mode: t.cpu()


def test_a_stochastic_step_in_the_mode_is_the_class_step():
    """Euler ancestral and LCM draw noise at each step from the generator; wrapped, the steps are the same."""
    for cls in (EulerAncestralDiscreteScheduler, LCMScheduler):
        a, b = cls(), cls()
        assert host_timesteps.keep_on_host(a)
        assert async_upload.wrapped_by_us(a, "step") and "step" not in b.__dict__
        assert inspect.signature(a.step) == inspect.signature(b.step)
        for s in (a, b):
            s.set_timesteps(4, device="cpu")
        x = torch.randn(1, 4, 8, 8)
        ga, gb = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        for t in a.timesteps:
            xa = a.step(x, t, x, generator=ga).prev_sample
            xb = b.step(x, t, x, generator=gb).prev_sample
            assert torch.equal(xa, xb)
        c = copy.deepcopy(a)  # the engine steps copies of its schedulers
        c.set_timesteps(2, device="cpu")
        assert len(c.timesteps) == 2 and len(a.timesteps) == 4
        host_timesteps.release(a)
        assert "step" not in a.__dict__ and "set_timesteps" not in a.__dict__


def test_pipeline_wrappers_are_per_instance_and_leave_others_alone(tiny_engine):
    pipe = tiny_engine.pipe
    cls = type(pipe)
    before = inspect.signature(pipe.prepare_latents)
    assert async_upload.install(pipe) == 1  # SD has no _get_add_time_ids
    assert async_upload.wrapped_by_us(pipe, "prepare_latents")
    assert inspect.signature(pipe.prepare_latents) == before and cls.prepare_latents is not pipe.prepare_latents
    async_upload.uninstall(pipe)
    assert "prepare_latents" not in pipe.__dict__
    pipe.prepare_latents = lambda *a, **k: None  # someone else's instance wrapper
    try:
        assert async_upload.install(pipe) == 0 and not async_upload.wrapped_by_us(pipe, "prepare_latents")
    finally:
        del pipe.prepare_latents


def test_sdxl_time_ids_stay_on_the_host_pipelines_device():
    """``_get_add_time_ids`` is uploaded only to a CUDA execution device; on the CPU its tensors are stock's."""
    import sdfast

    pipe = sdfast.load("random:tiny-xl", optimize=False).pipe
    stock = pipe._get_add_time_ids((64, 64), (0, 0), (64, 64), dtype=torch.float32,
                                   text_encoder_projection_dim=pipe.text_encoder_2.config.projection_dim)
    assert async_upload.install(pipe) == 2
    ours = pipe._get_add_time_ids((64, 64), (0, 0), (64, 64), dtype=torch.float32,
                                  text_encoder_projection_dim=pipe.text_encoder_2.config.projection_dim)
    assert torch.equal(ours, stock) and ours.device.type == "cpu"
    async_upload.uninstall(pipe)


def test_each_wrapped_scheduler_reports_its_own_class_signature():
    """diffusers' ``prepare_extra_step_kwargs`` passes ``generator`` only to a ``step`` whose signature takes it:
    schedulers of different classes wrapped one after the other each keep their own (one shared wrapper function
    once reported the last class's, and Euler ancestral then drew its noise off the request's generator)."""
    from diffusers import PNDMScheduler

    euler, pndm = EulerAncestralDiscreteScheduler(), PNDMScheduler()
    host_timesteps.keep_on_host(euler)
    host_timesteps.keep_on_host(pndm)
    assert "generator" in inspect.signature(euler.step).parameters
    assert "generator" not in inspect.signature(pndm.step).parameters
    assert inspect.signature(pndm.set_timesteps) == inspect.signature(PNDMScheduler().set_timesteps)
