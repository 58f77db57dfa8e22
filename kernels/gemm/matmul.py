"""Linear layer GEMM with a fused epilogue: ``y = (act(x @ W^T + b) + residual) * out_scale``.

The Triton kernel walks K in ``BLOCK_K`` tiles; ``num_stages`` makes Triton software-pipeline the
A/B tile loads through shared memory (``cp.async`` on sm80+, a ring of ``num_stages`` buffers), the
MMA accumulates in fp32, and the epilogue is applied to the fp32 accumulator before one store:

* ``+ bias``
* ``epilogue="gelu"``: exact GELU, ``0.5 * y * (1 + erf(y / sqrt(2)))``
* ``epilogue="geglu"``: ``weight`` has ``2N`` rows (diffusers' ``GEGLU.proj``); rows ``[0, N)`` give
  ``a``, rows ``[N, 2N)`` give the gate ``g``, and the output is ``a * gelu(g)`` (N columns). One
  program computes the matching ``a`` and ``g`` tiles (rows ``n`` and ``n + N``) in two accumulators,
  so the 2N-wide intermediate never reaches memory (GEGLU: Shazeer 2020, "GLU Variants Improve
  Transformer").
* ``+ residual`` (M, N), then ``* out_scale`` (diffusers' attention: ``(to_out(h) + residual) /
  rescale_output_factor``).

Program order follows the grouped ("super-tile") ordering of the Triton matmul tutorial so that
neighbouring programs share A rows in L2.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.dispatch import interpret_mode, launch_autotuned, use_triton
from kernels.gelu import gelu_erf
from kernels.gemm._common import autotune_bench, even_k, grouped_tile, interp_meta, smem_limit

EPILOGUES = (None, "gelu", "geglu")
_EPI_CODE = {"none": 0, "gelu": 1, "geglu": 2}
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------
def linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    epilogue: str | None = None,
    residual: torch.Tensor | None = None,
    out_scale: float = 1.0,
    upcast: bool = True,
) -> torch.Tensor:
    """Plain-PyTorch ``linear`` with the same epilogue.

    x: (..., K); weight: (N, K), or (2N, K) for ``epilogue="geglu"``; bias: (N,) or (2N,);
    residual: (..., N). With ``upcast`` every step runs in fp32 and the result is cast back to
    ``x.dtype``; without it the math runs in ``x.dtype`` (the "torch low precision" baseline).
    """
    dt = x.dtype
    if upcast:
        x, weight = x.float(), weight.float()
        bias = bias.float() if bias is not None else None
        residual = residual.float() if residual is not None else None
    y = torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    if epilogue == "gelu":
        y = torch.nn.functional.gelu(y)
    elif epilogue == "geglu":
        a, g = y.chunk(2, dim=-1)
        y = a * torch.nn.functional.gelu(g)
    elif epilogue is not None:
        raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    if residual is not None:
        y = y + residual.to(y.dtype)
    if out_scale != 1.0:
        y = y * out_scale
    return y.to(dt)


# --------------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _linear_kernel(
    x_ptr,  # (M, K) activations
    w_ptr,  # (N, K) weight, or (2N, K) for GEGLU
    bias_ptr,  # (N,) or (2N,) bias; unused when HAS_BIAS is False
    res_ptr,  # (M, N) residual; unused when HAS_RESIDUAL is False
    out_ptr,  # (M, N) output
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_rm,
    stride_rn,
    stride_om,
    stride_on,
    out_scale,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EPILOGUE: tl.constexpr,  # 0: none, 1: GELU, 2: GEGLU
    IEEE: tl.constexpr,  # fp32 inputs: exact fp32 dot instead of TF32
    K_TILES: tl.constexpr,  # > 0: K-loop trip count as a constexpr (interpreter); 0: cdiv(K, BLOCK_K) at run time
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask in the main loop
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Wrap rows/columns past the edge onto valid ones: loads need no M/N mask, the store masks.
    rm = tl.max_contiguous(tl.multiple_of(offs_m % M, BLOCK_M), BLOCK_M)
    rn = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    rk = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk
    w_ptrs = w_ptr + rn[None, :] * stride_wn + rk[:, None] * stride_wk  # (BLOCK_K, BLOCK_N) view of W^T
    g_ptrs = w_ptrs + N * stride_wn  # GEGLU gate rows [N, 2N)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if EPILOGUE == 2:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # (inline: the interpreter turns every plain assignment into a tensor, and cannot range() over one)
    for kt in range(0, K_TILES if K_TILES > 0 else tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_left = K - kt * BLOCK_K
            a = tl.load(x_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(w_ptrs, mask=rk[:, None] < k_left, other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if EPILOGUE == 2:
            if EVEN_K:
                bg = tl.load(g_ptrs)
            else:
                bg = tl.load(g_ptrs, mask=rk[:, None] < k_left, other=0.0)
            if IEEE:
                acc_g = tl.dot(a, bg, acc_g, input_precision="ieee")
            else:
                acc_g = tl.dot(a, bg, acc_g)
            g_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
        if EPILOGUE == 2:
            acc_g += tl.load(bias_ptr + N + rn).to(tl.float32)[None, :]
    if EPILOGUE == 1:
        acc = gelu_erf(acc)
    elif EPILOGUE == 2:
        acc = acc * gelu_erf(acc_g)

    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn, mask=mask, other=0.0)
        acc += r.to(tl.float32)
    acc = acc * out_scale
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps): a short list (autotuning cost matters at
# benchmark time), filtered by the device's shared memory.
_GPU_CONFIGS = (
    (128, 128, 64, 4, 8),
    (128, 256, 64, 3, 8),
    (64, 128, 64, 4, 4),
    (64, 64, 64, 4, 4),  # small M (cross-attention K/V on 154 tokens) and narrow N
)


def smem_bytes(block_m: int, block_n: int, block_k: int, stages: int, elem_bytes: int, n_b_tiles: int = 1) -> int:
    """Shared memory of the pipelined main loop: ``stages`` copies of one A and ``n_b_tiles`` B tiles."""
    return stages * (block_m * block_k + n_b_tiles * block_n * block_k) * elem_bytes


def device_smem_limit(device_index: int) -> int:
    """Opt-in shared memory per block (bytes) of a CUDA device (227 KiB on H100/H200, 163 KiB on A100)."""
    return smem_limit(device_index)


def linear_configs(device: torch.device, elem_bytes: int, n_b_tiles: int = 1) -> list[triton.Config]:
    """Configs whose pipelined tiles fit the device's shared memory (one config under the interpreter)."""
    if device.type != "cuda":
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}, num_warps=4, num_stages=1)]
    limit = device_smem_limit(device.index if device.index is not None else torch.cuda.current_device())
    out = []
    for bm, bn, bk, st, nw in _GPU_CONFIGS:
        # fp32 tiles are twice as large: halve K so the same pipelines fit
        bk_eff = bk if elem_bytes <= 2 else bk // 2
        if smem_bytes(bm, bn, bk_eff, st, elem_bytes, n_b_tiles) <= limit:
            out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk_eff, "GROUP_M": 8}, num_warps=nw, num_stages=st))
    if not out:
        out.append(triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=2))
    return out


