"""Attention pass: a dispatching attention processor for diffusers' ``Attention`` modules.

What it does to a UNet / VAE (``apply``):

* every stock ``Attention`` (UNet self- and cross-attention in ``Transformer2DModel`` blocks, the VAE
  mid-block attention) gets :class:`SdfastAttnProcessor`, numerically the same as diffusers'
  ``AttnProcessor2_0`` (spatial_norm, group_norm, norm_cross, attention_mask, 4D input,
  residual_connection, rescale_output_factor);
* Q/K/V projections are fused into one GEMM for self-attention (``to_qkv``) and K/V into one for
  cross-attention (``to_kv``), the names diffusers' ``Attention.fuse_projections()`` uses. Unlike
  diffusers (which keeps a second copy of the weights and has no per-module unfuse on the legacy
  ``Attention``), ``to_q`` / ``to_k`` / ``to_v`` weights become views into the fused weight, so no
  memory is added, and ``undo`` restores separate weights;
* heads are never transposed in memory: q, k, v go to the kernel as (B, H, L, D) strided views of
  the projection output (B, L, H·D), and the kernel output comes back in (B, L, H, D) memory when
  the backend allows it;
* each attention call goes through :class:`AttentionDispatcher`, which picks per shape the fastest
  backend that gives the right answer: torch SDPA with a forced backend (cuDNN, FlashAttention,
  memory-efficient, math), SDPA's own choice, xformers (if importable and a probe call works), or
  our Triton kernel (``kernels.attention.flash_attention``).

Pass API (shared by sdfast's passes, after torchao's ``quantize_`` / Liger's ``apply_liger_kernel``):
``apply(module, *, filter_fn=None, dispatcher=None, fuse_projections=True) -> int`` and
``undo(module) -> int``. Run ``undo`` before saving weights, loading or fusing LoRA, or changing
the projection weights, then ``apply`` again: after ``apply`` the fused layers hold the weights.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from typing import Callable, Dict, Mapping, NamedTuple, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import precompile
from kernels.attention.buckets import length_bucket
from sdfast.passes._modules import runs_as_its_class
from sdfast.quantization.shared_input import SharedInputQuantization

log = logging.getLogger("sdfast.attention")

ENV_BACKEND = "SDFAST_ATTENTION_BACKEND"
SAFE_DEFAULT = "sdpa"
_SDPA_FORCED = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}
BACKEND_NAMES = ("cudnn", "flash", "efficient", "math", "sdpa", "xformers", "triton", "tf32")
_STATE_ATTR = "_sdfast_attention_state"
# Names of the fused Q/K/V (K/V) projections this pass adds: views of to_q/to_k/to_v's weights, used
# only while those are plain nn.Linear, so other passes (quantize_, sparsify_) never convert them.
FUSED_PROJECTIONS = (".to_qkv", ".to_kv")
# processors whose math SdfastAttnProcessor reproduces (others, e.g. IP-Adapter or LoRA processors,
# are left alone)
_STOCK_PROCESSORS = {"AttnProcessor", "AttnProcessor2_0", "FusedAttnProcessor2_0", "XFormersAttnProcessor"}

# A backend: fn(q, k, v, attn_mask, scale, upcast) -> (B, H, Lq, D).
# q: (B, H, Lq, D), k/v: (B, H, Lk, D) (strided views allowed), attn_mask: SDPA-style bool
# (True = keep) or additive float mask broadcastable to (B, H, Lq, Lk), or None.
BackendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], float, bool], torch.Tensor]


# ----------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------


def _sdpa_forced(name: str) -> BackendFn:
    def run(q, k, v, attn_mask, scale, upcast):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = _sdpa_layout(q), _sdpa_layout(k), _sdpa_layout(v)
        with sdpa_kernel([getattr(SDPBackend, _SDPA_FORCED[name])]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)

    run.__name__ = f"sdpa_{name}"
    return run


def _sdpa_default(q, k, v, attn_mask, scale, upcast):
    # SDPA's own backend choice: what diffusers' AttnProcessor2_0 runs. Its fused backends already
    # do the softmax in fp32, which is what upcast asks for.
    q, k, v = _sdpa_layout(q), _sdpa_layout(k), _sdpa_layout(v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def _sdpa_layout(t: torch.Tensor) -> torch.Tensor:
    """Give SDPA a (B, H, L, D) tensor in one of the two layouts its CUDA backends are known to handle:
    BHSD-contiguous or the BSHD-packed view diffusers itself passes. The interleaved Q/K/V views of a
    fused projection (sequence stride 3·H·D) made torch 2.11's default SDPA fault with an illegal memory
    access on the H200 (seen 2026-11-29), so those are packed first (one copy of L·H·D elements)."""
    b, h, l, d = t.shape
    packed_bshd = t.stride(3) == 1 and t.stride(1) == d and t.stride(2) == h * d
    if t.is_contiguous() or packed_bshd or t.device.type != "cuda":
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def key_padding_from_mask(attn_mask: torch.Tensor, batch: int, lk: int) -> torch.Tensor:
    """(B, Lk) bool key-padding mask from an SDPA bool mask broadcast over heads and queries.

    Raises NotImplementedError for float (additive) masks or masks that vary per head/query.
    """
    if attn_mask.dtype != torch.bool:
        raise NotImplementedError(f"triton attention takes bool key-padding masks, got {attn_mask.dtype}")
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if m.shape[1] != 1 or m.shape[2] != 1 or m.shape[3] != lk or m.shape[0] not in (1, batch):
        raise NotImplementedError(
            f"triton attention takes key-padding masks (B or 1, 1, 1, Lk); got {tuple(attn_mask.shape)}"
        )
    return m.reshape(m.shape[0], lk)


def _triton_backend(q, k, v, attn_mask, scale, upcast):
    from kernels.attention.flash_attention import flash_attention

    kpm = None if attn_mask is None else key_padding_from_mask(attn_mask, q.shape[0], k.shape[2])
    return flash_attention(q, k, v, key_padding_mask=kpm, scale=scale, upcast_softmax=upcast)


_SCORE_CHUNK_ELEMS = 64 * 2**20  # fp32 scores per query chunk of the math paths (256 MiB)


def _mask_4d(attn_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    m = attn_mask
    while m is not None and m.dim() < 4:
        m = m.unsqueeze(0)
    return m


def _chunk_rows(q: torch.Tensor, k: torch.Tensor) -> int:
    """Queries per chunk so that one chunk's (B, H, rows, Lk) fp32 scores stay under ``_SCORE_CHUNK_ELEMS``."""
    return max(1, _SCORE_CHUNK_ELEMS // max(1, q.shape[0] * q.shape[1] * k.shape[2]))


def _tf32_backend(q, k, v, attn_mask, scale, upcast):
    """Attention of fp32 tensors with both matmuls in TF32 (tensor cores: fp32 range, 10-bit mantissa, fp32
    accumulation) and an fp32 softmax, over chunks of queries whose (B, H, rows, Lk) scores stay under
    256 MiB. For the fp32 VAE of SDXL (``force_upcast``) at 1024², where SDPA's fp32 kernels run on CUDA
    cores: 13.6 ms per call on the H200 (run 7). The TF32 flag is process-wide: it is set only while this
    function queues its matmuls, and restored (``_tf32_matmuls``). On the CPU there is no TF32: the same
    chunked fp32 math."""
    if q.dtype != torch.float32:
        raise NotImplementedError(f"the tf32 backend takes fp32 tensors, got {q.dtype}")
    B, H, Lq, _ = q.shape
    m, rows = _mask_4d(attn_mask), _chunk_rows(q, k)
    out = torch.empty(B, H, Lq, v.shape[-1], dtype=q.dtype, device=q.device)
    kt = k.transpose(-1, -2)
    with _tf32_matmuls():
        for i in range(0, Lq, rows):
            s = torch.matmul(q[:, :, i : i + rows] * scale, kt)
            if m is not None:
                mi = m if m.shape[2] == 1 else m[:, :, i : i + rows]
                s = s.masked_fill(~mi, float("-inf")) if mi.dtype == torch.bool else s + mi
            out[:, :, i : i + rows] = torch.matmul(torch.softmax(s, dim=-1), v)
            del s
    return out


@contextlib.contextmanager
def _tf32_matmuls():
    """cuBLAS fp32 matmuls in TF32 inside the block, the caller's setting restored after, through whichever of
    torch's two flag APIs the caller uses (reading the legacy ``allow_tf32`` raises once the caller has set
    the newer ``fp32_precision``, and mixing them makes later reads raise)."""
    m = torch.backends.cuda.matmul
    try:
        name, previous, value = "allow_tf32", m.allow_tf32, True
    except RuntimeError:
        name, previous, value = "fp32_precision", m.fp32_precision, "tf32"
    setattr(m, name, value)
    try:
        yield
    finally:
        setattr(m, name, previous)


def _xformers_backend(q, k, v, attn_mask, scale, upcast):
    if attn_mask is not None:
        raise NotImplementedError("xformers backend: attention masks are not wired")
    import xformers.ops as xops  # type: ignore

    # xformers takes (B, L, H, D): our (B, H, L, D) views transposed back, no copy
    out = xops.memory_efficient_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return out.transpose(1, 2)


_xformers_ok: Dict[str, bool] = {}


@contextlib.contextmanager
def quiet_probe(what: str, logged: Optional[set] = None):
    """Run a backend probe without showing its warnings: torch's SDPA explains at length, in one
    ``UserWarning`` per reason ("Flash attention kernel not used because", "head_dim should be no more than
    256", ...), why a forced backend cannot run inputs that another backend runs fine, and a first image at a
    new shape probes dozens of them. What the probe warns is logged at debug level, each message once per
    ``logged`` set (a fresh one per call without it). The same kernel warning at a real call is shown as
    usual: only the probe is quiet.

    ``warnings.catch_warnings`` swaps the process's warning filters, so a warning another thread raises while
    a probe runs is logged here too instead of shown: hence the probes are short (one call and its timing)."""
    logged = set() if logged is None else logged
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for w in caught:
                msg = f"{w.category.__name__}: {w.message}"
                if msg not in logged:
                    logged.add(msg)
                    log.debug("sdfast attention: probing %s warned: %s", what, msg)


def xformers_works(device: torch.device) -> bool:
    """xformers importable AND a tiny call on ``device`` runs (the GPU machine's wheel fails with
    'No operator found'). Probed once per device, on first use, never at import; logged."""
    dkey = str(device)
    if dkey not in _xformers_ok:
        try:
            with quiet_probe(f"xformers on {device}"):
                import xformers.ops as xops  # type: ignore

                x = torch.randn(1, 4, 1, 40, device=device, dtype=torch.float16)
                xops.memory_efficient_attention(x, x, x)
            _xformers_ok[dkey] = True
        except ImportError:
            _xformers_ok[dkey] = False
            log.debug("sdfast attention: xformers not installed")
        except Exception as e:  # noqa: BLE001 - any failure means: do not use it
            _xformers_ok[dkey] = False
            log.info("sdfast attention: xformers is installed but its probe call failed on %s: %s", device, e)
    return _xformers_ok[dkey]


def _builtin_backends() -> Dict[str, BackendFn]:
    b: Dict[str, BackendFn] = {n: _sdpa_forced(n) for n in _SDPA_FORCED}
    b["sdpa"] = _sdpa_default
    b["xformers"] = _xformers_backend
    b["triton"] = _triton_backend
    b["tf32"] = _tf32_backend
    return b


# ----------------------------------------------------------------------------------------------
# Dispatcher
# ----------------------------------------------------------------------------------------------


class AttentionKey(NamedTuple):
    lq: int
    lk: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    has_mask: bool
    upcast: bool


_RTOL = {torch.float16: 2e-2, torch.bfloat16: 6e-2, torch.float32: 2e-3}
# Backends that compute in a narrower precision than their inputs: checked at that precision's tolerance.
_COMPUTE_DTYPE = {"tf32": torch.float16}  # TF32 keeps fp16's 10-bit mantissa


def _reference(q, k, v, attn_mask, scale) -> torch.Tensor:
    """fp32 math attention, chunked over queries to keep the score matrix under ~256 MiB."""
    Lq = q.shape[2]
    m, rows = _mask_4d(attn_mask), _chunk_rows(q, k)
    if m is not None and m.dtype != torch.bool:
        m = m.float()
    kf, vf = k.float(), v.float()
    outs = []
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        for i in range(0, Lq, rows):
            mi = None if m is None else (m if m.shape[2] == 1 else m[:, :, i : i + rows])
            outs.append(
                F.scaled_dot_product_attention(q[:, :, i : i + rows].float(), kf, vf, attn_mask=mi, scale=scale)
            )
    return torch.cat(outs, dim=2)


def _mismatch(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> Optional[str]:
    """None if ``out`` matches the fp32 reference within the dtype's tolerance, else why not.
    Rows the reference leaves NaN (all keys masked) are not compared."""
    if tuple(out.shape) != tuple(ref.shape):
        return f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    fin = torch.isfinite(ref)
    o = out.float()[fin]
    r = ref[fin]
    if o.numel() == 0:
        return None
    if not torch.isfinite(o).all():
        return "output has NaN/Inf"
    err = (o - r).abs().max().item()
    tol = _RTOL.get(dtype, 2e-2) * r.abs().max().item() + 1e-5
    if err > tol:
        return f"max abs error {err:.3e} > tolerance {tol:.3e}"
    return None


def _time_us(fn: Callable[[], object], device: torch.device, budget_ms: float) -> float:
    """Median time of ``fn`` in µs. CUDA: per-call CUDA events, with the calls queued behind a
    spin kernel long enough for the host to enqueue them all, so that host overhead (large for a
    Triton kernel launched from Python) is not counted: under CUDA graphs it is not paid."""
    if device.type != "cuda":
        fn()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[1] * 1e6
    fn()
    torch.cuda.synchronize(device)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    s.record()
    fn()
    e.record()
    host_us = (time.perf_counter() - t0) * 1e6
    e.synchronize()
    est_ms = max(s.elapsed_time(e), 1e-3)
    n = int(min(50, max(3, budget_ms / est_ms)))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    if hasattr(torch.cuda, "_sleep"):
        # twice the host time of the n calls, at >= 1 cycle per ns (H200 SMs run at ~2 GHz)
        torch.cuda._sleep(int(1000 * (2 * host_us * n + 50)))
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize(device)
    ts = sorted(s.elapsed_time(e) for s, e in events)
    return ts[len(ts) // 2] * 1000.0


def _time_once_us(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of one call in µs, the device synchronized before and after (a rough probe, launch included)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e6


def _capturing_or_compiling(device: torch.device) -> bool:
    compiling = getattr(torch.compiler, "is_compiling", lambda: False)()
    return compiling or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _first_queries(q: torch.Tensor, attn_mask: Optional[torch.Tensor], m: int) -> tuple:
    """The first ``m`` queries of ``q`` (B, H, Lq, D) and the matching rows of a mask that has a query axis."""
    lq = q.shape[2]
    per_query = attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] == lq
    return q[:, :, :m], attn_mask[..., :m, :] if per_query else attn_mask


def _dry_rows(lq: int) -> int:
    """Queries to run our kernel on in a compile-only pass: at most 128 + 127, congruent to ``lq`` modulo 128, so
    every power-of-two divisibility Triton specializes on (and every BLOCK_M up to 128 divides alike)."""
    return lq if lq <= 256 else 128 + lq % 128


def _bucket(key: AttentionKey) -> tuple:
    """``key`` with both lengths replaced by their buckets, and whether the lengths are equal: self-attention
    (Lq == Lk) and cross-attention over 77 tokens share buckets at SD's smallest latents (64 and 77 queries
    or keys), but not a bucket mate."""
    return key._replace(lq=length_bucket(key.lq), lk=length_bucket(key.lk)), key.lq == key.lk


class AttentionDispatcher:
    """Picks, per attention shape, the fastest backend that computes it correctly, and caches it.

    Call: ``dispatcher(q, k, v, *, attn_mask=None, scale=None, upcast=False) -> (B, H, Lq, D)``
    with q (B, H, Lq, D), k/v (B, H, Lk, D) (strided views welcome), fp16/bf16/fp32,
    ``attn_mask`` SDPA-style (bool True = keep, or additive float) broadcastable to (B, H, Lq, Lk).

    Cache key: :class:`AttentionKey` (Lq, Lk, heads, head_dim, dtype, device, has_mask, upcast);
    the batch size is not part of it. On the first call of a key on CUDA (outside CUDA-graph capture
    and torch.compile tracing), every candidate backend (for a key whose lengths fall in the power-of-two
    buckets of a key measured before: only those within ``mate_factor`` of that key's best, ``_narrowed``)
    runs once on the real inputs and is compared with fp32 math attention; a backend that raises or
    disagrees is excluded for that key and logged (``_exclude``: the one logged dispatch point); the others are timed (CUDA events, about
    ``budget_ms`` each) and the fastest is cached. A key first seen during capture/compile uses
    SDPA's default (``"sdpa"``, capture-safe) uncached, with a warning: warm up before capturing.
    Probing is quiet (``quiet_probe``): warnings a candidate raises while it is checked and timed go to the
    debug log, once per message; the picked backend's warnings at real calls are shown.
    On CPU the default is SDPA without measuring (``measure_cpu=True`` measures like CUDA; the
    Triton kernel runs on CPU only under ``TRITON_INTERPRET=1``).

    Backends: ``cudnn``, ``flash``, ``efficient``, ``math`` (torch SDPA forced to that backend via
    ``torch.nn.attention.sdpa_kernel``), ``sdpa`` (SDPA's own choice), ``xformers`` (only if
    importable and a probe call works), ``triton`` (ours; no masks other than key padding), ``tf32``
    (fp32 inputs, matmuls in TF32; only with ``allow_tf32``).
    ``upcast`` is passed to the Triton kernel (fp32-like P, see ``flash_attention``); SDPA backends
    already run the softmax in fp32, as diffusers' ``AttnProcessor2_0`` relies on.

    Args:
        backend: force one backend for every call (tests, benchmarks). Default: the environment
            variable ``SDFAST_ATTENTION_BACKEND``; ``None`` / ``"auto"`` = measure. A forced backend
            that fails raises (no silent fallback).
        candidates: backend names to consider when measuring (default: all available).
        extra_backends: additional named backends ``fn(q, k, v, attn_mask, scale, upcast)``.
        measure_cpu: measure on CPU too instead of taking SDPA.
        budget_ms: timing budget per backend and key.
        allow_tf32: fp32 keys also consider ``tf32`` (both matmuls in TF32, checked at fp16's tolerance
            against the fp32 reference). Off by default: an fp32 model asked for fp32.

    Raises:
        ValueError: unknown backend / candidate name.
        RuntimeError: no backend computed a key correctly.
    """

    def __init__(
        self,
        backend: Optional[str] = None,
        *,
        candidates: Optional[Sequence[str]] = None,
        extra_backends: Optional[Mapping[str, BackendFn]] = None,
        measure_cpu: bool = False,
        budget_ms: float = 3.0,
        allow_tf32: bool = False,
    ):
        self._backends: Dict[str, BackendFn] = _builtin_backends()
        if extra_backends:
            self._backends.update(extra_backends)
        if backend is None:
            backend = os.environ.get(ENV_BACKEND) or None
        if backend == "auto":
            backend = None
        if backend is not None and backend not in self._backends:
            raise ValueError(f"unknown attention backend {backend!r}; known: {sorted(self._backends)}")
        if candidates is not None:
            unknown = [c for c in candidates if c not in self._backends]
            if unknown:
                raise ValueError(f"unknown attention backends {unknown}; known: {sorted(self._backends)}")
        self.forced = backend
        self.candidates = tuple(candidates) if candidates is not None else None
        # A candidate is probed on a slice of the queries first when the best time so far is at least probe_us,
        # and skipped if that extrapolates to more than slow_factor times the best (see _too_slow).
        self.probe_us = 1000.0
        self.slow_factor = 8.0
        # A key whose length bucket was measured before measures only the backends within this factor of that
        # key's best (see _narrowed).
        self.mate_factor = 1.25
        self._extra = tuple(extra_backends or ())
        self.measure_cpu = measure_cpu
        self.budget_ms = budget_ms
        self.allow_tf32 = allow_tf32
        self._choice: Dict[AttentionKey, str] = {}
        self._timings: Dict[AttentionKey, Dict[str, float]] = {}
        self._excluded: Dict[AttentionKey, Dict[str, str]] = {}
        self._warned: set = set()
        self._probe_logged: Dict[tuple, set] = {}  # (key, backend) -> warning messages logged while probing

    # -- public views of the cache ------------------------------------------------------------
    def choices(self) -> Dict[AttentionKey, str]:
        """key -> backend name picked (a copy)."""
        return dict(self._choice)

    def timings(self) -> Dict[AttentionKey, Dict[str, float]]:
        """key -> {backend: µs} measured when the key was first seen."""
        return {k: dict(v) for k, v in self._timings.items()}

    def excluded(self) -> Dict[AttentionKey, Dict[str, str]]:
        """key -> {backend: reason} for backends that raised or gave a wrong answer."""
        return {k: dict(v) for k, v in self._excluded.items()}

    def backend_fn(self, name: str) -> BackendFn:
        return self._backends[name]

    @staticmethod
    def key_for(q: torch.Tensor, k: torch.Tensor, attn_mask: Optional[torch.Tensor], upcast: bool) -> AttentionKey:
        return AttentionKey(
            q.shape[2], k.shape[2], q.shape[1], q.shape[3], q.dtype, q.device, attn_mask is not None, bool(upcast)
        )

    # -- call -----------------------------------------------------------------------------------
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attn_mask: Optional[torch.Tensor] = None,
        scale: Optional[float] = None,
        upcast: bool = False,
    ) -> torch.Tensor:
        if scale is None:
            scale = q.shape[-1] ** -0.5
        if self.forced is not None:
            return self._backends[self.forced](q, k, v, attn_mask, scale, upcast)
        key = self.key_for(q, k, attn_mask, upcast)
        name = self._choice.get(key)
        if name is None:
            name = self._choose(key, q, k, v, attn_mask, scale, upcast)
        if name == SAFE_DEFAULT:
            return self._backends[name](q, k, v, attn_mask, scale, upcast)
        try:
            return self._backends[name](q, k, v, attn_mask, scale, upcast)
        except torch.OutOfMemoryError:
            raise  # the request is too big, not the backend's fault: nothing is excluded
        except Exception as e:  # noqa: BLE001
            # the cached winner failed on a later call (the key has no batch size): exclude it and
            # use SDPA's default from now on. Inside graph capture there is nothing safe to do.
            if _capturing_or_compiling(q.device):
                raise
            self._exclude(key, name, f"failed after being picked: {type(e).__name__}: {e}", wrong=True)
            self._choice[key] = SAFE_DEFAULT
            return self._backends[SAFE_DEFAULT](q, k, v, attn_mask, scale, upcast)

    def _too_slow(self, key: AttentionKey, name: str, fn: BackendFn, args: tuple, best_us: float) -> bool:
        """When the best time so far is long (``probe_us``), run a candidate on 1/64 of the queries first and
        exclude it if that extrapolates to more than ``slow_factor`` times the best: a full run, let alone the
        timing loop, would cost seconds (the SDXL VAE's fp32 attention at 128x128 latents: 2.3 s per call of
        our fp32 Triton path against 13.5 ms for SDPA, about 14 s of warm-up per image size, run 6; with
        ``tf32`` at 2.3 ms measured first, a 5 ms threshold let it through: 15 s per size, run 7)."""
        q, k, v, attn_mask, scale, upcast = args
        lq = q.shape[2]
        m = max(64, lq // 64)
        if best_us < self.probe_us or m >= lq:
            return False
        qs, ms = _first_queries(q, attn_mask, m)
        with torch.no_grad():
            fn(qs, k, v, ms, scale, upcast)  # compilation / autotuning at the slice shape, not timed
            est = _time_once_us(lambda: fn(qs, k, v, ms, scale, upcast), q.device) * lq / m
        if est <= self.slow_factor * best_us:
            return False
        self._exclude(key, name, f"too slow: about {est / 1000:.1f} ms estimated from {m} of {lq} queries, "
                                 f"against {best_us / 1000:.1f} ms")
        return True

    def _narrowed(self, key: AttentionKey, names: list) -> list:
        """The candidates worth measuring for a new ``key``: when a key in the same length bucket (both lengths
        within one power of two, equal or not as in ``key``, everything else equal: SD's layers at another image
        size) was measured, only the backends that were within ``mate_factor`` of its best time (and not
        excluded there since); else all of ``names``. Each one kept is
        still checked against the fp32 reference and timed at ``key``'s own shape.
        SD1.5's first 640x512 image after 512x512 measured 6 backends at 9 shapes, 1.2 s of its warm-up on
        the H200, mostly our kernel's autotuning (run 11)."""
        mate = next((m for m in list(self._timings) if _bucket(m) == _bucket(key)), None)
        if mate is None:
            return names
        timed = {n: t for n, t in self._timings[mate].items() if n not in self._excluded.get(mate, {})}
        if not timed:  # every backend timed there failed later
            return names
        best = min(timed.values())
        kept = [n for n in names if timed.get(n, float("inf")) <= self.mate_factor * best]
        log.info("sdfast attention: %s measures %s, the backends within %.3gx of the best at %s",
                 tuple(key), kept, self.mate_factor, tuple(mate))
        return kept or names

    def _exclude(self, key: AttentionKey, name: str, reason: str, wrong: bool = False) -> None:
        """The one logged dispatch point: backend ``name`` will not be used for ``key``."""
        self._excluded.setdefault(key, {})[name] = reason
        level = logging.WARNING if wrong else logging.INFO
        log.log(level, "sdfast attention: backend %r excluded for %s: %s", name, tuple(key), reason)

    def _candidate_names(self, q: torch.Tensor, k: torch.Tensor) -> list:
        if self.candidates is not None:
            return list(self.candidates)
        device = q.device
        # math materializes the (B, H, Lq, Lk) scores in fp32: never the fastest at SD sizes, and
        # above 2**27 elements (512 MiB) its warm-up run could run a smaller GPU out of memory
        math_ok = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] <= 2**27
        if device.type == "cuda":
            names = ["cudnn", "flash", "efficient"] + (["math"] if math_ok else []) + ["sdpa"]
            if xformers_works(device):
                names.append("xformers")
            if self.allow_tf32 and q.dtype == torch.float32:
                names.append("tf32")
            if os.environ.get("SDFAST_ATTENTION_TRITON", "1") != "0":
                # SDFAST_ATTENTION_TRITON=0 leaves our kernel out: a kernel fault (unlike an exception)
                # breaks the CUDA context, so it could not be measured-and-excluded like the others.
                names.append("triton")
        else:
            names = ["math", "flash", "sdpa"]
            from kernels.dispatch import interpret_mode

            if interpret_mode():
                names.append("triton")
        return names + [n for n in self._extra if n not in names]

    def _measure(self, key: AttentionKey, names: list, args: tuple, ref: torch.Tensor) -> Dict[str, float]:
        """Check each backend in ``names`` against the fp32 reference ``ref`` and time those that agree (µs);
        a backend that raises or disagrees is excluded for ``key`` (logged). Out of memory is raised as is."""
        q, k, v, attn_mask, scale, upcast = args
        device = q.device
        times: Dict[str, float] = {}
        for name in names:
            fn = self._backends[name]
            try:
                with self._quiet(key, name):
                    if times and self._too_slow(key, name, fn, args, min(times.values())):
                        continue
                    with torch.no_grad():
                        out = fn(q, k, v, attn_mask, scale, upcast)
                    bad = _mismatch(out, ref, _COMPUTE_DTYPE.get(name, q.dtype))
                    del out
                    if bad is not None:
                        self._exclude(key, name, f"wrong result vs fp32 math: {bad}", wrong=True)
                        continue
                    with torch.no_grad():
                        times[name] = _time_us(lambda: fn(q, k, v, attn_mask, scale, upcast), device, self.budget_ms)
            except torch.OutOfMemoryError:
                # transient: nothing is cached for this key, the next call measures again
                self._excluded.pop(key, None)
                raise
            except Exception as e:  # noqa: BLE001 - any other failure excludes the backend for this key
                self._exclude(key, name, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return times

    def _quiet(self, key: AttentionKey, name: str):
        """``quiet_probe`` for backend ``name`` at ``key``: its warnings logged at debug level, once each."""
        return quiet_probe(f"{name!r} for {tuple(key)}", self._probe_logged.setdefault((key, name), set()))

    def _choose(self, key, q, k, v, attn_mask, scale, upcast) -> str:
        device = q.device
        if _capturing_or_compiling(device):
            if key not in self._warned:
                self._warned.add(key)
                log.warning(
                    "sdfast attention: %s first seen during CUDA graph capture / compile: using %r "
                    "unmeasured; run a warm-up call before capturing", tuple(key), SAFE_DEFAULT,
                )
            return SAFE_DEFAULT
        if device.type != "cuda" and not self.measure_cpu:
            self._choice[key] = SAFE_DEFAULT
            return SAFE_DEFAULT
        if precompile.active():  # compile-only pass: queue our kernel's compilation; measure and cache nothing
            if "triton" in self._candidate_names(q, k):
                # a few queries: what compiles is the same, and a real launch (of a compiled kernel) is cheap;
                # a failure is left to the real pass, whose measurement excludes and logs it
                qs, ms = _first_queries(q, attn_mask, _dry_rows(q.shape[2]))
                with contextlib.suppress(Exception), self._quiet(key, "triton"), torch.no_grad():
                    self._backends["triton"](qs, k, v, ms, scale, upcast)
            return SAFE_DEFAULT
        args = (q, k, v, attn_mask, scale, upcast)
        ref = _reference(q, k, v, attn_mask, scale)
        names = self._candidate_names(q, k)
        kept = self._narrowed(key, names)
        times = self._measure(key, kept, args, ref)
        if not times and len(kept) < len(names):  # none of the narrowed candidates worked here: try the rest
            times = self._measure(key, [n for n in names if n not in kept], args, ref)
        del ref
        if not times:
            raise RuntimeError(
                f"sdfast attention: no backend computed {tuple(key)} correctly: {self._excluded.get(key)}"
            )
        best = min(times, key=times.get)
        self._choice[key] = best
        self._timings[key] = times
        log.info(
            "sdfast attention: %s -> %s (%s)", tuple(key), best,
            ", ".join(f"{n} {t:.1f}us" for n, t in sorted(times.items(), key=lambda x: x[1])),
        )
        return best


_default_dispatcher: Optional[AttentionDispatcher] = None


def default_dispatcher() -> AttentionDispatcher:
    """The process-wide dispatcher shared by UNet and VAE (created on first use)."""
    global _default_dispatcher
    if _default_dispatcher is None:
        _default_dispatcher = AttentionDispatcher()
    return _default_dispatcher


# ----------------------------------------------------------------------------------------------
# Processor
# ----------------------------------------------------------------------------------------------


def _fused_layer(attn: nn.Module, name: str) -> Optional[nn.Module]:
    """``attn.to_qkv`` / ``attn.to_kv`` when one GEMM on it computes exactly what the separate projections
    compute now, else None (the caller then runs ``to_q``/``to_k``/``to_v``). Not so when a projection is
    wrapped (a PEFT LoRA layer from ``load_lora_weights``: its adapter must run) or hooked (forward hooks or
    pre-hooks, e.g. the calibration of ``quantize_``/``sparsify_``; an instance-level forward), or, for layers
    :func:`apply` fused, when a projection's weight or bias no longer lives in the fused tensor (replaced
    by ``module.to(...)``, ``param.data = ...``, a safe LoRA merge): the fused copy would be stale."""
    if not getattr(attn, "fused_projections", False):
        return None
    fused = getattr(attn, name, None)
    if fused is None:
        return None
    parts = (attn.to_k, attn.to_v) if name == "to_kv" else (attn.to_q, attn.to_k, attn.to_v)
    if not all(runs_as_its_class(p, nn.Linear) for p in parts):
        return None  # a wrapped, hooked (calibration, user hooks) or re-bound projection must run itself
    state = getattr(attn, _STATE_ATTR, None)
    if state is None or state.get("fused") != name:
        return fused  # fused by diffusers (``fuse_projections``): its own copy, as stock uses it
    row = 0
    for p in parts:
        for mine, whole in ((p.weight, fused.weight), (p.bias, fused.bias)):
            if mine is None:
                continue
            expected = whole.data_ptr() + row * whole.stride(0) * whole.element_size()
            if mine.data_ptr() != expected or mine.dtype != whole.dtype:
                if not state.get("stale_logged"):
                    state["stale_logged"] = True
                    log.info("sdfast attention: projection weights of a fused %s were replaced; running the "
                             "separate projections (re-apply the pass to fuse again)", name)
                return None
        row += p.out_features
    return fused


# Attribute of a cross-attention ``Attention`` that holds a K/V cache (``sdfast.runtime.cross_kv.CrossKV``):
# ``cache.lookup(attn, encoder_hidden_states)`` gives its (key, value) or None.
CROSS_KV_ATTR = "_sdfast_cross_kv"


def split_projection(fused: nn.Linear, x: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
    """The ``parts`` equal projections packed in ``fused`` (weight (parts * N, K): rows ``[i * N, (i + 1) * N)``
    are projection ``i``; bias (parts * N,) or None) applied to ``x`` (..., K), as ONE batched GEMM:
    ``bmm(x broadcast to (parts, M, K), weight viewed (parts, K, N))`` writes (parts, M, N), so each projection
    comes back contiguous, (..., N), in the layout its own ``nn.Linear`` gives. One wide GEMM (``fused(x)``)
    would give (..., parts * N), whose per-projection views are interleaved (row stride parts * N): torch 2.11's
    SDPA faulted on those on the H200 and had to get packed copies (see ``_sdpa_layout``).

    Numerics: the separate GEMMs' products and fp32 accumulation; bit-identical to them at the UNets' bias-free
    shapes on the H200 (``benchmarks/bench_qkv.py``). With a bias, ``baddbmm`` adds it before the one rounding,
    where ``F.linear`` on a non-contiguous input rounds the product and the sum separately (a last-bit
    difference in fp16). A fused layer that does not run as a plain ``nn.Linear`` (hooks, a replaced forward)
    is called as a module and its output split into views, so what it adds still runs.
    Raises ``ValueError`` if the weight's rows do not split in ``parts``."""
    w = fused.weight
    if w.shape[0] % parts:
        raise ValueError(f"split_projection: {w.shape[0]} weight rows do not split into {parts} projections")
    n, k = w.shape[0] // parts, w.shape[1]
    if not runs_as_its_class(fused, nn.Linear):
        out = fused(x)
        return out.view(*out.shape[:-1], parts, n).unbind(-2)
    x2 = x.reshape(-1, k)
    a = x2.unsqueeze(0).expand(parts, *x2.shape)  # batch stride 0: the input is read, never copied
    wt = w.view(parts, n, k).transpose(1, 2)
    if fused.bias is None:
        out = torch.bmm(a, wt)
    else:
        out = torch.baddbmm(fused.bias.view(parts, 1, n), a, wt)
    return out.view(parts, *x.shape[:-1], n).unbind(0)


def project_kv(attn: nn.Module, context: torch.Tensor, *, cross: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``attn`` for ``context`` (B, Lk, C_ctx), as diffusers' ``AttnProcessor2_0`` computes them:
    ``norm_cross`` first (cross-attention only), then ``to_k``/``to_v`` (one ``to_kv`` GEMM when fused).
    Returns (B, Lk, H, D) views of contiguous (B, Lk, H * D) projections (``split_projection`` when fused)."""
    if cross and attn.norm_cross:
        context = attn.norm_encoder_hidden_states(context)
    heads = attn.heads
    to_kv = _fused_layer(attn, "to_kv")
    if to_kv is not None:
        key, value = split_projection(to_kv, context, 2)
        head_dim = key.shape[-1] // heads
        return key.view(*key.shape[:2], heads, head_dim), value.view(*value.shape[:2], heads, head_dim)
    key = attn.to_k(context)
    value = attn.to_v(context)
    head_dim = key.shape[-1] // heads
    return key.view(key.shape[0], -1, heads, head_dim), value.view(value.shape[0], -1, heads, head_dim)


class SdfastAttnProcessor:
    """Attention processor for diffusers' ``Attention``: same result as ``AttnProcessor2_0``.

    hidden_states: (B, L, C) or (B, C, H, W) (VAE); encoder_hidden_states: (B, Lk, C_ctx) or None.
    Uses ``attn.to_qkv`` (self-attention) / ``attn.to_kv`` (cross-attention) when the module's
    projections are fused (by :func:`apply` or by diffusers), else ``to_q``/``to_k``/``to_v``.
    Attention runs through ``dispatcher`` with q/k/v as (B, H, L, D) strided views; the softmax scale is
    ``attn.scale``. diffusers' ``upcast_attention`` / ``upcast_softmax`` (SD 2.x, the VAE) ask for fp32
    scores and an fp32 softmax, with the probabilities cast back to the value dtype before P·V (diffusers'
    ``Attention.get_attention_scores``); every backend here already computes exactly that (fp32
    accumulation and softmax), so the dispatcher is called with ``upcast=False``: the Triton kernel's
    split-P mode is more precise than stock and costs ~18 % on the VAE (measured 2026-11-29).
    """

    def __init__(self, dispatcher: Optional[AttentionDispatcher] = None):
        self.dispatcher = dispatcher if dispatcher is not None else default_dispatcher()

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        temb: Optional[torch.Tensor] = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)

        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        heads = attn.heads
        with SharedInputQuantization():  # static-scale quantized Q/K/V read one quantized copy of the input
            query, key, value, head_dim = self._project(attn, hidden_states, encoder_hidden_states, batch_size)

        # (B, L, H, D) -> (B, H, L, D) views: no copies
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        out = self.dispatcher(query, key, value, attn_mask=attention_mask, scale=attn.scale, upcast=False)

        out = out.transpose(1, 2).reshape(batch_size, -1, heads * head_dim)
        out = out.to(query.dtype)
        out = attn.to_out[0](out)
        out = attn.to_out[1](out)
        if input_ndim == 4:
            out = out.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            out = out + residual
        if attn.rescale_output_factor != 1.0:  # x / 1.0 is x: skip the pass over the output (140 per SDXL step)
            out = out / attn.rescale_output_factor
        return out

    @staticmethod
    def _project(attn, hidden_states, encoder_hidden_states, batch_size):
        """Q, K, V as (B, L, H, D) views, and the head dim (the fused ``to_qkv`` GEMM when there is one)."""
        heads = attn.heads
        to_qkv = _fused_layer(attn, "to_qkv") if encoder_hidden_states is None else None
        if to_qkv is not None:
            query, key, value = split_projection(to_qkv, hidden_states, 3)
            head_dim = query.shape[-1] // heads
            return tuple(t.view(*t.shape[:2], heads, head_dim) for t in (query, key, value)) + (head_dim,)
        query = attn.to_q(hidden_states)
        cached = None
        if encoder_hidden_states is not None and (kv_cache := getattr(attn, CROSS_KV_ATTR, None)) is not None:
            cached = kv_cache.lookup(attn, encoder_hidden_states)  # K/V computed outside the step's graph
        if cached is not None:
            key, value = cached
        else:
            key, value = project_kv(attn, hidden_states if encoder_hidden_states is None else encoder_hidden_states,
                                    cross=encoder_hidden_states is not None)
        head_dim = key.shape[-1]
        return query.view(batch_size, -1, heads, head_dim), key, value, head_dim


# ----------------------------------------------------------------------------------------------
# Projection fusion
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def _fuse(attn: nn.Module) -> Optional[str]:
    """Fuse to_q/to_k/to_v into ``to_qkv`` (self-attention) or to_k/to_v into ``to_kv``
    (cross-attention). The separate weights become views of the fused one (no extra memory).
    Returns the name created, or None when skipped (already fused, or not plain ``nn.Linear``
    layers, e.g. LoRA-wrapped or quantized)."""
    if getattr(attn, "fused_projections", False):
        return None
    cross = bool(getattr(attn, "is_cross_attention", False))
    parts = [attn.to_k, attn.to_v] if cross else [attn.to_q, attn.to_k, attn.to_v]
    if any(type(p) is not nn.Linear for p in parts):
        return None
    w0 = parts[0].weight
    if w0.device.type == "meta" or any(
        p.weight.dtype != w0.dtype or p.weight.device != w0.device or p.in_features != parts[0].in_features
        for p in parts
    ):
        return None
    has_bias = [p.bias is not None for p in parts]
    if any(has_bias) and not all(has_bias):
        return None
    name = "to_kv" if cross else "to_qkv"
    out_features = sum(p.out_features for p in parts)
    fused = nn.Linear(parts[0].in_features, out_features, bias=all(has_bias), device=w0.device, dtype=w0.dtype)
    fused.weight.data = torch.cat([p.weight.data for p in parts])
    fused.weight.requires_grad_(w0.requires_grad)
    if all(has_bias):
        fused.bias.data = torch.cat([p.bias.data for p in parts])
        fused.bias.requires_grad_(parts[0].bias.requires_grad)
    off = 0
    for p in parts:  # share storage: the separate layers stay valid, no second copy
        n = p.out_features
        p.weight.data = fused.weight.data[off : off + n]
        if p.bias is not None:
            p.bias.data = fused.bias.data[off : off + n]
        off += n
    setattr(attn, name, fused)
    attn.fused_projections = True
    _hide_fused_from_state_dict(fused)
    return name


def _hide_fused_from_state_dict(fused: nn.Module) -> None:
    """Keep ``fused`` (to_qkv / to_kv) out of ``state_dict`` and out of what ``load_state_dict`` expects: its
    weight overlaps the separate projections' (they are views of it), which safetensors refuses to save
    (``save_pretrained`` of an optimized pipeline), and a stock checkpoint has no such keys. The hooks live on
    ``fused`` itself, so they see exactly its own keys (its prefix) and go with it. On load, a key the state dict
    lacks is filled with the layer's current tensor (a copy onto itself): the separate projections, loaded
    first, have already written the new values in place through their views."""

    def drop(module, state_dict, prefix, local_metadata):
        for name in module._parameters:
            state_dict.pop(prefix + name, None)

    def fill(module, state_dict, prefix, *args):
        for name, t in module._parameters.items():
            if t is not None:
                state_dict.setdefault(prefix + name, t.detach())

    fused.register_state_dict_post_hook(drop)
    fused.register_load_state_dict_pre_hook(fill)


@torch.no_grad()
def _unfuse(attn: nn.Module, name: str) -> None:
    cross = name == "to_kv"
    parts = [attn.to_k, attn.to_v] if cross else [attn.to_q, attn.to_k, attn.to_v]
    for p in parts:  # own storage again (exact same values)
        if type(p) is not nn.Linear:
            continue  # replaced since (quantized, pruned, LoRA-wrapped): it no longer lives in the fused tensor
        p.weight.data = p.weight.data.clone()
        if p.bias is not None:
            p.bias.data = p.bias.data.clone()
    if hasattr(attn, name):
        delattr(attn, name)
    attn.fused_projections = False


# ----------------------------------------------------------------------------------------------
# Pass API
# ----------------------------------------------------------------------------------------------


def _attention_class():
    from diffusers.models.attention_processor import Attention

    return Attention


def _convertible(attn: nn.Module) -> bool:
    proc = getattr(attn, "processor", None)
    if type(proc).__name__ not in _STOCK_PROCESSORS:
        return False
    if getattr(attn, "added_kv_proj_dim", None) is not None or getattr(attn, "to_k", None) is None:
        return False
    if getattr(attn, "is_causal", False):
        return False
    if getattr(attn, "inner_kv_dim", None) != getattr(attn, "inner_dim", None):
        return False
    return True


def _set_processors(module: nn.Module, new: Mapping[str, object]) -> None:
    """Set processors by module name, through the model's ``set_attn_processor`` when it has one."""
    procs = getattr(module, "attn_processors", None) if hasattr(module, "set_attn_processor") else None
    if procs is not None and all(f"{n}.processor" in procs for n in new):
        procs = dict(procs)
        for n, p in new.items():
            procs[f"{n}.processor"] = p
        module.set_attn_processor(procs)
        return
    mods = dict(module.named_modules())
    for n, p in new.items():
        mods[n].set_processor(p)


def apply(
    module: nn.Module,
    *,
    filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
    dispatcher: Optional[AttentionDispatcher] = None,
    fuse_projections: bool = True,
) -> int:
    """Give every stock diffusers ``Attention`` under ``module`` an :class:`SdfastAttnProcessor`.

    Args:
        module: a UNet, VAE, or any ``nn.Module`` containing diffusers ``Attention`` modules
            (or an ``Attention`` itself).
        filter_fn: ``filter_fn(attention_module, qualified_name) -> bool``; False leaves it alone.
        dispatcher: shared :class:`AttentionDispatcher` (default: the process-wide one).
        fuse_projections: fuse Q/K/V (self) or K/V (cross) projections into one GEMM.

    Returns:
        the number of ``Attention`` modules converted. Modules already converted, modules with a
        non-stock processor (IP-Adapter, LoRA processors, ...) and added-KV / causal / GQA modules
        are skipped. Processors are set through ``module.set_attn_processor`` when available.
    """
    Attention = _attention_class()
    processor = SdfastAttnProcessor(dispatcher)
    new: Dict[str, object] = {}
    for name, m in module.named_modules():
        if not isinstance(m, Attention) or hasattr(m, _STATE_ATTR):
            continue
        if isinstance(getattr(m, "processor", None), SdfastAttnProcessor):
            continue
        if filter_fn is not None and not filter_fn(m, name):
            continue
        if not _convertible(m):
            log.debug("sdfast attention: %s skipped (processor %s)", name, type(m.processor).__name__)
            continue
        state = {"processor": m.processor, "fused": _fuse(m) if fuse_projections else None}
        setattr(m, _STATE_ATTR, state)
        new[name] = processor
    if new:
        _set_processors(module, new)
    return len(new)


def undo(module: nn.Module) -> int:
    """Restore the processors and separate projections that :func:`apply` replaced. A module whose processor
    was set to something else after ``apply`` keeps that processor and its fused projections (the separate
    ``to_q``/``to_k``/``to_v`` remain valid views of them), since that processor may use either.

    Returns the number of ``Attention`` modules restored. Outputs are then bit-identical to
    before ``apply`` (the projection weights are restored with the same values).
    """
    old: Dict[str, object] = {}
    restored = 0
    for name, m in module.named_modules():
        state = getattr(m, _STATE_ATTR, None)
        if state is None:
            continue
        ours = isinstance(getattr(m, "processor", None), SdfastAttnProcessor)
        if ours:  # a processor the user set after apply stays, with the projections it may use (fused or not:
            old[name] = state["processor"]  # the separate layers stay valid views of the fused weight)
            if state["fused"] is not None:
                _unfuse(m, state["fused"])
        delattr(m, _STATE_ATTR)
        restored += 1
    if old:
        _set_processors(module, old)
    return restored


__all__ = [
    "AttentionDispatcher",
    "AttentionKey",
    "SdfastAttnProcessor",
    "apply",
    "undo",
    "default_dispatcher",
    "key_padding_from_mask",
    "xformers_works",
    "BACKEND_NAMES",
    "ENV_BACKEND",
]
