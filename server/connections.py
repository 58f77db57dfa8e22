"""Connection limits for uvicorn: a read deadline per request, a bound on open connections, quiet accept errors.

uvicorn (0.54) bounds neither: its h11 protocol arms no timer until a first response is sent, so a client that
opens a connection and sends part of a request holds a file descriptor for ever, and ``limit_concurrency``
answers 503 only to complete requests, so half-open sockets are not counted against it. Enough of them
exhaust the process's file descriptors; asyncio then logs every failed ``accept()`` with a traceback (up to
``backlog`` times per loop tick).

``GuardedH11Protocol`` (uvicorn's ``H11Protocol``, passed to ``uvicorn.Config(http=...)``, one subclass per
``ConnectionGuard``):

- read deadline: a connection must deliver a complete request (headers and body) within ``read_timeout_s`` of
  opening, or of the end of its previous response (kept-alive connections; uvicorn's own ``timeout_keep_alive``
  closes those that stay silent); else it is closed. Time spent generating is not counted: the timer stops
  when the request is complete.
- connection bound: at most ``max_connections`` open. A connection beyond it closes the oldest one that has not
  delivered a complete request (a slow or idle client; a client that sends its request at once is served even
  while thousands of such connections arrive); if every open connection is a request being served, the new one
  is answered 503 and closed.

``Server`` (a ``uvicorn.Server``) installs a loop exception handler that logs asyncio's "socket.accept() out of
system resource" (EMFILE, ENFILE, ...) once per ``log_interval_s`` with a count, without the traceback; other
loop errors go to the default handler. (The bound on connections keeps the descriptors from running out: ``serve``
raises the soft ``RLIMIT_NOFILE`` to fit ``max_connections``; this is for descriptors used up by anything else.)
Timeouts, evictions, refusals and accept failures are each logged that way (``Every``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import traceback
from dataclasses import dataclass, field

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("sdfast.server")

DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 256
LOG_INTERVAL_S = 10.0


class Every:
    """A rate-limited warning: the first event is logged at once, later ones at most once per ``interval_s``,
    with the number of events since the last line (``message`` has one ``%d`` for it)."""

    def __init__(self, message: str, interval_s: float = LOG_INTERVAL_S, logger: logging.Logger = log):
        self.message = message
        self.interval_s = interval_s
        self.logger = logger
        self.count = 0
        self.last: float | None = None

    def __call__(self) -> None:
        self.count += 1
        now = time.monotonic()
        if self.last is None or now - self.last >= self.interval_s:
            self.logger.warning(self.message, self.count)
            self.count, self.last = 0, now


@dataclass
class ConnectionGuard:
    """The limits of one server and the connections that have not delivered a complete request, oldest first."""

    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    log_interval_s: float = LOG_INTERVAL_S
    waiting: dict = field(default_factory=dict)  # protocol -> None, insertion-ordered

    def __post_init__(self):
        if not 0 < self.read_timeout_s < math.inf:  # NaN too; inf would be no read deadline at all
            raise ValueError(f"--read-timeout must be > 0 seconds, finite (got {self.read_timeout_s!r})")
        if not isinstance(self.max_connections, int) or isinstance(self.max_connections, bool) \
                or self.max_connections < 1:
            raise ValueError(f"--max-connections must be an integer >= 1 (got {self.max_connections!r})")
        every = lambda what: Every(what, self.log_interval_s)  # noqa: E731
        self.timed_out = every(f"sdfast: closed %d connection(s) that sent no complete request within "
                               f"{self.read_timeout_s:g} s (--read-timeout)")
        self.evicted = every(f"sdfast: {self.max_connections} connections open (--max-connections): closed the "
                             "oldest without a complete request, %d time(s)")
        self.refused = every(f"sdfast: {self.max_connections} connections open (--max-connections), all serving "
                             "requests: answered 503 to %d new connection(s)")
        self.accept_failed = every("sdfast: cannot accept connections (%d time(s)): out of file descriptors or "
                                   "memory; lower --max-connections or raise the limit (ulimit -n)")

    def protocol(self) -> type[H11Protocol]:
        """The protocol class for ``uvicorn.Config(http=...)``, bound to this guard."""
        return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": self})

    def loop_exception_handler(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """Accept failures (and the errors of asyncio's accept retries once the server closed its socket: each
        failure schedules one per ``backlog`` attempt) are counted and logged by ``accept_failed``."""
        if context.get("message") == "socket.accept() out of system resource" or _in_accept_retry(context):
            self.accept_failed()
            return
        loop.default_exception_handler(context)


def _in_accept_retry(context: dict) -> bool:
    exc = context.get("exception")
    tb = getattr(exc, "__traceback__", None)
    return tb is not None and any(frame.name == "_start_serving" for frame in traceback.extract_tb(tb))


_BUSY_BODY = json.dumps({"error": {
    "message": "too many open connections; retry later", "type": "server_busy", "param": None, "code": 503,
}}).encode()
BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
                 b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(_BUSY_BODY)) + _BUSY_BODY


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the read deadline and the connection bound of ``guard`` (module docstring)."""

    guard: ConnectionGuard

    def connection_made(self, transport) -> None:
        guard = self.guard
        self._read_timer = None
        if len(self.connections) >= guard.max_connections:
            if guard.waiting:
                oldest = next(iter(guard.waiting))
                guard.evicted()
                oldest._close()
            else:  # every connection holds a request being served: this one is told so, without reading it
                guard.refused()
                self.transport = transport
                transport.write(BUSY_RESPONSE)
                transport.close()
                return
        super().connection_made(transport)
        self._start_read_timer()

    def _start_read_timer(self) -> None:
        self._stop_read_timer()
        self.guard.waiting[self] = None
        self._read_timer = self.loop.call_later(self.guard.read_timeout_s, self._read_timed_out)

    def _stop_read_timer(self) -> None:
        self.guard.waiting.pop(self, None)
        if getattr(self, "_read_timer", None) is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        self.guard.timed_out()
        self._close()

    def _close(self) -> None:
        self._stop_read_timer()
        if not self.transport.is_closing():
            self.transport.close()

    def _reading(self) -> bool:
        """Whether the client is still to send (part of) a request: none yet, or its body."""
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._read_timer is not None and not self._reading():
            self._stop_read_timer()  # the request is complete: what follows is the app's time

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request already received
        if not self.transport.is_closing() and self._reading():
            self._start_read_timer()  # the next request on this kept-alive connection has its own deadline

    def connection_lost(self, exc) -> None:
        self._stop_read_timer()
        if self.flow is None:  # refused in connection_made: uvicorn's state was never set up
            return
        super().connection_lost(exc)


class Server(uvicorn.Server):
    """``uvicorn.Server`` with ``guard``'s loop exception handler (rate-limited accept errors)."""

    def __init__(self, config: uvicorn.Config, guard: ConnectionGuard):
        super().__init__(config)
        self.guard = guard

    async def startup(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(self.guard.loop_exception_handler)
        await super().startup(sockets)