@functools.lru_cache(maxsize=None)
def _tuned(device_key: tuple, elem_bytes: int, n_b_tiles: int):
    device = torch.device(*device_key) if device_key[0] == "cuda" else torch.device("cpu")
    return triton.autotune(
        configs=linear_configs(device, elem_bytes, n_b_tiles),
        key=["M", "N", "K", "HAS_BIAS", "HAS_RESIDUAL", "EPILOGUE", "IEEE"],
        do_bench=autotune_bench,
    )(triton.heuristics({"EVEN_K": even_k})(_linear_kernel))


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------
def _check(x, weight, bias, epilogue, residual):
    if epilogue not in EPILOGUES:
        raise ValueError(f"linear: epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    if x.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"linear: expected x (..., K) and weight (N, K), got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"linear: x dtype {x.dtype} not supported (supported: {_SUPPORTED_DTYPES})")
    if weight.dtype != x.dtype:
        raise TypeError(f"linear: weight dtype {weight.dtype} != x dtype {x.dtype}")
    K = x.shape[-1]
    if weight.shape[1] != K:
        raise ValueError(f"linear: x has K={K} but weight is {tuple(weight.shape)} (expected (N, {K}))")
    n_rows = weight.shape[0]
    if epilogue == "geglu" and n_rows % 2:
        raise ValueError(f"linear: epilogue='geglu' needs weight with 2N rows, got {n_rows} rows")
    N = n_rows // 2 if epilogue == "geglu" else n_rows
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n_rows):
        raise ValueError(f"linear: bias must be ({n_rows},), got {tuple(bias.shape)}")
    if residual is not None and tuple(residual.shape) != (*x.shape[:-1], N):
        raise ValueError(f"linear: residual must be {(*x.shape[:-1], N)}, got {tuple(residual.shape)}")
    devs = {t.device for t in (x, weight, bias, residual) if t is not None}
    if len(devs) != 1:
        raise ValueError(f"linear: all tensors must be on one device, got {sorted(map(str, devs))}")
    return K, N


