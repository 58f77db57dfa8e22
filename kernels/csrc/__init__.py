"""CUDA C++ kernels with explicit cp.async PTX (``gemm_cp_async.cu``), built on demand by
``kernels.csrc.build`` (never at import) and compile-checked with nvcc by ``check_compile.py``."""
