"""Scheduler names users know, mapped onto diffusers' scheduler classes.

Each entry is (diffusers class name, config overrides). A scheduler is built with
``cls.from_config(pipe.scheduler.config, **overrides)``, so it keeps the model's beta schedule,
prediction type and timestep spacing, exactly as diffusers' docs recommend for swapping schedulers.

Few-step models: ``lcm`` (LCM and LCM-LoRA, Luo et al. 2023: diffusers' ``LCMScheduler``, 2-8 steps, guidance 1-2),
``euler_a_trailing`` (SDXL-Turbo's scheduler: Euler ancestral with "trailing" timestep spacing, which starts at the
last training timestep, 999, as a 1-4 step schedule needs; guidance 0) and ``euler_trailing`` (SDXL-Lightning's:
Euler, trailing). "trailing" is from Lin et al. 2023, "Common Diffusion Noise Schedules and Sample Steps are
Flawed"; with SDXL's own "leading" spacing a 4-step schedule starts at timestep 751 and leaves noise in the image.
"""

from __future__ import annotations

from .errors import InvalidRequestError

SCHEDULERS: dict[str, tuple[str, dict]] = {
    "ddim": ("DDIMScheduler", {}),
    "pndm": ("PNDMScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", {}),
    "dpmpp_2m_karras": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    "unipc": ("UniPCMultistepScheduler", {}),
    "lcm": ("LCMScheduler", {}),
    "euler_a_trailing": ("EulerAncestralDiscreteScheduler", {"timestep_spacing": "trailing"}),
    "euler_trailing": ("EulerDiscreteScheduler", {"timestep_spacing": "trailing"}),
}


def check_scheduler_name(name: str) -> None:
    """Raise ``InvalidRequestError`` (field ``scheduler``) unless ``name`` is a known scheduler."""
    if name not in SCHEDULERS:
        raise InvalidRequestError("scheduler", f"unknown scheduler {name!r}; known: {', '.join(SCHEDULERS)}")


def make_scheduler(name: str, base_config) -> object:
    """A new diffusers scheduler called ``name``, configured from the model's ``base_config``.

    Keys of ``base_config`` that the new class does not take (e.g. PNDM's ``skip_prk_steps`` for LCM) are left out:
    diffusers would ignore them anyway, with a "config attributes ... will be ignored" warning."""
    import diffusers

    check_scheduler_name(name)
    cls_name, overrides = SCHEDULERS[name]
    cls = getattr(diffusers, cls_name)
    accepted = cls._get_init_keys(cls)
    config = {k: v for k, v in dict(base_config).items() if k in accepted or k.startswith("_")}
    return cls.from_config(config, **overrides)


def check_steps(num_inference_steps: int, scheduler, name: str | None) -> None:
    """Raise ``InvalidRequestError`` (field ``num_inference_steps``) when ``scheduler`` cannot take that many
    steps: at most its ``num_train_timesteps`` less its ``steps_offset`` (at least 1: 999 for SD), and for LCM its
    ``original_inference_steps`` (50). At SD's 1000 steps, diffusers' "leading" spacing shifted by ``steps_offset``
    indexes past the last timestep (PNDM, DDIM: IndexError), and the multistep solvers return NaN (UniPC, DPM++)."""
    cfg = scheduler.config
    limit = int(cfg.get("num_train_timesteps", 1000)) - max(1, int(cfg.get("steps_offset", 0) or 0))
    if cfg.get("original_inference_steps") is not None:
        limit = min(limit, int(cfg["original_inference_steps"]))
    if num_inference_steps > limit:
        which = name or f"model's own ({type(scheduler).__name__})"
        raise InvalidRequestError("num_inference_steps", f"at most {limit} with the {which} scheduler (got {num_inference_steps})")
