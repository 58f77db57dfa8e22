"""CUDA graphs for a module's forward, one per input signature, over one shared memory pool.

``GraphedForward`` replaces ``module.forward`` on the instance. A call whose signature (the pytree of
its arguments: tensor shapes, strides, dtypes, devices and every non-tensor value) was seen before
copies its tensors into that graph's static input buffers, replays the graph, and returns clones of
the static outputs, so no caller ever holds a view of a graph's buffer. A module with forward hooks below
its root runs eagerly (hooks need Python at every call: a calibration collecting activations, a user's
hook).

A new signature is first run once in compile-only mode (``kernels.precompile.dry_run``, ``parallel_compile``:
its Triton kernels compile on all cores), then warmed up eagerly on a side stream (cuDNN/cuBLAS handles, the
kernel choices' measurements happen there: once, or ``warmup_iters`` times while a warm-up still measured a
choice) and captured; ``stats.setup_s`` has the seconds each phase took. Graphs share the engine's memory pool: their
intermediates reuse one planned workspace, safe because graphs replay one at a time and outputs are
copied out at once. At most ``max_graphs`` are kept (least recently used dropped). With ``conditionings``
(``runtime.conditioning``: the cross-attention K/V of the text context, a ControlNet's control-image embedding),
each signature has one more small graph per conditioning, replayed only when its input changes. With a ``split``
(``GraphSplit``; ``runtime.control_overlap``), a call may be captured as two graphs, cut where one submodule's forward
returns: the arguments only the second one reads are copied in between, after the work of another stream that made
them, so that work runs beside the first graph.

Parameters are read by the graph from their storage, so in-place weight updates (``param.copy_``, a
fused LoRA) are seen by the next replay; replacing a parameter's storage (``module.to(dtype)``, new
modules, LoRA adapter state) is seen by ``WeightsWatch`` and ``GraphCache.check`` drops the stale graphs.

Method: ``torch.cuda.CUDAGraph`` as in PyTorch's "CUDA Graphs" notes; graph pools as in
``torch.cuda.make_graphed_callables``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from itertools import chain, repeat
from operator import itemgetter
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch.nn.modules import module as nn_module
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from kernels import precompile, select
from sdfast.runtime.conditioning import Conditioning, SeenContext

log = logging.getLogger("sdfast.runtime")


def _is_tuner_layer(m: torch.nn.Module) -> bool:
    """A PEFT ``BaseTunerLayer`` (what diffusers' LoRA loaders inject)."""
    return hasattr(m, "merged_adapters") and hasattr(m, "active_adapters")


def _adapter_state(name: str, m: torch.nn.Module) -> tuple:
    scaling = getattr(m, "scaling", {})
    return (
        name,
        tuple(m.merged_adapters),
        tuple(m.active_adapters),
        bool(getattr(m, "disable_adapters", False)),
        tuple(sorted((k, float(v)) for k, v in scaling.items())) if isinstance(scaling, dict) else (),
    )


# Instance attributes that change what a forward does in Python: a replaced forward, diffusers' attention
# processor, FreeU's factors.
_PYTHON_ATTRS = frozenset(("forward", "processor", "s1", "s2", "b1", "b2"))


def _python_state(dicts: list) -> tuple:
    """What changes a forward in Python, for every module but the root (whose hooks and forward run outside the
    graph: the graph runner is its forward): forward hooks and pre-hooks, a forward replaced on the instance,
    an attention processor (diffusers' ``set_attn_processor``), FreeU's factors (``enable_freeu``); and the
    global module hooks. Objects compare by identity, numbers by value. Hooks a graph reproduces
    (``_needs_python_each_call``) are left out: transformers installs them during the first call, which is the
    capture, so counting them recaptured every text encoder at the next call. Only the modules that have any of
    it are listed, by position (this runs before every pipeline call over every module: SDXL's UNet has 2,600);
    an attribute set to None counts as present (one more recapture at worst).

    ``dicts``: the modules' ``__dict__`` in ``modules()`` order, the root first. The first pass is one filtering
    comprehension with inlined dict lookups (no set or tuple per module): 0.09 ms over SD1.5's UNet on the dev
    CPU, against 0.31 ms for building ``keys() & names`` per module."""
    hit = [i for i, d in enumerate(dicts) if i and (
        d["_forward_hooks"] or d["_forward_pre_hooks"] or "forward" in d or "processor" in d
        or "s1" in d or "s2" in d or "b1" in d or "b2" in d)]
    per_module = []
    for i in hit:
        d = dicts[i]
        post, pre = _hook_ids(d["_forward_hooks"]), _hook_ids(d["_forward_pre_hooks"])
        attrs = sorted(k for k in _PYTHON_ATTRS if k in d)
        if attrs or post or pre:
            per_module.append((i, post, pre, tuple((k, d[k]) for k in attrs)))
    return (tuple(per_module), _hook_ids(nn_module._global_forward_hooks),
            _hook_ids(nn_module._global_forward_pre_hooks))


def _hook_ids(hooks: dict) -> tuple:
    """The handle ids of the hooks in a hook dict that a graph replay would skip (empty dicts: no work)."""
    return tuple(k for k, h in hooks.items() if _needs_python_each_call(h)) if hooks else ()


def _needs_python_each_call(hook) -> bool:
    """False for hooks that a captured graph reproduces: transformers' output-capturing hooks (installed on the
    encoder layers at the first call to collect ``hidden_states`` into the output, which the graph's static
    output already holds)."""
    name, module = getattr(hook, "__name__", ""), getattr(hook, "__module__", "") or ""
    return not (name == "output_capturing_hook" and module.split(".")[0] == "transformers")


_modules_of, _parameters_of, _buffers_of = itemgetter("_modules"), itemgetter("_parameters"), itemgetter("_buffers")
_hooks_of, _pre_hooks_of = itemgetter("_forward_hooks"), itemgetter("_forward_pre_hooks")
_tensor_data_ptr = torch._C.TensorBase.data_ptr


class WeightsWatch:
    """What a captured graph bakes in about a module's weights, checked before every pipeline call.

    The state is: the module tree (each module's children, by identity), the storage pointer of every
    parameter and buffer (changes when one is replaced or moved: ``module.weight = ...``,
    ``module.to(dtype)``, ``param.data = ...``), and the adapter state of every PEFT LoRA layer (merged and
    active adapters, disabled or not, scalings: ``fuse_lora``/``unfuse_lora``, ``set_adapters``,
    ``disable_lora`` change it without touching any storage, and the layer decides them in Python, so at
    capture time). Also what changes a forward in Python below the root: forward hooks and pre-hooks (global
    ones too), forwards replaced on an instance, attention processors (``set_attn_processor``), FreeU's
    factors (``enable_freeu``). In-place updates (``param.copy_``) change none of it: the graphs read the storage.

    A check runs before every pipeline call with the GPU idle, over every module (SDXL's UNet: about 2,000), so it
    has two tiers. First a fingerprint, gathered by C-level ``map``/``chain`` with no Python frame per module: every
    module's children and the sizes of its children, parameter and buffer dicts; the parameters and buffers by
    identity, and their storage pointers; below the root (whose hooks and attributes act outside the graph: the
    engine's and the benchmark's hooks come and go there at every call) the sizes of each module's ``__dict__`` and
    hook dicts, the handle ids of its forward hooks, its instance ``forward`` and ``processor`` and the values of the
    Python attributes above that were set at the snapshot; the global hooks' handle ids. The watch holds what it compares by identity, so an id cannot be taken by a new object. Equal
    fingerprints mean the same state (an attribute added is seen in its module's ``__dict__`` size), and the check
    ends there. Only when the fingerprint differs is the state itself computed and compared (the transformers hooks
    a graph reproduces are left out there, see ``_python_state``); a difference that does not change the state
    then renews the fingerprint.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.snapshot()

    def snapshot(self) -> None:
        """Take the current state as the reference."""
        self.modules = list(self.module.modules())
        self.tuners = [(n, m) for n, m in self.module.named_modules() if _is_tuner_layer(m)]
        self._dicts = [m.__dict__ for m in self.modules]  # read at every check: no attribute lookups
        self.state = self._state()
        self._remember()
        # Hooks below the root need Python at every call (e.g. a calibration collecting activations): a graph
        # replay would skip them, so the runner runs such a module eagerly (``GraphedForward``). The state's
        # Python part lists exactly those hooks.
        per_module, global_post, global_pre = self.state[3]
        self.hooked = bool(global_post or global_pre or any(post or pre for _, post, pre, _ in per_module))

    def _fingerprint(self) -> tuple | None:
        """(ints: the sizes (hook dicts too) and the hook handle ids; the children, by identity; the parameters and buffers, with
        None; the attributes: ``forward`` and ``processor`` of every module, and those set at the snapshot). None
        when one of those was deleted."""
        dicts, below = self._dicts, self._below  # the root's hooks and attributes run outside the graphs: left out
        children, params, buffers = (list(map(get, dicts)) for get in (_modules_of, _parameters_of, _buffers_of))
        hooked = self._hooked_dicts  # the hook ids of the modules that had hooks at the snapshot; the others' count
        ints = [*map(len, below), *map(len, children), *map(len, params), *map(len, buffers),
                *map(len, map(_hooks_of, below)), *map(len, map(_pre_hooks_of, below)),
                *chain.from_iterable(map(_hooks_of, hooked)), -1, *chain.from_iterable(map(_pre_hooks_of, hooked)), -1,
                *nn_module._global_forward_hooks, -1, *nn_module._global_forward_pre_hooks]
        tensors = [*chain.from_iterable(map(dict.values, params)), *chain.from_iterable(map(dict.values, buffers))]
        try:
            attrs = [*map(dict.get, below, repeat("forward")), *map(dict.get, below, repeat("processor")),
                     *map(dict.__getitem__, self._attr_dicts, self._attr_names)]
        except KeyError:
            return None
        return ints, list(chain.from_iterable(map(dict.values, children))), tensors, attrs

    def _remember(self) -> None:
        """Take the fingerprint of now as the reference: which attributes and hooks it reads by name, then the
        fingerprint, its objects held so that their ids stay theirs."""
        self._below = self._dicts[1:]
        present = [(d, k) for d in self._below for k in _PYTHON_ATTRS if k in d]
        self._attr_dicts, self._attr_names = [d for d, _ in present], [k for _, k in present]
        self._hooked_dicts = [d for d in self._below if d["_forward_hooks"] or d["_forward_pre_hooks"]]
        self._held = self._fingerprint()
        self._tensor_ids = list(map(id, self._held[2]))
        self._tensors = [t for t in self._held[2] if t is not None]
        self._pointers = list(map(_tensor_data_ptr, self._tensors))

    def _same_fingerprint(self, fingerprint: tuple | None) -> bool:
        """Whether ``fingerprint`` is the reference's: the same objects (children and attributes compare by identity
        or, numbers, by value: none defines another ``==``; tensors by id) and the same storage pointers."""
        if fingerprint is None:
            return False
        ints, children, tensors, attrs = fingerprint
        held_ints, held_children, _, held_attrs = self._held
        return (ints == held_ints and children == held_children and attrs == held_attrs
                and list(map(id, tensors)) == self._tensor_ids
                and list(map(_tensor_data_ptr, self._tensors)) == self._pointers)

    def _state(self) -> tuple:
        dicts = self._dicts
        structure = [tuple(d["_modules"].values()) for d in dicts]  # modules compare by identity
        tensors = chain.from_iterable(map(dict.values, [d[k] for d in dicts for k in ("_parameters", "_buffers")]))
        pointers = [0 if t is None else t.data_ptr() for t in tensors]  # by position: a moved tensor is a change
        return structure, pointers, self._adapters(), _python_state(dicts)

    def _adapters(self) -> tuple:
        return tuple(_adapter_state(n, m) for n, m in self.tuners)

    def changed(self) -> bool:
        """True (and a new snapshot taken) when the state differs from the reference."""
        fingerprint = self._fingerprint()
        if self._same_fingerprint(fingerprint) and (not self.tuners or self._adapters() == self.state[2]):
            return False
        if fingerprint is not None and self._state() == self.state:
            self._remember()
            return False
        self.snapshot()
        return True


def _autocast_key() -> tuple:
    """CUDA autocast on/off and its dtype: the ops a captured forward ran depend on them."""
    return torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")


def _leaf_key(x):
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.stride(), x.dtype, x.device)
    try:
        hash(x)
    except TypeError:
        return ("U", id(x))  # unhashable non-tensor: never matches another call
    return ("V", type(x), x)


def _is_host_scalar(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.numel() == 1


def _static_input(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The graph's buffer for one tensor argument: a clone, except that a one-element CPU tensor (a timestep the
    scheduler keeps on the host, ``runtime.host_timesteps``) gets a buffer on the graph's device: the module sees
    the value on the GPU, as if the caller had passed it there. A module that needs the host value (``.item()``,
    Python control flow) cannot be captured with it, and runs eagerly (the logged fallback)."""
    if _is_host_scalar(x):
        return torch.full(x.shape, x.item(), dtype=x.dtype, device=device)
    return x.clone()


