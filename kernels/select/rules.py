"""``decide``: the one place where a kernel choice is made, pinned, guarded, measured, recorded and logged."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from kernels import precompile
from kernels.dispatch import interpret_mode, log_fallback
from kernels.select import store
from kernels.select.declare import Choice, Decision
from kernels.select.timer import fastest, gpu_time_us

log = logging.getLogger("sdfast.kernels")

_pins: dict[str, str] = {}  # choice name -> candidate (the kernel policy's, set by sdfast.optimize)
_test_pins = threading.local()


def set_pins(pins: Mapping[str, str | None]) -> None:
    """Replace the process-wide pins: ``{choice name: candidate}`` (None or "auto": measure). ``sdfast.optimize``
    sets them from its config's kernel policy (the last optimized pipeline's policy holds for every pipeline of the
    process)."""
    _pins.clear()
    _pins.update({name: c for name, c in pins.items() if c not in (None, "auto")})


def pins() -> dict[str, str]:
    """The pins in force (a copy), the innermost :func:`pinned` context's over the process-wide ones."""
    return {**_pins, **getattr(_test_pins, "pins", {})}


@contextlib.contextmanager
def pinned(choices: Mapping[str, str | None]) -> Iterator[None]:
    """Pin choices on this thread for the ``with`` block (tests, benchmarks): ``{choice name: candidate}``; None
    unpins one (it is measured)."""
    before = getattr(_test_pins, "pins", {})
    _test_pins.pins = {**before, **choices}
    try:
        yield
    finally:
        _test_pins.pins = before


def signature(*tensors: torch.Tensor | None) -> tuple:
    """A key part per tensor: shape, strides, dtype and class name (None for an absent one). Alignment (a view's
    storage offset) is not in it: callers that need it check per call."""
    return tuple(None if t is None else (tuple(t.shape), t.stride(), str(t.dtype), type(t).__name__)
                 for t in tensors)


def measuring_blocked(device: torch.device, measure_cpu: bool = False) -> str | None:
    """Why nothing may be timed now on ``device`` (None when it may): inside torch.compile tracing, a CUDA graph
    capture, a ``kernels.precompile`` dry run, or on the CPU (unless ``measure_cpu``)."""
    if torch.compiler.is_compiling():
        return "torch.compile tracing"
    if precompile.active():
        return "a kernels.precompile dry run"
    if device.type == "cuda":
        return "CUDA graph capture" if torch.cuda.is_current_stream_capturing() else None
    return None if measure_cpu else f"the {device.type}"


def decide(choice: Choice, key: tuple, *, candidates: Mapping[str, Callable[[], object]] | Sequence[str],
           device: torch.device, problem: Callable[[str], str | None] | None = None, pin: str | None = None,
           compile_all: Callable[[], object] | None = None,
           measure: Callable[[dict], Mapping[str, float]] | None = None, measure_cpu: bool = False,
           describe: str | Callable[[], str] = "") -> str:
    """The candidate to run for ``key``: see ``kernels/select/__init__.py`` for the order of the rules.

    candidates: name -> zero-arg callable that runs that candidate on this call's inputs (what is timed), or just
        the names when ``measure`` times them; ``choice.default`` must be among them. problem(name): why that
        candidate cannot run this call, or None. pin: a candidate forced by the caller (beside the policy's
        pins). compile_all: called in a precompile dry run. measure(live): {name: µs} for the live candidates (a
        missing one failed), instead of :func:`gpu_time_us`. describe: words for the log line (shapes), or a callable
        that returns them (built only when something is logged).
    Raises ValueError for a pin that is not a candidate; what a candidate raises while it is timed (an
    out-of-memory error: nothing is recorded, a later call measures again).
    """
    pin = pins().get(choice.name, pin)
    dev = store.device_name(device)
    found = store.lookup(choice.name, dev, key)
    if found is not None and (pin is None or (found.source == "pinned" and found.winner == pin)):
        return found.winner
    names = list(candidates)
    if choice.default not in names:
        raise ValueError(f"{choice.name}: the default {choice.default!r} is not among the candidates {names}")
    if pin is not None:
        if pin not in names:
            raise ValueError(f"{choice.name}: the pinned candidate {pin!r} is not one of {names}")
        why = problem(pin) if problem else None
        if why is None:
            return store.record(Decision(choice.name, repr(key), pin, {}, "pinned", {}, dev), key, save=False).winner
        _log_reason(choice, f"the pinned {pin} cannot run: {why}", [n for n in names if n != pin], device)
        if found is not None and found.source != "pinned":
            return found.winner
    if callable(describe):
        describe = describe()
    reasons = {name: why for name in names if (why := problem(name) if problem else None) is not None}
    live = [name for name in names if name not in reasons]
    for why in dict.fromkeys(reasons.values()):  # one line per reason, however many candidates it rules out
        _log_reason(choice, why, live, device)
    if not live:
        raise RuntimeError(f"{choice.name}: no candidate can run {describe or key!r}: {reasons}")
    if len(live) == 1:
        return store.record(Decision(choice.name, repr(key), live[0], {}, "only", reasons, dev), key, save=False).winner
    blocked = measuring_blocked(device, measure_cpu)
    if blocked is not None:
        if blocked == "a kernels.precompile dry run" and compile_all is not None:
            compile_all()
        return choice.default if choice.default in live else live[0]
    if measure is not None:
        times = dict(measure({name: candidates[name] if isinstance(candidates, Mapping) else None for name in live}))
    else:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            runnable = {}
            for name in live:  # a candidate that fails here (a tile too big for shared memory, no memory for a
                try:  # workspace) is logged and dropped for this key; the default's failure is the caller's
                    candidates[name]()
                    runnable[name] = candidates[name]
                except Exception as e:  # noqa: BLE001
                    if name == choice.default:
                        raise
                    reasons[name] = f"{name} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    _log_reason(choice, reasons[name], [n for n in live if n not in reasons], device)
            times = gpu_time_us(runnable) if len(runnable) > 1 else {name: 0.0 for name in runnable}
    times = {name: times[name] for name in live if name in times}
    if not times:
        raise RuntimeError(f"{choice.name}: every candidate failed for {describe or key!r}")
    winner = fastest(times, choice.default, choice.margin)
    log.info("sdfast kernel choice %s %s: %s -> %s", choice.name, describe or repr(key),
             ", ".join(f"{n} {t:.1f} us" for n, t in times.items()), winner)
    decision = Decision(choice.name, repr(key), winner, times, "measured", reasons, dev)
    return store.record(decision, key, save=choice.save).winner


def _log_reason(choice: Choice, why: str, instead: Sequence[str], device: torch.device) -> None:
    """Log once per reason that candidates cannot run, and what runs instead (where a choice exists at all: on a
    GPU, or on the CPU in the Triton interpreter; elsewhere only the library path runs: nothing to say)."""
    if device.type == "cuda" or (device.type == "cpu" and interpret_mode()):
        log_fallback(choice.name, why, instead=" or ".join(instead) or "nothing")
