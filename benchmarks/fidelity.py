"""Numerical fidelity against an fp32 reference, at the same inputs: one UNet step, and a few denoising steps.

After tens of denoising steps on random weights every fp16 trajectory has drifted far from the fp32 one, so an
image-level comparison with fp32 says the same for every system and cannot fail. This check compares where the
trajectories have not yet diverged:

- ``step``: the UNet's noise prediction at each of ``FEW_STEPS`` denoising steps, every system fed the same
  inputs (those stock fp16 saw), against stock's UNet upcast to fp32 (no TF32) on the same inputs;
- ``steps``: the latents after a ``FEW_STEPS``-step generation from the same initial latents, against stock
  upcast to fp32.

Each error is relative: ``mean|x - x32| / mean|x32|``. A system passes when both of its errors are at most
``MAX_RATIO`` times stock fp16's. A kernel with a real defect (``tests/test_fidelity_gpu.py`` injects a GroupNorm
with eps 1e-2) fails it; fp16 rounding differences between kernels do not. Quantized presets are not expected
to pass: their ratio says how far from fp32 the quantization moves the model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

FEW_STEPS = 4
MAX_RATIO = 1.5
LATENT_SEED = 1234


@dataclass
class Fp32Reference:
    """What every system is compared with: the inputs of each UNet call of stock fp16's ``FEW_STEPS``-step
    generation (on the device, in the pipeline's dtype), the fp32 UNet outputs on them, the initial latents (fp32),
    the generation's arguments, the fp32 final latents, and stock fp16's two errors."""

    unet_inputs: list
    unet_out32: list
    latents0: object
    call_kwargs: dict
    latents32: object
    stock_err_step: float = float("nan")
    stock_err_steps: float = float("nan")


def _map(tree, fn):
    import torch
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, tree)


def _as(dtype):
    def cast(t):
        return t.to(dtype) if t.is_floating_point() else t
    return cast


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)


def rel_error(x, ref) -> float:
    """``mean|x - ref| / mean|ref|``, in fp64 on the host-independent device of ``ref``."""
    x, ref = x.double(), ref.double().to(x.device)
    return float((x - ref).abs().mean() / ref.abs().mean())


@contextlib.contextmanager
def strict_fp32():
    """True fp32: no TF32 in matmuls or cuDNN convolutions (restored after)."""
    import torch

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _generate_latents(pipe, call_kwargs: dict, latents0, dtype, capture: list | None = None):
    """The final latents of ``pipe(**call_kwargs, latents=latents0, output_type="latent")`` (cloned); with
    ``capture``, the (args, kwargs) of every UNet call are appended to it (cloned)."""
    import torch

    handle = None
    if capture is not None:
        def pre(module, args, kwargs):
            capture.append(_map((tuple(args), dict(kwargs)), lambda t: t.detach().clone()))
        handle = pipe.unet.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            out = pipe(**call_kwargs, latents=latents0.to(dtype), output_type="latent", return_dict=False)[0]
        return out.detach().clone()
    finally:
        if handle is not None:
            handle.remove()


def _unet_outputs(unet, inputs: list, dtype) -> list:
    """``unet(*args, **kwargs)[0]`` for each captured call, its floating inputs cast to ``dtype`` (outputs cloned
    at once: a CUDA-graphed or reduce-overhead-compiled UNet reuses its output buffer)."""
    import torch

    outs = []
    with torch.no_grad():
        for args, kwargs in inputs:
            a, k = _map((args, kwargs), _as(dtype))
            outs.append(_first(unet(*a, **k)).detach().clone())
    return outs


def reference(engine, *, prompt: str, guidance_scale: float, height: int | None, width: int | None,
              batch: int = 1) -> Fp32Reference:
    """The fp32 reference, from a stock (unoptimized) engine: a ``FEW_STEPS``-step generation in the engine's dtype
    records the UNet's inputs and stock's errors; the pipeline is upcast to fp32 in place for the reference and
    put back in its dtype after."""
    import torch

    pipe, dtype = engine.pipe, engine.dtype
    height = engine.default_size if height is None else height
    width = engine.default_size if width is None else width
    scale = pipe.vae_scale_factor
    shape = (batch, pipe.unet.config.in_channels, height // scale, width // scale)
    latents0 = torch.randn(shape, generator=torch.Generator("cpu").manual_seed(LATENT_SEED)).to(engine.device)
    call_kwargs = dict(prompt=[prompt] * batch, num_inference_steps=FEW_STEPS, guidance_scale=guidance_scale,
                       height=height, width=width)
    inputs: list = []
    latents16 = _generate_latents(pipe, call_kwargs, latents0, dtype, capture=inputs)
    out16 = _unet_outputs(pipe.unet, inputs, dtype)
    pipe.to(torch.float32)
    try:
        with strict_fp32():
            out32 = _unet_outputs(pipe.unet, inputs, torch.float32)
            latents32 = _generate_latents(pipe, call_kwargs, latents0, torch.float32)
    finally:
        pipe.to(dtype)
    ref = Fp32Reference(inputs, out32, latents0, call_kwargs, latents32)
    ref.stock_err_step = _mean_error(out16, out32)
    ref.stock_err_steps = rel_error(latents16, latents32)
    return ref


def _mean_error(outs: list, refs: list) -> float:
    return sum(rel_error(o, r) for o, r in zip(outs, refs)) / len(refs)


def compare(engine, ref: Fp32Reference) -> dict:
    """This engine's errors against ``ref`` and their ratios to stock fp16's; ``fp32_check`` is "pass" when both
    ratios are at most ``MAX_RATIO``. Keys: ``err_fp32_step``, ``err_fp32_step_ratio``, ``err_fp32_steps``,
    ``err_fp32_steps_ratio``, ``fp32_check`` ("n/a" with ratios None when stock's dtype is fp32 itself)."""
    pipe = engine.pipe
    err_step = _mean_error(_unet_outputs(pipe.unet, ref.unet_inputs, engine.dtype), ref.unet_out32)
    err_steps = rel_error(_generate_latents(pipe, ref.call_kwargs, ref.latents0, engine.dtype), ref.latents32)
    row = {"err_fp32_step": err_step, "err_fp32_step_ratio": _ratio(err_step, ref.stock_err_step),
           "err_fp32_steps": err_steps, "err_fp32_steps_ratio": _ratio(err_steps, ref.stock_err_steps)}
    ratios = (row["err_fp32_step_ratio"], row["err_fp32_steps_ratio"])
    if None in ratios:  # the engine runs in fp32 itself (a CPU run): there is no fp16 error to compare with
        row["fp32_check"] = "n/a"
    else:
        row["fp32_check"] = "pass" if max(ratios) <= MAX_RATIO else "fail"
    return row


def _ratio(err: float, stock_err: float) -> float | None:
    return err / stock_err if stock_err > 0 else None
