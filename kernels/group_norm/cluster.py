"""GroupNorm in one read and one write, through Hopper thread-block clusters, for channels_last and NCHW tensors.

The kernels (``cluster.cu`` beside this file) give each unit of the input to a cluster of ``K`` CTAs that
hold the unit in registers, reduce its statistics through distributed shared memory and normalize from the
registers (the .cu file has the method):

* channels_last: a unit is a (batch item, slice of ``CS`` channels), split in pixel runs (:class:`ClusterPlan`);
* contiguous NCHW: a unit is a (batch item, group), whose ``Cg * H * W`` values are contiguous (:class:`NchwPlan`).

The Triton kernels read a large input twice in three launches (statistics, finalize, apply; small shapes take
their one-launch "onepass" kernel); these read it once in one launch.

``kernels.group_norm.op`` runs them through :func:`run_if_faster`, the ``kernels.select`` choice :data:`CHOICE`
("group_norm": "cluster" or "triton"): where one can run, it is timed once per call signature against the Triton
kernels and the faster is kept (logged, in ``kernels.select.decisions()``); the kernel policy's pin
(``KernelPolicy.group_norm``, ``SDFAST_GN_CLUSTER=0``: "triton") skips it. They can run where all of these hold (else
the reason is logged once through ``kernels.dispatch.log_fallback`` and the Triton kernels run):

* a CUDA device of compute capability 9.0 or newer (clusters, distributed shared memory);
* x (and the residual, laid out like x) dense channels_last or contiguous NCHW, fp16 / bf16 / fp32, 16-byte
  aligned; channels_last: C a multiple of the 16-byte vector (8 channels in fp16/bf16, 4 in fp32); NCHW: H*W a
  multiple of it; weight, bias and channel bias in x's dtype, weight and bias contiguous;
* a plan exists: every unit fits in a cluster of at most ``max_cluster`` CTAs holding at most 8 vectors per
  thread, with all clusters resident at once (channels_last: most of SD's UNet shapes up to 64x64, the VAEs'
  64x64 ones, none from 128x128 up);
* nvcc builds the library (once per source version, cached in ``~/.cache/sdfast/csrc``).

Method: Wu & He 2018 (GroupNorm); the CUDA Programming Guide's thread-block clusters and distributed shared
memory (Hopper); one-read NHWC GroupNorm as in TensorRT's and Apex's GroupNorm kernels.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import math
import threading
from pathlib import Path

import torch

from kernels import precompile, select
from kernels.dispatch import log_fallback

log = logging.getLogger("sdfast.kernels")

SOURCE = Path(__file__).resolve().parent / "cluster.cu"
_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}  # SDFAST_GN_DTYPE 0, 1, 2
_ERRORS = {-2: "bad split (CS, K, R, J)", -3: "a pointer is not 16-byte aligned"}

# The kernel choice between these kernels and the Triton ones: the cluster kernel is the default (it runs where
# nothing may be timed: inside a CUDA graph capture) and keeps ties.
CHOICE = select.Choice("group_norm", default="cluster")

# Knobs read at call time (tests and benchmarks change them).
TUNING = {
    "max_cluster": 16,  # CTAs per cluster; 8 is the portable maximum (16: the kernels opt in to non-portable sizes)
    "max_threads": 1024,  # NHWC kernel, at most its launch bounds (nhwc_max_threads)
    "nchw_max_threads": 1024,  # NCHW kernel (its launch bounds)
    "max_vectors": 8,  # J: 16-byte vectors per thread (the kernel's template range)
    "num_sms": None,  # None: the device's count
    "plan": None,  # tests/benchmarks: a ClusterPlan to force
}


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    """One launch: ``CS`` channels per slice, clusters of ``K`` CTAs, ``R`` pixel rows per pass of a CTA's
    ``nt`` threads, ``J`` 16-byte vectors per thread (a CTA covers ``R * J`` pixels)."""

    CS: int
    K: int
    R: int
    J: int
    nt: int
    ctas: int


def _vec(elem_size: int) -> int:
    return 16 // elem_size


def candidate_plans(B: int, C: int, HW: int, G: int, elem_size: int):
    """Every launch shape the kernel accepts for a (B, C, H*W) channels_last GroupNorm with G groups. Yields nothing
    when C is not a multiple of the 16-byte vector or no cluster holds a unit."""
    vec = _vec(elem_size)
    if C % vec or C % G:
        return
    Cg = C // G
    step = Cg * vec // math.gcd(Cg, vec)
    T = TUNING
    for cs in range(step, C + 1, step):
        if C % cs:
            continue
        nv = cs // vec
        for K in (k for k in (1, 2, 4, 8, 16) if k <= T["max_cluster"]):
            P = -(-HW // K)
            for J in range(1, T["max_vectors"] + 1):
                R = -(-P // J)
                nt = nv * R
                if nt > min(T["max_threads"], nhwc_max_threads(J)) or (K > 1 and -(-HW // (R * J)) < K):
                    continue  # too many threads, or a CTA of the cluster would own no pixel
                if _smem_floats(R, cs, Cg, nt) > 12 * 1024:
                    continue  # shared memory over 48 KB
                yield ClusterPlan(cs, K, R, J, nt, B * (C // cs) * K)


def nhwc_max_threads(J: int) -> int:
    """Threads per CTA the NHWC kernel is compiled for at ``J`` vectors per thread (``nhwc_max_threads`` in the .cu
    file: 64 registers hold up to 5 vectors, more need up to 93 and two CTAs per SM)."""
    return 1024 if J <= 5 else 320


def _smem_floats(R: int, CS: int, Cg: int, nt: int) -> int:
    """The kernel's shared memory in floats (``smem_floats`` in the .cu file)."""
    Q = nt // CS if nt >= CS else 1
    return 2 * (R * (CS + 1) + Q * CS + CS) + 3 * CS + 2 * (CS // Cg)


def cluster_plan(B: int, C: int, HW: int, G: int, elem_size: int, num_sms: int = 132, fits=None) -> ClusterPlan | None:
    """The first channels_last plan ``fits(plan)`` accepts (the launcher passes "all clusters resident at once", from
    the occupancy API: a second wave of clusters doubles the time), or None when none does (C not a multiple of the
    vector, a unit too large for one cluster, or no candidate resident in one wave).

    Order (from timing every plan at SD's 8x8 to 64x64 shapes on sm_90; a bandwidth model ranked them worse): plans
    that give nearly every SM a CTA first, then the narrowest slices (most units), about 4 vectors per thread, fewer
    CTAs per cluster, fewer threads."""
    def rank(p: ClusterPlan):
        return (p.ctas < 0.9 * num_sms, p.CS, abs(p.J - 4), p.K, p.nt)

    plans = sorted(candidate_plans(B, C, HW, G, elem_size), key=rank)
    return next((p for p in plans[:48] if fits is None or fits(p)), None)


@dataclasses.dataclass(frozen=True)
class NchwPlan:
    """One NCHW launch: a cluster of ``K`` CTAs per (batch item, group), ``nt`` threads per CTA, ``J`` 16-byte vectors
    per thread (a CTA covers ``nt * J`` vectors of the group's contiguous ``Cg * H * W`` values)."""

    K: int
    nt: int
    J: int
    ctas: int


def nchw_candidate_plans(B: int, C: int, HW: int, G: int, elem_size: int):
    """Every launch shape the NCHW kernel accepts for a contiguous (B, C, H*W) GroupNorm with G groups. Yields nothing
    when H*W is not a multiple of the 16-byte vector (a vector must lie in one channel) or a group does not fit one
    cluster."""
    vec = _vec(elem_size)
    if HW % vec or C % G:
        return
    nvec = C // G * HW // vec
    for K in (k for k in (1, 2, 4, 8, 16) if k <= TUNING["max_cluster"]):
        for nt in range(64, TUNING["nchw_max_threads"] + 1, 64):
            J = -(-nvec // (K * nt))
            if J > TUNING["max_vectors"] or -(-nvec // (nt * J)) != K:
                continue  # too many vectors per thread, or a CTA of the cluster would own none
            yield NchwPlan(K, nt, J, B * G * K)


def nchw_plan(B: int, C: int, HW: int, G: int, elem_size: int, num_sms: int = 132, fits=None) -> NchwPlan | None:
    """The first NCHW plan ``fits(plan)`` accepts, in this order (from timing the plans at SD's 16x16 to 64x64 shapes
    on sm_90): the fewest CTAs per cluster that still give nearly every SM a CTA, then about 20 warps per CTA (fewer
    when a CTA has fewer vectors than that), fewer threads on a tie. Where no cluster size fills the SMs, the largest
    first. None when no plan fits."""
    nvec = C // G * HW // _vec(elem_size) if C % G == 0 else 0

    def rank(p: NchwPlan):
        fills = p.ctas >= 0.9 * num_sms
        per_cta = -(-nvec // p.K)  # vectors
        threads = min(640, -(-per_cta // 64) * 64)
        return (not fills, p.K if fills else -p.K, abs(p.nt - threads), p.nt)

    plans = sorted(nchw_candidate_plans(B, C, HW, G, elem_size), key=rank)
    return next((p for p in plans if fits is None or fits(p)), None)


# --------------------------------------------------------------------------------------------
# library
# --------------------------------------------------------------------------------------------
_build_lock = threading.Lock()
_built: dict[str, object] = {}  # "lib": the loaded library, or "error": why the build failed (not retried)


def library() -> ctypes.CDLL:
    """Build (first call: several seconds of nvcc, cached across processes by source hash) and load the kernel
    library. Raises RuntimeError when nvcc is missing or fails (once built or failed, never rebuilt in this
    process)."""
    with _build_lock:
        if not _built:
            try:
                _built["lib"] = _load()
            except Exception as e:  # noqa: BLE001 - nvcc, the loader, a missing symbol: all mean "no library"
                _built["error"] = f"{type(e).__name__}: {e}"
        if "error" in _built:
            raise RuntimeError(_built["error"])
        return _built["lib"]


def _load() -> ctypes.CDLL:
    from kernels.csrc.build import compile_shared_library

    parts = tuple((f"-DSDFAST_GN_DTYPE={d}",) for d in range(len(_DTYPES)))  # one nvcc per dtype, in parallel
    lib = ctypes.CDLL(str(compile_shared_library(SOURCE, "sdfast_group_norm_cluster", parts=parts)))
    vp, i, ll, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
    for suffix in _DTYPES.values():
        launch, active = getattr(lib, f"sdfast_gn_cluster_nhwc_{suffix}"), getattr(lib, f"sdfast_gn_cluster_max_active_{suffix}")
        launch.argtypes, launch.restype = [vp, vp, vp, vp, vp, vp, vp, i, i, i, i, i, i, i, i, ll, f, i, vp], i
        active.argtypes, active.restype = [i, i, i, i, i, i], i
        nchw, nchw_active = getattr(lib, f"sdfast_gn_cluster_nchw_{suffix}"), getattr(lib, f"sdfast_gn_cluster_nchw_max_active_{suffix}")
        nchw.argtypes, nchw.restype = [vp, vp, vp, vp, vp, vp, vp, i, i, i, i, i, i, i, ll, f, i, vp], i
        nchw_active.argtypes, nchw_active.restype = [i, i, i], i
    return lib


_builder: list[threading.Thread] = []


def _start_build() -> None:
    """Build the library on a background thread, once (nvcc is a subprocess, so this overlaps with Triton's
    compilations). The next real call's ``library()`` waits on the build lock and gets the result; a failed
    build is logged there, and that call and every later one run the Triton kernels."""
    if _builder:
        return

    def build():
        try:
            library()
        except Exception:  # noqa: BLE001 - library() keeps the error; the next real call logs the fallback
            pass

    th = threading.Thread(target=build, name="sdfast-gn-cluster-build", daemon=True)
    _builder.append(th)
    th.start()


@functools.lru_cache(maxsize=None)
def _device_ok(index: int) -> tuple[bool, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major >= 9, props.multi_processor_count


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------
def _unsupported(x, weight, bias, channel_bias, residual) -> str | None:
    """Why this call cannot run the cluster kernel, or None when it can (plan aside)."""
    if not x.is_cuda:
        return "not a CUDA tensor"
    ok, _ = _device_ok(x.device.index if x.device.index is not None else torch.cuda.current_device())
    if not ok:
        return "needs compute capability 9.0+ (thread-block clusters)"
    return _layout_problem(x, weight, bias, channel_bias, residual)


def layout(x: torch.Tensor) -> str | None:
    """"nhwc" for a dense channels_last x, "nchw" for a contiguous one (channels_last first: with H*W = 1 x is both),
    else None."""
    H, W = x.shape[2:]
    if x.is_contiguous(memory_format=torch.channels_last) and (H * W == 1 or x.stride(1) == 1):
        return "nhwc"
    return "nchw" if x.is_contiguous() else None


def _layout_problem(x, weight, bias, channel_bias, residual) -> str | None:
    """What of the tensors' dtypes, layouts and alignment the kernels cannot take, or None."""
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype}"
    B, C, H, W = x.shape
    lay = layout(x)
    if lay is None:
        return "x is neither dense channels_last nor contiguous"
    if lay == "nchw" and (H * W) % _vec(x.element_size()):
        return f"NCHW with H*W = {H * W} not a multiple of the 16-byte vector"
    for name, t in (("weight", weight), ("bias", bias), ("channel_bias", channel_bias)):
        if t is not None and t.dtype != x.dtype:
            return f"{name} dtype {t.dtype} is not x's {x.dtype}"
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and not t.is_contiguous():
            return f"{name} is not contiguous (stride {t.stride()})"
    if residual is not None and (residual.stride() != x.stride() or residual.data_ptr() % 16):
        return "residual is not laid out like x"
    if channel_bias is not None and channel_bias.reshape(-1, C).stride(1) != 1:
        return "channel_bias is not contiguous along C"
    if x.data_ptr() % 16:
        return "x is not 16-byte aligned"
    return None


def launcher(x, num_groups, weight, bias, eps, channel_bias, residual, silu, y, pre):
    """A zero-argument callable that runs the cluster kernel into ``y`` (and ``pre`` when given: the rounded
    ``x + channel_bias + residual``), or None when it cannot run this call (the reason logged once). Inside a
    compile-only pass (``kernels.precompile``) it starts building the library on a thread and returns None, so
    that the pass goes on to the Triton kernels and queues their compilation too. Inputs were checked by
    ``kernels.group_norm.op``; y and pre are fresh tensors laid out like x."""
    launch, why = _prepare(x, num_groups, weight, bias, eps, channel_bias, residual, silu, y, pre)
    if why is not None:
        log_fallback("group_norm cluster", why, instead="the Triton kernels")
    return launch


def _prepare(x, num_groups, weight, bias, eps, channel_bias, residual, silu, y, pre):
    """(launch, None) as :func:`launcher`, or (None, why it cannot run this call), nothing logged; (None, None) inside
    a compile-only pass, after starting the library's build there."""
    why = _unsupported(x, weight, bias, channel_bias, residual)
    if why is None and precompile.active():
        if not _built:
            _start_build()
        return None, None
    B, C, H, W = x.shape
    plan = lib = None
    if why is None:
        try:
            lib = library()
        except RuntimeError as e:
            why = f"library build failed: {str(e)[:300]}"
    lay = layout(x)
    nchw = why is None and lay == "nchw"
    if why is None:
        plan = TUNING["plan"] or device_plan(B, C, H * W, num_groups, x.dtype, x.device.index or 0, nchw=nchw)
        if plan is None or isinstance(plan, NchwPlan) != nchw:
            why = f"no cluster plan for (B, C, HW, G) = ({B}, {C}, {H * W}, {num_groups}) {x.dtype} {lay}"
    if why is not None:
        return None, why
    cb_bstride = 0
    if channel_bias is not None:
        cb2 = channel_bias.reshape(-1, C)
        cb_bstride = cb2.stride(0) if cb2.shape[0] > 1 else 0

    def ptr(t):
        return None if t is None else t.data_ptr()

    tensors = (ptr(x), ptr(residual), ptr(channel_bias), ptr(weight), ptr(bias), ptr(y), ptr(pre))
    tail = (cb_bstride, float(eps), int(silu))
    if nchw:
        fn = getattr(lib, f"sdfast_gn_cluster_nchw_{_DTYPES[x.dtype]}")
        args = (*tensors, B, C, H * W, num_groups, plan.K, plan.nt, plan.J, *tail)
    else:
        fn = getattr(lib, f"sdfast_gn_cluster_nhwc_{_DTYPES[x.dtype]}")
        args = (*tensors, B, C, H * W, num_groups, plan.CS, plan.K, plan.R, plan.J, *tail)

    def launch() -> None:
        with torch.cuda.device(x.device):
            rc = fn(*args, torch.cuda.current_stream(x.device).cuda_stream)
        if rc != 0:
            raise RuntimeError(f"group_norm cluster kernel: {_ERRORS.get(rc, f'CUDA error {rc}')} ({plan})")

    return launch, None


def try_group_norm(x, num_groups, weight, bias, eps, channel_bias, residual, silu, y, pre) -> bool:
    """Run the cluster kernel (see :func:`launcher`) and return True, or return False when it cannot run."""
    launch = launcher(x, num_groups, weight, bias, eps, channel_bias, residual, silu, y, pre)
    if launch is None:
        return False
    launch()
    return True


def run_if_faster(x, num_groups, weight, bias, eps, channel_bias, residual, silu, y, pre, triton_call) -> bool:
    """Run the cluster kernel and return True when :data:`CHOICE` picks it for this call; otherwise return False
    (the caller runs ``triton_call``, which writes the same outputs).

    The choice (``kernels.select.decide``) is keyed by the call signature (shape, strides, dtype, groups, fusions);
    where the cluster kernel can run it is measured once per key as GPU time on the caller's stream (the one timer,
    ``kernels.select.gpu_time_us``: the host's launches do not count, and a two-pass Triton GroupNorm is three
    launches from Python), both kernels alternating on the same L2-resident input (as in a UNet, where the norm
    reads what the convolution before it just wrote); the cluster kernel keeps ties. Where it cannot run, the
    reason is logged once and Triton is the only candidate. Inside a CUDA graph capture nothing is timed: the
    cluster kernel runs, and nothing is kept. Inside a ``kernels.precompile`` dry run the library's build starts on
    a thread and the Triton kernels run (so that their compilation is queued too); nothing is kept. A pin
    ("triton", e.g. ``SDFAST_GN_CLUSTER=0`` through the kernel policy) consults nothing here. Timing noise can tip a
    close choice either way from one process to the next; the two kernels' outputs agree within the tolerance rule,
    not to the bit."""
    if precompile.active():
        _prepare(x, num_groups, weight, bias, eps, channel_bias, residual, silu, y, pre)  # starts the build
        return False
    cb = None if channel_bias is None else tuple(channel_bias.shape)
    key = (tuple(x.shape), x.stride(), str(x.dtype), num_groups, weight is None, bias is None, cb,
           residual is not None, pre is not None, bool(silu))
    prepared: dict = {}

    def problem(name: str) -> str | None:
        if name != "cluster":
            return None
        prepared["launch"], why = _prepare(x, num_groups, weight, bias, eps, channel_bias, residual, silu, y, pre)
        return why

    winner = select.decide(
        CHOICE, key, device=x.device, problem=problem,
        candidates={"cluster": lambda: prepared["launch"](), "triton": triton_call},
        describe=lambda: f"x {tuple(x.shape)} {x.dtype} groups={num_groups}")
    if winner != "cluster":
        return False
    launch = prepared.get("launch")
    if launch is None:  # decided before: the per-call checks (alignment) and the cached plan
        launch, why = _prepare(x, num_groups, weight, bias, eps, channel_bias, residual, silu, y, pre)
        if launch is None:
            log_fallback("group_norm cluster", why or "cannot run this call", instead="the Triton kernels")
            return False
    launch()
    return True


@functools.lru_cache(maxsize=1024)
def _plan_for(B: int, C: int, HW: int, G: int, dtype: torch.dtype, device_index: int, nchw: bool,
              knobs: tuple) -> ClusterPlan | NchwPlan | None:
    """:func:`cluster_plan` (or :func:`nchw_plan`) for this device, keeping only plans whose clusters are all
    resident at once (the occupancy query needs the compiled kernels: raises RuntimeError when the library does not
    build). ``knobs``: the TUNING values the plans depend on (part of the cache key)."""
    sms = TUNING["num_sms"] or _device_ok(device_index)[1]

    def one_wave(plan) -> bool:
        clusters = B * G if nchw else B * C // plan.CS
        with torch.cuda.device(device_index):
            return clusters <= max_active_clusters(plan, C, G, dtype)

    library()
    planner = nchw_plan if nchw else cluster_plan
    return planner(B, C, HW, G, torch.tensor([], dtype=dtype).element_size(), sms, fits=one_wave)


def device_plan(B: int, C: int, HW: int, G: int, dtype: torch.dtype, device_index: int = 0,
                nchw: bool = False) -> ClusterPlan | NchwPlan | None:
    """The plan the launcher uses on this CUDA device for a channels_last (or, with ``nchw``, a contiguous) x:
    the modeled best with every cluster resident at once (cached per shape). Raises RuntimeError when the library
    does not build."""
    knobs = (TUNING["max_cluster"], TUNING["max_threads"], TUNING["nchw_max_threads"], TUNING["max_vectors"],
             TUNING["num_sms"])
    return _plan_for(B, C, HW, G, dtype, device_index, nchw, knobs)


def max_active_clusters(plan: ClusterPlan | NchwPlan, C: int, G: int, dtype: torch.dtype) -> int:
    """``cudaOccupancyMaxActiveClusters`` for ``plan`` on the current device (0: K cannot launch)."""
    if isinstance(plan, NchwPlan):
        return getattr(library(), f"sdfast_gn_cluster_nchw_max_active_{_DTYPES[dtype]}")(plan.K, plan.nt, plan.J)
    fn = getattr(library(), f"sdfast_gn_cluster_max_active_{_DTYPES[dtype]}")
    return fn(C, G, plan.CS, plan.K, plan.R, plan.J)


__all__ = ["ClusterPlan", "NchwPlan", "cluster_plan", "candidate_plans", "nchw_plan", "nchw_candidate_plans",
           "nhwc_max_threads", "layout", "device_plan", "launcher", "try_group_norm", "run_if_faster", "CHOICE",
           "library", "max_active_clusters", "TUNING"]
