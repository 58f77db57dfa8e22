"""Activation statistics of nn.Linear (and nn.Conv2d) inputs, collected with forward pre-hooks during a calibration
run.

``collect_linear_stats(linears, calibration)`` hooks every given ``nn.Linear``, calls
``calibration()`` once (e.g. ``lambda: pipe("a photo of a cat", num_inference_steps=2)``) under
``torch.no_grad()``, removes the hooks (also on error) and returns one :class:`LinearStats` per
layer with what the quantizers need:

* ``absmax`` (K,): max |x| per input channel (SmoothQuant's ``max|X_j|``, LLM.int8()'s outlier columns)
* ``absmean`` (K,): mean |x| per input channel (AWQ's activation salience)
* ``xtx`` (K, K): sum over tokens of ``x^T x`` (GPTQ's Hessian is ``2 * xtx / n_tokens``), when ``hessian=True``
* ``samples`` (S, K): up to ``n_samples`` input rows drawn uniformly over all calls (AWQ's scale search)

All statistics are fp32 on the layer's device. A convolution's input (N, C, H, W) counts each pixel as a token of
its C channels (K = in_channels). Memory: ``xtx`` is K² fp32 per layer (100 MiB at
K = 5120), so GPTQ calibration of a whole SDXL UNet holds several GiB on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class LinearStats:
    """Per-input-channel statistics of one linear layer's input (K = in_features)."""

    absmax: torch.Tensor
    abssum: torch.Tensor
    n_tokens: int = 0
    xtx: torch.Tensor | None = None
    samples: torch.Tensor | None = None
    _keys: torch.Tensor | None = field(default=None, repr=False)

    @property
    def absmean(self) -> torch.Tensor:
        """(K,) mean |x| per input channel over every calibration token."""
        return self.abssum / max(self.n_tokens, 1)

    @property
    def hessian(self) -> torch.Tensor:
        """(K, K) GPTQ Hessian ``2 X^T X / n`` (raises when ``hessian=True`` was not collected)."""
        if self.xtx is None:
            raise ValueError("LinearStats: X^T X was not collected (collect_linear_stats(..., hessian=True))")
        return self.xtx * (2.0 / max(self.n_tokens, 1))

    def update(self, x: torch.Tensor, *, hessian: bool, n_samples: int, generator: torch.Generator | None) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if x.shape[0] == 0:
            return
        a = x.abs()
        torch.maximum(self.absmax, a.amax(dim=0), out=self.absmax)
        self.abssum += a.sum(dim=0)
        self.n_tokens += x.shape[0]
        if hessian:
            if self.xtx is None:
                self.xtx = torch.zeros(x.shape[1], x.shape[1], device=x.device, dtype=torch.float32)
            self.xtx.addmm_(x.t(), x)
        if n_samples > 0:
            self._reservoir(x, n_samples, generator)

    def _reservoir(self, x: torch.Tensor, n: int, generator: torch.Generator | None) -> None:
        # Uniform sample without replacement over the stream: keep each row with key u^(1/w) largest
        # (all weights 1 -> the n largest uniform keys), merging with the kept rows' keys.
        keys = torch.rand(x.shape[0], generator=generator, device="cpu").to(x.device)
        if self.samples is not None:
            x = torch.cat([self.samples, x])
            keys = torch.cat([self._keys, keys])
        if x.shape[0] > n:
            idx = keys.topk(n).indices
            x, keys = x[idx], keys[idx]
        self.samples, self._keys = x, keys


def collect_linear_stats(
    linears: dict[str, nn.Linear],
    calibration: Callable[[], Any],
    *,
    hessian: bool = False,
    n_samples: int = 0,
    seed: int = 0,
) -> dict[str, LinearStats]:
    """Run ``calibration()`` once with pre-hooks on ``linears`` and return their input statistics.

    linears: name -> module (any module whose first forward argument is the (..., K) input, or an ``nn.Conv2d``).
    hessian: also accumulate ``x^T x`` (K, K) (GPTQ). n_samples: keep that many input rows (AWQ).
    Raises RuntimeError when no hooked layer ran during ``calibration()``.
    """
    stats: dict[str, LinearStats] = {}
    gen = torch.Generator().manual_seed(seed)
    handles = []

    def make_hook(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0]
            if isinstance(module, nn.Conv2d):  # (N, C, H, W): the channels are the features
                x = x.movedim(1, -1)
            st = stats.get(name)
            if st is None:
                K = x.shape[-1]
                z = torch.zeros(K, device=x.device, dtype=torch.float32)
                st = stats[name] = LinearStats(absmax=z.clone(), abssum=z.clone())
            st.update(x, hessian=hessian, n_samples=n_samples, generator=gen)

        return hook

    try:
        for name, mod in linears.items():
            handles.append(mod.register_forward_pre_hook(make_hook(name)))
        with torch.no_grad():
            calibration()
    finally:
        for h in handles:
            h.remove()
    if linears and not stats:
        raise RuntimeError(
            f"collect_linear_stats: calibration ran but none of the {len(linears)} targeted linear layers was "
            "called (does the callable run the model these layers belong to?)"
        )
    return stats


__all__ = ["LinearStats", "collect_linear_stats"]
