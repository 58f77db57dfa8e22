"""Issue 29 items 13 and 18 at the ``sdfast serve`` layer: the deadline, read timeout and connection flags (and
``SDFAST_REQUEST_TIMEOUT``) reach the service, bad values are refused before loading, and the ``Host`` header
is checked (loopback names only when bound to loopback; ``--allowed-hosts`` otherwise)."""

from __future__ import annotations

import httpx
import pytest

import server.app as app_module
from server.app import allowed_hosts_for, create_app

from .helpers import FakeEngine, serving

LOOPBACK = ["localhost", "127.0.0.1", "[::1]"]


def test_allowed_hosts_by_bind_address_and_flag():
    assert allowed_hosts_for("127.0.0.1") == LOOPBACK
    assert allowed_hosts_for("localhost") == LOOPBACK
    assert allowed_hosts_for("::1") == LOOPBACK
    assert allowed_hosts_for("127.0.0.2") == [*LOOPBACK, "127.0.0.2"]
    assert allowed_hosts_for("0.0.0.0") is None  # a deployment's own names are unknown: any, unless told
    assert allowed_hosts_for("0.0.0.0", "Images.example, *.corp.example") == ["images.example", "*.corp.example"]
    assert allowed_hosts_for("127.0.0.1", "*") is None
    for bad in ("images.example:8000", "http://images.example", "a.*.example", ""):
        with pytest.raises(ValueError, match="--allowed-hosts"):
            allowed_hosts_for("127.0.0.1", bad)


@pytest.mark.parametrize("allowed, ok, refused", [
    (None, ["127.0.0.1:{port}", "localhost:{port}", "[::1]:{port}", "LOCALHOST"],
     ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example"]),
    ("images.example", ["images.example", "images.example:{port}"], ["localhost:{port}", "evil.example"]),
])
def test_host_header_is_checked(allowed, ok, refused):
    app = create_app(FakeEngine(), api_key="", allowed_hosts=allowed_hosts_for("127.0.0.1", allowed))
    with serving(app) as url, httpx.Client(base_url=url, timeout=10) as c:
        port = url.rsplit(":", 1)[1]
        for host in ok:
            r = c.get("/health", headers={"Host": host.format(port=port)})
            assert r.status_code == 200, (host, r.text)
        for host in refused:
            for path in ("/", "/health", "/v1/txt2img"):
                r = c.get(path, headers={"Host": host.format(port=port)})
                assert r.status_code == 400 and r.text == "Invalid host header", (host, path)


class _StubServer:
    started = True

    def __init__(self, app, **kw):
        self.app, self.kw = app, kw

    def run(self):
        pass


@pytest.fixture
def captured(monkeypatch):
    """``serve`` with a fake model and no real server: what it built."""
    import sdfast

    built = {}

    def load(model, optimize=True, controlnet=None):
        built["load"] = dict(model=model, optimize=optimize, controlnet=controlnet)
        return built.setdefault("engine", FakeEngine())

    monkeypatch.setattr(sdfast, "load", load)
    monkeypatch.setattr(app_module, "_check_can_listen", lambda host, port: None)
    monkeypatch.setattr(app_module, "uvicorn_server",
                        lambda app, **kw: built.setdefault("server", _StubServer(app, **kw)))
    return built


def _middleware(app, name):
    return next((m for m in app.user_middleware if m.cls.__name__ == name), None)


def test_sdfast_serve_passes_the_limits_and_the_host_rule(captured, monkeypatch):
    from sdfast.cli import main

    monkeypatch.setenv("SDFAST_REQUEST_TIMEOUT", "7.5")
    assert main(["serve", "--model", "random:tiny", "--read-timeout", "12", "--max-connections", "40"]) == 0
    server = captured["server"]
    assert server.app.state.service.request_timeout_s == 7.5
    guard = server.kw["guard"]
    assert (guard.read_timeout_s, guard.max_connections) == (12.0, 40)
    assert _middleware(server.app, "TrustedHostMiddleware").kwargs["allowed_hosts"] == LOOPBACK
    captured.clear()
    assert main(["serve", "--model", "random:tiny", "--host", "0.0.0.0", "--request-timeout", "2"]) == 0
    server = captured["server"]
    assert server.app.state.service.request_timeout_s == 2.0  # the flag wins over the environment
    assert (server.kw["guard"].read_timeout_s, server.kw["guard"].max_connections) == (30.0, 256)
    assert _middleware(server.app, "TrustedHostMiddleware") is None


def test_sdfast_serve_batching_flag(captured):
    """Issue 33: continuous batching by default; ``--batching static`` keeps the batch-to-completion worker."""
    from sdfast.cli import main

    assert main(["serve", "--model", "random:tiny"]) == 0
    assert captured["server"].app.state.service.worker.mode == "continuous"
    captured.clear()
    assert main(["serve", "--model", "random:tiny", "--batching", "static"]) == 0
    assert captured["server"].app.state.service.worker.mode == "static"


@pytest.mark.parametrize("args, env, message", [
    (["--request-timeout", "0"], None, "--request-timeout must be a number of seconds > 0"),
    (["--request-timeout", "inf"], None, "--request-timeout must be a number of seconds > 0"),
    ([], "soon", "SDFAST_REQUEST_TIMEOUT must be a number of seconds > 0 (got 'soon')"),
    (["--read-timeout", "-1"], None, "--read-timeout must be > 0"),
    (["--read-timeout", "inf"], None, "--read-timeout must be > 0 seconds, finite"),
    (["--read-timeout", "nan"], None, "--read-timeout must be > 0 seconds, finite"),
    (["--max-connections", "0"], None, "--max-connections must be an integer >= 1"),
    (["--allowed-hosts", "x.example:80"], None, "--allowed-hosts: 'x.example:80' is not a host name"),
])
def test_sdfast_serve_refuses_bad_limits_before_loading(captured, monkeypatch, capsys, args, env, message):
    from sdfast.cli import main

    if env is not None:
        monkeypatch.setenv("SDFAST_REQUEST_TIMEOUT", env)
    else:
        monkeypatch.delenv("SDFAST_REQUEST_TIMEOUT", raising=False)
    assert main(["serve", "--model", "random:tiny", *args]) == 2
    assert message in capsys.readouterr().err
    assert "engine" not in captured and "server" not in captured