@torch.library.custom_op("sdfast::linear", mutates_args=())
def _linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    epilogue: str,
    residual: torch.Tensor | None,
    out_scale: float,
) -> torch.Tensor:
    epi = None if epilogue == "none" else epilogue
    K, N = _check(x, weight, bias, epi, residual)
    if not use_triton("linear", x, weight, bias, residual):
        return linear_ref(x, weight, bias, epilogue=epi, residual=residual, out_scale=out_scale)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return out.reshape(*lead, N)
    if K == 0:
        return linear_ref(x, weight, bias, epilogue=epi, residual=residual, out_scale=out_scale)
    r2 = residual.reshape(M, N) if residual is not None else out
    dev_key = ("cuda", x.device.index if x.device.index is not None else torch.cuda.current_device()) if x.is_cuda else ("cpu",)
    n_b = 2 if epi == "geglu" else 1
    common = dict(
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        EPILOGUE=_EPI_CODE[epilogue],
        IEEE=x.dtype == torch.float32,
    )
    args = (
        x2, weight, bias if bias is not None else out, r2, out,
        M, N, K,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
        r2.stride(0), r2.stride(1), out.stride(0), out.stride(1),
        float(out_scale),
    )
    if x.is_cuda and not interpret_mode():
        kernel = _tuned(dev_key, x.element_size(), n_b)

        def grid(meta):
            return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

        launch_autotuned(kernel, grid, *args, **common, K_TILES=0)
    else:
        cfg = linear_configs(x.device, x.element_size(), n_b)[0]
        grid = (triton.cdiv(M, cfg.kwargs["BLOCK_M"]) * triton.cdiv(N, cfg.kwargs["BLOCK_N"]),)
        _linear_kernel[grid](*args, **common, **interp_meta(K, cfg.kwargs["BLOCK_K"]), **cfg.kwargs,
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.reshape(*lead, N)


@_linear_op.register_fake
def _(x, weight, bias, epilogue, residual, out_scale):
    n = weight.shape[0] // 2 if epilogue == "geglu" else weight.shape[0]
    return x.new_empty((*x.shape[:-1], n))


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    epilogue: str | None = None,
    residual: torch.Tensor | None = None,
    out_scale: float = 1.0,
) -> torch.Tensor:
    """``(act(x @ weight^T + bias) + residual) * out_scale`` in one Triton GEMM (op ``sdfast::linear``).

    Args:
        x: (..., K) or (M, K), fp16 / bf16 / fp32 (any strides; leading dims are flattened).
        weight: (N, K) as ``nn.Linear`` stores it, same dtype as ``x``; (2N, K) for ``"geglu"``.
        bias: optional (N,) (or (2N,) for ``"geglu"``), any float dtype (read in fp32).
        epilogue: None, ``"gelu"`` (exact erf GELU) or ``"geglu"`` (``a * gelu(g)`` with ``a`` from
            weight rows ``[0, N)`` and ``g`` from rows ``[N, 2N)``, as diffusers' ``GEGLU``).
        residual: optional (..., N), added after the activation.
        out_scale: multiplies the final result (after the residual add).

    Returns:
        (..., N) in ``x.dtype``. Accumulation is fp32; fp32 inputs use exact fp32 (IEEE) products.

    Raises:
        ValueError: shape mismatch, unknown epilogue, odd row count for GEGLU, tensors on several devices.
        TypeError: unsupported dtype or ``weight.dtype != x.dtype``.
    """
    if epilogue not in EPILOGUES:
        raise ValueError(f"linear: epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    return _linear_op(x, weight, bias, "none" if epilogue is None else epilogue, residual, float(out_scale))


def linear_flops(M: int, N: int, K: int, epilogue: str | None = None) -> float:
    """Multiply-add FLOP count (2·M·N_W·K, with N_W = 2N for GEGLU), for TFLOP/s figures."""
    return 2.0 * M * K * N * (2 if epilogue == "geglu" else 1)


__all__ = ["linear", "linear_ref", "linear_configs", "linear_flops", "smem_bytes", "EPILOGUES"]

