"""OptimizeConfig and its KernelPolicy: the one reader of the SDFAST_* kernel switches, applied at optimize."""

import pytest

import sdfast
from kernels import select
from sdfast.config import KernelPolicy, OptimizeConfig


def test_from_env_reads_every_kernel_switch():
    env = {"SDFAST_ATTENTION_BACKEND": "flash", "SDFAST_ATTENTION_TRITON": "0", "SDFAST_CONV_GEMM": "0",
           "SDFAST_GN_CLUSTER": "0", "SDFAST_LINEAR_TMA": "0", "SDFAST_GEGLU_TMA": "0", "SDFAST_CUSPARSELT_SEARCH": "1",
           "SDFAST_FP8_CONV": "0", "SDFAST_FP8_GEGLU": "0"}
    assert KernelPolicy.from_env(env) == KernelPolicy(attention="flash", attention_triton=False, conv3x3="cudnn",
                                                      group_norm="triton", linear="cublas", geglu="cublas",
                                                      fp8_conv3x3="cudnn", geglu_fp8="scaled_mm", cusparselt_search=True)
    assert KernelPolicy.from_env({}) == KernelPolicy() == KernelPolicy.from_env({"SDFAST_CONV_GEMM": "1"})
    assert KernelPolicy.from_env({}).pins() == {"conv3x3": None, "group_norm": None, "linear": None, "geglu": None,
                                                "fp8_conv3x3": None, "geglu_fp8": None}


def test_bad_values_are_refused_with_the_name():
    with pytest.raises(ValueError, match="SDFAST_CONV_GEMM must be 0 or 1"):
        KernelPolicy.from_env({"SDFAST_CONV_GEMM": "yes"})
    with pytest.raises(ValueError, match="KernelPolicy.conv3x3 must be one of"):
        KernelPolicy(conv3x3="winograd")
    with pytest.raises(TypeError, match="KernelPolicy.attention_triton"):
        KernelPolicy(attention_triton="no")
    with pytest.raises(TypeError, match="OptimizeConfig.kernels"):
        OptimizeConfig(kernels={"conv3x3": "cudnn"})


def test_no_switch_is_read_at_import_or_construction(monkeypatch):
    monkeypatch.setenv("SDFAST_CONV_GEMM", "0")
    assert OptimizeConfig().kernels is None  # read when optimize runs


def test_optimize_reads_the_switches_and_pins_the_choices(monkeypatch, tiny_engine):
    sdfast.unoptimize(tiny_engine.pipe)
    monkeypatch.setenv("SDFAST_CONV_GEMM", "0")
    monkeypatch.setenv("SDFAST_LINEAR_TMA", "0")
    try:
        sdfast.optimize(tiny_engine.pipe)
        assert tiny_engine.pipe._sdfast.config.kernels == KernelPolicy(conv3x3="cudnn", linear="cublas")
        assert select.pins() == {"conv3x3": "cudnn", "linear": "cublas"}
        sdfast.optimize(tiny_engine.pipe, OptimizeConfig())  # the same switches: the same config, no error
    finally:
        select.set_pins({})


def test_optimize_hands_the_attention_switches_to_the_dispatchers(monkeypatch, tiny_engine):
    from sdfast.passes.attention import SdfastAttnProcessor

    sdfast.unoptimize(tiny_engine.pipe)
    monkeypatch.setenv("SDFAST_ATTENTION_BACKEND", "math")
    monkeypatch.setenv("SDFAST_ATTENTION_TRITON", "0")
    try:
        sdfast.optimize(tiny_engine.pipe)
        procs = [p for p in tiny_engine.pipe.unet.attn_processors.values() if isinstance(p, SdfastAttnProcessor)]
        assert procs and all(p.dispatcher.forced == "math" and p.dispatcher.triton is False for p in procs)
    finally:
        sdfast.unoptimize(tiny_engine.pipe)
        select.set_pins({})
