"""2:4 structured ("semi-structured") sparsity for linear layers, by concept.

2:4 sparsity keeps two non-zeros in every group of four consecutive weights along the reduction dimension K.
Ampere and Hopper tensor cores skip the zeros (``mma.sp``), for up to twice the dense rate (NVIDIA, "Accelerating
Sparse Deep Neural Networks", Mishra et al. 2021).

- :mod:`kernels.sparse24.prune`: 2:4 masks, magnitude pruning, SparseGPT (its per-block loop is one Triton
  kernel, :mod:`kernels.sparse24.sparsegpt_block`).
- :mod:`kernels.sparse24.format`: our compressed format (values + 2-bit metadata) and torch's CUTLASS layout.
- :mod:`kernels.sparse24.kernel`: ``sparse24_linear``, the Triton kernel reading that format, and its reference.
- :mod:`kernels.sparse24.cusparselt`: the hardware 2:4 backends torch exposes (cuSPARSELt and CUTLASS): probing,
  algorithm search, direct calls.

The nn.Module that runs a pruned linear on the fastest of these (and dense cuBLAS) is
``sdfast.quantization.sparse.SparseLinear``; its per-shape choice is the kernel-choice service's ``"sparse24"``.

Layout conventions (all of this package):

- ``weight: (N, K)`` as in ``nn.Linear`` (N = out_features, K = in_features); groups of four run
  along K: elements ``weight[n, 4g : 4g + 4]`` form group ``g`` of row ``n``.
- ``x: (..., K)``, output ``(..., N)``, i.e. ``y = x @ weight.T + bias``.
- Dtypes: pruning/compression any float dtype; hardware backends float16/bfloat16; the Triton
  kernel float16/bfloat16/float32.
- K must be a multiple of 4. A weight whose K is not raises ``ValueError``: we do not pad, because
  every linear of SD 1.x/2.x/SDXL has K a multiple of 64, and the hardware backends need K to be a
  multiple of 16 (cuSPARSELt) or 64 (CUTLASS) anyway. The pass (``sdfast.passes.sparsity``) skips
  such layers instead of calling these functions.

Sources: SparseGPT, Frantar & Alistarh, "SparseGPT: Massive Language Models Can Be Accurately
Pruned in One-Shot", ICML 2023 (IST-DASLab/sparsegpt); Optimal Brain Surgeon, Hassibi & Stork 1993;
PyTorch ``torch.sparse.semi_structured``; NVIDIA cuSPARSELt documentation.
"""
