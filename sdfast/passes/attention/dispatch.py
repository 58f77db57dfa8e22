"""The attention dispatcher: per attention shape, the fastest backend (:mod:`.backends`) that computes it correctly.

:class:`AttentionDispatcher` is what the processor calls; :class:`AttentionKey` is its per-shape cache key (no
batch size). A backend is checked against fp32 math attention before it is timed; one that raises or disagrees is
excluded for that key and logged in one place (``AttentionDispatcher._exclude``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Dict, Mapping, NamedTuple, Optional, Sequence

import torch

from kernels import precompile
from kernels.attention.buckets import length_bucket
from sdfast.passes.attention.backends import BackendFn, builtin_backends, quiet_probe, reference, xformers_works

log = logging.getLogger("sdfast.attention")

SAFE_DEFAULT = "sdpa"


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


def mismatch(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> Optional[str]:
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
        backend: force one backend for every call (the kernel policy, tests, benchmarks); ``None`` /
            ``"auto"`` = measure. A forced backend that fails raises (no silent fallback). The environment is
            not read here: ``sdfast.optimize`` passes what its kernel policy says.
        triton: whether our Triton kernel is a candidate (on CUDA; on CPU under ``TRITON_INTERPRET=1``). ``False`` leaves it out: a kernel fault
            (unlike an exception) breaks the CUDA context, so it could not be measured-and-excluded like the
            others.
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
        triton: bool = True,
        candidates: Optional[Sequence[str]] = None,
        extra_backends: Optional[Mapping[str, BackendFn]] = None,
        measure_cpu: bool = False,
        budget_ms: float = 3.0,
        allow_tf32: bool = False,
    ):
        self._backends: Dict[str, BackendFn] = builtin_backends()
        if extra_backends:
            self._backends.update(extra_backends)
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
        self.triton = bool(triton)
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
        timing loop, would cost seconds per image size (the SDXL VAE's fp32 attention at 128x128 latents, where
        our fp32 Triton path is orders of magnitude slower than SDPA and ``tf32``). ``probe_us`` is low enough
        that a fast ``tf32`` measured first still probes the slow candidates after it."""
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
        still checked against the fp32 reference and timed at ``key``'s own shape. Without it, a second image
        size measures every backend at every shape again, most of it our kernel's autotuning."""
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
            if self.triton:
                names.append("triton")
        else:
            names = ["math", "flash", "sdpa"]
            from kernels.dispatch import interpret_mode

            if self.triton and interpret_mode():
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
                    bad = mismatch(out, ref, _COMPUTE_DTYPE.get(name, q.dtype))
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
        ref = reference(q, k, v, attn_mask, scale)
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

