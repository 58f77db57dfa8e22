"""Continuous batching in the service: the worker thread schedules denoising steps, not whole requests.

``ContinuousWorker`` is ``server.worker.Worker`` (the same queue, submit, cancel, stop, deadlines and errors) whose
thread runs txt2img requests through ``sdfast.runtime.step_batch``: requests of one ``StepKey`` (image size and
77-token text windows) form a group, a ``StepBatch`` advanced one denoising step (one UNet call) at a time. At each
step boundary:

1. every in-flight request whose client left or whose deadline passed leaves its group (its place is free at once;
   it is answered ``Cancelled`` / ``DeadlineExceeded``, "stopped after step i of n"); queued jobs past their deadline
   are answered and dropped;
2. the worker picks the work of the oldest job (in flight or queued): **oldest first between groups**. The group
   holding the oldest job takes the next step; the groups whose jobs are all younger wait. Every job's age only
   grows, and only the finitely many older jobs go before it, so no group starves. Jobs the step path does not take
   (img2img, inpainting, ControlNet, an engine that is not an ``sdfast.Engine``: ``step_batch.supports``) form one
   more "group": when its oldest job is the oldest, the worker runs it as ``Worker`` does (one engine call with the
   later compatible jobs), between two steps of the others;
3. the picked group admits its queued jobs in queue order while its images in flight stay within ``max_batch``
   (stopping at the first that does not fit, so a large request is not overtaken forever by small ones); their texts
   are encoded in one batch (``StepBatch.join``);
4. one step of the group; requests that ran their last step are decoded in one VAE call and answered.

So a request waits for the current step, not the current batch: a short request sent while a long one runs joins it
and finishes first. Requests with different step counts, guidance scales (CFG on and off), negative prompts, seeds
and schedulers share the UNet call; each gets the image it gets alone (``step_batch``: up to batched-kernel rounding).

Out of memory (``torch.OutOfMemoryError``, host allocation failures too): the failed call's frames are cleared, the
CUDA cache emptied, and its requests retried in two halves, down to single requests, before any one of them gets 503
(``GPUOutOfMemory``); a UNet step that needed halving keeps stepping in groups of at most the size that worked, until
the group is empty. The same for joining (text encoding) and decoding. Another failure of a call fails its requests
(500); one request's own scheduler failure fails that request only. The thread never dies from a request.

Metrics (``on_step``, ``on_request``, ``on_batch``): images per UNet step (occupancy), and per request its queue wait,
time to first step and latency (``server.worker.JobReport``); ``on_batch`` is called once per group run (from its
first request joining to its last leaving: images delivered, seconds, "ok" when it delivered any).

Method: iteration-level scheduling of Orca (Yu et al., OSDI 2022) and vLLM's continuous batching (Kwon et al., SOSP
2023), at the granularity of a diffusion model's denoising steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Callable

from sdfast.errors import GenerationCancelled

from .worker import (
    DeadlineExceeded,
    GenerationFailed,
    GPUOutOfMemory,
    InvalidRequest,
    Job,
    JobReport,
    JobResult,
    ServiceError,
    Worker,
    _clear_exception_chain,
    _is_oom,
    free_gpu_memory,
)

log = logging.getLogger("sdfast.server")

STATIC = "static"  # Job.route of a job that runs through Engine.run (None: not decided yet)


@dataclasses.dataclass(eq=False)
class _Group:
    """The in-flight requests of one ``StepKey``: their ``StepBatch`` and the job of each slot."""

    key: object
    batch: object
    jobs: dict = dataclasses.field(default_factory=dict)  # Slot -> Job
    started: float = dataclasses.field(default_factory=time.monotonic)
    chunk: int | None = None  # after an OOM: at most this many slots per UNet call, until the group is empty
    delivered: int = 0
    last_failure: str = "cancelled"
    closed: bool = False

    def oldest(self) -> float:
        return min(job.enqueued_at for job in self.jobs.values())


class ContinuousWorker(Worker):
    """``Worker`` with step-level (continuous) batching; see the module docstring.

    ``max_batch``: images in flight per group (and so per UNet call: rows are twice that with CFG) and per request.
    ``buckets``: ``StepBatch``'s (default "auto": pad the UNet batch to ``step_batch.BUCKETS`` rows when the UNet
    runs in CUDA graphs). ``on_step(images, seconds, outcome)``: after each UNet step call, ``outcome`` "ok", "oom"
    or "error". The other arguments: ``Worker``'s.
    """

    mode = "continuous"

    def __init__(self, engine, *, max_batch: int = 4, queue_size: int = 64,
                 on_batch: Callable[[int, float, str], None] | None = None,
                 on_step: Callable[[int, float, str], None] | None = None,
                 on_request: Callable[[JobReport], None] | None = None,
                 buckets="auto"):
        super().__init__(engine, max_batch=max_batch, queue_size=queue_size, on_batch=on_batch,
                         on_request=on_request)
        self.on_step = on_step
        self.buckets = buckets
        self._groups: dict = {}  # StepKey -> _Group, in flight
        self._deferred: list | None = None  # answers held back until a group's run is reported (``_answers_after``)
        self.steps_run = 0

    # -- state ---------------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self._running) or any(g.jobs for g in list(self._groups.values()))

    @property
    def in_flight(self) -> int:
        """Images of the requests being stepped."""
        return sum(g.batch.images for g in list(self._groups.values()))

    # -- the thread ----------------------------------------------------------------------------------------------
    def _route(self, job: Job):
        """The ``StepKey`` of a job the step path takes, else ``STATIC``. On the worker thread (may tokenize)."""
        from sdfast.runtime import step_batch

        try:
            if step_batch.supports(self.engine, job.request):
                return step_batch.group_key(self.engine, job.request)
        except Exception:  # noqa: BLE001 - Engine.run answers it as it would (a 422, a 500)
            log.exception("worker: could not group a request for step batching; it runs on its own")
        return STATIC

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._groups and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._groups:
                    return
                unrouted = [job for job in self._queue if job.route is None]
            for job in unrouted:
                job.route = self._route(job)
            static, key, joiners = [], None, []
            try:
                with self._cond:
                    self._expire_queued()
                    static, key, joiners = self._pick()
                    self._running = static
                if static:
                    self._run_batch(static)
                self._boundary()
                if key is not None:
                    self._advance(key, joiners)
            except BaseException:  # never let the thread die
                log.exception("worker: unexpected error around a step")
                failed = GenerationFailed("internal error in the worker (logged)")
                for job in static + joiners:
                    self._settle(job, error=failed)
                for group in list(self._groups.values()):  # its state is unknown now: its requests fail
                    for job in group.jobs.values():
                        self._settle(job, error=failed)
                    self._close(group)
            finally:
                self._running = []

    def _expire_queued(self) -> None:
        """Under the lock: answer and drop the queued jobs that were cancelled or are past their deadline."""
        now = time.monotonic()
        for job in [j for j in self._queue if j.future.cancelled() or now > j.deadline]:
            self._queue.remove(job)
            if job.future.set_running_or_notify_cancel():
                self._settle(job, error=DeadlineExceeded(
                    f"waited {now - job.enqueued_at:.1f} s in the queue, past the {job.timeout_s:g} s deadline"))

    def _pick(self):
        """Under the lock: (static batch, None, []) or ([], group key, joiners) for the oldest job's work (see the
        module docstring), or ([], None, []) when nothing can run yet (jobs not routed: the next round)."""
        ages: dict = {}  # work -> the enqueue time of its oldest job
        for key, group in self._groups.items():
            if group.jobs:
                ages[key] = group.oldest()
        for job in self._queue:
            if job.route is not None and job.route not in ages:
                ages[job.route] = job.enqueued_at
            elif job.route is not None:
                ages[job.route] = min(ages[job.route], job.enqueued_at)
        if not ages:
            return [], None, []
        work = min(ages, key=ages.get)
        if work == STATIC:
            return self._take_batch(lambda job: job.route == STATIC), None, []
        group = self._groups.get(work)
        flying = group.batch.images if group is not None else 0
        room = self.max_batch - flying
        joiners, left, now = [], [], time.monotonic()
        blocked = False
        for job in self._queue:
            if job.route != work or blocked:
                left.append(job)
                continue
            if job.n > room and (flying or joiners):  # (one larger than max_batch runs alone: it never fits)
                blocked = True  # queue order within the group: no later job overtakes this one
                left.append(job)
                continue
            if not job.future.set_running_or_notify_cancel():
                continue
            job.started_at = now
            joiners.append(job)
            room -= job.n
        self._queue.clear()
        self._queue.extend(left)
        return [], work, joiners

    def _settle(self, job: Job, result: JobResult | None = None, error: ServiceError | None = None) -> None:
        if self._deferred is not None and threading.current_thread() is self._thread:
            self._deferred.append((job, result, error))
            return
        super()._settle(job, result, error)

    @contextlib.contextmanager
    def _answers_after(self, group: _Group):
        """Inside, answers are held back; on the way out ``group`` is closed if it is empty (its run reported) and
        then they are set, so that a client that has its answer finds everything about it counted."""
        self._deferred = []
        try:
            yield
        finally:
            deferred, self._deferred = self._deferred, None
            if not group.jobs:
                self._close(group)
            for job, result, error in deferred:
                super()._settle(job, result, error)

    def _boundary(self) -> None:
        """At a step boundary: the in-flight requests whose client left or whose deadline passed leave their group."""
        now = time.monotonic()
        for group in list(self._groups.values()):
            with self._answers_after(group):
                for slot, job in list(group.jobs.items()):
                    if job.future.done() or self._is_dead(job, now):
                        self._leave(group, slot)
                        self._settle(job, error=self._dead_error(job, GenerationCancelled(slot.step, slot.steps)))
                        group.last_failure = "cancelled"

    def _group(self, key) -> _Group:
        group = self._groups.get(key)
        if group is None:
            from sdfast.runtime.step_batch import StepBatch

            group = _Group(key, StepBatch(self.engine, key, buckets=self.buckets))
            with self._cond:
                self._groups[key] = group
        return group

    def _leave(self, group: _Group, slot) -> None:
        group.batch.leave(slot)
        group.jobs.pop(slot, None)

    def _drop(self, group: _Group, slots: list, error_of, failure: str) -> None:
        """Take ``slots`` out of the batch and answer each one's job with ``error_of(job)``; ``failure`` ("oom",
        "error") is the group's last failure."""
        for slot in slots:
            job = group.jobs.get(slot)
            self._leave(group, slot)
            if job is not None:
                self._settle(job, error=error_of(job))
        group.last_failure = failure

    def _close(self, group: _Group) -> None:
        """The group is empty (or failed as a whole): forget it and report its run (``on_batch``), once."""
        if group.closed:
            return
        group.closed = True
        for slot in list(group.jobs):
            self._leave(group, slot)
        with self._cond:
            if self._groups.get(group.key) is group:
                del self._groups[group.key]
        self.batches_run += 1
        if self.on_batch is not None:
            try:
                self.on_batch(group.delivered, time.monotonic() - group.started,
                              "ok" if group.delivered else group.last_failure)
            except Exception:  # noqa: BLE001 - metrics must not break serving
                log.exception("worker: on_batch callback failed")

    def _advance(self, key, joiners: list[Job]) -> None:
        """Admit ``joiners`` to the group of ``key``, run one step of it, answer the requests that finished."""
        if key not in self._groups and not joiners:  # its one queued job left meanwhile
            return
        group = self._group(key)
        with self._answers_after(group):
            if joiners:
                self._join(group, joiners)
            slots = list(group.jobs)
            size = group.chunk or len(slots)
            finished = []
            for i in range(0, len(slots), size):
                finished += self._step(group, slots[i:i + size])
            if finished:
                self._finish(group, finished)

    # -- the calls, each retried in halves after running out of memory ---------------------------------------------
    def _oom_error(self, group: _Group, job: Job) -> GPUOutOfMemory:
        """The 503 of a request that ran out of memory in a call of its own (after the halvings)."""
        return GPUOutOfMemory(
            f"out of GPU memory generating {job.n} image(s) of {group.key.width}x{group.key.height} (this request "
            "ran alone); the memory was freed, retry, or ask for fewer or smaller images")

    def _failure(self, e: BaseException) -> ServiceError:
        """The answer to a request that ``e`` failed: 422 naming the field for an ``InvalidRequestError``, else 500."""
        if isinstance(e, ValueError) and getattr(e, "field", None):
            return InvalidRequest(str(e), field=e.field)
        return GenerationFailed(f"image generation failed ({type(e).__name__}: {e})")

    def _join(self, group: _Group, jobs: list[Job]) -> None:
        oom = False
        try:
            results = group.batch.join([job.request for job in jobs], tags=jobs)
        except Exception as e:  # noqa: BLE001 - each failure becomes an answer
            oom = _is_oom(e)
            if not oom:
                log.exception("worker: encoding %d request(s) failed", len(jobs))
                error = self._failure(e)
                for job in jobs:
                    self._settle(job, error=type(error)(error.message, field=error.field))
            _clear_exception_chain(e)
            results = None
        if oom:
            free_gpu_memory()
            if len(jobs) == 1:
                self._settle(jobs[0], error=self._oom_error(group, jobs[0]))
                group.last_failure = "oom"
                return
            log.warning("worker: out of memory encoding %d requests; retrying them in two halves", len(jobs))
            half = (len(jobs) + 1) // 2
            self._join(group, jobs[:half])
            self._join(group, jobs[half:])
            return
        if results is None:
            group.last_failure = "error"
            return
        for job, result in zip(jobs, results):
            if isinstance(result, BaseException):
                self._settle(job, error=self._failure(result))
                group.last_failure = "error"
            else:
                group.jobs[result] = job

    def _step(self, group: _Group, slots: list) -> list:
        """One UNet step of ``slots``; returns those that ran their last step."""
        images = sum(s.images for s in slots)
        started = time.monotonic()
        outcome, result = "ok", None
        try:
            result = group.batch.step(slots)
        except Exception as e:  # noqa: BLE001 - each failure becomes an answer
            outcome = "oom" if _is_oom(e) else "error"
            if outcome == "error":
                log.exception("worker: a step of %d request(s) failed", len(slots))
                error = self._failure(e)
            _clear_exception_chain(e)
        self._observe_step(images, time.monotonic() - started, outcome)
        if outcome == "oom":
            free_gpu_memory()
            if len(slots) == 1:
                self._drop(group, slots, lambda job: self._oom_error(group, job), "oom")
                return []
            half = (len(slots) + 1) // 2
            group.chunk = min(group.chunk or half, half)
            log.warning("worker: out of memory stepping %d requests; retrying them in groups of %d", len(slots), half)
            return self._step(group, slots[:half]) + self._step(group, slots[half:])
        if outcome == "error":
            self._drop(group, slots, lambda job: type(error)(error.message, field=error.field), "error")
            return []
        now = time.monotonic()
        for slot in slots:
            job = group.jobs.get(slot)
            if job is not None:
                job.step_images += images
                job.steps_run += 1
                if job.first_step_at is None:
                    job.first_step_at = now
        for slot, e in result.failed:
            job = group.jobs.pop(slot, None)
            if job is not None:
                log.error("worker: the scheduler step of a request failed (%s: %s)", type(e).__name__, e)
                self._settle(job, error=self._failure(e))
            group.last_failure = "error"
        return result.finished

    def _finish(self, group: _Group, slots: list) -> None:
        """Decode ``slots`` in one VAE call (halves after running out of memory) and answer their jobs."""
        oom = False
        try:
            outputs = group.batch.decode(slots)
        except Exception as e:  # noqa: BLE001 - each failure becomes an answer
            oom = _is_oom(e)
            if not oom:
                log.exception("worker: decoding %d request(s) failed", len(slots))
                error = self._failure(e)
                self._drop(group, slots, lambda job: type(error)(error.message, field=error.field), "error")
            _clear_exception_chain(e)
            outputs = None
        if oom:
            free_gpu_memory()
            if len(slots) == 1:
                self._drop(group, slots, lambda job: self._oom_error(group, job), "oom")
                return
            half = (len(slots) + 1) // 2
            self._finish(group, slots[:half])
            self._finish(group, slots[half:])
            return
        if outputs is None:
            return
        now = time.monotonic()
        for slot, out in zip(slots, outputs):
            job = group.jobs.get(slot)
            self._leave(group, slot)
            if job is None:
                continue
            if isinstance(out, BaseException):
                self._settle(job, error=self._failure(out))
                group.last_failure = "error"
                continue
            started = job.started_at if job.started_at is not None else job.enqueued_at
            occupancy = round(job.step_images / job.steps_run) if job.steps_run else job.n
            self._settle(job, JobResult(images=out, queue_s=started - job.enqueued_at, generate_s=now - started,
                                        batch_images=occupancy))
            group.delivered += job.n

    def _observe_step(self, images: int, seconds: float, outcome: str) -> None:
        self.steps_run += 1
        if self.on_step is not None:
            try:
                self.on_step(images, seconds, outcome)
            except Exception:  # noqa: BLE001 - metrics must not break serving
                log.exception("worker: on_step callback failed")


def make_worker(engine, *, batching: str = "continuous", **kwargs) -> Worker:
    """The service's worker for ``batching``: "continuous" (``ContinuousWorker``) or "static" (``Worker``; the
    continuous-only arguments ``on_step`` and ``buckets`` are dropped). Raises ``ValueError`` for another value."""
    if batching == "continuous":
        return ContinuousWorker(engine, **kwargs)
    if batching == "static":
        kwargs.pop("on_step", None)
        kwargs.pop("buckets", None)
        return Worker(engine, **kwargs)
    raise ValueError(f"batching must be 'continuous' or 'static' (got {batching!r})")


BATCHING_MODES = ("continuous", "static")
