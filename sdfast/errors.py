"""Errors sdfast raises for bad input. Each is a ``ValueError`` (or ``FileNotFoundError``/``ConnectionError``)
so callers that catch the builtin still catch it; ``field`` names the offending argument where there is one."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A generation argument is out of range; ``field`` is its name (e.g. ``"height"``), ``reason`` the message
    without it (the CLI puts its flag in front instead)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class ModelNotFoundError(FileNotFoundError):
    """A model path does not exist or is not a diffusers pipeline folder / checkpoint file."""


class HubOfflineError(ConnectionError):
    """A hub id was given but the Hugging Face Hub cannot be reached and the model is not cached."""


class NonFiniteOutputError(RuntimeError):
    """The pipeline produced NaN/Inf pixels (fp16 overflow, a broken kernel): never returned as a black image."""


class GenerationCancelled(Exception):
    """``Engine.txt2img(should_stop=...)`` stopped at a step boundary because ``should_stop()`` returned True: no
    image. ``step``: denoising-loop iterations run; ``steps``: the iterations the call would have run (PNDM runs one
    more than ``num_inference_steps``). Not a ``RuntimeError``, so no handler of engine failures mistakes it for one."""

    def __init__(self, step: int, steps: int):
        super().__init__(f"generation cancelled after step {step} of {steps}")
        self.step = step
        self.steps = steps
