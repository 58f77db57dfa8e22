"""A minimal Chrome DevTools Protocol client over ``--remote-debugging-pipe`` (no websocket, no pip
package): headless Chromium reads commands on fd 3 and writes answers on fd 4, each a JSON object
ended by a NUL byte. Enough to drive one page: navigate, evaluate JavaScript, type, click, screenshot.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class CDPError(RuntimeError):
    pass


class Chromium:
    """Headless Chromium with one page target; ``send`` runs a CDP command on that page."""

    def __init__(self, executable: str, *, width: int = 1000, height: int = 900, timeout: float = 30.0):
        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory(prefix="sdfast-chromium-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        # The child's ends move above fd 9, so that dup2 onto 3 and 4 cannot clobber one with the other.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_chrome_r, from_chrome_w)]
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        to_chrome_r, from_chrome_w = high
        args = [
            executable, "--headless", "--remote-debugging-pipe", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--mute-audio",
            f"--user-data-dir={self._profile.name}", f"--window-size={width},{height}",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
        # fds 3 and 4 in the child, wired by a small Python trampoline (no preexec_fn in a threaded process).
        trampoline = ("import os, sys; r, w = int(sys.argv[1]), int(sys.argv[2]); os.dup2(r, 3); os.dup2(w, 4); "
                      "os.close(r); os.close(w); os.execv(sys.argv[3], sys.argv[3:])")
        self._log = open(os.path.join(self._profile.name, "chromium.log"), "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-c", trampoline, str(to_chrome_r), str(from_chrome_w), *args, "about:blank"],
            pass_fds=(to_chrome_r, from_chrome_w), stdout=subprocess.DEVNULL, stderr=self._log)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict] = []
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        attached = self.send("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)
        self.session = attached["sessionId"]
        self.send("Page.enable")
        self.send("Runtime.enable")
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    # -- protocol ---------------------------------------------------------------------------
    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("Chromium did not answer in time")
            ready, _, _ = select.select([self._from_chrome], [], [], left)
            if ready:
                chunk = os.read(self._from_chrome, 1 << 20)
                if not chunk:
                    raise CDPError(f"Chromium closed the pipe (exit {self.proc.poll()}): {self.log_tail()}")
                self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        return json.loads(raw)

    def send(self, method: str, params: dict | None = None, *, session: bool = True, timeout: float | None = None):
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def log_tail(self, chars: int = 2000) -> str:
        self._log.flush()
        with open(self._log.name, "rb") as f:
            return f.read().decode(errors="replace")[-chars:]

    # -- page helpers ---------------------------------------------------------------------------
    def evaluate(self, expression: str):
        """The JSON value of a JavaScript expression (promises awaited); raises on a JS exception."""
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise CDPError(f"JavaScript error in {expression!r}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0, interval: float = 0.1):
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout} s waiting for {expression!r}")
            time.sleep(interval)

    def navigate(self, url: str, *, headers: dict | None = None) -> None:
        if headers:
            self.send("Network.enable")
            self.send("Network.setExtraHTTPHeaders", {"headers": headers})
        self.send("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def type_into(self, selector: str, text: str) -> None:
        """Focus ``selector``, select what is there, and type ``text`` as keyboard input would."""
        self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
                      " e.focus(); e.select(); })()")
        self.send("Input.insertText", {"text": text})

    def set_files(self, selector: str, paths) -> None:
        """Choose ``paths`` in the file input ``selector``, as the file dialog would (its change event fires)."""
        root = self.send("DOM.getDocument")["root"]["nodeId"]
        node = self.send("DOM.querySelector", {"nodeId": root, "selector": selector})["nodeId"]
        self.send("DOM.setFileInputFiles", {"files": [str(p) for p in paths], "nodeId": node})

    def click(self, selector: str) -> None:
        """A real mouse click (press + release) at the centre of ``selector``."""
        box = self.evaluate(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
            " return {x: r.x + r.width / 2, y: r.y + r.height / 2}; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent",
                      {"type": kind, "x": box["x"], "y": box["y"], "button": "left", "clickCount": 1})

    def screenshot(self, path) -> bytes:
        data = base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"])
        with open(path, "wb") as f:
            f.write(data)
        return data

    def console_errors(self) -> list[str]:
        return [str(e["params"].get("exceptionDetails", {}).get("text", e))
                for e in self.events if e.get("method") == "Runtime.exceptionThrown"]

    def close(self) -> None:
        try:
            self.send("Browser.close", session=False, timeout=5)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        for fd in (self._to_chrome, self._from_chrome):
            try:
                os.close(fd)
            except OSError:
                pass
        self._log.close()
        self._profile.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
