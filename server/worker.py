"""The one thread that owns the engine (and so the GPU), its bounded queue, and request batching (static batching:
``server.continuous.ContinuousWorker`` builds step-level batching on this class).

HTTP handlers run on the event loop; they never touch the engine. They ``submit`` a ``Job`` and
wait on its ``future``. The worker thread takes the oldest live job, adds every later queued job
with the same ``BatchKey`` while the batch stays within ``max_batch`` images, and runs them as one
``engine.run`` call: the jobs' built requests concatenated (``Txt2ImgRequest.concat``: a list of prompts, one
seed per image, the token ids the service computed; img2img and inpainting requests with the same strength by
``Img2ImgRequest.concat``, which also lists one init image and mask per image). The engine draws image
``i``'s noise (and its VAE latent sample) from its own seeded CPU generator, so each job's images are the ones it
would get alone (up to batch-size-dependent float rounding: at most 1/255 on the CPU). Requests of different
tasks never share a call, and a request with control images (ControlNet) shares none: the engine's requests do not
concatenate ControlNet inputs, so it runs alone, as built, between the batches of the jobs around it.

Failure isolation: after ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``) the worker drops every
reference to what the failed call held (the exception and its traceback are not kept), returns cached blocks
to the driver (``torch.cuda.empty_cache()``) and, if the batch held several jobs, runs each half again (down
to single jobs), so only a job that runs out of memory alone gets ``GPUOutOfMemory`` (503). Any other
exception fails that batch with ``GenerationFailed`` (500). The thread itself never dies from a batch.

A job leaves the queue when the worker takes it, when its handler cancels it (client gone,
deadline passed: ``Worker.cancel``), or when the worker finds it past its deadline. A running batch
stops at the next denoising step (``Engine.run(should_stop=...)``) once every job in it was
cancelled or is past its deadline: the queue does not wait for images nobody will receive.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from sdfast.errors import GenerationCancelled
from sdfast.request import Txt2ImgRequest

log = logging.getLogger("sdfast.server")


class ServiceError(Exception):
    """An error that becomes an HTTP answer: ``status``, ``message`` and (optionally) the ``field``."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidRequest(ServiceError):
    status, type = 422, "invalid_request_error"


class QueueFull(ServiceError):
    status, type = 429, "queue_full"


class GenerationFailed(ServiceError):
    status, type = 500, "generation_failed"


class GPUOutOfMemory(ServiceError):
    status, type = 503, "gpu_out_of_memory"


class ShuttingDown(ServiceError):
    status, type = 503, "shutting_down"


class DeadlineExceeded(ServiceError):
    status, type = 504, "deadline_exceeded"


class Cancelled(ServiceError):
    """The job's handler gave up on it (client gone, deadline passed) while it waited or ran."""

    status, type = 504, "cancelled"


@dataclass(frozen=True)
class BatchKey:
    """Jobs with equal keys can share one engine call.

    ``has_negative``: a batch passes either ``negative_prompt=None`` to every image or a list of
    strings; both cannot mix (SDXL encodes "no negative prompt" as zeros, not as the empty string).
    ``text_windows``: 77-token CLIP windows of the prompt and of the negative prompt. The engine pads
    every prompt of a call to the longest one's windows, which would change a shorter prompt's
    image, so only equal counts share a call.
    ``task``: the request's (``"txt2img"``, ``"img2img"``, ``"inpaint"``: each runs its own pipeline);
    ``strength``: img2img's and inpainting's (it sets the timesteps that run), None for txt2img.
    ``deep_cache``: DeepCache's (``cache_interval``, ``cache_branch``): one schedule per engine call.
    """

    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    scheduler: str | None
    has_negative: bool
    text_windows: tuple[int, int] = (1, 1)
    task: str = "txt2img"
    strength: float | None = None
    deep_cache: tuple[int, int] = (1, 0)


@dataclass
class JobResult:
    """``images``: PIL images, one per seed; seconds waited (``queue_s``) and spent in the engine call
    (``generate_s``, shared by the batch); ``batch_images``: images in that call."""

    images: list
    queue_s: float
    generate_s: float
    batch_images: int


