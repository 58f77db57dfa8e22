"""The HTTP image-generation service: a FastAPI app around one ``sdfast.Engine``.

    from server.app import create_app, serve
    app = create_app("random:tiny")            # or an Engine; run with any ASGI server
    serve(model="./stable-diffusion-v1-5")     # what `sdfast serve` calls (uvicorn)

Endpoints (every one but ``/health`` answers 401 without the key when an API key is set):

- ``POST /v1/txt2img``: ``Txt2ImgRequest`` (JSON, or ``multipart/form-data`` for control images as files) ->
  ``image/png`` (one image) or, with ``response_format: "b64_json"``, ``Txt2ImgResponse`` (each image as base64 PNG
  with its seed, and timings);
- ``POST /v1/images/generations``: the OpenAI Images API (``prompt``, ``n``, ``size``, ``output_format``,
  ... see ``ImagesGenerationsRequest``) -> ``{"created", "data": [{"b64_json"}], "output_format", "size"}``;
- ``POST /v1/img2img`` / ``POST /v1/inpaint``: ``Img2ImgRequest`` / ``InpaintRequest`` (``Txt2ImgRequest``'s fields,
  ``image``, ``strength``, inpainting's ``mask_image``: white = repaint), as JSON (images in base64) or
  ``multipart/form-data`` (images as files) -> what ``/v1/txt2img`` answers;
- ``POST /v1/images/edits``: the OpenAI Images API edit (multipart; ``image``, ``mask``: its fully transparent
  pixels are repainted; see ``ImagesEditsRequest``) -> what ``/v1/images/generations`` answers;
- ``GET``/``HEAD /health``: ``{"status"}``; with the key (or when no key is set) also the model, its ControlNets,
  device and GPU, queue depth (503 if the worker thread is gone);
- ``GET /metrics``: Prometheus text format (see ``server.metrics``);
- ``GET``/``HEAD /``: the web page (``server/static/index.html``), with a Content-Security-Policy;
- ``GET /openapi.json``: the API's schema (no ``/docs``: Swagger UI would load its assets from a CDN).

ControlNet (``create_app(..., controlnet=...)``, ``sdfast serve --controlnet MODEL``): every generation endpoint takes
the ControlNet fields (``schemas.CONTROL_FIELDS``: ``control_image``, one per ControlNet, required; the scale and the
guidance window); they are checked against the service's ControlNets before any image is decoded, and a request with
control images runs in an engine call of its own (``server.worker``).

Request bodies are parsed and validated off the event loop, with bounded work (``server.parse``); a body with
images may be ``schemas.MAX_UPLOAD_BYTES`` long, others 1 MiB (413 past that; on a service with ControlNets, the
txt2img and generations bodies may hold control images: ``MAX_UPLOAD_BYTES``).
Errors are JSON in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``:
422 bad input (``param`` names the field; ``detail`` lists at most ``MAX_DETAIL`` errors), 401 no/wrong key,
429 queue full (answered at once), 503 GPU out of memory (the service goes on), 504 deadline passed,
500 the engine (or the service) failed: a generic message with a ``request_id``, whose log line has the details.
A client that disconnects while waiting releases its place in the queue. Batching (``create_app(batching=...)``,
``sdfast serve --batching``): "continuous" (default, ``server.continuous``) steps txt2img requests together, joining
and leaving the running batch at denoising steps, and a request past its deadline or whose client left leaves at the
next step; "static" (``server.worker``) runs compatible queued requests as one engine call, which stops at the next
denoising step once every request of its batch is past its deadline or gone. ``serve`` adds the connection
limits of ``server.connections`` and the ``Host`` check of ``allowed_hosts_for``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import sys
import time
import uuid
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import ClientDisconnect

from sdfast.png import encode_image, encode_png

from .metrics import Metrics, MetricsMiddleware
from .parse import (
    MAX_DETAIL,
    MAX_PLAIN_JSON_BYTES,
    ImageBody,
    image_body,
    openapi_body,
    openapi_image_body,
    prepare_images,
    transparent_mask,
)
from .schemas import (
    CONTROL_VALUE_FIELDS,
    MAX_SEED,
    MAX_UPLOAD_BYTES,
    Health,
    HealthStatus,
    Img2ImgRequest,
    ImageOut,
    ImagesEditsRequest,
    ImagesGenerationsRequest,
    ImagesGenerationsResponse,
    InpaintRequest,
    OpenAIImage,
    OversizedInt,
    Timings,
    Txt2ImgRequest,
    Txt2ImgResponse,
)
from .continuous import BATCHING_MODES, make_worker
from .worker import DeadlineExceeded, InvalidRequest, Job, JobResult, ServiceError

log = logging.getLogger("sdfast.server")

STATIC = Path(__file__).parent / "static"
API_KEY_ENV = "SDFAST_API_KEY"
PUBLIC_PATHS = frozenset({"/health"})
# The body model of each POST endpoint (its 422 for an unknown field lists the model's fields).
BODIES = {"/v1/txt2img": Txt2ImgRequest, "/v1/images/generations": ImagesGenerationsRequest,
          "/v1/img2img": Img2ImgRequest, "/v1/inpaint": InpaintRequest, "/v1/images/edits": ImagesEditsRequest}
UPLOAD_PATHS = ("/v1/img2img", "/v1/inpaint", "/v1/images/edits")  # bodies with images: MAX_UPLOAD_BYTES
CONTROL_PATHS = ("/v1/txt2img", "/v1/images/generations")  # with ControlNets, these bodies hold images too
ENDPOINTS = ("/", *BODIES, "/health", "/metrics")
DEFAULT_BATCHING = "continuous"  # --batching: "continuous" (server.continuous) or "static" (server.worker)
DEFAULT_TIMEOUT_S = 300.0  # seconds a request may wait for its images, queue and generation (--request-timeout)
REQUEST_TIMEOUT_ENV = "SDFAST_REQUEST_TIMEOUT"
CLIENT_CLOSED = 499  # nginx's "client closed request": recorded in metrics, never seen by the client


def _error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_response(status: int, message: str, type_: str, param: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse(_error_body(status, message, type_, param), status_code=status, headers=headers)


# -- API key ---------------------------------------------------------------------------------------


def _presented_keys(headers: dict[bytes, bytes]) -> list[bytes]:
    keys = []
    if b"x-api-key" in headers:
        keys.append(headers[b"x-api-key"].strip())
    auth = headers.get(b"authorization", b"")
    scheme, _, value = auth.partition(b" ")
    if scheme.lower() == b"bearer":
        keys.append(value.strip())
    elif scheme.lower() == b"basic":  # browsers: any user name, the key as password
        with contextlib.suppress(binascii.Error, ValueError):
            keys.append(base64.b64decode(value.strip(), validate=True).partition(b":")[2])
    return keys


def has_key(scope, key: bytes) -> bool:
    """Whether the request of ``scope`` presents ``key`` (compared in constant time)."""
    headers = dict(scope.get("headers") or [])
    return any(hmac.compare_digest(k, key) for k in _presented_keys(headers))


class APIKeyMiddleware:
    """Pure ASGI middleware: 401 on every path but ``PUBLIC_PATHS`` unless the request carries the key
    as ``Authorization: Bearer KEY``, ``X-API-Key: KEY`` or HTTP Basic with the key as password (so a
    browser can open the page: it asks for a password once and sends it with the page's requests)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        if has_key(scope, self.key):
            return await self.app(scope, receive, send)
        challenge = 'Basic realm="sdfast", charset="UTF-8"' if scope.get("path") == "/" else 'Bearer realm="sdfast"'
        response = error_response(
            401, "missing or wrong API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'",
            "authentication_error", headers={"WWW-Authenticate": challenge},
        )
        await response(scope, receive, send)


# -- request size ----------------------------------------------------------------------------------

MAX_BODY_BYTES = 1 << 20  # a request is a prompt of <= 1000 characters and a few numbers: 1 MiB is generous


class BodyLimitMiddleware:
    """Pure ASGI middleware: 413 for a body over ``max_bytes`` (``upload_bytes`` on ``upload_paths``, the endpoints
    that take images), before anything parses it: at once from ``Content-Length``, else while a chunked body streams
    in (buffered up to the limit, then replayed)."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES, upload_bytes: int = MAX_UPLOAD_BYTES,
                 upload_paths=UPLOAD_PATHS):
        self.app = app
        self.max_bytes = max_bytes
        self.upload_bytes = upload_bytes
        self.upload_paths = frozenset(upload_paths)

    async def _too_large(self, scope, receive, send, limit: int) -> None:
        what = "with images " if limit != self.max_bytes else ""
        response = error_response(413, f"request body {what}over {limit} bytes ({limit / 2**20:g} MiB)",
                                  "invalid_request_error", "body")
        await response(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.upload_bytes if scope.get("path") in self.upload_paths else self.max_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > limit:
                return await self._too_large(scope, receive, send, limit)
            return await self.app(scope, receive, send)
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > limit:
                return await self._too_large(scope, receive, send, limit)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


# -- Host header -----------------------------------------------------------------------------------

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def _is_loopback(host: str) -> bool:
    """Whether the bind address ``host`` (an IP literal or a name) is loopback only."""
    import ipaddress
    import socket

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    if host.lower() == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def allowed_hosts_for(host: str, allowed_hosts=None) -> list[str] | None:
    """The ``Host`` header names the service accepts (any port), or None for any.

    ``allowed_hosts``: a list or a comma-separated string of names (``*.example.com`` for subdomains, ``*``
    for any; IPv6 literals in brackets). None: loopback names only (``LOOPBACK_HOSTS``, and ``host`` itself)
    when ``host`` is a loopback address, so a web page cannot reach the service through DNS rebinding; any
    name otherwise. Raises ``ValueError`` naming ``--allowed-hosts`` for a malformed entry."""
    if allowed_hosts is None:
        if not _is_loopback(host):
            return None
        literal = f"[{host.strip('[]')}]" if ":" in host else host
        return list(dict.fromkeys([*LOOPBACK_HOSTS, literal.lower()]))
    names = allowed_hosts.split(",") if isinstance(allowed_hosts, str) else list(allowed_hosts)
    names = [n.strip().lower() for n in names if n.strip()]
    if not names:
        raise ValueError("--allowed-hosts: give at least one host name, or '*' for any")
    for n in names:
        bad_wildcard = "*" in n[1:] or (n.startswith("*") and n != "*" and not n.startswith("*."))
        if bad_wildcard or (":" in n and not (n.startswith("[") and n.endswith("]"))) or "/" in n:
            raise ValueError(f"--allowed-hosts: {n!r} is not a host name (no port or scheme; '*.example.com' for "
                             "subdomains, '[::1]' for an IPv6 address, '*' for any)")
    return None if "*" in names else names


# -- images ----------------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# -- the app ---------------------------------------------------------------------------------------


class Service:
    """What the endpoints share: the engine's description, the worker, the metrics, the deadline."""

    def __init__(self, engine, *, max_batch: int, queue_size: int, request_timeout_s: float, poll_s: float,
                 controlnet_names=None, batching: str = DEFAULT_BATCHING):
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 (got {request_timeout_s!r})")
        self.engine = engine
        self.model = str(getattr(engine, "name", type(engine).__name__))
        self.controlnets = _controlnet_names(engine, controlnet_names)
        device = getattr(engine, "device", None)
        self.device = str(device) if device is not None else "cpu"
        self.gpu = None
        if getattr(device, "type", None) == "cuda":
            import torch

            self.gpu = torch.cuda.get_device_name(device)
        self.dtype = str(getattr(engine, "dtype", "unknown")).replace("torch.", "")
        self.default_size = int(getattr(engine, "default_size", 512))
        self.tasks = list(getattr(engine, "tasks", ("txt2img", "img2img", "inpaint")))
        self.request_timeout_s = float(request_timeout_s)
        self.poll_s = poll_s
        self._tokenize = _tokenizer_for(engine)
        self.metrics = Metrics(endpoints=ENDPOINTS, queue_depth=lambda: self.worker.depth, device=device,
                               in_flight=lambda: getattr(self.worker, "in_flight", 0))
        self.worker = make_worker(engine, batching=batching, max_batch=max_batch, queue_size=queue_size,
                                  on_batch=self.metrics.observe_batch, on_step=self.metrics.observe_step,
                                  on_request=self.metrics.observe_job)

    async def generate(self, request: Request, *, prompt: str, negative_prompt: str | None, seed: int | None,
                       num_images: int, width: int | None, height: int | None, num_inference_steps: int,
                       guidance_scale: float, scheduler: str | None, images_field: str = "num_images",
                       task: dict | None = None, fields: dict | None = None,
                       control: dict | None = None, deep_cache: tuple[int, int] = (1, 0)) -> tuple[Job, JobResult] | None:
        """Queue one request and wait for it. Returns None if the client disconnected (its job is
        cancelled); raises ``ServiceError`` (429 full, 504 deadline, 503/500/422 from the worker; 422 naming
        ``images_field`` for more images than ``max_batch``, the most one engine call may take).

        ``task``: None (txt2img), or img2img's ``{"image", "strength"}`` (inpainting's with ``"mask_image"``): the
        prepared images (``server.parse.prepare_images``), whose size replaces ``width`` / ``height``. ``fields``:
        the endpoint's names of the engine's fields, for its 422s (e.g. ``{"mask_image": "mask"}``). ``control``:
        None, or the ControlNet arguments of the engine's requests (``control_inputs``). ``deep_cache``:
        (``cache_interval``, ``cache_branch``), the branch checked against the model's UNet here (a 422)."""
        self._check_steps(num_inference_steps, scheduler)
        self._check_deep_cache(*deep_cache)
        if num_images > self.worker.max_batch:
            raise InvalidRequest(
                f"{images_field}: at most {self.worker.max_batch} images per request on this service (its max batch; "
                f"got {num_images})", field=images_field)
        # Image i uses seed + i, and every seed returned must be one the service accepts: seed + n - 1 <= MAX_SEED.
        if seed is None:
            seed = secrets.randbelow(MAX_SEED + 2 - num_images)
        elif seed + num_images - 1 > MAX_SEED:
            raise InvalidRequest(
                f"seed: image i uses seed + i, so with {images_field}={num_images} the seed must be at most "
                f"{MAX_SEED - num_images + 1} (got {seed}; seeds are at most {MAX_SEED})", field="seed")
        job = self._job(prompt=prompt, negative_prompt=negative_prompt, seed=seed, num_images=num_images,
                        width=width, height=height, num_inference_steps=num_inference_steps,
                        guidance_scale=guidance_scale, scheduler=scheduler, images_field=images_field,
                        task=task, fields=fields, control=control, deep_cache=deep_cache)
        self.worker.submit(job)  # QueueFull -> 429 at once
        waiter = asyncio.wrap_future(job.future)
        try:
            while True:
                left = job.deadline - time.monotonic()
                if left <= 0:
                    self.worker.cancel(job)
                    raise DeadlineExceeded(
                        f"no image within the {self.request_timeout_s:g} s deadline "
                        f"({self.worker.depth} request(s) waiting); retry later")
                done, _ = await asyncio.wait({waiter}, timeout=min(self.poll_s, left))
                if done:
                    return job, waiter.result()
                if await request.is_disconnected():
                    self.worker.cancel(job)
                    log.info("client left; its request was %s", "dropped from the queue" if job.future.cancelled()
                             else "already running: it leaves at the next step (static batching: once its whole "
                                  "batch is gone)")
                    return None
        except asyncio.CancelledError:  # the server cancelled the handler (shutdown, disconnect)
            self.worker.cancel(job)
            raise
        finally:
            # Left without the answer (deadline, client gone): the error a stopped job gets later has no
            # reader, and asyncio would log it as "Future exception was never retrieved".
            waiter.cancel()

    def _job(self, *, prompt: str, negative_prompt: str | None, seed: int, num_images: int, width: int | None,
             height: int | None, num_inference_steps: int, guidance_scale: float, scheduler: str | None,
             images_field: str, task: dict | None = None, fields: dict | None = None,
             control: dict | None = None, deep_cache: tuple[int, int] = (1, 0)) -> Job:
        """The job of one request: its ``sdfast.request.Txt2ImgRequest`` (``Img2ImgRequest`` / ``InpaintRequest``
        with a ``task``; one prompt per image, so that a batch is the concatenation of its jobs' requests), built
        once here with the texts tokenized once (the worker and the engine take it as it is). The schemas' limits
        are within the engine's, so building raises only on an inconsistency or on what only the engine checks
        (``strength`` x steps under one step; the ControlNet values' counts and window, ``check_control``), as a 422
        naming the service's field."""
        from sdfast.errors import InvalidRequestError
        from sdfast.request import Img2ImgRequest, InpaintRequest, Txt2ImgRequest

        common = dict(
            negative_prompt=None if negative_prompt is None else [negative_prompt] * num_images,
            seed=[seed + i for i in range(num_images)], num_inference_steps=num_inference_steps,
            guidance_scale=float(guidance_scale), num_images_per_prompt=1, scheduler=scheduler,
            cache_interval=deep_cache[0], cache_branch=deep_cache[1], tokenize=self._tokenize, **(control or {}))
        names = {"num_images_per_prompt": images_field, **(fields or {})}
        try:
            if task is None:
                request = Txt2ImgRequest.build([prompt] * num_images, width=width or self.default_size,
                                               height=height or self.default_size, **common)
            elif task.get("mask_image") is None:
                request = Img2ImgRequest.build(task["image"], [prompt] * num_images, strength=task["strength"],
                                               **common)
            else:
                request = InpaintRequest.build(task["image"], task["mask_image"], [prompt] * num_images,
                                               strength=task["strength"], **common)
        except InvalidRequestError as e:
            field = names.get(e.field, e.field)
            raise InvalidRequest(f"{field}: {e.reason}", field=field) from None
        windows = request.tokens.windows() if request.tokens is not None else (1, 1)
        return Job(request=request, timeout_s=self.request_timeout_s, text_windows=windows)

    def _check_steps(self, steps: int, scheduler: str | None) -> None:
        """The scheduler's own step limit (LCM: 50) as a 422 before the request is queued (``sdfast.schedulers``)."""
        get = getattr(self.engine, "scheduler_for", None)
        if get is None:
            return
        from sdfast.errors import InvalidRequestError
        from sdfast.schedulers import check_steps

        try:
            check_steps(steps, get(scheduler), scheduler)
        except InvalidRequestError as e:
            raise InvalidRequest(str(e), field=e.field) from None

    def _check_deep_cache(self, cache_interval: int, cache_branch: int) -> None:
        """DeepCache's branch against the model's UNet (``sdfast.runtime.deep_cache.check``: SD 1.x/2.x have 4 skip
        branches, SDXL 3) as a 422 before the request is queued."""
        unet = getattr(getattr(self.engine, "pipe", None), "unet", None)
        if unet is None or cache_interval == 1:
            return
        from sdfast.errors import InvalidRequestError
        from sdfast.runtime import deep_cache

        try:
            deep_cache.check(unet, cache_interval, cache_branch)
        except InvalidRequestError as e:
            raise InvalidRequest(str(e), field=e.field) from None

    def check_control(self, fields, uploads: dict) -> None:
        """A parsed body's ControlNet fields against the service's ControlNets, before any image is decoded
        (``server.parse.parse_image_request``'s ``check``): with ControlNets, one control image per ControlNet;
        without, no control image and no other ControlNet field. Raises ``InvalidRequest`` (422) naming the field."""
        given = uploads.get("control_image")
        count = 0 if given is None else len(given) if isinstance(given, list) else 1
        nets = len(self.controlnets)
        if not nets:
            if count:
                raise InvalidRequest("control_image: this service has no ControlNet (start it with `sdfast serve "
                                     "--controlnet MODEL`); leave control_image out", field="control_image")
            stray = [name for name in CONTROL_VALUE_FIELDS if name in fields.model_fields_set]
            if stray:
                raise InvalidRequest(f"{stray[0]}: only with control_image, on a service with ControlNets (this one "
                                     "has none)", field=stray[0])
        elif count != nets:
            what = "is required" if not count else f"got {count}"
            raise InvalidRequest(f"control_image: {what}: this service runs {nets} ControlNet(s) "
                                 f"({', '.join(self.controlnets)}); send one control image per ControlNet, in that "
                                 "order", field="control_image")

    def health(self, details: bool) -> HealthStatus:
        """The status; with ``details``, also the model, its ControlNets, device, GPU and queue (``Health``)."""
        from sdfast.schedulers import SCHEDULERS

        alive = self.worker.alive
        if not details:
            return HealthStatus(status="ok" if alive else "degraded")
        return Health(
            status="ok" if alive else "degraded", model=self.model, model_loaded=self.engine is not None,
            device=self.device, gpu=self.gpu, dtype=self.dtype, default_size=self.default_size,
            queue_depth=self.worker.depth, queue_size=self.worker.queue_size, max_batch=self.worker.max_batch,
            busy=self.worker.busy, worker_alive=alive, schedulers=sorted(SCHEDULERS), controlnets=self.controlnets,
            tasks=self.tasks, batching=self.worker.mode, in_flight_images=getattr(self.worker, "in_flight", 0),
        )


def _controlnet_names(engine, names) -> list[str]:
    """What ``/health`` calls the engine's ControlNets: ``names`` (a string or a list, one per ControlNet: what they
    were loaded from), else each one's ``_name_or_path`` (diffusers records the folder or hub id it loaded), else
    ``controlnet[i]``. Raises ``ValueError`` when ``names`` does not have one name per ControlNet."""
    nets = list(getattr(engine, "controlnets", None) or [])
    if names is not None:
        names = list(names) if isinstance(names, (list, tuple)) else [names]
        if len(names) != len(nets):
            raise ValueError(f"controlnet: {len(names)} name(s) for the engine's {len(nets)} ControlNet(s)")
        return [os.fspath(n) if isinstance(n, (str, os.PathLike)) else type(n).__name__ for n in names]

    def loaded_from(net, i: int) -> str:
        config = getattr(net, "config", None)
        path = config.get("_name_or_path") if hasattr(config, "get") else None
        return str(path) if path else f"controlnet[{i}]"

    return [loaded_from(net, i) for i, net in enumerate(nets)]


def control_inputs(parsed: ImageBody) -> dict | None:
    """The ControlNet arguments of the engine's requests (``sdfast.request.check_control``'s) from a parsed body:
    None without a control image; else the control image(s) as RGB ``PIL.Image.Image`` s (one, or a list as sent:
    EXIF-upright, alpha dropped, as the other images) and the three values as validated."""
    images = parsed.images.get("control_image")
    if images is None:
        return None
    body = parsed.fields
    rgb = [im.convert("RGB") for im in images] if isinstance(images, list) else images.convert("RGB")
    return dict(control_image=rgb, controlnet_conditioning_scale=body.controlnet_conditioning_scale,
                control_guidance_start=body.control_guidance_start, control_guidance_end=body.control_guidance_end)


def control_size(control: dict, resize_fields: str) -> tuple[int, int]:
    """(width, height) of a txt2img request with ``control`` and no size: the first control image's, rounded down to
    multiples of 8 (as the engine and diffusers' ControlNet pipelines take it). Raises ``InvalidRequest`` naming the
    image when that is outside the service's sides, [``MIN_SIDE``, ``MAX_SIDE``]."""
    from .schemas import MAX_SIDE, MIN_SIDE

    images = control["control_image"]
    first, field = (images[0], "control_image[0]") if isinstance(images, list) else (images, "control_image")
    width, height = first.width // 8 * 8, first.height // 8 * 8
    if not (MIN_SIDE <= width <= MAX_SIDE and MIN_SIDE <= height <= MAX_SIDE):
        raise InvalidRequest(f"{field}: is {first.width}x{first.height}: without {resize_fields}, the images come at "
                             f"its size rounded down to multiples of 8, whose sides must be in [{MIN_SIDE}, {MAX_SIDE}]"
                             f" pixels; send {resize_fields}", field=field)
    return width, height


def _tokenizer_for(engine):
    """A function (prompts, negative_prompts) -> ``sdfast.prompts.PromptTokens`` for ``Txt2ImgRequest.build``,
    using private copies of the engine's tokenizers (the event loop tokenizes while the worker thread runs the
    engine, and a fast tokenizer must not be shared between threads). None when the engine has no tokenizer
    (then the engine tokenizes, and every text counts one window)."""
    import copy

    pipe = getattr(engine, "pipe", None)
    if getattr(pipe, "tokenizer", None) is None:
        return None
    import functools

    from sdfast import prompts

    tokenizers = [copy.deepcopy(t) for t in (pipe.tokenizer, getattr(pipe, "tokenizer_2", None)) if t is not None]
    return functools.partial(prompts.tokenize, pipe, tokenizers=tokenizers)


def _params(job: Job, seed: int, controlnets=()) -> dict:
    params = {"prompt": job.prompt, "negative_prompt": job.negative_prompt, "seed": seed,
              "steps": job.num_inference_steps, "guidance_scale": job.guidance_scale, "scheduler": job.scheduler,
              "width": job.width, "height": job.height}
    if job.request.task != "txt2img":  # img2img, inpainting: what else made the image
        params.update(task=job.request.task, strength=job.request.strength)
    if job.request.cache_interval != 1:  # DeepCache
        params.update(cache_interval=job.request.cache_interval, cache_branch=job.request.cache_branch)
    control = job.request.control
    if control is not None:  # one value per ControlNet, in their order
        scale = None if control.conditioning_scale is None else list(control.conditioning_scale)
        params.update(controlnets=list(controlnets), controlnet_conditioning_scale=scale,
                      control_guidance_start=list(control.guidance_start),
                      control_guidance_end=list(control.guidance_end))
    return params


def _timings(result: JobResult, arrived: float) -> Timings:
    return Timings(queue_s=round(result.queue_s, 4), generate_s=round(result.generate_s, 4),
                   total_s=round(time.monotonic() - arrived, 4), batch_images=result.batch_images)


def _validation_response(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming the field of the first error; ``detail`` lists the first ``MAX_DETAIL`` errors and
    ``detail_omitted`` counts the others."""
    items = []
    errors = exc.errors()
    omitted = max(0, len(errors) - MAX_DETAIL) + getattr(exc, "omitted", 0)
    for err in errors[:MAX_DETAIL]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc)[:100] or "body"
        msg = str(err.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ")
        if isinstance(err.get("input"), OversizedInt):
            msg = f"{err['input']!r} is out of range"
        elif err.get("type") == "extra_forbidden":
            model = BODIES.get(request.url.path, Txt2ImgRequest)
            msg = f"unknown field; this endpoint accepts: {', '.join(model.model_fields)}"
        elif err.get("type") == "json_invalid":
            field, msg = "body", f"not valid JSON ({err.get('ctx', {}).get('error', msg)})"
        items.append({"field": field, "message": f"{field}: {msg}"})
    first = items[0] if items else {"field": "body", "message": "body: invalid request"}
    body = _error_body(422, first["message"], "invalid_request_error", first["field"])
    body["detail"] = items
    if omitted:
        body["detail_omitted"] = omitted
    return JSONResponse(body, status_code=422)


def _internal_error(scope, message: str, exc_info=None) -> JSONResponse:
    """500 with a generic message and a request id; the log line with that id has the details."""
    request_id = uuid.uuid4().hex
    log.error("request %s (%s %s) failed: %s", request_id, scope.get("method"), scope.get("path"), message,
              exc_info=exc_info)
    body = _error_body(500, f"internal error (request id {request_id}; the service log has the details)",
                       "internal_error")
    body["error"]["request_id"] = request_id
    return JSONResponse(body, status_code=500, headers={"X-Request-ID": request_id})


class InternalErrorMiddleware:
    """Pure ASGI middleware: an exception no handler took becomes ``_internal_error``'s 500 (no exception text
    in the body, the traceback logged with the request id), and the connection stays usable. (Starlette's own
    500 handler re-raises, and uvicorn then closes the connection.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:  # noqa: BLE001 - answered, and logged with its traceback
            if started:
                raise
            await _internal_error(scope, f"{type(exc).__name__}: {exc}", exc_info=exc)(scope, receive, send)


# -- the web page ----------------------------------------------------------------------------------


def _csp_hashes(html: str, tag: str) -> str:
    """CSP source expressions ('sha256-...') for the inline ``<tag>`` elements of ``html``."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)


def page_headers(html: str) -> dict[str, str]:
    """Security headers of the web page: a CSP that allows its own inline script and style (by hash), its
    fetches to this origin, data: images (the results), and nothing else; no framing; no MIME sniffing."""
    csp = (f"default-src 'none'; script-src {_csp_hashes(html, 'script')}; style-src {_csp_hashes(html, 'style')}; "
           "img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return {"Content-Security-Policy": csp, "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer"}


def create_app(engine_or_model, *, max_batch: int = 4, queue_size: int = 64, api_key: str | None = None,
               request_timeout_s: float = DEFAULT_TIMEOUT_S, poll_interval_s: float = 0.05,
               allowed_hosts: list[str] | None = None, controlnet=None, batching: str = DEFAULT_BATCHING) -> FastAPI:
    """The FastAPI app serving ``engine_or_model`` (an ``sdfast.Engine``, or anything ``sdfast.load`` takes).

    Args:
        max_batch: at most this many images in one engine call, or in flight in one step batch (1: no batching).
        batching: "continuous" (default; ``server.continuous``: txt2img requests join and leave a running batch at
            denoising steps, and are cancelled at the next step) or "static" (``server.worker``: compatible requests
            queued together run as one engine call to completion). With "continuous", img2img, inpainting and
            ControlNet requests, and every request of an engine that is not an ``sdfast.Engine``, run as "static"
            runs them, between steps.
        queue_size: requests that may wait; one more answers 429 at once.
        api_key: required on every endpoint but ``/health``; default: the ``SDFAST_API_KEY``
            environment variable; None or empty: no key.
        request_timeout_s: seconds a request may wait for its images (queue + generation) before 504; its
            generation stops at the next denoising step once every request of its batch is gone.
        poll_interval_s: how often a waiting request checks whether its client is still connected.
        allowed_hosts: ``Host`` header names accepted (Starlette's ``TrustedHostMiddleware``: others get 400
            "Invalid host header"); None: any. ``serve`` passes ``allowed_hosts_for(host, ...)``.
        controlnet: with a model name, the ControlNet(s) to load it with (``sdfast.load``'s ``controlnet``: a
            name, or a list for several); with an engine, the names its ControlNets were loaded from (one per
            ControlNet), which ``/health`` reports (default: each ControlNet's ``_name_or_path``).
    Raises ``ValueError`` for a bad ``max_batch``/``queue_size``/``request_timeout_s``/``batching`` (or a
    ``controlnet`` list of another length than the engine's ControlNets), and what ``sdfast.load`` raises for a bad
    model.
    """
    if batching not in BATCHING_MODES:
        raise ValueError(f"batching must be one of {', '.join(BATCHING_MODES)} (got {batching!r})")
    engine = engine_or_model
    if isinstance(engine_or_model, (str, os.PathLike)):
        import sdfast

        engine = sdfast.load(os.fspath(engine_or_model), controlnet=controlnet)
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    service = Service(engine, max_batch=max_batch, queue_size=queue_size, request_timeout_s=request_timeout_s,
                      poll_s=poll_interval_s, controlnet_names=controlnet, batching=batching)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.worker.start()
        try:
            yield
        finally:
            await run_in_threadpool(service.worker.stop)

    # No /docs or /redoc: Swagger UI and ReDoc load their assets from a CDN, so they do not render offline;
    # /openapi.json stays.
    app = FastAPI(title="sdfast", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Stable Diffusion image generation (txt2img, img2img, inpainting) on one loaded model.")
    app.state.service = service

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):
        if exc.status == 500:
            return _internal_error(request.scope, exc.message)
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        body = _error_body(exc.status, exc.message, exc.type, exc.field)
        if exc.status == 422:  # the same shape as a schema 422: ``detail`` lists the failing fields
            body["detail"] = [{"field": exc.field or "body", "message": exc.message}]
        return JSONResponse(body, status_code=exc.status, headers=headers)

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, exc: ClientDisconnect):
        # The client went before its body arrived (it left, or --read-timeout / --max-connections closed it):
        # nobody reads an answer, and it is no service failure to log.
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _validation_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and request.method == "POST":
            # A body FastAPI could not parse at all (e.g. JSON nested past Python's recursion limit): the same
            # 422 naming ``body`` as other invalid JSON.
            message = f"body: could not be parsed as JSON ({exc.detail})"
            body = _error_body(422, message, "invalid_request_error", "body")
            body["detail"] = [{"field": "body", "message": message}]
            return JSONResponse(body, status_code=422)
        return error_response(exc.status_code, str(exc.detail), "http_error", headers=getattr(exc, "headers", None))

    def _one_png(body) -> None:
        if body.response_format == "png" and body.num_images != 1:
            raise InvalidRequest(
                f"num_images: response_format 'png' returns one image (got num_images={body.num_images}); "
                "use response_format 'b64_json' for several", field="num_images")

    async def _answer(body, out, arrived: float):
        """``/v1/txt2img``'s answer (and img2img's, inpainting's): the PNG, or JSON with every image."""
        if out is None:
            return Response(status_code=CLIENT_CLOSED)
        job, result = out
        pngs = await run_in_threadpool(
            lambda: [encode_png(img, _params(job, s, service.controlnets)) for img, s in zip(result.images, job.seeds)])
        timings = _timings(result, arrived)
        if body.response_format == "png":
            headers = {
                "X-Seed": str(job.seeds[0]),
                "Server-Timing": f"queue;dur={timings.queue_s * 1e3:.1f}, generate;dur={timings.generate_s * 1e3:.1f}",
                "X-Batch-Images": str(result.batch_images),
            }
            return Response(pngs[0], media_type="image/png", headers=headers)
        images = [ImageOut(b64_json=_b64(p), seed=s, width=job.width, height=job.height)
                  for p, s in zip(pngs, job.seeds)]
        return Txt2ImgResponse(images=images, timings=timings, model=service.model)

    async def _openai_answer(body, out):
        """``/v1/images/generations``' answer (and the edits'): each file in ``output_format``, base64."""
        if out is None:
            return Response(status_code=CLIENT_CLOSED)
        job, result = out
        files = await run_in_threadpool(
            lambda: [encode_image(img, body.image_format, quality=body.image_quality, parameters=_params(job, s, service.controlnets))
                     for img, s in zip(result.images, job.seeds)])
        return ImagesGenerationsResponse(created=int(time.time()), data=[OpenAIImage(b64_json=_b64(f)) for f in files],
                                         output_format=body.image_format, size=f"{job.width}x{job.height}")

    # The endpoints that usually take no image: their JSON is counted only past the size every JSON body may have.
    plain = dict(count_tokens_above=MAX_PLAIN_JSON_BYTES, check=service.check_control)

    @app.post("/v1/txt2img", responses={200: {"content": {"image/png": {}}, "model": Txt2ImgResponse}},
              openapi_extra=openapi_image_body(Txt2ImgRequest))
    async def txt2img(request: Request, parsed: ImageBody = Depends(image_body(Txt2ImgRequest, **plain))):
        """Generate ``num_images`` images; ``png`` returns the image file, ``b64_json`` a JSON list. JSON, or multipart
        (control images as files); with a control image and no size, at the control image's size."""
        arrived = time.monotonic()
        body = parsed.fields
        _one_png(body)
        control = await run_in_threadpool(control_inputs, parsed)
        width, height = body.width, body.height
        if control is not None and width is None and height is None:
            width, height = control_size(control, "width and height")
        out = await service.generate(
            request, prompt=body.prompt, negative_prompt=body.negative_prompt, seed=body.seed,
            num_images=body.num_images, width=width, height=height,
            num_inference_steps=body.num_inference_steps, guidance_scale=body.guidance_scale,
            scheduler=body.scheduler, control=control, deep_cache=(body.cache_interval, body.cache_branch))
        return await _answer(body, out, arrived)

    async def _from_image(request: Request, parsed: ImageBody):
        """img2img, or inpainting with a ``mask_image``: the images prepared (``prepare_images``, off the event loop),
        then as ``txt2img``."""
        arrived = time.monotonic()
        body = parsed.fields
        _one_png(body)
        image, mask = await run_in_threadpool(prepare_images, parsed.images["image"], parsed.images.get("mask_image"),
                                              width=body.width, height=body.height)
        control = await run_in_threadpool(control_inputs, parsed)
        out = await service.generate(
            request, prompt=body.prompt, negative_prompt=body.negative_prompt, seed=body.seed,
            num_images=body.num_images, width=None, height=None, num_inference_steps=body.num_inference_steps,
            guidance_scale=body.guidance_scale, scheduler=body.scheduler,
            task={"image": image, "mask_image": mask, "strength": body.strength}, control=control,
            deep_cache=(body.cache_interval, body.cache_branch))
        return await _answer(body, out, arrived)

    @app.post("/v1/img2img", responses={200: {"content": {"image/png": {}}, "model": Txt2ImgResponse}},
              openapi_extra=openapi_image_body(Img2ImgRequest))
    async def img2img(request: Request,
                      parsed: ImageBody = Depends(image_body(Img2ImgRequest, check=service.check_control))):
        """img2img: ``image`` noised to ``strength`` and denoised for ``prompt``; JSON (the image in base64) or
        multipart (the image a file). Answers as ``/v1/txt2img``."""
        return await _from_image(request, parsed)

    @app.post("/v1/inpaint", responses={200: {"content": {"image/png": {}}, "model": Txt2ImgResponse}},
              openapi_extra=openapi_image_body(InpaintRequest))
    async def inpaint(request: Request,
                      parsed: ImageBody = Depends(image_body(InpaintRequest, check=service.check_control))):
        """Inpainting: the white part of ``mask_image`` repainted, the black part kept; JSON or multipart, as
        ``/v1/img2img``. Answers as ``/v1/txt2img``."""
        return await _from_image(request, parsed)

    @app.post("/v1/images/generations", response_model=ImagesGenerationsResponse,
              openapi_extra=openapi_body(ImagesGenerationsRequest))
    async def images_generations(
            request: Request,
            parsed: ImageBody = Depends(image_body(ImagesGenerationsRequest, json_only=True, **plain))):
        """The OpenAI Images API: ``prompt``, ``n``, ``size``, ``output_format`` (png, jpeg, webp) at
        ``output_compression``; answers base64 files. What is ignored and what is refused:
        ``ImagesGenerationsRequest``. ``negative_prompt``, ``num_inference_steps``, ``guidance_scale``, ``seed``
        and the ControlNet fields (``control_image`` in base64) are optional sdfast extensions."""
        body = parsed.fields
        width, height = body.dimensions()
        control = await run_in_threadpool(control_inputs, parsed)
        if control is not None and width is None:
            width, height = control_size(control, "size")
        out = await service.generate(
            request, prompt=body.prompt, negative_prompt=body.negative_prompt, seed=body.seed, num_images=body.n,
            width=width, height=height, num_inference_steps=body.num_inference_steps,
            guidance_scale=body.guidance_scale, scheduler=None, images_field="n", control=control,
            deep_cache=(body.cache_interval, body.cache_branch))
        return await _openai_answer(body, out)

    @app.post("/v1/images/edits", response_model=ImagesGenerationsResponse,
              openapi_extra=openapi_image_body(ImagesEditsRequest, multipart_only=True))
    async def images_edits(
            request: Request,
            parsed: ImageBody = Depends(image_body(ImagesEditsRequest, multipart_only=True, check=service.check_control))):
        """The OpenAI Images API edit (multipart, as the official client sends it): inpainting of the fully
        transparent pixels of ``mask`` (or, without a mask, of ``image``), at ``size`` (the image and mask resized
        to it; default: the image's size). Answers as ``/v1/images/generations``; see ``ImagesEditsRequest``."""
        body = parsed.fields
        width, height = body.dimensions()
        image = parsed.images["image"]

        def prepare():
            if "mask" in parsed.images:
                mask = transparent_mask(parsed.images["mask"], "mask")
            else:
                mask = transparent_mask(image, "image", also=" and no mask was sent")
            return prepare_images(image, mask, width=width, height=height, mask_field="mask", resize_fields="size")

        image, mask = await run_in_threadpool(prepare)
        control = await run_in_threadpool(control_inputs, parsed)
        out = await service.generate(
            request, prompt=body.prompt, negative_prompt=body.negative_prompt, seed=body.seed, num_images=body.n,
            width=None, height=None, num_inference_steps=body.num_inference_steps,
            guidance_scale=body.guidance_scale, scheduler=None, images_field="n",
            task={"image": image, "mask_image": mask, "strength": body.strength}, fields={"mask_image": "mask"},
            control=control, deep_cache=(body.cache_interval, body.cache_branch))
        return await _openai_answer(body, out)

    key = api_key.encode() if api_key else None

    @app.get("/health", response_model=Health)
    async def health(request: Request):
        """Always public: 200 while the worker runs, else 503. Without the key (when one is set) only
        ``status``; the details (model, device, queue) need the key."""
        h = service.health(details=key is None or has_key(request.scope, key))
        return JSONResponse(h.model_dump(), status_code=200 if h.status == "ok" else 503)

    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)  # probes that send HEAD

    @app.get("/metrics", include_in_schema=False)
    async def metrics():
        return Response(service.metrics.render(), media_type=service.metrics.content_type)

    html = (STATIC / "index.html").read_text(encoding="utf-8")
    headers = page_headers(html)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def page():
        return HTMLResponse(html, headers=headers)

    # Order: metrics outermost, so answers of the host and key checks are counted too; then the body limit;
    # innermost the 500 for unexpected exceptions.
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(BodyLimitMiddleware, upload_paths=UPLOAD_PATHS + (CONTROL_PATHS if service.controlnets else ()))
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if allowed_hosts is not None:  # before the key check: a rebinding page is refused whatever it sends
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts), www_redirect=False)
    app.add_middleware(MetricsMiddleware, metrics=service.metrics)
    return app


def _version() -> str:
    try:
        import sdfast

        return sdfast.__version__
    except Exception:  # noqa: BLE001
        return "0"


def _check_can_listen(host: str, port: int) -> None:
    """Raise ``ValueError`` when ``host:port`` cannot be bound (taken, no such address, no permission)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--host: cannot resolve {host!r} ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            sock.bind(addr)
        except OSError as e:
            raise ValueError(f"--port: cannot listen on {host}:{port} ({e.strerror or e})") from None


def request_timeout_from_env(value: float | None) -> float:
    """``value``, else the ``SDFAST_REQUEST_TIMEOUT`` environment variable, else ``DEFAULT_TIMEOUT_S``; checked > 0."""
    name = "--request-timeout"
    if value is None and os.environ.get(REQUEST_TIMEOUT_ENV, "").strip():
        name, raw = REQUEST_TIMEOUT_ENV, os.environ[REQUEST_TIMEOUT_ENV].strip()
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{name} must be a number of seconds > 0 (got {raw!r})") from None
    value = DEFAULT_TIMEOUT_S if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a number of seconds > 0 (got {value!r})")
    return float(value)


FD_RESERVE = 128  # file descriptors besides the connections: model files, CUDA, the event loop, logs


def _fit_file_limit(max_connections: int) -> None:
    """Raise this process's soft ``RLIMIT_NOFILE`` to fit ``max_connections`` (up to the hard limit); raise
    ``ValueError`` naming ``--max-connections`` when even the hard limit is too low."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    need = max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ValueError(f"--max-connections {max_connections} needs about {need} file descriptors and this "
                         f"process may open at most {hard} (ulimit -Hn); lower --max-connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def uvicorn_server(app, *, host: str, port: int, guard, log_level: str = "info"):
    """The ``uvicorn.Server`` that ``serve`` runs: HTTP/1.1 (h11) with ``guard``'s limits
    (``server.connections``), uvicorn's 5 s keep-alive."""
    import uvicorn

    from .connections import Server

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=guard.protocol())
    return Server(config, guard)


