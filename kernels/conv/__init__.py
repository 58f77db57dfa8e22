"""Convolution kernels for SD's 3x3 convolutions (channels_last):

* ``conv3x3``: cuDNN or im2col + one cuBLAS GEMM, the faster measured per call signature (what the engine runs);
* ``im2col``: the patch matrix of a 3x3, stride-1, padding-1 convolution (Triton).
"""