@dataclass(eq=False)
class Job:
    """One HTTP request: its built ``sdfast.request.Txt2ImgRequest`` (or ``Img2ImgRequest`` / ``InpaintRequest``; one
    prompt per image, each image's seed, the size resolved, the texts tokenized when the engine has tokenizers),
    handed to the engine as it is (concatenated with the other requests of its batch: its class's ``concat``).

    ``text_windows``: 77-token windows of the prompt and of the negative prompt (``PromptTokens.windows``).
    """

    request: Txt2ImgRequest
    timeout_s: float
    text_windows: tuple[int, int] = (1, 1)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    enqueued_at: float = field(default_factory=time.monotonic)
    abandoned: bool = False  # set by ``Worker.cancel``: nobody waits for the images any more
    # Set by the worker thread: when it took the job (out of the queue), when its first denoising step ended, and
    # (step-level batching) the images in each step it shared, summed, and the steps it ran.
    started_at: float | None = None
    first_step_at: float | None = None
    step_images: int = 0
    steps_run: int = 0
    route: object = field(default=None, repr=False)  # ``server.continuous``: how the job runs, once decided

    @property
    def prompt(self) -> str:
        return self.request.prompts[0]

    @property
    def negative_prompt(self) -> str | None:
        negatives = self.request.negative_prompts
        return None if negatives is None else negatives[0]

    @property
    def seeds(self) -> list[int]:
        return list(self.request.seeds)

    @property
    def width(self) -> int:
        return self.request.width

    @property
    def height(self) -> int:
        return self.request.height

    @property
    def num_inference_steps(self) -> int:
        return self.request.num_inference_steps

    @property
    def guidance_scale(self) -> float:
        return self.request.guidance_scale

    @property
    def scheduler(self) -> str | None:
        return self.request.scheduler

    @property
    def n(self) -> int:
        return self.request.num_images

    @property
    def deadline(self) -> float:
        return self.enqueued_at + self.timeout_s

    @property
    def batchable(self) -> bool:
        """Whether the job may share an engine call: not with control images (``Txt2ImgRequest.concat`` refuses
        ControlNet inputs), so such a job always runs alone."""
        return self.request.control is None

    @property
    def key(self) -> BatchKey:
        strength = getattr(self.request, "strength", None)
        return BatchKey(self.width, self.height, self.num_inference_steps, float(self.guidance_scale),
                        self.scheduler, self.negative_prompt is not None, tuple(self.text_windows),
                        self.request.task, None if strength is None else float(strength),
                        (self.request.cache_interval, self.request.cache_branch))


@dataclass(frozen=True)
class JobReport:
    """What the worker reports of one answered job (``Worker.on_request``): ``outcome`` "ok" or the error's ``type``
    (e.g. "gpu_out_of_memory", "deadline_exceeded", "cancelled"); ``images`` generated for it (0 on an error); seconds
    from queueing to the worker taking it (``queue_s``; None if it never was), to the end of its first denoising step
    (``first_step_s``; None if it ran none, or the engine does not report steps) and to its answer (``total_s``)."""

    outcome: str
    images: int
    queue_s: float | None
    first_step_s: float | None
    total_s: float


def _is_oom(exc: BaseException) -> bool:
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return oom is not None and isinstance(exc, oom)