def _as_list(controlnet) -> list[str]:
    return [controlnet] if isinstance(controlnet, str) else list(controlnet)


def _check_controlnet_flag(controlnet):
    """``serve``'s ``controlnet`` as ``sdfast.load`` takes it: None, one name (a list of one too: a single
    ControlNet, not a multi-ControlNet of one) or a list of several. Raises ``ValueError`` naming ``--controlnet``
    for an empty name or an unknown ``random:`` one, before the (slow) load."""
    if controlnet is None:
        return None
    names = _as_list(controlnet)
    if not names:
        return None
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"--controlnet: a ControlNet folder, .safetensors file, hub id or random:<name> (got "
                             f"{name!r})")
        if name.startswith("random:"):
            from sdfast.architectures import get_controlnet

            try:
                get_controlnet(name.split(":", 1)[1])
            except ValueError as e:
                raise ValueError(f"--controlnet: {e}") from None
    return names[0] if len(names) == 1 else names


def serve(*, model: str, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 4, queue_size: int = 64,
          api_key: str | None = None, request_timeout_s: float | None = None, optimize: bool = True,
          log_level: str = "info", read_timeout_s: float | None = None, max_connections: int | None = None,
          allowed_hosts=None, controlnet=None, batching: str = DEFAULT_BATCHING) -> int:
    """Load ``model`` and serve it with uvicorn until interrupted (what ``sdfast serve`` runs).

    The key comes from ``api_key`` or the ``SDFAST_API_KEY`` environment variable. ``optimize``:
    passed to ``sdfast.load`` (False: the stock diffusers pipeline). ``request_timeout_s``: the deadline of a
    request, queue and generation (default: ``SDFAST_REQUEST_TIMEOUT``, else 300 s). ``read_timeout_s``: a
    client must send its complete request within this time (default 30 s); ``max_connections``: open
    connections at most (default 256; ``server.connections``). ``allowed_hosts``: the ``Host`` names
    accepted (``allowed_hosts_for``: loopback names only when ``host`` is loopback). ``controlnet``: None, a
    ControlNet (what ``sdfast.load``'s ``controlnet`` takes: a folder, a ``.safetensors`` file, a hub id,
    ``random:<name>``) or a list of them (``--controlnet``, repeated): the engine is loaded with them and every
    request takes one ``control_image`` per ControlNet. ``batching``: "continuous" (default) or "static"
    (``--batching``; see ``create_app``). Bad values raise ``ValueError`` before the model is loaded.
    """
    import sdfast

    from .connections import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT_S, ConnectionGuard

    for flag, v in (("--max-batch", max_batch), ("--queue", queue_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{flag} must be an integer >= 1 (got {v!r})")
    if batching not in BATCHING_MODES:
        raise ValueError(f"--batching must be one of {', '.join(BATCHING_MODES)} (got {batching!r})")
    request_timeout_s = request_timeout_from_env(request_timeout_s)
    controlnet = _check_controlnet_flag(controlnet)
    guard = ConnectionGuard(
        read_timeout_s=DEFAULT_READ_TIMEOUT_S if read_timeout_s is None else read_timeout_s,
        max_connections=DEFAULT_MAX_CONNECTIONS if max_connections is None else max_connections)
    hosts = allowed_hosts_for(host, allowed_hosts)
    _fit_file_limit(guard.max_connections)
    _check_can_listen(host, port)  # before the (slow) load: a taken port answers at once

    t0 = time.perf_counter()
    engine = sdfast.load(model, optimize=optimize, controlnet=controlnet)
    with_nets = "" if controlnet is None else f" with ControlNet(s) {', '.join(_as_list(controlnet))}"
    print(f"sdfast: loaded {model}{with_nets} on {engine.device} in {time.perf_counter() - t0:.1f} s; "
          f"max batch {max_batch} images, queue {queue_size} requests, {batching} batching", file=sys.stderr)
    if str(model).startswith("random:"):
        print(f"sdfast: note: {model} has random weights, so its images are noise", file=sys.stderr)
    app = create_app(engine, max_batch=max_batch, queue_size=queue_size, api_key=api_key,
                     request_timeout_s=request_timeout_s, allowed_hosts=hosts,
                     controlnet=None if controlnet is None else _as_list(controlnet), batching=batching)
    if any(m.cls is APIKeyMiddleware for m in app.user_middleware):
        print("sdfast: an API key is required on every endpoint but /health", file=sys.stderr)
    print(f"sdfast: request deadline {request_timeout_s:g} s, read timeout {guard.read_timeout_s:g} s, at most "
          f"{guard.max_connections} connections; Host: {', '.join(hosts) if hosts else 'any'}", file=sys.stderr)
    server = uvicorn_server(app, host=host, port=port, guard=guard, log_level=log_level)
    server.run()
    return 0 if server.started else 1
