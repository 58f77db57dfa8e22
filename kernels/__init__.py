"""sdfast's fused kernels.

Every op lives in its own module with a plain-PyTorch ``*_ref`` beside the Triton kernel, and is
registered as a ``torch.library`` custom op (namespace ``sdfast``) with a fake implementation, so
CUDA-graph capture and torch.compile treat it as one opaque op.

Importing this package does no GPU work. Sub-packages: ``norm``, ``attention``, ``gemm``, ``csrc``.
"""