def _clear_exception_chain(exc: BaseException) -> None:
    """Clear the locals of every frame in the tracebacks of ``exc`` and of the exceptions it chains
    (``__cause__``, ``__context__``: an OOM raised while handling an earlier OOM keeps the first
    one's frames, and their tensors, alive otherwise)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


def free_gpu_memory() -> None:
    """Collect garbage and hand the CUDA caching allocator's free blocks back (no-op without CUDA)."""
    gc.collect()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class Worker:
    """Owns ``engine``; runs queued jobs in batches of at most ``max_batch`` images (static batching: a batch runs to
    completion as one engine call; ``server.continuous.ContinuousWorker`` batches at denoising steps instead).

    ``queue_size``: jobs that may wait (the running batch not counted); ``submit`` raises
    ``QueueFull`` beyond it. ``on_batch(images, seconds, outcome)`` is called after each engine call,
    ``outcome`` one of ``"ok"``, ``"oom"``, ``"error"``, ``"cancelled"`` (used for metrics).
    ``on_request(report)`` is called once per job with its ``JobReport``, just before its answer is set (so a client
    that has its answer finds it counted).
    """

    mode = "static"

    def __init__(self, engine, *, max_batch: int = 4, queue_size: int = 64,
                 on_batch: Callable[[int, float, str], None] | None = None,
                 on_request: Callable[[JobReport], None] | None = None):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1 (got {max_batch!r})")
        if not isinstance(queue_size, int) or queue_size < 1:
            raise ValueError(f"queue_size must be an integer >= 1 (got {queue_size!r})")
        self.engine = engine
        self.max_batch = max_batch
        self.queue_size = queue_size
        self.on_batch = on_batch
        self.on_request = on_request
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._running: list[Job] = []
        self._thread: threading.Thread | None = None
        self.batches_run = 0

    # -- state -------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the batch being generated)."""
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return bool(self._running)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            if self.alive:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="sdfast-worker", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Finish the running batch, fail the waiting jobs with ``ShuttingDown``, join the thread."""
        with self._cond:
            self._stopping = True
            waiting, self._queue = list(self._queue), deque()
            self._cond.notify_all()
        for job in waiting:
            if job.future.set_running_or_notify_cancel():
                self._settle(job, error=ShuttingDown("the service is shutting down"))
        if self._thread is not None:
            self._thread.join(timeout)

    # -- called from the event loop ------------------------------------------------------------
    def submit(self, job: Job) -> concurrent.futures.Future:
        """Queue ``job`` (starting the thread on first use); raises ``QueueFull`` at once when full,
        ``ShuttingDown`` after ``stop``."""
        if self._thread is None:
            self.start()
        with self._cond:
            if self._stopping:
                raise ShuttingDown("the service is shutting down")
            if len(self._queue) >= self.queue_size:
                raise QueueFull(f"the queue is full ({self.queue_size} requests waiting); retry later")
            self._queue.append(job)
            self._cond.notify()
        return job.future

    def cancel(self, job: Job) -> bool:
        """Take ``job`` out of the queue (its place is released at once). True if it had not started.
        A running job is marked abandoned: its batch stops at the next denoising step once every job in
        it is abandoned or past its deadline."""
        job.abandoned = True
        with self._cond:
            try:
                self._queue.remove(job)
            except ValueError:
                pass
        return job.future.cancel()

    # -- the thread -----------------------------------------------------------------------------
    def _take_batch(self, eligible: Callable[[Job], bool] | None = None) -> list[Job]:
        """Under the lock: the oldest live job plus later compatible ones, within ``max_batch`` images (of the jobs
        ``eligible`` takes, default all; the others stay queued, in order)."""
        now = time.monotonic()
        batch: list[Job] = []
        total = 0
        left: deque[Job] = deque()
        for job in self._queue:
            if (eligible is not None and not eligible(job)) or batch and (
                    not batch[0].batchable or not job.batchable or job.key != batch[0].key
                    or total + job.n > self.max_batch):
                left.append(job)
                continue
            if not job.future.set_running_or_notify_cancel():
                continue  # cancelled: the client left
            if now > job.deadline:
                self._settle(job, error=DeadlineExceeded(
                    f"waited {now - job.enqueued_at:.1f} s in the queue, past the {job.timeout_s:g} s deadline"))
                continue
            job.started_at = now
            batch.append(job)
            total += job.n
        self._queue = left
        return batch

    def _settle(self, job: Job, result: JobResult | None = None, error: ServiceError | None = None) -> None:
        """Report ``job`` (``on_request``), then set its answer: its images or ``error``."""
        if job.future.done():
            return
        if self.on_request is not None:
            queue_s = None if job.started_at is None else job.started_at - job.enqueued_at
            first = None if job.first_step_at is None else job.first_step_at - job.enqueued_at
            try:
                self.on_request(JobReport("ok" if error is None else error.type, 0 if error is not None else job.n,
                                          queue_s, first, time.monotonic() - job.enqueued_at))
            except Exception:  # noqa: BLE001 - metrics must not break serving
                log.exception("worker: on_request callback failed")
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                batch = self._take_batch()
                self._running = batch
            try:
                if batch:
                    self._run_batch(batch)
            except BaseException:  # never let the thread die
                log.exception("worker: unexpected error around a batch")
                for job in batch:
                    self._settle(job, error=GenerationFailed("internal error in the worker (logged)"))
            finally:
                self._running = []

    def _run_batch(self, batch: list[Job]) -> None:
        """One engine call for ``batch``. Out of memory with several jobs in it: each half runs again (down to
        single jobs) before any job gets 503, so a request too large for the memory fails alone."""
        batch = [job for job in batch if not self._drop_if_dead(job)]
        if not batch:
            return
        outcome, error, images, started, seconds = self._call(batch)
        if outcome == "oom" and len(batch) > 1:
            log.warning("worker: retrying the %d requests of that batch in two halves", len(batch))
            half = (len(batch) + 1) // 2
            self._run_batch(batch[:half])
            self._run_batch(batch[half:])
            return
        n = sum(job.n for job in batch)
        i = 0
        for job in batch:
            if job.future.done():
                continue
            if isinstance(error, GenerationCancelled):
                self._settle(job, error=self._dead_error(job, error))
            elif error is not None:
                self._settle(job, error=type(error)(error.message, field=error.field))
            else:
                self._settle(job, JobResult(
                    images=images[i:i + job.n], queue_s=started - job.enqueued_at, generate_s=seconds,
                    batch_images=n,
                ))
            i += job.n

    @staticmethod
    def _is_dead(job: Job, now: float) -> bool:
        """Nobody will read this job's images: its handler left (``cancel``) or its deadline passed."""
        return job.abandoned or now > job.deadline

    @staticmethod
    def _dead_error(job: Job, cancelled=None) -> ServiceError:
        where = f"stopped after step {cancelled.step} of {cancelled.steps}" if cancelled is not None else "not run"
        if time.monotonic() > job.deadline:  # also when its handler gave up at the deadline: counted as a deadline
            return DeadlineExceeded(f"no image within the {job.timeout_s:g} s deadline; {where}")
        return Cancelled(f"the request was cancelled (its client left); {where}")

    def _drop_if_dead(self, job: Job) -> bool:
        if job.future.done():
            return True
        if self._is_dead(job, time.monotonic()):
            self._settle(job, error=self._dead_error(job))
            return True
        return False

    def _call(self, batch: list[Job]):
        """The engine call of ``batch``: (outcome, error or None, images, start time, seconds). It stops at the
        next denoising step once every job of the batch is dead (``GenerationCancelled``: outcome "cancelled")."""
        key = batch[0].key
        seeds = [s for job in batch for s in job.seeds]

        def should_stop() -> bool:  # after every denoising step
            now = time.monotonic()
            for job in batch:
                if job.first_step_at is None:
                    job.first_step_at = now
            return all(self._is_dead(job, now) for job in batch)

        started = time.monotonic()
        error: ServiceError | GenerationCancelled | None = None
        outcome = "ok"
        images = None
        try:
            # A job that runs alone with control images is its request as built (concat refuses ControlNet inputs).
            request = batch[0].request if not batch[0].batchable else type(batch[0].request).concat(
                [job.request for job in batch])
            images = self.engine.run(request, should_stop=should_stop)
            if len(images) != len(seeds):
                raise RuntimeError(f"the engine returned {len(images)} images for {len(seeds)} seeds")
        except GenerationCancelled as e:
            outcome = "cancelled"
            error = e
            log.info("worker: %s: every request of its batch is gone", e)
            _clear_exception_chain(e)
            images = None
        except Exception as e:  # noqa: BLE001 - each failure becomes an answer; the thread goes on
            # Answer from the message only, and clear the locals of the failed call's frames: its
            # traceback holds them (and so its tensors) for as long as anyone keeps the exception.
            if _is_oom(e):
                outcome = "oom"
                alone = "alone" if len(batch) == 1 else f"batched with {len(batch) - 1} other(s)"
                error = GPUOutOfMemory(
                    f"out of GPU memory generating {len(seeds)} image(s) of {key.width}x{key.height} "
                    f"(this request ran {alone}); the memory was freed, "
                    "retry, or ask for fewer or smaller images"
                )
                log.warning("worker: CUDA out of memory on a batch of %d images at %dx%d",
                            len(seeds), key.width, key.height)
            elif isinstance(e, ValueError) and getattr(e, "field", None):
                outcome = "error"
                error = InvalidRequest(str(e), field=e.field)
            else:
                outcome = "error"
                log.exception("worker: the engine failed on a batch of %d images", len(seeds))
                error = GenerationFailed(f"image generation failed ({type(e).__name__}: {e})")
            _clear_exception_chain(e)
            images = None
        if outcome == "oom":
            free_gpu_memory()
        seconds = time.monotonic() - started
        self.batches_run += 1
        if self.on_batch is not None:
            try:
                self.on_batch(len(seeds) if error is None else 0, seconds, outcome)
            except Exception:  # noqa: BLE001 - metrics must not break serving
                log.exception("worker: on_batch callback failed")
        return outcome, error, images, started, seconds
