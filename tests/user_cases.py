"""What tests/test_user_cases.py and tests/test_user_cases_models.py share: the request defaults, the pixel
comparison, the ``tiny`` engines (each file's module-scoped fixture) and the stand-ins for CUDA graphs.

``fast`` is ``sdfast.load(arch)`` (every pass on; its Triton kernels run in the interpreter here) and
``stock`` the same seeded weights with ``optimize=False``. Images are compared on uint8 pixels.
"""

from __future__ import annotations

import numpy as np

import sdfast

# Two steps: with one, "leading" timestep spacing runs the UNet only at t=1, where it barely changes the image.
# DDIM: one UNet call per step (the interpreter makes each optimized UNet call cost about a second here).
KW = dict(num_inference_steps=2, height=32, width=32, scheduler="ddim")
PIPE_KW = dict(num_inference_steps=2, height=32, width=32)  # for calls to the diffusers pipeline itself
LONG = "a photo of a cat, " * 30  # 180 CLIP tokens: three 75-token windows
TOL = 2  # max |fast - stock| in uint8 levels (fp32 kernels; rounding only)


def _px(img) -> np.ndarray:
    return np.asarray(img).astype(np.int16)


def _diff(a, b) -> int:
    a, b = (a if isinstance(a, list) else [a]), (b if isinstance(b, list) else [b])
    assert len(a) == len(b)
    return max(int(np.abs(_px(x) - _px(y)).max()) for x, y in zip(a, b))


def _pair(arch: str):
    return sdfast.load(f"random:{arch}", optimize=False), sdfast.load(f"random:{arch}")


def warm_tiny_pair():
    """(stock, fast, warm-up image) for each file's module-scoped ``tiny`` fixture: every case runs on a
    warmed-up optimized engine."""
    stock, fast = _pair("tiny")
    warm = fast.txt2img("a cat", seed=0, **KW)
    return stock, fast, warm


def _unet_calls(engine):
    """A list that receives (batch, sequence length, added-cond shapes) of every UNet call, and its hook."""
    calls = []

    def hook(module, args, kwargs):
        sample = args[0] if args else kwargs["sample"]
        ehs = kwargs.get("encoder_hidden_states", args[2] if len(args) > 2 else None)
        added = {k: tuple(v.shape) for k, v in (kwargs.get("added_cond_kwargs") or {}).items()}
        calls.append((sample.shape[0], ehs.shape[1], added))

    return calls, engine.pipe.unet.register_forward_pre_hook(hook, with_kwargs=True)


class _FakeGraphs:  # stands in for runtime.cuda_graphs.GraphCache on the CPU (no graphs are captured)
    def check(self, names=None):
        return 0

    def check_early(self, modules):
        return 0

    def checked_early(self):
        return frozenset()

    def forget_early(self):
        pass

    def mark(self):
        return 0

    def drop_since(self, mark):
        return 0
