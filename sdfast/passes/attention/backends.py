"""Attention backends: the implementations the dispatcher chooses among, all called the same way.

A backend is ``fn(q, k, v, attn_mask, scale, upcast) -> (B, H, Lq, D)`` with q (B, H, Lq, D), k/v (B, H, Lk, D)
(strided views allowed) and ``attn_mask`` an SDPA-style bool (True = keep) or additive float mask broadcastable
to (B, H, Lq, Lk), or None:

* ``cudnn``, ``flash``, ``efficient``, ``math``: torch SDPA forced to that backend (``torch.nn.attention.sdpa_kernel``);
* ``sdpa``: SDPA's own choice, what diffusers' ``AttnProcessor2_0`` runs (capture-safe: the dispatcher's default);
* ``xformers``: ``xformers.ops.memory_efficient_attention``, no masks (used only where :func:`xformers_works`);
* ``triton``: our kernel (``kernels.attention.flash_attention``), key-padding masks only;
* ``tf32``: fp32 inputs with both matmuls in TF32, over query chunks (the fp32 VAE).

Also here: :func:`reference`, the chunked fp32 math attention every backend is checked against, and
:func:`quiet_probe`, which keeps a probe's warnings out of the user's console.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

log = logging.getLogger("sdfast.attention")

_SDPA_FORCED = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}
BACKEND_NAMES = ("cudnn", "flash", "efficient", "math", "sdpa", "xformers", "triton", "tf32")

# A backend: fn(q, k, v, attn_mask, scale, upcast) -> (B, H, Lq, D).
# q: (B, H, Lq, D), k/v: (B, H, Lk, D) (strided views allowed), attn_mask: SDPA-style bool
# (True = keep) or additive float mask broadcastable to (B, H, Lq, Lk), or None.
BackendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], float, bool], torch.Tensor]


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
    access on sm_90, so those are packed first (one copy of L·H·D elements)."""
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


def mask_4d(attn_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    m = attn_mask
    while m is not None and m.dim() < 4:
        m = m.unsqueeze(0)
    return m


def chunk_rows(q: torch.Tensor, k: torch.Tensor) -> int:
    """Queries per chunk so that one chunk's (B, H, rows, Lk) fp32 scores stay under ``_SCORE_CHUNK_ELEMS``."""
    return max(1, _SCORE_CHUNK_ELEMS // max(1, q.shape[0] * q.shape[1] * k.shape[2]))


def _tf32_backend(q, k, v, attn_mask, scale, upcast):
    """Attention of fp32 tensors with both matmuls in TF32 (tensor cores: fp32 range, 10-bit mantissa, fp32
    accumulation) and an fp32 softmax, over chunks of queries whose (B, H, rows, Lk) scores stay under
    256 MiB. For the fp32 VAE of SDXL (``force_upcast``) at 1024², where SDPA's fp32 kernels run on CUDA
    cores (measured faster than them on sm_90). The TF32 flag is process-wide: it is set only while this
    function queues its matmuls, and restored (``_tf32_matmuls``). On the CPU there is no TF32: the same
    chunked fp32 math."""
    if q.dtype != torch.float32:
        raise NotImplementedError(f"the tf32 backend takes fp32 tensors, got {q.dtype}")
    B, H, Lq, _ = q.shape
    m, rows = mask_4d(attn_mask), chunk_rows(q, k)
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
    'No operator found'). Probed once per device, on first use (never at import, never inside a CUDA graph
    capture or torch.compile tracing: False there, unprobed); logged."""
    dkey = str(device)
    if dkey not in _xformers_ok:
        if torch.compiler.is_compiling() or (
            device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        ):
            return False  # no probe inside a CUDA graph capture or torch.compile tracing: asked again after it
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


def builtin_backends() -> Dict[str, BackendFn]:
    """A fresh name -> backend table of every backend above (``BACKEND_NAMES``)."""
    b: Dict[str, BackendFn] = {n: _sdpa_forced(n) for n in _SDPA_FORCED}
    b["sdpa"] = _sdpa_default
    b["xformers"] = _xformers_backend
    b["triton"] = _triton_backend
    b["tf32"] = _tf32_backend
    return b


def reference(q, k, v, attn_mask, scale) -> torch.Tensor:
    """fp32 math attention (SDPA's math backend on fp32 copies), chunked over queries to keep the score matrix
    under ~256 MiB: what every backend's output is checked against. Same arguments as a backend (no ``upcast``);
    returns fp32 (B, H, Lq, D)."""
    Lq = q.shape[2]
    m, rows = mask_4d(attn_mask), chunk_rows(q, k)
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
