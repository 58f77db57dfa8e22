"""Issue 29 item 12: clients that never finish a request are disconnected after the read timeout, open
connections are bounded (the oldest unfinished one makes room), a client that sends its request at once is
served meanwhile, and accept failures for lack of file descriptors are logged once per interval."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx

from server.app import create_app
from server.connections import ConnectionGuard

from .helpers import FakeEngine, free_port, serving, wait_for

ROOT = Path(__file__).resolve().parents[2]
PARTIAL = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # the blank line that ends the headers never comes


def _open_partial(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(PARTIAL)
        socks.append(s)
    return socks


def _closed_by_server(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_unfinished_requests_are_cut_off_and_bounded_while_prompt_clients_are_served():
    guard = ConnectionGuard(read_timeout_s=2.0, max_connections=20)
    with serving(create_app(FakeEngine(), api_key=""), guard) as url:
        port = _port(url)
        t0 = time.monotonic()
        socks = []
        for _ in range(6):  # 150 unfinished requests, and a prompt client after each 25
            socks += _open_partial(port, 25)
            r = httpx.get(f"{url}/", timeout=5)
            assert r.status_code == 200
        time.sleep(0.2)
        still_open = [s for s in socks if not _closed_by_server(s)]
        assert len(still_open) <= 20 and len(socks) == 150
        assert time.monotonic() - t0 < 2.0, "the check above must run within the read timeout"
        wait_for(lambda: all(_closed_by_server(s) for s in still_open), timeout=4, what="the read timeout")
        assert time.monotonic() - t0 < 5
        for s in socks:
            s.close()


def test_kept_alive_connection_has_a_read_deadline_but_generation_time_does_not_count():
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    guard = ConnectionGuard(read_timeout_s=0.5, max_connections=8)
    with serving(create_app(engine, api_key=""), guard) as url:
        with httpx.Client(base_url=url, timeout=10) as c:
            threading.Timer(1.2, gate.set).start()  # the request is complete: 1.2 s of generation is fine
            r = c.post("/v1/txt2img", json={"prompt": "a cat", "num_inference_steps": 2, "seed": 1})
            assert r.status_code == 200
        s = socket.create_connection(("127.0.0.1", _port(url)), timeout=5)
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert s.recv(1 << 16).startswith(b"HTTP/1.1 200")
        s.sendall(PARTIAL)  # a second request on the kept-alive connection, never finished
        s.settimeout(3)
        t0 = time.monotonic()
        while s.recv(1 << 16):
            pass
        assert time.monotonic() - t0 < 2, "the unfinished second request was not cut off"
        s.close()


def test_new_connection_gets_503_when_every_connection_is_serving_a_request():
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    guard = ConnectionGuard(read_timeout_s=5, max_connections=2)
    req = {"prompt": "a cat", "num_inference_steps": 2, "seed": 1}
    with serving(create_app(engine, api_key=""), guard) as url:
        results = []
        threads = [threading.Thread(target=lambda i=i: results.append(
            httpx.post(f"{url}/v1/txt2img", json={**req, "seed": i}, timeout=20).status_code)) for i in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: len(engine.calls) >= 1, what="the first request to run")
        time.sleep(0.3)  # the second request is in the queue
        s = socket.create_connection(("127.0.0.1", _port(url)), timeout=5)
        answer = b""
        while chunk := s.recv(1 << 16):
            answer += chunk
        s.close()
        assert answer.startswith(b"HTTP/1.1 503") and b'"type": "server_busy"' in answer
        gate.set()
        for t in threads:
            t.join(20)
        assert results == [200, 200]


ACCEPT_SERVER = textwrap.dedent("""
    import logging, os, resource, sys
    import uvicorn
    from server.connections import ConnectionGuard, Server

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    guard = ConnectionGuard(read_timeout_s=4, max_connections=1000)  # more than the file descriptors allow
    config = uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", http=guard.protocol(),
                            lifespan="off")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    Server(config, guard).run()
""")


def test_accept_failures_for_lack_of_file_descriptors_are_logged_once_per_interval(tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", ACCEPT_SERVER, str(port)], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _answers(port), timeout=15, interval=0.1, what="the server to start")
        socks = _open_partial(port, 60)  # the kernel queues what the server cannot accept
        time.sleep(2.5)  # accept() fails with EMFILE; asyncio retries each second
        for s in socks:
            s.close()
        wait_for(lambda: _answers(port), timeout=5, interval=0.1, what="the server to accept again")
    finally:
        proc.terminate()
        proc.wait(10)
    text = log.read_text()
    assert text.count("sdfast: cannot accept connections") == 1, text[-3000:]
    assert "Traceback" not in text and "out of system resource" not in text, text[-3000:]


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/", timeout=1).status_code == 200
    except httpx.TransportError:
        return False
