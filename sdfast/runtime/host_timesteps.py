"""Keep a scheduler's timesteps on the host, so the denoising loop never waits for the GPU.

diffusers pipelines call ``scheduler.set_timesteps(n, device=cuda)``, so each step's timestep ``t`` is a GPU
tensor. Schedulers that index host tables with it stall the host until the GPU is done: SD1.5's default
``PNDMScheduler._get_prev_sample`` reads ``alphas_cumprod[timestep]`` (a CPU tensor indexed by a GPU scalar)
and tests ``prev_timestep >= 0``; every step the host then waits for the UNet, and the GPU idles while the
host finishes the scheduler and launches the next step (about half a millisecond per step on sm_90; the README's
figures).

``keep_on_host(scheduler)`` wraps ``set_timesteps`` on that scheduler instance (not its class) to move
``scheduler.timesteps`` back to the CPU after the scheduler has set everything else up. The pipeline then
passes a CPU ``t`` to the UNet, whose CUDA-graph runner uploads it by value (``runtime.cuda_graphs``: a fill
kernel, no copy and no sync), and the scheduler's arithmetic on ``t`` runs on the host. The values, hence
the images, are the same. ``release(scheduler)`` undoes it.
"""

from __future__ import annotations

import functools
import types

_MARK = "_sdfast_host_timesteps"  # set on the wrapper function: the instance's set_timesteps is ours


def _wrapped_by_us(scheduler) -> bool:
    fn = scheduler.__dict__.get("set_timesteps")
    return getattr(getattr(fn, "__func__", None), _MARK, False)


def keep_on_host(scheduler) -> bool:
    """Wrap ``scheduler.set_timesteps`` so that ``scheduler.timesteps`` stays on the CPU. Idempotent.
    Returns False (and changes nothing) for an object without ``set_timesteps``, or whose ``set_timesteps`` is
    already replaced on the instance by someone else.

    The wrapper keeps the class method's signature (diffusers' ``retrieve_timesteps`` inspects it for
    ``timesteps=`` / ``sigmas=`` support) and calls the class method on whatever instance it is bound to, so a
    ``copy.deepcopy`` of the scheduler sets its own timesteps."""
    if scheduler is None or not callable(getattr(scheduler, "set_timesteps", None)):
        return False
    if _wrapped_by_us(scheduler):
        return True
    if "set_timesteps" in scheduler.__dict__:  # someone else's wrapper on this instance: left as it is
        return False

    @functools.wraps(type(scheduler).set_timesteps)
    def set_timesteps(self, *args, **kwargs):
        out = type(self).set_timesteps(self, *args, **kwargs)
        ts = getattr(self, "timesteps", None)
        if ts is not None and hasattr(ts, "cpu"):
            self.timesteps = ts.cpu()
        return out

    setattr(set_timesteps, _MARK, True)
    scheduler.set_timesteps = types.MethodType(set_timesteps, scheduler)
    return True


def release(scheduler) -> None:
    """Undo ``keep_on_host`` on this scheduler instance (the class's ``set_timesteps`` comes back)."""
    if scheduler is not None and _wrapped_by_us(scheduler):
        del scheduler.__dict__["set_timesteps"]
