"""``OptimizeConfig``: the one frozen config of ``sdfast.optimize``; each flag states its trade-off.

Its ``kernels`` field is the :class:`KernelPolicy`: one field per kernel choice of :mod:`kernels.select`. The
policy is built from the environment by :func:`KernelPolicy.from_env`, the only reader of the ``SDFAST_*`` kernel
switches, called when ``optimize`` runs (never at import).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

# choice name -> (the policy field, the values it takes besides "auto", the environment variable, the value an
# "off" ("0") of that variable means). One row per kernel choice of kernels.select.
POLICY_FIELDS = {
    "attention": ("attention", None, "SDFAST_ATTENTION_BACKEND", None),
    "conv3x3": ("conv3x3", ("cudnn", "gemm"), "SDFAST_CONV_GEMM", "cudnn"),
    "group_norm": ("group_norm", ("cluster", "triton"), "SDFAST_GN_CLUSTER", "triton"),
    "linear": ("linear", ("cublas",), "SDFAST_LINEAR_TMA", "cublas"),
    "geglu": ("geglu", ("cublas",), "SDFAST_GEGLU_TMA", "cublas"),
    "fp8_conv3x3": ("fp8_conv3x3", ("fp8", "fp8_tma", "cudnn"), "SDFAST_FP8_CONV", "cudnn"),
    "geglu_fp8": ("geglu_fp8", ("scaled_mm",), "SDFAST_FP8_GEGLU", "scaled_mm"),
}


@dataclass(frozen=True)
class KernelPolicy:
    """Which kernel each measured choice may take; "auto" (the default) measures per shape on the GPU at warm-up.

    attention: "auto", or one attention backend for every call ("sdpa", "flash", "efficient", "cudnn", "math",
        "triton", "xformers"); a forced backend that fails raises.
    attention_triton: sdfast's Triton flash attention is among the measured backends.
    conv3x3: the ResNet blocks' 3x3 convolutions: "auto", "cudnn", or "gemm" (im2col + cuBLAS where it can run).
    group_norm: the fused GroupNorm kernels: "auto", "cluster" (the sm_90 thread-block-cluster kernel where it can
        run) or "triton".
    linear: the small-K linears (``OptimizeConfig.tma_linear``): "auto" or "cublas" (never the TMA GEMM).
    geglu: GEGLU's projection: "auto" or "cublas" (cuBLAS then the GEGLU kernel; never the TMA GEMM).
    fp8_conv3x3: the 3x3 convolutions quantized by ``W8A8Config(convs=True)``: "auto", "fp8" / "fp8_tma" (the FP8
        implicit GEMM's pointer or TMA kernel) or "cudnn" (cuDNN on the kept 16-bit weight).
    geglu_fp8: GEGLU over a static FP8 projection: "auto" or "scaled_mm" (cuBLASLt's FP8 GEMM, the GEGLU kernel and
        the quantize kernel; never the FP8 TMA GEMM with the activation in its epilogue).
    cusparselt_search: 2:4 sparse linears run cuSPARSELt's algorithm search for each shape (slower to start).

    Environment (read by :meth:`from_env` only): ``SDFAST_ATTENTION_BACKEND`` (a backend or "auto"),
    ``SDFAST_ATTENTION_TRITON=0``, ``SDFAST_CONV_GEMM=0`` (cuDNN), ``SDFAST_GN_CLUSTER=0`` (Triton),
    ``SDFAST_LINEAR_TMA=0`` and ``SDFAST_GEGLU_TMA=0`` (cuBLAS), ``SDFAST_FP8_CONV=0`` (cuDNN), ``SDFAST_FP8_GEGLU=0``
    (scaled_mm),
    ``SDFAST_CUSPARSELT_SEARCH=1``.
    Raises ValueError for a value a field does not take.
    """

    attention: str = "auto"
    attention_triton: bool = True
    conv3x3: str = "auto"
    group_norm: str = "auto"
    linear: str = "auto"
    geglu: str = "auto"
    fp8_conv3x3: str = "auto"
    geglu_fp8: str = "auto"
    cusparselt_search: bool = False

    def __post_init__(self):
        for choice, (name, values, _, _) in POLICY_FIELDS.items():
            value = getattr(self, name)
            if not isinstance(value, str) or (values is not None and value not in ("auto", *values)):
                allowed = "a backend name or 'auto'" if values is None else f"one of {('auto', *values)}"
                raise ValueError(f"KernelPolicy.{name} must be {allowed}, got {value!r}")
        for name in ("attention_triton", "cusparselt_search"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"KernelPolicy.{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def from_env(cls, environ=None) -> "KernelPolicy":
        """The policy the ``SDFAST_*`` kernel switches ask for (see the class docstring); unset ones are "auto".
        The one place sdfast reads them."""
        env = os.environ if environ is None else environ
        values: dict = {}
        for name, _, var, off in POLICY_FIELDS.values():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            if off is None:  # a value switch (the attention backend)
                values[name] = raw
            elif raw == "0":
                values[name] = off
            elif raw != "1":
                raise ValueError(f"{var} must be 0 or 1, got {raw!r}")
        if env.get("SDFAST_ATTENTION_TRITON", "1") == "0":
            values["attention_triton"] = False
        if env.get("SDFAST_CUSPARSELT_SEARCH", "0") == "1":
            values["cusparselt_search"] = True
        return cls(**values)

    def pins(self) -> dict[str, str | None]:
        """``{choice name: candidate or None}`` for :func:`kernels.select.set_pins` (the attention backend is
        passed to the attention dispatcher instead: its candidates are per dispatcher)."""
        return {choice: None if getattr(self, name) == "auto" else getattr(self, name)
                for choice, (name, *_rest) in POLICY_FIELDS.items() if choice != "attention"}

# The dtypes the fused kernels take (an optimized pipeline must be in one of them).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class OptimizeConfig:
    """What ``sdfast.optimize`` changes. Defaults are the fast, image-preserving choices (what each saved on the
    H200: the README's "What each flag saved" table).

    attention: route every diffusers ``Attention`` through sdfast's dispatching processor (the fastest
        exact backend per shape, measured at warm-up). Numerics: fp32 softmax accumulation in every backend;
        differences from stock are fp16 rounding.
    fuse_qkv: fuse Q/K/V (self-attention) and K/V (cross-attention) projections into one GEMM each: the
        separate weights become views of one packed weight, and the projections run as one batched GEMM
        (``sdfast.passes.attention.split_projection``) whose Q, K and V come back contiguous, as separate GEMMs
        give them. Speed: 48 (SD1.5) and 210 (SDXL) fewer GEMM launches per UNet step. Numerics: the same
        products and fp32 accumulation (bit-identical to the separate GEMMs at the UNets' bias-free shapes on
        sm_90; with a bias, rounding-level).
    fuse_norms: GroupNorm(+time-embedding bias)(+SiLU), LayerNorm(+residual) and GEGLU run as single
        Triton kernels (fp32 statistics). Speed: one pass over memory instead of three to five. On sm_90 a GEGLU
        over a plain ``nn.Linear`` may run projection and activation as one TMA GEMM where that measured faster
        (SDXL's levels); its a * gelu(g) is taken from the fp32 accumulators
        (stock rounds the 2N-wide product to fp16 first), with erf from a fit of relative error < 1.2e-7
        (``kernels.geglu.gelu``: a faster epilogue than libdevice's erf). The ResNet blocks' 3x3 convolutions at small
        latent sizes may run as im2col plus one cuBLAS GEMM where that measured faster than cuDNN (the same
        products with fp32 accumulation, summed in another order; ``KernelPolicy.conv3x3``).
    batch_temb: with fuse_norms, the UNet's ResNet blocks' time-embedding projections (SiLU, a tiny GEMM and
        conv1's bias add per block: 22 of each per SD1.5 step, 17 per SDXL step) run as one SiLU, one bias add
        and one GEMM over weights packed at optimize time (``sdfast.passes.time_embedding``; the parameters
        become views of the pack, so in-place updates are seen). Speed: 44 (SD1.5) and 34 (SDXL) fewer
        launches per UNet step.
        Numerics: the same products and sums; conv1's bias joins the projection's bias in fp16 first.
    channels_last: convolutions and norms run in NHWC with no layout round trips. Speed: cuDNN's
        fastest fp16 convolutions; on CPU it changes nothing numerically.
    upsample: diffusers' ``Upsample2D`` (UNet and VAE decoder up blocks) upsamples on sdfast's nearest-2x kernel
        in the tensor's own layout. Speed: PyTorch's channels_last kernel for it runs far below the memory
        bandwidth. Numerics: identical (a copy). Inference
        only (no backward through the kernel).
    skip_concat: the UNet up blocks' skip-connection concatenation (``torch.cat`` along the channels, before each
        ResNet block: 12 per SD1.5 step, 9 per SDXL step) runs on sdfast's channels_last kernel
        (``sdfast.passes.skip_concat``). Speed: PyTorch's kernel for it runs at about half the memory bandwidth. Numerics: identical (a copy). Inference only.
    conv_bias: the convolutions outside the fused blocks (``conv_in``/``conv_out`` of the UNet and the VAE, the
        VAE's ``post_quant_conv``, the down- and upsamplers' convolutions) add their bias in one vectorized kernel
        instead of PyTorch's broadcast add (``sdfast.passes.conv_bias``). Speed: that add runs well below the
        memory bandwidth (most in the fp32 VAE decode). Numerics: the bias added in fp32 and
        rounded once (stock rounds the same sum in the output dtype).
    tma_linear: the UNet's linear layers with K <= 640 (SD1.5's 320- and 640-wide attention projections) and SD 1.x's
        1x1 ``proj_in``/``proj_out`` run on a TMA Triton GEMM where that measured faster than cuBLAS for the shape, at
        warm-up (``sdfast.passes.linear``); ``proj_out`` then takes its bias and the residual add in the GEMM's
        epilogue. Speed: on SD1.5, 31 of its GEMMs run the kernel and 16 bias + residual passes are gone; SDXL
        keeps cuBLAS everywhere (``KernelPolicy.linear``). Numerics: the same
        products with fp32 accumulation; bias and residual added in fp32, rounded once.
    cuda_graphs: the UNet step, the text encoder(s) and the VAE decoder replay CUDA graphs, one per input
        signature, over one shared memory pool. Speed: no launch overhead; costs one capture (about a
        second) per new shape, and graph memory. CUDA only.
    cross_kv_once: with cuda_graphs, the cross-attention K/V projections of the text embedding run once per
        pipeline call (in their own graph) instead of at every step: the embedding does not change during the
        denoising loop. Speed: 140 fewer GEMMs per SDXL step (about 0.9 ms of 31), 32 per SD1.5 step; memory:
        the K/V of every layer (SDXL about 55 MB). Numerics: identical (the same GEMMs, run earlier).
    control_embedding_once: with cuda_graphs, each ControlNet embeds its control image (the eight convolutions of
        ``controlnet_cond_embedding``, at pixel resolution) once per pipeline call, in its own graph, instead of
        at every step (``runtime.control_embedding``). Memory: one (B, C, h, w) embedding per ControlNet.
        Numerics: identical (the same convolutions, run earlier).
    controlnet_overlap: with cuda_graphs and ControlNets, inside engine calls, each step's ControlNets run on a
        second CUDA stream at the same time as the UNet's down blocks, which do not read their residuals
        (``runtime.control_overlap``): the UNet's step with residuals is captured as two graphs, joined where the
        residuals are first read. Memory: the ControlNets' graphs in a pool of their own. Numerics: identical (the
        same kernels on the same inputs).
    parallel_compile: with cuda_graphs, before the first warm-up at a new input signature, one compile-only pass
        (``kernels.precompile``) compiles the Triton kernels it reaches on all CPU cores (ptxas, LLVM and the
        launcher builds overlap) instead of one after another. Speed: warm-up with a cold Triton cache; costs
        one extra eager pass per new signature. Numerics: none (no output of that pass is used).
    max_graphs: graphs kept per module; the least recently used shape is dropped beyond this.
    vae_fp32_when_asked: when the VAE config says ``force_upcast`` and the pipeline is fp16, keep the VAE
        in fp32 permanently (what stock diffusers does per call, without casting weights back and forth).
    vae_decoder_dtype: None (default: the dtype above), or "bfloat16", "float16" or "float32": the VAE's decoder (and
        its ``post_quant_conv``) kept in that dtype, the latents cast to it at ``decode``. "bfloat16" is for a VAE
        whose config says ``force_upcast`` (SDXL's): bf16 has fp32's range, so the fp16 overflow that flag avoids
        cannot happen, and its decoder runs the fused fp16/bf16 kernels instead of fp32 ones. Numerics: bf16's
        8-bit mantissa (a few tenths of a dB to a few dB of PSNR against the fp32 decoder; measured in
        ``benchmarks/results``). The encoder keeps the dtype above.
    vae_tf32: with that fp32 VAE, its attention may run both matmuls in TF32 (fp32 range, fp16's 10-bit
        mantissa, fp32 accumulation and softmax) when the dispatcher measures that faster and within fp16's
        tolerance of fp32. Stock's fp32 VAE already runs its convolutions in TF32 (PyTorch's default
        ``torch.backends.cudnn.allow_tf32``); the upcast is for fp16's range, which TF32 keeps. Speed: SDXL's
        1024² VAE attention runs on tensor cores instead of SDPA's fp32 kernels. Numerics: checked against fp32
        per shape by the dispatcher.
    kernels: the :class:`KernelPolicy` (which kernel each measured choice may take); None: the one the ``SDFAST_*``
        switches ask for, read when ``optimize`` runs (``KernelPolicy.from_env``).
    """

    attention: bool = True
    fuse_qkv: bool = True
    fuse_norms: bool = True
    batch_temb: bool = True
    channels_last: bool = True
    upsample: bool = True
    skip_concat: bool = True
    conv_bias: bool = True
    tma_linear: bool = True
    cuda_graphs: bool = True
    cross_kv_once: bool = True
    control_embedding_once: bool = True
    controlnet_overlap: bool = True
    parallel_compile: bool = True
    max_graphs: int = 8
    vae_fp32_when_asked: bool = True
    vae_decoder_dtype: str | None = None
    vae_tf32: bool = True
    kernels: KernelPolicy | None = None

    def __post_init__(self):
        if self.kernels is not None and not isinstance(self.kernels, KernelPolicy):
            raise TypeError(f"OptimizeConfig.kernels must be an sdfast.KernelPolicy, got {type(self.kernels).__name__}")
        for name, value in asdict(self).items():
            if name in ("max_graphs", "kernels", "vae_decoder_dtype"):
                continue
            if not isinstance(value, bool):
                raise TypeError(f"OptimizeConfig.{name} must be True or False, got {value!r}")
        if self.vae_decoder_dtype not in (None, "bfloat16", "float16", "float32"):
            raise ValueError("OptimizeConfig.vae_decoder_dtype must be None, 'bfloat16', 'float16' or 'float32', got "
                             f"{self.vae_decoder_dtype!r}")
        if not isinstance(self.max_graphs, int) or isinstance(self.max_graphs, bool) or self.max_graphs < 1:
            raise ValueError(f"OptimizeConfig.max_graphs must be an integer >= 1, got {self.max_graphs!r}")

    def as_dict(self) -> dict:
        return asdict(self)
