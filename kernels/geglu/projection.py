"""diffusers' ``GEGLU`` (projection, then ``a * gelu(g)``) on the faster of two paths, chosen per call signature.

* the TMA GEMM with the activation in its epilogue (:mod:`kernels.geglu.triton_tma_gemm`; sm_90+, fp16/bf16), in the
  tile config that measured fastest for the shape;
* cuBLAS (``F.linear``) for the 2N-wide projection, then :func:`kernels.geglu.geglu` (``triton_elementwise``; one
  memory pass).

The choice is the kernel-choice service's ``geglu`` (:mod:`kernels.select`): candidates "cublas" (the default, kept
on a tie) and one per TMA tile config in ``TUNING["configs"]`` (named by the config's ``str``). The kernel policy
pins cuBLAS (``sdfast.KernelPolicy.geglu``); under ``torch.compile`` the two-kernel path is traced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import select
from kernels.dispatch import log_fallback
from kernels.geglu.triton_elementwise import geglu
from kernels.geglu.triton_tma_gemm import CONFIGS, TileConfig, geglu_linear, misaligned, shape_problem, unsupported

TUNING = {
    "configs": CONFIGS,  # the TMA candidates measured per signature
}

CHOICE = select.Choice("geglu", default="cublas")


def cublas_geglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``geglu(F.linear(x, weight, bias))``: the 2N-wide projection on cuBLAS, then the activation kernel."""
    return geglu(F.linear(x, weight, bias))


def geglu_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a * gelu(g)`` with ``a, g = (x @ weight^T + bias).chunk(2, -1)``, diffusers' ``GEGLU``.

    Args: x (..., K); weight (2N, K) (rows [0, N) give ``a``, rows [N, 2N) the gate); bias (2N,) or None; the
    dtypes of ``F.linear``. Returns (..., N) in ``x.dtype``. Raises what ``F.linear`` raises for bad shapes.
    """
    if torch.compiler.is_compiling():  # Dynamo cannot trace the choice (data_ptr, timing): the two-kernel path
        return cublas_geglu(x, weight, bias)
    configs = {str(c): c for c in TUNING["configs"]}
    tma_problem = []  # computed once per decision, for every TMA candidate

    def problem(name: str) -> str | None:
        if name == "cublas":
            return None
        if not tma_problem:
            tma_problem.append(shape_problem(x, weight, bias) or unsupported(x, weight, bias))
        return tma_problem[0]

    candidates = {"cublas": lambda: cublas_geglu(x, weight, bias)}
    candidates.update({name: lambda c=c: geglu_linear(x, weight, bias, c) for name, c in configs.items()})
    name = select.decide(
        CHOICE, select.signature(x, weight, bias), device=x.device, candidates=candidates, problem=problem,
        compile_all=lambda: [geglu_linear(x, weight, bias, c) for c in configs.values()],
        describe=lambda: f"x {tuple(x.shape)} weight {tuple(weight.shape)} {x.dtype}")
    config: TileConfig | None = configs.get(name)
    if config is not None and misaligned(x, weight):  # the one property the key does not hold: a view's offset
        log_fallback("geglu_projection", "x or the weight is not 16-byte aligned", instead="cuBLAS and the GEGLU kernel")
        config = None
    return cublas_geglu(x, weight, bias) if config is None else geglu_linear(x, weight, bias, config)


__all__ = ["CHOICE", "TUNING", "cublas_geglu", "geglu_projection"]
