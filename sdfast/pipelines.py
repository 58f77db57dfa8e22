"""Diffusers pipelines built on another pipeline's components: ``derive(pipe, cls)``.

diffusers' ``DiffusionPipeline.from_pipe(pipe)`` (0.42) ends with ``new_pipeline.to(dtype=dtype)``, ``dtype``
defaulting to float32: the components it shares with ``pipe`` are cast in place, so an fp16 pipeline silently runs
(and keeps running, ``pipe`` too) in fp32 after one ``from_pipe`` without ``dtype``. With a ``dtype`` every component
is cast to that one, which also undoes a VAE kept in fp32 (``force_upcast``). ``derive`` builds the same pipeline
object as ``from_pipe`` (the same component objects, the pipeline options of ``pipe``'s config) and casts nothing.
"""

from __future__ import annotations

import inspect


def derive(pipe, cls, **components):
    """A ``cls`` pipeline (a diffusers pipeline class, or its name) on ``pipe``'s components, as
    ``cls.from_pipe(pipe, **components)`` makes it, but with every module left in its dtype and on its device (see the
    module docstring). ``components`` replace or add components (e.g. ``controlnet=``). Components ``cls`` does not
    take are left out; ``pipe``'s config options that ``cls`` takes (``requires_safety_checker``,
    ``force_zeros_for_empty_prompt``...) are passed on. Raises ``ValueError`` naming a component ``cls`` needs that
    neither ``pipe`` nor ``components`` has."""
    import diffusers

    from .loading import quiet_loading

    cls = getattr(diffusers, cls) if isinstance(cls, str) else cls
    expected, optional = cls._get_signature_keys(cls)
    params = inspect.signature(cls.__init__).parameters
    kwargs = {name: c for name, c in pipe.components.items() if name in expected}
    kwargs.update(components)
    config = dict(pipe.config)
    for key in optional:
        if key not in kwargs:
            if key in config:
                kwargs[key] = config[key]
            elif f"_{key}" in config:  # an option ``pipe`` kept from the pipeline it was derived from
                kwargs[key] = config[f"_{key}"]
    missing = [name for name in expected if name not in kwargs and params[name].default is inspect.Parameter.empty
               and name not in cls._optional_components]
    if missing:
        raise ValueError(f"derive: {cls.__name__} needs {missing}, which {type(pipe).__name__} does not have")
    for name in [n for n in expected if n not in kwargs and n in cls._optional_components
                 and params[n].default is inspect.Parameter.empty]:
        kwargs[name] = None
    with quiet_loading():
        return cls(**kwargs)
