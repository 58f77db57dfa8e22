"""The real service for the end-to-end tests: ``server.app.serve`` (uvicorn) in a subprocess on
127.0.0.1:<free port>, ``random:tiny`` on the CPU, an API key, started once for this folder."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from .helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MAX_BATCH = 4
QUEUE = 32


@dataclass
class LiveServer:
    url: str
    key: str
    log: Path

    def client(self, *, key: bool = True, timeout: float = 60) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)


@pytest.fixture(scope="package")
def live(tmp_path_factory) -> LiveServer:
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # One intra-op thread: on a shared 2-core CI machine two OpenMP threads that spin at every barrier
    # run a tiny model 10-30x slower whenever another process wants a core.
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", SDFAST_API_KEY=API_KEY, PYTHONPATH=pythonpath)
    # serve() is what `sdfast serve` runs; the stock pipeline (optimize=False) keeps these tests about
    # the service, not the kernels.
    code = (
        "import sys; from server.app import serve; "
        f"sys.exit(serve(model='random:tiny', host='127.0.0.1', port={port}, max_batch={MAX_BATCH}, "
        f"queue_size={QUEUE}, optimize=False, log_level='warning'))"
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not answer /health within 120 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield LiveServer(url=url, key=API_KEY, log=log)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
