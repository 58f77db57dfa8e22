"""The one kernel-choice service: where a kernel call picks among candidates that write the same outputs.

A choice is a declaration (:class:`Choice`: name, default, margin) beside the op; each call site asks
:func:`decide` with its key (:func:`signature` of its tensors plus plain values), its candidates, and why a
candidate cannot run (``problem``). The rules, in order, at a call:

1. a pin (the kernel policy's, set by ``sdfast.optimize`` through :func:`set_pins`, a test's :func:`pinned`, or the
   caller's ``pin=``) runs that candidate, unmeasured, where it can run;
2. a decision made before for the key (in this process, or read from the saved-choices file of this GPU and these
   versions, :mod:`kernels.select.store`) runs its winner;
3. candidates with a problem are dropped, the reason logged once (``kernels.dispatch.log_fallback``); when one
   candidate is left it is the decision;
4. nothing is timed inside torch.compile tracing, CUDA graph capture, a ``kernels.precompile`` dry run (there
   ``compile_all`` compiles every candidate) or on the CPU: the default runs and nothing is recorded;
5. otherwise every candidate is timed (:func:`gpu_time_us`, or the caller's ``measure``); the default wins unless
   another is faster than ``margin`` times its time; the decision is logged, recorded, and saved.

:func:`decisions` is the public report (``sdfast.decisions()``); benchmarks read it, not private caches.
"""

from kernels.select.declare import Choice, Decision
from kernels.select.rules import decide, measuring_blocked, pinned, pins, set_pins, signature
from kernels.select.store import cache_dir, clear, decisions, load, measured_count, persist, saved_path, save
from kernels.select.timer import fastest, gpu_time_us

__all__ = ["Choice", "Decision", "cache_dir", "clear", "decide", "decisions", "fastest", "gpu_time_us",
           "load", "measured_count", "measuring_blocked", "persist", "pinned", "pins", "save", "saved_path", "set_pins",
           "signature"]
