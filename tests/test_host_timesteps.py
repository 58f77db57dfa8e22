"""``runtime.host_timesteps``: a scheduler instance whose timesteps stay on the CPU (no per-step GPU sync)."""

import torch
from diffusers import EulerDiscreteScheduler, PNDMScheduler

from sdfast.runtime import host_timesteps


class _Stub:
    """A scheduler whose set_timesteps puts its timesteps on 'the GPU' (an object that records .cpu())."""

    class _OnDevice:
        def cpu(self):
            return "moved to cpu"

    def set_timesteps(self, n, device=None):
        self.timesteps = self._OnDevice()
        self.n = n


def test_timesteps_are_moved_to_the_host_after_set_timesteps():
    s = _Stub()
    assert host_timesteps.keep_on_host(s) and host_timesteps.keep_on_host(s)  # idempotent
    s.set_timesteps(7, device="cuda")
    assert s.timesteps == "moved to cpu" and s.n == 7
    host_timesteps.release(s)
    s.set_timesteps(7, device="cuda")
    assert isinstance(s.timesteps, _Stub._OnDevice)  # the class's method again
    assert "set_timesteps" not in s.__dict__


def test_only_that_instance_changes_and_the_schedule_is_the_same():
    for cls in (PNDMScheduler, EulerDiscreteScheduler):
        a, b = cls(), cls()
        original = cls.set_timesteps
        host_timesteps.keep_on_host(a)
        a.set_timesteps(25, device="cpu")
        b.set_timesteps(25, device="cpu")
        assert torch.equal(a.timesteps, b.timesteps) and a.timesteps.device.type == "cpu"
        assert "set_timesteps" not in b.__dict__ and cls.set_timesteps is original
        assert a.set_timesteps.__func__ is not original  # the instance's own wrapper


def test_objects_without_set_timesteps_are_left_alone():
    assert not host_timesteps.keep_on_host(None) and not host_timesteps.keep_on_host(object())
    host_timesteps.release(None)


def test_engine_keeps_the_timesteps_on_device_without_graphs(tiny_engine):
    """On the CPU there are no CUDA graphs: the engine leaves (or puts back) the class's set_timesteps."""
    host_timesteps.keep_on_host(tiny_engine.pipe.scheduler)
    tiny_engine.txt2img("a cat", num_inference_steps=2, seed=0, height=32, width=32)
    assert "set_timesteps" not in tiny_engine.pipe.scheduler.__dict__


def test_the_wrapper_keeps_the_signature_that_diffusers_inspects_for_custom_schedules():
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps

    s = EulerDiscreteScheduler()
    host_timesteps.keep_on_host(s)
    ts, n = retrieve_timesteps(s, timesteps=[999, 700, 400, 100], device="cpu")
    assert n == 4 and ts.tolist() == [999, 700, 400, 100]
    ts, n = retrieve_timesteps(s, sigmas=[14.6, 5.0, 1.0, 0.1], device="cpu")  # raised before: signature hidden
    assert n == len(s.timesteps) > 0 and ts.device.type == "cpu"


def test_a_deep_copy_sets_its_own_timesteps_and_other_wrappers_are_left_alone():
    import copy

    s = PNDMScheduler()
    host_timesteps.keep_on_host(s)
    s.set_timesteps(30)
    c = copy.deepcopy(s)
    c.set_timesteps(5)
    assert len(c.timesteps) < len(s.timesteps)  # the copy changed, not the original
    other = PNDMScheduler()
    other.set_timesteps = lambda *a, **k: None  # a user's own instance wrapper
    assert not host_timesteps.keep_on_host(other)
