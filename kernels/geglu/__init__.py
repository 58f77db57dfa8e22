"""GEGLU (diffusers' ``FeedForward`` ``GEGLU``: ``a, g = proj(x).chunk(2, -1); a * gelu(g)``), one module per concept:

* ``ref``: :func:`geglu_ref` (the activation) and :func:`geglu_linear_ref` (projection + activation), plain PyTorch;
* ``gelu``: the exact (erf) GELU device function of the Triton kernels, ``gelu_erf``, and its PyTorch twin;
* ``triton_elementwise``: the one-memory-pass activation kernel, its config and :func:`geglu`
  (``torch.ops.sdfast.geglu``);
* ``triton_tma_gemm``: the TMA-fed GEMM with ``a * gelu(g)`` in its epilogue (sm_90), :func:`geglu_linear`;
* ``projection``: :func:`geglu_projection`, what the norms pass runs, and its kernel choice ``CHOICE`` ("geglu":
  cuBLAS + the activation kernel, or the TMA GEMM in one of its tile configs).
"""

from kernels.geglu.projection import geglu_projection
from kernels.geglu.ref import geglu_linear_ref, geglu_ref
from kernels.geglu.triton_elementwise import geglu
from kernels.geglu.triton_tma_gemm import geglu_linear

__all__ = ["geglu", "geglu_ref", "geglu_linear", "geglu_linear_ref", "geglu_projection"]
