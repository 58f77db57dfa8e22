"""Convolution kernels for SD's 3x3 convolutions (channels_last):

* ``conv3x3_tma``: an implicit-GEMM convolution on TMA tiles (Hopper, Triton); measured slower than cuDNN, not wired.
"""
