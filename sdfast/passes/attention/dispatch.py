"""The attention dispatcher: per attention shape, the fastest backend (:mod:`.backends`) that computes it correctly.

:class:`AttentionDispatcher` is what the processor calls. Its per-shape choice is the ``attention`` declaration
(:data:`ATTENTION`) of the kernel-choice service :mod:`kernels.select`: the service holds the decisions (reported by
``select.decisions("attention")``, saved and read back by a second process), the pins and the guards; the
dispatcher supplies the key (:class:`AttentionKey` without the batch size, plus its own options), the candidates and
the measurement, in which each backend is checked against fp32 math attention before it is timed with
``select.gpu_time_us``. A backend that raises or disagrees is excluded for that key and logged in one place
(``AttentionDispatcher._exclude``).
"""

from __future__ import annotations

import ast
import contextlib
import logging
import time
from typing import Callable, Dict, Mapping, NamedTuple, Optional, Sequence

import torch

from kernels import select
from kernels.attention.buckets import length_bucket
from kernels.select.store import device_name
from sdfast.passes.attention.backends import BackendFn, builtin_backends, quiet_probe, reference, xformers_works

log = logging.getLogger("sdfast.attention")

SAFE_DEFAULT = "sdpa"
# The attention choice: SDPA's own pick is the default (capture-safe, what stock diffusers runs); the fastest
# correct backend wins (no margin: the candidates are all exact up to fp16 rounding).
ATTENTION = select.Choice("attention", default=SAFE_DEFAULT, margin=1.0)


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


def _bucket(key: tuple) -> tuple:
    """A choice key (``AttentionDispatcher.choice_key``: lq, lk, then the rest) with both lengths replaced by their
    buckets, and whether the lengths are equal: self-attention (Lq == Lk) and cross-attention over 77 tokens share
    buckets at SD's smallest latents (64 and 77 queries or keys), but not a bucket mate."""
    return (length_bucket(key[0]), length_bucket(key[1])) + tuple(key[2:]), key[0] == key[1]


