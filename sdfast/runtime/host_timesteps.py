"""Keep a scheduler's timesteps on the host, so the denoising loop never waits for the GPU.

diffusers pipelines call ``scheduler.set_timesteps(n, device=cuda)``, so each step's timestep ``t`` is a GPU
tensor. Schedulers that index host tables with it stall the host until the GPU is done: SD1.5's default
``PNDMScheduler._get_prev_sample`` reads ``alphas_cumprod[timestep]`` (a CPU tensor indexed by a GPU scalar)
and tests ``prev_timestep >= 0``; every step the host then waits for the UNet, and the GPU idles while the
host finishes the scheduler and launches the next step (about half a millisecond per step on sm_90; the README's
figures).

``keep_on_host(scheduler)`` wraps ``set_timesteps`` on that scheduler instance (not its class) to move
``scheduler.timesteps`` back to the CPU after the scheduler has set everything else up (the host values they were
uploaded from: ``set_timesteps`` and ``step`` run in ``runtime.async_upload``'s mode, so no copy of theirs to the
GPU waits for it, the noise of stochastic samplers included). The pipeline then passes a CPU ``t`` to the UNet, whose CUDA-graph runner uploads it by value (``runtime.cuda_graphs``: a fill
kernel, no copy and no sync), and the scheduler's arithmetic on ``t`` runs on the host. The values, hence
the images, are the same. ``release(scheduler)`` undoes it.
"""

from __future__ import annotations

import torch

from .async_upload import AsyncUpload, unwrap_method, wrap_method, wrapped_by_us


def _set_timesteps(self, *args, **kwargs):
    with AsyncUpload() as uploads:
        out = type(self).set_timesteps(self, *args, **kwargs)
    ts = getattr(self, "timesteps", None)
    if ts is not None and hasattr(ts, "cpu"):
        self.timesteps = uploads.host_copy(ts) if isinstance(ts, torch.Tensor) else ts.cpu()
    return out


def _step(self, *args, **kwargs):
    with AsyncUpload():
        return type(self).step(self, *args, **kwargs)


def keep_on_host(scheduler) -> bool:
    """Wrap ``scheduler.set_timesteps`` so that ``scheduler.timesteps`` stays on the CPU, and ``scheduler.step``
    so that its noise goes to the GPU without a wait. Idempotent. Returns False (and changes nothing) for an object
    without ``set_timesteps``, or whose ``set_timesteps`` is already replaced on the instance by someone else.

    The wrappers keep the class methods' signatures (diffusers' ``retrieve_timesteps`` inspects ``set_timesteps`` for
    ``timesteps=`` / ``sigmas=`` support) and call the class method on whatever instance they are bound to, so a
    ``copy.deepcopy`` of the scheduler sets its own timesteps."""
    if scheduler is None or not callable(getattr(scheduler, "set_timesteps", None)):
        return False
    if wrapped_by_us(scheduler, "set_timesteps"):
        return True
    if not wrap_method(scheduler, "set_timesteps", _set_timesteps):
        return False
    wrap_method(scheduler, "step", _step)
    return True


def release(scheduler) -> None:
    """Undo ``keep_on_host`` on this scheduler instance (the class's ``set_timesteps`` and ``step`` come back)."""
    unwrap_method(scheduler, "set_timesteps")
    unwrap_method(scheduler, "step")