@dataclass
class _Projection:
    """For one of the ``conditionings`` (``runtime.conditioning``): the graph that runs its work on its context
    leaf, replayed only when that leaf changes."""

    graph: torch.cuda.CUDAGraph
    conditioning: Conditioning
    index: int  # the context's position among the call's leaves
    params: list  # the tensors the work reads besides the context (their versions are watched)
    slots: dict  # what the step graph reads: kept alive, in this graph's own memory pool
    seen: SeenContext = field(default_factory=SeenContext)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static_inputs: list  # tensors, in leaf order (None for non-tensor leaves)
    static_output: object
    pre: tuple[_Projection, ...] = ()
    tail: torch.cuda.CUDAGraph | None = None  # a split capture's second graph (``GraphSplit``)
    deferred: tuple[int, ...] = ()  # the leaves the first graph does not read: copied between the two replays

    def __post_init__(self):
        # the leaves not copied before the first replay: the deferred ones and the conditionings' contexts
        self.skip = frozenset(self.deferred) | frozenset(p.index for p in self.pre)


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    evictions: int = 0
    eager_calls: int = 0
    split_captures: int = 0  # signatures captured as two graphs (``GraphSplit``)
    conditioning_runs: int = 0  # replays of the conditionings' graphs (cross-attention K/V, control embedding)
    failures: list = field(default_factory=list)
    # Seconds spent making graphs, by phase ("dry_run", "warmup", "capture"), summed over signatures; "warmups"
    # counts the warm-up passes run.
    setup_s: dict = field(default_factory=dict)