def _gpu_time_us(fn: Callable[[], object], device: torch.device, budget_ms: float) -> float:
    """GPU time per call of ``fn`` (µs) by ``select.gpu_time_us``, with enough calls to fill about ``budget_ms``
    (3 to 50, from one call's time) and a spin kernel ahead of them long enough (twice the host time of the calls,
    at >= 1 cycle per ns) for the host to queue them all: the host's launch time (large for a Triton kernel
    launched from Python) is not counted; under CUDA graphs it is not paid."""
    torch.cuda.synchronize(device)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    s.record()
    fn()
    e.record()
    host_us = (time.perf_counter() - t0) * 1e6
    e.synchronize()
    n = int(min(50, max(3, budget_ms / max(s.elapsed_time(e), 1e-3))))
    iters = max(2, -(-n // 2))  # two rounds (the best of them) of half the calls each
    return select.gpu_time_us({"fn": fn}, iters=iters, rounds=2, sleep_cycles=int(1000 * (2 * host_us * iters + 50)))["fn"]


def _cpu_time_us(fn: Callable[[], object]) -> float:
    """Median wall time of 3 calls after a warm-up (µs): the CPU's stand-in timer (``measure_cpu``, tests)."""
    fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[1] * 1e6


class AttentionDispatcher:
    """Picks, per attention shape, the fastest backend that computes it correctly: the ``attention`` choice of
    :mod:`kernels.select`.

    Call: ``dispatcher(q, k, v, *, attn_mask=None, scale=None, upcast=False) -> (B, H, Lq, D)``
    with q (B, H, Lq, D), k/v (B, H, Lk, D) (strided views welcome), fp16/bf16/fp32,
    ``attn_mask`` SDPA-style (bool True = keep, or additive float) broadcastable to (B, H, Lq, Lk).

    Choice key (:meth:`choice_key`): Lq, Lk, heads, head_dim, dtype, has_mask, upcast (not the batch size), and
    this dispatcher's options (``allow_tf32``, ``triton``, ``candidates``, the names of ``extra_backends``), so two
    dispatchers share a decision only when they would choose among the same backends; the service files it per
    GPU. On the first call of a key on CUDA (outside CUDA-graph capture, torch.compile tracing and a
    ``kernels.precompile`` dry run: the service's guards), every candidate backend (for a key whose lengths fall in
    the power-of-two buckets of a key decided before: only those within ``mate_factor`` of that key's best,
    ``_narrowed``) runs once on the real inputs and is compared with fp32 math attention; a backend that raises
    or disagrees is excluded for that key and logged (``_exclude``: the one logged dispatch point); the others
    are timed (``select.gpu_time_us``, about ``budget_ms`` each) and the service records the fastest (and saves
    it: a second process on the same GPU and versions measures nothing). A key first seen during capture/compile
    uses SDPA's default (``"sdpa"``, capture-safe) undecided, with a warning: warm up before capturing.
    Probing is quiet (``quiet_probe``): warnings a candidate raises while it is checked and timed go to the
    debug log, once per message; the picked backend's warnings at real calls are shown.
    On CPU the default is SDPA without measuring (``measure_cpu=True`` measures, with a wall-clock timer; the
    Triton kernel runs on CPU only under ``TRITON_INTERPRET=1``). A pin (``select.pinned({"attention": name})``)
    runs that backend unmeasured.

    Backends: ``cudnn``, ``flash``, ``efficient``, ``math`` (torch SDPA forced to that backend via
    ``torch.nn.attention.sdpa_kernel``), ``sdpa`` (SDPA's own choice), ``xformers`` (only if
    importable and a probe call works), ``triton`` (ours; no masks other than key padding), ``tf32``
    (fp32 inputs, matmuls in TF32; only with ``allow_tf32``).
    ``upcast`` is passed to the Triton kernel (fp32-like P, see ``flash_attention``); SDPA backends
    already run the softmax in fp32, as diffusers' ``AttnProcessor2_0`` relies on.

    Args:
        backend: force one backend for every call (the kernel policy, tests, benchmarks); ``None`` /
            ``"auto"`` = measure. A forced backend runs without a decision; one that fails raises a RuntimeError
            naming the backend and the shapes (no silent fallback). The environment is not read here:
            ``sdfast.optimize`` passes what its kernel policy says.
        triton: whether our Triton kernel is a candidate (on CUDA; on CPU under ``TRITON_INTERPRET=1``).
            ``False`` leaves it out: a kernel fault (unlike an exception) breaks the CUDA context, so it could not
            be measured-and-excluded like the others.
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
        # A key whose length bucket was decided before measures only the backends within this factor of that
        # key's best (see _narrowed).
        self.mate_factor = 1.25
        self._extra = tuple(extra_backends or ())
        self.measure_cpu = measure_cpu
        self.budget_ms = budget_ms
        self.allow_tf32 = allow_tf32
        self.triton = bool(triton)
        # What makes this dispatcher's decisions its own: the end of every choice key.
        self.options = (("tf32", self.allow_tf32), ("triton", self.triton), ("candidates", self.candidates),
                        ("extra", self._extra))
        self._excluded: Dict[AttentionKey, Dict[str, str]] = {}
        self._warned: set = set()
        self._probe_logged: Dict[tuple, set] = {}  # (key, backend) -> warning messages logged while probing

    # -- keys and the service's record ---------------------------------------------------------
    @staticmethod
    def key_for(q: torch.Tensor, k: torch.Tensor, attn_mask: Optional[torch.Tensor], upcast: bool) -> AttentionKey:
        return AttentionKey(
            q.shape[2], k.shape[2], q.shape[1], q.shape[3], q.dtype, q.device, attn_mask is not None, bool(upcast)
        )

    def choice_key(self, key: AttentionKey) -> tuple:
        """The key of ``key``'s decision in :mod:`kernels.select` (plain values; the device goes by its name)."""
        return (key.lq, key.lk, key.heads, key.head_dim, str(key.dtype).removeprefix("torch."), key.has_mask,
                key.upcast, self.options)

    def decision(self, key: AttentionKey) -> Optional[select.Decision]:
        """The service's decision for ``key`` on its device (``select.decisions("attention")``), or None."""
        want, dev = repr(self.choice_key(key)), device_name(key.device)
        return next((d for d in select.decisions(ATTENTION.name) if d.key == want and d.device == dev), None)

    def excluded(self) -> Dict[AttentionKey, Dict[str, str]]:
        """key -> {backend: reason} for backends that raised or gave a wrong answer."""
        return {k: dict(v) for k, v in self._excluded.items()}

    def backend_fn(self, name: str) -> BackendFn:
        return self._backends[name]

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
            try:
                return self._backends[self.forced](q, k, v, attn_mask, scale, upcast)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised with what was forced and on what
                raise RuntimeError(
                    f"sdfast attention: the forced backend {self.forced!r} (the kernel policy's attention, "
                    f"SDFAST_ATTENTION_BACKEND) cannot run q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, "
                    f"mask {None if attn_mask is None else tuple(attn_mask.shape)}: {type(e).__name__}: {e}; "
                    "leave it unset (auto) to measure and take a backend per shape") from e
        args = (q, k, v, attn_mask, scale, upcast)
        key = self.key_for(q, k, attn_mask, upcast)
        name = self._decide(key, args)
        if name == SAFE_DEFAULT:
            self._warn_if_undecided(key)
            return self._backends[name](*args)
        try:
            return self._backends[name](*args)
        except torch.OutOfMemoryError:
            raise  # the request is too big, not the backend's fault: nothing is excluded
        except Exception as e:  # noqa: BLE001
            # the winner failed on a later call (the key has no batch size; or a saved winner that cannot run in
            # this process): exclude it and take SDPA's default from now on (the service's decision for the key
            # becomes that, pinned). Inside graph capture there is nothing safe to do.
            if _capturing_or_compiling(q.device):
                raise
            self._exclude(key, name, f"failed after being picked: {type(e).__name__}: {e}", wrong=True)
            self._decide(key, args, pin=SAFE_DEFAULT)
            return self._backends[SAFE_DEFAULT](*args)

    def _decide(self, key: AttentionKey, args: tuple, pin: Optional[str] = None) -> str:
        q, k = args[0], args[1]
        names = self._candidate_names(q, k)
        return select.decide(
            ATTENTION, self.choice_key(key),
            candidates=names if SAFE_DEFAULT in names else names + [SAFE_DEFAULT],  # the service's default
            device=q.device, pin=pin, measure_cpu=self.measure_cpu,
            measure=lambda live: self._measure_key(key, [n for n in names if n in live], args),
            compile_all=lambda: self._compile_triton(key, names, args),
            describe=lambda: repr(tuple(key)),
        )

    def _warn_if_undecided(self, key: AttentionKey) -> None:
        """Warn once per key that runs SDPA's default unmeasured because it was first seen during capture/compile."""
        if key in self._warned or not _capturing_or_compiling(key.device):
            return
        self._warned.add(key)
        if self.decision(key) is None:
            log.warning(
                "sdfast attention: %s first seen during CUDA graph capture / compile: using %r "
                "unmeasured; run a warm-up call before capturing", tuple(key), SAFE_DEFAULT,
            )

    def _compile_triton(self, key: AttentionKey, names: list, args: tuple) -> None:
        """The ``kernels.precompile`` dry run: queue our kernel's compilation for this key (nothing is decided)."""
        if "triton" not in names:
            return
        q, k, v, attn_mask, scale, upcast = args
        # a few queries: what compiles is the same, and a real launch (of a compiled kernel) is cheap;
        # a failure is left to the real pass, whose measurement excludes and logs it
        qs, ms = _first_queries(q, attn_mask, _dry_rows(q.shape[2]))
        with contextlib.suppress(Exception), self._quiet(key, "triton"), torch.no_grad():
            self._backends["triton"](qs, k, v, ms, scale, upcast)

    # -- measurement (the service's ``measure``) ------------------------------------------------
    def _measure_key(self, key: AttentionKey, names: list, args: tuple) -> Dict[str, float]:
        """{backend: µs} of the backends of ``names`` (narrowed by a bucket mate) that compute ``key`` correctly;
        the rest of ``names`` when none of the narrowed ones does. Raises RuntimeError when no backend does."""
        q, k, v, attn_mask, scale, upcast = args
        ref = reference(q, k, v, attn_mask, scale)
        kept = self._narrowed(key, names)
        times = self._measure(key, kept, args, ref)
        if not times and len(kept) < len(names):  # none of the narrowed candidates worked here: try the rest
            times = self._measure(key, [n for n in names if n not in kept], args, ref)
        del ref
        if not times:
            raise RuntimeError(
                f"sdfast attention: no backend computed {tuple(key)} correctly: {self._excluded.get(key)}"
            )
        return times

    def _time(self, name: str, fn: Callable[[], object], device: torch.device) -> float:
        """µs per call of backend ``name`` (``fn`` runs it on the key's inputs)."""
        if device.type == "cuda":
            return _gpu_time_us(fn, device, self.budget_ms)
        return _cpu_time_us(fn)

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
        size) was decided by measuring, only the backends that were within ``mate_factor`` of its best time (and not
        excluded there since); else all of ``names``. Each one kept is
        still checked against the fp32 reference and timed at ``key``'s own shape. Without it, a second image
        size measures every backend at every shape again, most of it our kernel's autotuning."""
        mate, timed = self._mate(key)
        if mate is None:
            return names
        timed = {n: t for n, t in timed.items() if n not in self._excluded.get(mate, {})}
        if not timed:  # every backend timed there failed later
            return names
        best = min(timed.values())
        kept = [n for n in names if timed.get(n, float("inf")) <= self.mate_factor * best]
        log.info("sdfast attention: %s measures %s, the backends within %.3gx of the best at %s",
                 tuple(key), kept, self.mate_factor, tuple(mate))
        return kept or names

    def _mate(self, key: AttentionKey) -> tuple:
        """A key decided by measuring (in this process or read from the saved file) whose lengths share
        ``key``'s buckets, everything else equal, with its times (µs per backend); (None, {}) when there is none."""
        own = self.choice_key(key)
        dev = device_name(key.device)
        for d in select.decisions(ATTENTION.name):
            if not d.times_us or d.device != dev:
                continue
            other = ast.literal_eval(d.key)
            if other != own and _bucket(other) == _bucket(own):
                return key._replace(lq=other[0], lk=other[1]), dict(d.times_us)
        return None, {}

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
                        times[name] = self._time(name, lambda: fn(q, k, v, attn_mask, scale, upcast), device)
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
