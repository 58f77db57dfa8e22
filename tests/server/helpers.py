"""Shared pieces of the service tests: fake engines, a free port, an in-process uvicorn server."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import weakref

import httpx
import torch
from PIL import Image


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed_color(seed: int, prompt: str) -> tuple[int, int, int]:
    """The colour FakeEngine paints for (seed, prompt): lets a test check which image went where."""
    return (seed % 251, (seed // 251) % 251, len(prompt) % 251)


class FakeEngine:
    """Stands in for ``sdfast.Engine``: records each call (``run``'s request as the dict of its fields in ``calls``,
    and itself in ``requests``), paints one flat image per seed.

    ``gate``: each call blocks until it is set (``started`` is set when a call begins).
    ``failures``: exceptions to raise, one per call, in order (None: succeed).
    ``hold``: on a failing call, a tensor is allocated first and a weak reference kept in ``held``,
    so a test can check that nothing keeps the failed call's memory alive.
    ``oom_prompts``: a call whose prompts include one of these raises ``torch.OutOfMemoryError``.
    ``step_s``: each call runs ``num_inference_steps`` steps of this many seconds, calling ``should_stop``
    after each as ``Engine.txt2img`` does (``steps_run`` records how many each call ran).
    """

    name = "fake"
    device = torch.device("cpu")
    dtype = torch.float32
    default_size = 64

    def __init__(self, *, gate: threading.Event | None = None, failures=(), hold: bool = False, oom_prompts=(),
                 step_s: float = 0.0):
        self.oom_prompts = set(oom_prompts)
        self.step_s = step_s
        self.steps_run: list[int] = []
        self.gate = gate
        self.failures = list(failures)
        self.hold = hold
        self.held: list[weakref.ref] = []
        self.calls: list[dict] = []
        self.requests: list = []  # the built requests, as run received them
        self.started = threading.Event()

    def txt2img(self, prompt, *, should_stop=None, **kwargs):
        from sdfast.request import Txt2ImgRequest

        return self.run(Txt2ImgRequest.build(prompt, **kwargs), should_stop=should_stop)

    def run(self, request, *, should_stop=None, progress=False):
        """``Engine.run``: the worker hands it the batch's built request."""
        prompts = list(request.prompts)
        negative_prompt = None if request.negative_prompts is None else list(request.negative_prompts)
        seed, width, height = list(request.seeds), request.width, request.height
        num_inference_steps = request.num_inference_steps
        self.requests.append(request)
        self.calls.append(dict(prompts=prompts, negative_prompt=negative_prompt, seeds=seed,
                               steps=num_inference_steps, guidance_scale=request.guidance_scale, width=width,
                               height=height, num_images_per_prompt=request.num_images_per_prompt,
                               scheduler=request.scheduler))
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(30), "test gate never opened"
        failure = self.failures.pop(0) if self.failures else None
        if failure is not None:
            if self.hold:
                held = torch.ones(1 << 16)
                self.held.append(weakref.ref(held))
            raise failure
        if self.oom_prompts & set(prompts):
            raise torch.OutOfMemoryError(f"CUDA out of memory ({len(prompts)} images)")
        if self.step_s:
            from sdfast.errors import GenerationCancelled

            for step in range(1, num_inference_steps + 1):
                time.sleep(self.step_s)
                if should_stop is not None and should_stop():
                    self.steps_run.append(step)
                    raise GenerationCancelled(step, num_inference_steps)
            self.steps_run.append(num_inference_steps)
        images = []
        for p, s in zip(prompts, seed):
            img = Image.new("RGB", (width, height), seed_color(s, p))
            img.info["seed"] = str(s)
            images.append(img)
        return images


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@contextlib.contextmanager
def serving(app, guard=None):
    """Run ``app`` with uvicorn on 127.0.0.1:<free port> in a thread; yields the base URL. With ``guard`` (a
    ``server.connections.ConnectionGuard``), the server ``serve`` runs (``server.app.uvicorn_server``)."""
    import uvicorn

    port = free_port()
    if guard is not None:
        from server.app import uvicorn_server

        server = uvicorn_server(app, host="127.0.0.1", port=port, guard=guard, log_level="warning")
    else:
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=20, what="uvicorn to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def metric_value(text: str, name: str, **labels) -> float:
    """The value of sample ``name`` with exactly these labels in Prometheus text (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def health(client: httpx.Client) -> dict:
    return client.get("/health").json()
