"""Convolution kernels for SD's stride-1 convolutions (channels_last):

* ``conv2d``: cuDNN or one cuBLAS GEMM (over the NHWC input for 1x1, its im2col matrix for 3x3), the faster measured
  per call signature (what the engine runs);
* ``im2col``: the patch matrix of a 3x3, stride-1, padding-1 convolution (Triton);
* ``conv3x3_tma``: an implicit-GEMM convolution on TMA tiles (Hopper, Triton); measured slower than cuDNN, not wired.
"""