class _Phases:
    """Adds the wall time since the previous call (the side stream drained) to ``totals[name]``."""

    def __init__(self, totals: dict, stream):
        self.totals, self.stream = totals, stream
        self.t = time.perf_counter()

    def __call__(self, name: str) -> None:
        self.stream.synchronize()
        now = time.perf_counter()
        self.totals[name] = self.totals.get(name, 0.0) + now - self.t
        if name == "warmup":
            self.totals["warmups"] = self.totals.get("warmups", 0) + 1
        self.t = now


class GraphSplit:
    """How a runner captures some calls as two graphs, for work of another stream to join in between
    (``runtime.control_overlap``: the UNet's down blocks beside a ControlNet). Subclasses define the three methods."""

    def cut_after(self, forward, args: tuple, kwargs: dict) -> torch.nn.Module | None:
        """The submodule at the end of whose forward the capture of this call (``forward(*args, **kwargs)``, the
        runner's eager forward) is cut in two; None: one graph. The first graph must not read ``deferred``."""
        raise NotImplementedError

    def deferred(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
        """The tensor arguments that only the second graph reads."""
        raise NotImplementedError

    def copy_deferred(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (static buffer, argument) pair after the first graph was launched, the current stream then
        ordered after whatever produced the arguments."""
        raise NotImplementedError

    def join(self) -> None:
        """Order the current stream after whatever produced the deferred arguments (before any use of them)."""
        raise NotImplementedError


class GraphedForward:
    """A callable that replaces ``module.forward`` (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, *, pool, max_graphs: int = 8, warmup_iters: int = 2, name: str = "",
                 clock=None, stream=None, conditionings: tuple[Conditioning, ...] = (), parallel_compile: bool = True,
                 output_scale: str | None = None, split: GraphSplit | None = None):
        self.module = module
        self.split = split  # calls captured as two graphs, another stream's work joining in between
        self.output_scale = output_scale  # a keyword argument that scales every output: applied after the replay
        self.parallel_compile = parallel_compile  # a compile-only pass before the first warm-up at a signature
        self.conditionings = tuple(conditionings)  # each in its own graph, once per context (runtime.conditioning)
        self.eager = module.forward  # the forward as it was (possibly already patched by other passes)
        self.rebound = "forward" in module.__dict__  # was forward already an instance attribute?
        self.pool = pool
        self.max_graphs = max_graphs
        self.warmup_iters = warmup_iters
        self.name = name or type(module).__name__
        self.graphs: OrderedDict[tuple, _Graph | None] = OrderedDict()  # None: this signature runs eagerly
        self.stats = GraphStats()
        self.watch = WeightsWatch(module)
        self.hook_epoch = RemovableHandle.next_id
        self.clock = clock or (lambda: 0)  # GraphCache's capture counter
        self.stream = stream  # side stream for warm-up and capture (None: a new one per capture)
        self.born: dict[tuple, int] = {}  # signature -> clock value at its capture
        self.check_due = False  # GraphCache.check asked for a full check at the next call

    def check_now(self) -> bool:
        """The full check: conditionings rerun at their next replay (weights may have changed in ways no version
        counter shows: ``.data``), and every graph is dropped when the weights, adapters or hooks changed since
        capture (``WeightsWatch``). Returns whether they had."""
        self.check_due = False
        self.forget_conditioning()
        self.hook_epoch = RemovableHandle.next_id  # this full check covers the hooks registered so far
        if not self.watch.changed():
            return False
        log.info("sdfast: weights or adapters of %s changed; dropping its CUDA graphs", self.name)
        self.invalidate()
        return True

    def hooked(self) -> bool:
        """Whether a module below the root has forward hooks now. Every hook registration anywhere takes a new
        ``RemovableHandle`` id, so the modules are rescanned (and stale graphs dropped) only after one."""
        epoch = RemovableHandle.next_id
        if epoch != self.hook_epoch:
            self.hook_epoch = epoch
            if self.watch.changed():
                self.invalidate()
        return self.watch.hooked

    def __call__(self, *args, **kwargs):
        scale = self._pull_scale(kwargs)
        if scale is not None:  # one graph for every scale: the outputs are scaled after the replay
            kwargs = {**kwargs, self.output_scale: 1.0}
            out = self(*args, **kwargs)
            if scale != 1.0:
                torch._foreach_mul_([t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)], scale)
            return out
        if self.check_due:
            self.check_now()
        leaves, spec = pytree.tree_flatten((args, kwargs))
        on_cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in leaves)
        if not on_cuda or torch.cuda.is_current_stream_capturing() or torch.is_grad_enabled() or self.hooked():
            return self._eager(args, kwargs)
        key = (spec, tuple(_leaf_key(x) for x in leaves), _autocast_key())
        if key not in self.graphs:
            self._join()  # the capture copies every argument
            self._capture(key, leaves, spec)
        entry = self.graphs[key]
        self.graphs.move_to_end(key)
        if entry is None:
            return self._eager(args, kwargs)
        if not entry.deferred:
            self._join()
        for pre in entry.pre:
            self._refresh_conditioning(pre, entry.static_inputs[pre.index], leaves[pre.index])
        skip = entry.skip
        for i, (static, x) in enumerate(zip(entry.static_inputs, leaves)):
            if static is None or i in skip:
                continue
            if static.device == x.device:
                static.copy_(x)
            else:  # a host scalar (the timestep): its value goes in the fill kernel's arguments, no copy, no sync
                static.fill_(x.item())
        entry.graph.replay()
        if entry.tail is not None:
            self.split.copy_deferred([(entry.static_inputs[i], leaves[i]) for i in entry.deferred])
            entry.tail.replay()
        self.stats.replays += 1
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, entry.static_output)

    def _join(self) -> None:
        if self.split is not None:
            self.split.join()

    def _eager(self, args, kwargs):
        self._join()
        self.stats.eager_calls += 1
        return self.eager(*args, **kwargs)

    def _pull_scale(self, kwargs: dict) -> float | None:
        """The value of the ``output_scale`` keyword when the call can take it out of the graph: a Python float
        other than 1.0 (ControlNet's ``conditioning_scale``: its residuals are ``r * scale``, so ``r`` at 1.0 then
        scaled is the same fp16 rounding), without ``guess_mode`` (whose per-residual scales would round twice).
        None otherwise: the value is then part of the graph's signature, as any non-tensor argument."""
        if self.output_scale is None or kwargs.get("guess_mode"):
            return None
        scale = kwargs.get(self.output_scale)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale == 1.0:
            return None
        return float(scale)

    def _refresh_conditioning(self, pre: _Projection, static: torch.Tensor, x: torch.Tensor) -> None:
        """Replay the conditioning's graph unless it last ran on this very tensor, unchanged, with unchanged weights."""
        state = pre.conditioning.state(x, pre.params)
        if pre.seen.same(x, state):
            return
        static.copy_(x)
        pre.graph.replay()
        pre.seen.set(x, state)
        self.stats.conditioning_runs += 1

    def forget_conditioning(self) -> None:
        """Make the next replay of every graph rerun its conditionings (start of a pipeline call)."""
        for entry in self.graphs.values():
            for pre in entry.pre if entry is not None else ():
                pre.seen.forget()

    def _capture_projection(self, conditioning: Conditioning, static_inputs: list, index: int) -> _Projection:
        """The graph of ``conditioning`` on its context at ``static_inputs[index]``. Its own memory pool, not the
        shared one: the slots must survive the replays of every other graph (the shared pool hands memory freed
        after one capture to the next, and replays write it)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):  # the runner's stream: its cuBLAS workspace (install)
            slots = conditioning.fill(static_inputs[index])
        return _Projection(graph, conditioning, index, conditioning.params(), slots)

    def _conditioning_indices(self, leaves, s_args, s_kwargs) -> list[tuple[Conditioning, int]]:
        """(conditioning, index of its context among the leaves) for each conditioning that has layers to work
        for and whose argument is a tensor of this call."""
        found = []
        for c in self.conditionings:
            ctx = c.context(s_args, s_kwargs) if c.layers() else None
            i = next((i for i, x in enumerate(leaves) if ctx is not None and x is ctx), -1)
            if i >= 0:
                found.append((c, i))
        return found

    def _capture(self, key, leaves, spec) -> None:
        device = next(x.device for x in leaves if isinstance(x, torch.Tensor) and x.is_cuda)
        static_inputs = [_static_input(x, device) if isinstance(x, torch.Tensor) else None for x in leaves]
        s_args, s_kwargs = pytree.tree_unflatten([s if s is not None else x for s, x in zip(static_inputs, leaves)], spec)
        found = self._conditioning_indices(static_inputs, s_args, s_kwargs)
        side = self.stream if self.stream is not None else torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            phase = _Phases(self.stats.setup_s, side)
            with torch.cuda.stream(side):
                if self.parallel_compile:  # the Triton kernels of this signature compile on all cores first
                    precompile.dry_run(self.eager, s_args, s_kwargs, label=self.name)
                    phase("dry_run")
                for _ in range(self.warmup_iters):
                    # A warm-up that timed no kernel choice ran exactly what the capture will run (every kernel
                    # loaded, every lazy handle made): another one would repeat it. One that measured ran the
                    # candidates too, so the winners run once more on their own before the capture.
                    measured = select.measured_count()
                    self.eager(*s_args, **s_kwargs)
                    phase("warmup")
                    if select.measured_count() == measured:
                        break
            torch.cuda.current_stream().wait_stream(side)
            pre = tuple(self._capture_projection(c, static_inputs, i) for c, i in found)
            cut = self.split.cut_after(self.eager, s_args, s_kwargs) if self.split is not None else None
            with contextlib.ExitStack() as reading:
                for p in pre:
                    reading.enter_context(p.conditioning.reading(p.slots, static_inputs[p.index]))
                graph, tail, out = self._capture_graphs(s_args, s_kwargs, cut, side)
            phase("capture")
        except torch.cuda.OutOfMemoryError:
            # Transient: nothing is cached, so the next call at this signature tries again.
            torch.cuda.synchronize()
            raise
        except Exception as e:  # the one logged fallback point of the graph runtime
            torch.cuda.synchronize()
            log.warning("sdfast: CUDA graph capture of %s failed (%s: %s); this input signature runs eagerly",
                        self.name, type(e).__name__, e)
            self.stats.failures.append(f"{type(e).__name__}: {e}")
            self.graphs[key] = None
            self.born[key] = self.clock()
            return
        deferred = ()
        if tail is not None:
            ids = {id(t) for t in self.split.deferred(s_args, s_kwargs)}
            deferred = tuple(i for i, x in enumerate(static_inputs) if x is not None and id(x) in ids)
            self.stats.split_captures += 1
        self.graphs[key] = _Graph(graph, static_inputs, out, pre, tail, deferred)
        self.born[key] = self.clock()
        self.stats.captures += 1
        log.info("sdfast: captured a CUDA graph of %s (%d cached)", self.name, len(self.graphs))
        try:  # the warm-up of this signature is done: what it measured is saved for the next process
            select.save()
        except OSError as e:
            log.warning("sdfast: could not save the kernel choices: %s", e)
        while len(self.graphs) > self.max_graphs:
            old, _ = self.graphs.popitem(last=False)
            self.born.pop(old, None)
            self.stats.evictions += 1

    def _capture_graphs(self, s_args, s_kwargs, cut: torch.nn.Module | None, stream):
        """Capture ``self.eager(*s_args, **s_kwargs)`` on ``stream`` over the shared pool, as ``torch.cuda.graph``
        does (synchronize, empty the cache, capture). With ``cut``: two graphs, the first ended and the second begun
        (same pool, same stream) when ``cut``'s forward returns (its first call). Returns (graph, second graph or
        None, output)."""
        parts = [torch.cuda.CUDAGraph()]
        capturing = []  # the graph whose capture is open: ended once, by the cut or at the end

        def end_capture():
            capturing.pop().capture_end()

        def cut_here(module, args, output):
            if len(parts) == 1:
                end_capture()
                parts.append(torch.cuda.CUDAGraph())
                parts[1].capture_begin(pool=self.pool)
                capturing.append(parts[1])

        handle = cut.register_forward_hook(cut_here) if cut is not None else None
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            with torch.cuda.stream(stream):
                parts[0].capture_begin(pool=self.pool)
                capturing.append(parts[0])
                try:
                    out = self.eager(*s_args, **s_kwargs)
                finally:
                    if capturing:
                        end_capture()
        finally:
            if handle is not None:
                handle.remove()
        return parts[0], parts[1] if len(parts) > 1 else None, out

    def drop_since(self, mark: int) -> int:
        """Drop the graphs captured after clock value ``mark``. Returns how many."""
        new = [key for key, t in self.born.items() if t > mark]
        for key in new:
            self.graphs.pop(key, None)
            del self.born[key]
        return len(new)

    def drop_where(self, predicate) -> int:
        """Drop the graphs whose signature's leaf keys (a tuple: ``("T", shape, stride, dtype, device)`` per tensor,
        ``("V", type, value)`` per hashable non-tensor) satisfy ``predicate`` (e.g. the DeepCache steps', whose cache
        buffer goes: ``runtime.deep_cache``). Returns how many."""
        keys = [key for key in self.graphs if predicate(key[1])]
        for key in keys:
            del self.graphs[key]
            self.born.pop(key, None)
        return len(keys)

    def invalidate(self) -> None:
        """Drop every captured graph (after ``watch.changed()`` saw replaced weights, hooks, adapters...)."""
        self.graphs.clear()
        self.born.clear()


class GraphCache:
    """The graphed modules of one pipeline and their shared memory pool."""

    def __init__(self, max_graphs: int = 8, parallel_compile: bool = True):
        self.parallel_compile = parallel_compile
        self.pool = torch.cuda.graph_pool_handle()
        # One side stream for every warm-up and capture: cuBLAS keeps a workspace per stream it has
        # run on, for the life of the process, so a new stream per capture would grow memory.
        self.stream = torch.cuda.Stream()
        self.max_graphs = max_graphs
        self.runners: dict[str, GraphedForward] = {}
        self._clock = 0
        self._early: frozenset[str] = frozenset()  # runners checked by ``check_early``, left out of the next ``check``

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def install(self, name: str, module: torch.nn.Module, conditionings: tuple[Conditioning, ...] = (),
                output_scale: str | None = None, split: GraphSplit | None = None, pool=None,
                stream=None) -> GraphedForward:
        """Replace ``module.forward`` by a ``GraphedForward`` named ``name`` (see there for ``conditionings``,
        ``output_scale`` and ``split``). For graphs that replay at the same time as the others (on another stream):
        ``pool``, a memory pool of their own (``torch.cuda.graph_pool_handle()``), and ``stream``, a warm-up and
        capture stream of their own (a graph keeps the cuBLAS workspace of the stream it was captured on); default
        the shared ones."""
        runner = GraphedForward(module, pool=self.pool if pool is None else pool, max_graphs=self.max_graphs,
                                name=name, clock=self._tick, stream=self.stream if stream is None else stream,
                                conditionings=conditionings, parallel_compile=self.parallel_compile,
                                output_scale=output_scale, split=split)
        module.forward = runner
        self.runners[name] = runner
        return runner

    def check(self, names=None) -> int:
        """Have every runner (of ``names``, default all) make its full check (``GraphedForward.check_now``: replaced
        weights, LoRA adapter state, hooks) at its next call, not now: a module that a pipeline call does not run
        (the VAE encoder in txt2img, text encoders given embeddings) is not checked, and one that runs late (the
        VAE decoder) is checked while the GPU still works on what was queued before it. A check of all runners
        (``names`` None) leaves out, once, those ``check_early`` just checked. Returns how many were marked."""
        early = frozenset()
        if names is None:
            early, self._early = self._early, frozenset()
        marked = 0
        for name, runner in self.runners.items():
            if (names is None or name in names) and name not in early:
                runner.check_due = True
                marked += 1
        return marked

    def check_early(self, modules) -> int:
        """The full check of the runners of ``modules`` now (e.g. the UNet's while the GPU runs the text encoders,
        instead of at its first step with the GPU idle); the next ``check`` leaves them out. Only for a caller that
        knows no weights can change before that ``check`` (``runtime.session``: inside one pipeline call's setup),
        and that calls ``forget_early`` when that ``check`` may not come. Returns how many were checked."""
        names = frozenset(name for name, r in self.runners.items() if any(r.module is m for m in modules))
        for name in names:
            self.runners[name].check_now()
        self._early = names
        return len(names)

    def checked_early(self) -> frozenset[str]:
        """The runners ``check_early`` checked that no ``check`` has consumed yet."""
        return self._early

    def forget_early(self) -> None:
        """The next ``check`` leaves no runner out."""
        self._early = frozenset()

    def mark(self) -> int:
        """A point in the capture history, for :meth:`drop_since`."""
        return self._clock

    def drop_since(self, mark: int) -> int:
        """Drop every graph captured after ``mark`` (e.g. those of a call that then ran out of memory:
        their static buffers would otherwise stay allocated for a signature that cannot complete)."""
        dropped = sum(runner.drop_since(mark) for runner in self.runners.values())
        if dropped:
            log.info("sdfast: dropped %d CUDA graph(s) captured by a failed call", dropped)
        return dropped

    def uninstall(self) -> int:
        for runner in self.runners.values():
            for conditioning in runner.conditionings:
                conditioning.uninstall()
            if runner.module.__dict__.get("forward") is runner:
                if runner.rebound:
                    runner.module.forward = runner.eager
                else:
                    del runner.module.forward
        n = len(self.runners)
        self.runners.clear()
        return n

    def stats(self) -> dict:
        return {name: vars(r.stats) | {"graphs": len(r.graphs)} for name, r in self.runners.items()}
