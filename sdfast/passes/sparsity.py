"""2:4 structured-sparsity pass: prune the UNet's transformer linears to 2:4 and swap in ``SparseLinear``.

Usage::

    from sdfast.passes.sparsity import Sparse24Config, sparsify_, sparsity_stats, densify_

    n = sparsify_(pipe.unet, Sparse24Config(method="sparsegpt"), calibration=lambda unet: run_a_few_steps(unet))
    pipe.unet(...)                 # first GPU call per shape measures dense vs sparse backends
    print(sparsity_stats(pipe.unet))
    densify_(pipe.unet)            # back to nn.Linear

Pruning changes the model (the image moves away from the dense one); ``SparseLinear`` itself does
not change numerics beyond accumulation order: every backend multiplies by the same pruned weight.

- ``method="magnitude"``: keep the two largest |w| of each group of four along K. No data needed.
- ``method="sparsegpt"``: SparseGPT (Frantar & Alistarh, ICML 2023). ``calibration`` runs the model;
  forward pre-hooks on every targeted ``nn.Linear`` accumulate ``H = 2 X^T X / n`` (fp32, n = rows
  seen), then each weight is pruned with OBS error compensation (``kernels.sparse24.prune``). All
  Hessians are collected in one calibration pass (not the paper's layer-by-layer sequential
  variant, which re-runs calibration after pruning each layer). Memory: ``4 K^2`` bytes per
  targeted layer (SD1.5 about 0.3 GB, SDXL about 8 GB; ``hessian_device="cpu"`` keeps them in RAM).

Undo: ``densify_`` puts ``nn.Linear`` back. With ``keep_dense_copy=True`` the original dense
weights are kept on CPU (one fp copy of every pruned weight) and restored exactly; otherwise the
restored ``nn.Linear`` holds the pruned weight (the model stays pruned, only the module type changes).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from collections import Counter
from typing import Callable

import torch
import torch.nn as nn

from kernels.sparse24.prune import prune_24_magnitude, sparsegpt_prune_24
from sdfast.passes.attention.qkv import FUSED_PROJECTIONS
from sdfast.quantization.registry import Calibration, handler_for, register_sparsify_module_handler
from sdfast.quantization.sparse import BACKEND_CHOICES, TIMING_CHOICES, SparseLinear

log = logging.getLogger("sdfast.passes")

__all__ = [
    "Sparse24Config",
    "default_filter",
    "collect_hessians",
    "sparsify_",
    "densify_",
    "undo",
    "sparsity_stats",
]

METHODS = ("magnitude", "sparsegpt")


@dataclasses.dataclass(frozen=True)
class Sparse24Config:
    """How to prune and run 2:4-sparse linears.

    - ``method``: ``"magnitude"`` (no data; larger quality loss) or ``"sparsegpt"`` (needs
      ``calibration``; Hessian-compensated, lower reconstruction error, costs one calibration run
      plus an O(K^2 N) solve per layer).
    - ``min_features``: skip linears whose in_features or out_features is below this (small GEMMs
      never gain from 2:4 and lose accuracy like any other).
    - ``backend``: ``"auto"`` measures dense and each sparse backend per layer shape and keeps the
      fastest (dense when sparse is not at least ``min_speedup`` x faster); ``"cusparselt"``,
      ``"cutlass"``, ``"triton"`` force one where the shape allows it (dense elsewhere);
      ``"dense"`` runs the pruned weight with cuBLAS (model-quality studies, no speed change).
    - ``timing``: ``"graph"`` measures kernels in a CUDA graph (right when the UNet is graph-captured,
      as sdfast does); ``"eager"`` includes per-call host overhead (right for eager inference,
      where cuSPARSELt's per-call plan setup makes it lose).
    - ``min_speedup``: margin a sparse backend must beat dense by (guards timing noise); >= 2/3.
    - ``cusparselt_search``: cuSPARSELt's own algorithm search per shape (a candidate beside its default
      algorithm; slower to start). None (default): the kernel policy's, ``sdfast.KernelPolicy.from_env()``
      (``SDFAST_CUSPARSELT_SEARCH=1``), read when ``sparsify_`` runs.
    - ``blocksize``, ``percdamp``: SparseGPT's lazy-update block (multiple of 4; speed only, the
      result is identical) and dampening (fraction of mean diag(H) added to the diagonal; larger is
      more stable and less exact).
    - ``keep_dense_copy``: keep each original weight on CPU so ``densify_`` restores it exactly
      (costs host RAM equal to the pruned weights).
    - ``hessian_device``: where SparseGPT's Hessians accumulate (None: the layer's device;
      ``"cpu"`` saves GPU memory and costs a device-to-host copy of every calibration activation).
    """

    method: str = "magnitude"
    min_features: int = 256
    backend: str = "auto"
    timing: str = "graph"
    min_speedup: float = 1.03
    blocksize: int = 128
    percdamp: float = 0.01
    keep_dense_copy: bool = False
    hessian_device: str | None = None
    cusparselt_search: bool | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {self.backend!r}")
        if self.timing not in TIMING_CHOICES:
            raise ValueError(f"timing must be one of {TIMING_CHOICES}, got {self.timing!r}")
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_real(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.min_features) or self.min_features < 0:
            raise ValueError(f"min_features must be an integer >= 0, got {self.min_features!r}")
        if not is_real(self.min_speedup) or self.min_speedup < 2 / 3:
            raise ValueError(f"min_speedup must be a finite number >= 2/3, got {self.min_speedup!r}")
        if not is_int(self.blocksize) or self.blocksize <= 0 or self.blocksize % 4:
            raise ValueError(f"blocksize must be a positive integer multiple of 4, got {self.blocksize!r}")
        if not is_real(self.percdamp) or self.percdamp < 0:
            raise ValueError(f"percdamp must be a finite number >= 0, got {self.percdamp!r}")
        if self.cusparselt_search is not None and not isinstance(self.cusparselt_search, bool):
            raise ValueError(f"cusparselt_search must be None, True or False, got {self.cusparselt_search!r}")
        if not isinstance(self.keep_dense_copy, bool):
            raise ValueError(f"keep_dense_copy must be True or False, got {self.keep_dense_copy!r}")
        if self.hessian_device is not None:
            try:
                dev = torch.device(self.hessian_device)
            except (RuntimeError, TypeError, ValueError) as e:
                raise ValueError(f"hessian_device must be None or a torch device such as 'cuda' or 'cpu', got "
                                 f"{self.hessian_device!r} ({e})") from None
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"hessian_device={self.hessian_device!r} but CUDA is not available here")


def default_filter(module: nn.Module, name: str) -> bool:
    """The UNet's transformer linears: every ``nn.Linear`` inside ``...attentions.<i>.transformer_blocks``
    (self/cross-attention q/k/v/out, GEGLU ``ff.net.0.proj``, ``ff.net.2``) and the transformer's
    linear ``proj_in``/``proj_out`` (SD2/SDXL). Not the VAE (its attention has no ``transformer_blocks``),
    not the text encoders, not time/class embeddings or ResNet ``time_emb_proj``."""
    if not isinstance(module, nn.Linear):
        return False
    parts = name.split(".")
    if "attentions" not in parts:
        return False
    return "transformer_blocks" in parts or parts[-1] in ("proj_in", "proj_out")


def _call_calibration(calibration: Callable, module: nn.Module) -> None:
    """``calibration(module)`` when it has a required positional parameter (or ``*args``), else
    ``calibration()``: an optional parameter (``lambda n=2: ...``) keeps its default."""
    try:
        wants = [
            p
            for p in inspect.signature(calibration).parameters.values()
            if p.kind is p.VAR_POSITIONAL
            or (p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)
        ]
    except (TypeError, ValueError):  # builtins without a signature: pass the module
        wants = [None]
    if wants:
        calibration(module)
    else:
        calibration()


def collect_hessians(
    module: nn.Module,
    targets: dict[str, nn.Linear],
    calibration: Callable,
    *,
    device: str | torch.device | None = None,
) -> dict[str, tuple[torch.Tensor, int]]:
    """Run ``calibration`` (called as ``calibration(module)``, or ``calibration()`` if it needs no
    argument) under ``torch.no_grad`` with forward pre-hooks on ``targets`` (name -> nn.Linear).

    Returns name -> ``(H, n)``: ``H = 2 X^T X / n`` (K, K) float32 over the ``n`` input rows the
    layer saw (``H`` is zeros when n == 0). Hooks are removed even if calibration raises.
    """
    state: dict[str, list] = {}
    handles = []

    def make_hook(key: str, k: int, dev):
        def hook(mod, args, kwargs=None):
            x = args[0] if args else (kwargs or {}).get("input")
            if x is None:
                return None
            x2 = x.detach().reshape(-1, k)
            entry = state.get(key)
            if entry is None:
                hdev = x2.device if dev is None else torch.device(dev)
                entry = state[key] = [torch.zeros(k, k, dtype=torch.float32, device=hdev), 0]
            x2 = x2.to(device=entry[0].device, dtype=torch.float32)
            entry[0].addmm_(x2.t(), x2, alpha=2.0)
            entry[1] += x2.shape[0]
            return None

        return hook

    for name, lin in targets.items():
        handles.append(lin.register_forward_pre_hook(make_hook(name, lin.in_features, device)))
    try:
        with torch.no_grad():
            _call_calibration(calibration, module)
    finally:
        for h in handles:
            h.remove()
    out = {}
    for name, lin in targets.items():
        entry = state.get(name)
        if entry is None or entry[1] == 0:
            dev = lin.weight.device if device is None else torch.device(device)
            out[name] = (torch.zeros(lin.in_features, lin.in_features, dtype=torch.float32, device=dev), 0)
        else:
            out[name] = (entry[0].div_(entry[1]), entry[1])
    return out


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def _targets(module: nn.Module, config, handler, filter_fn) -> dict[str, nn.Linear]:
    filter_fn = filter_fn or default_filter
    found: dict[str, nn.Linear] = {}
    for name, m in module.named_modules():
        if not name or isinstance(m, SparseLinear) or not isinstance(m, nn.Linear) or name.endswith(FUSED_PROJECTIONS):
            continue
        if not filter_fn(m, name):
            continue
        if m.in_features % 4:
            log.info("sparsify_: skip %s: in_features=%d is not a multiple of 4", name, m.in_features)
            continue
        if not handler.eligible(config, m):
            continue
        found[name] = m
    return found


def _sparse24_calibration(config: Sparse24Config) -> Calibration:
    if config.method == "sparsegpt":
        return Calibration(collect=True, required="method='sparsegpt'", hessian=True)
    return Calibration()


@register_sparsify_module_handler(Sparse24Config, calibration=_sparse24_calibration)
def _sparse24(lin: nn.Linear, config: Sparse24Config, hessian) -> SparseLinear:
    """Prune ``lin`` by ``config.method`` (SparseGPT with its ``(H, n)``; by magnitude, logged, where it saw no
    calibration input) into a :class:`SparseLinear`."""
    method = config.method
    with torch.no_grad():
        if method == "sparsegpt":
            H, n = hessian
            if n == 0:
                log.warning("sparsify_: a %s saw no calibration input; pruned by magnitude instead", lin)
                method = "magnitude_fallback"
                pruned, _ = prune_24_magnitude(lin.weight)
            else:
                pruned = sparsegpt_prune_24(
                    lin.weight, H.to(lin.weight.device), blocksize=config.blocksize, percdamp=config.percdamp
                )
            del H
        else:
            pruned, _ = prune_24_magnitude(lin.weight)
    search = config.cusparselt_search
    if search is None:
        from sdfast.config import KernelPolicy

        search = KernelPolicy.from_env().cusparselt_search
    new = SparseLinear.from_dense(
        lin,
        pruned,
        backend=config.backend,
        timing=config.timing,
        min_speedup=config.min_speedup,
        cusparselt_search=search,
        keep_dense_copy=config.keep_dense_copy,
    )
    new.method = method
    return new


def sparsify_(
    module: nn.Module,
    config: Sparse24Config = Sparse24Config(),
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    calibration: Callable | None = None,
) -> int:
    """Prune the targeted ``nn.Linear`` layers of ``module`` to 2:4 (in place) and replace them with
    ``sdfast.quantization.sparse.SparseLinear``, by the handler registered for ``config``'s type
    (``sdfast.quantization.registry``; :class:`Sparse24Config`'s by default). Returns how many layers were replaced.

    Targets: ``nn.Linear`` submodules (not ``module`` itself) with ``filter_fn(linear, qualified_name)``
    true (default ``default_filter``: the UNet's transformer linears), ``in_features % 4 == 0`` and
    both feature counts >= ``config.min_features``. Layers that are already ``SparseLinear`` are
    skipped, so a second call returns 0. ``method="sparsegpt"`` needs ``calibration`` (ValueError
    otherwise); a targeted layer that saw no calibration input is pruned by magnitude and logged
    (``sparsity_stats`` counts it under ``"magnitude_fallback"``). A config type with no handler raises TypeError.
    """
    if not isinstance(module, nn.Module):  # a diffusers pipeline: its UNet, as quantize_ does
        unet = getattr(module, "unet", None)
        if not isinstance(unet, nn.Module):
            raise TypeError(f"sparsify_: module must be an nn.Module or a pipeline with .unet, got {type(module).__name__}")
        module = unet
    handler = handler_for(config, "sparsify_")
    need = handler.calibration(config)
    if need.required and calibration is None:
        raise ValueError(f"{need.required} needs calibration=callable running the model on a few inputs")
    targets = _targets(module, config, handler, filter_fn)
    if not targets:
        return 0
    handler.validate(config, targets, None)
    hessians = {}
    if need.collect and calibration is not None:
        hessians = collect_hessians(module, targets, calibration, device=getattr(config, "hessian_device", None))
        handler.validate(config, targets, hessians)
    for name, lin in targets.items():
        new = handler.convert(lin, config, hessians.pop(name, None))
        new.train(lin.training)
        _set_submodule(module, name, new)
    return len(targets)


def densify_(module: nn.Module, *, filter_fn: Callable[[nn.Module, str], bool] | None = None) -> int:
    """Undo ``sparsify_``: replace every ``SparseLinear`` (with ``filter_fn(m, name)`` true, if given)
    by an ``nn.Linear``: the original weight if the layer kept a dense copy, else the pruned weight.
    Returns how many layers were replaced."""
    count = 0
    for name, m in list(module.named_modules()):
        if not name or not isinstance(m, SparseLinear):
            continue
        if filter_fn is not None and not filter_fn(m, name):
            continue
        lin = m.to_linear()
        lin.train(m.training)
        _set_submodule(module, name, lin)
        count += 1
    return count


undo = densify_


def sparsity_stats(module: nn.Module) -> dict:
    """Counts over the ``SparseLinear`` layers of ``module``.

    ``layers``; ``methods`` (Counter: magnitude / sparsegpt / magnitude_fallback / given);
    after GPU calls: ``sparse`` (every measured M runs a sparse backend), ``dense`` (every measured
    M stayed dense: sparse was not faster, or unsupported), ``mixed``, ``unmeasured`` (no GPU call
    yet, e.g. on CPU); ``backends`` (Counter over (layer, M) decisions); ``dense_copy_kept``.
    """
    layers = [m for m in module.modules() if isinstance(m, SparseLinear)]
    stats = {
        "layers": len(layers),
        "methods": Counter(getattr(m, "method", "given") for m in layers),
        "sparse": 0,
        "dense": 0,
        "mixed": 0,
        "unmeasured": 0,
        "backends": Counter(),
        "dense_copy_kept": sum(m.dense_weight_cpu is not None for m in layers),
    }
    for m in layers:
        chosen = list(m.chosen.values())
        stats["backends"].update(chosen)
        if not chosen:
            stats["unmeasured"] += 1
        elif all(b == "dense" for b in chosen):
            stats["dense"] += 1
        elif all(b != "dense" for b in chosen):
            stats["sparse"] += 1
        else:
            stats["mixed"] += 1
    return stats
