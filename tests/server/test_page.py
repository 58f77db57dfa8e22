"""Issue 9: the web page in headless Chromium (Debian's ``chromium``), driven over the DevTools
protocol: type a prompt, press Generate, the image appears with the time it took. A screenshot is
saved to ``test-artifacts/server_page.png``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .cdp import Chromium, find_chromium

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM = find_chromium()

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs headless Chromium: apt-get install -y chromium (Debian's package)")


def test_page_generates_an_image(live):
    ARTIFACTS.mkdir(exist_ok=True)
    with Chromium(CHROMIUM) as browser:
        browser.navigate(live.url + "/", headers={"Authorization": f"Bearer {live.key}"})
        # The controls the page promises, and the defaults it fetched from /health.
        for sel in ("#prompt", "#generate", "#result", "#time", "#width", "#height", "#steps", "#seed"):
            assert browser.evaluate(f"!!document.querySelector('{sel}')"), sel
        browser.wait_for("document.querySelector('#width').value === '64'", timeout=10)
        assert "random:tiny" in browser.evaluate("document.querySelector('#model').textContent")
        # The Content-Security-Policy (issue 29 item 21) lets the page's inline style and script run.
        assert browser.evaluate("getComputedStyle(document.querySelector('#generate')).borderTopLeftRadius") == "6px"

        browser.type_into("#prompt", "a lighthouse at dusk")
        browser.type_into("#steps", "2")
        browser.type_into("#seed", "42")
        browser.type_into("#width", "128")
        browser.click("#generate")
        width = browser.wait_for(
            "(() => { const i = document.querySelector('#result img');"
            " return i && i.complete && i.naturalWidth; })()", timeout=60)
        assert width == 128
        assert browser.evaluate("document.querySelector('#result img').naturalHeight") == 64
        took = browser.evaluate("document.querySelector('#time').textContent")
        assert re.match(r"^\d+\.\d\d s \(generation \d+\.\d\d s", took), took
        assert "seed 42" in took
        assert browser.evaluate("document.querySelector('#status').textContent") == ""
        assert browser.evaluate("document.querySelector('#generate').disabled") is False
        png = browser.screenshot(ARTIFACTS / "server_page.png")
        assert png[:8] == b"\x89PNG\r\n\x1a\n"

        # A bad value comes back as the server's 422 message, and the field is marked.
        browser.type_into("#steps", "500")
        browser.click("#generate")
        status = browser.wait_for("document.querySelector('#status').textContent", timeout=30)
        assert status.startswith("422: num_inference_steps:"), status
        assert browser.evaluate("document.querySelector('#steps').classList.contains('invalid')")
        # Issue 29 item 10: the error replaces the previous image, which no longer matches the form.
        assert browser.evaluate("document.querySelector('#result img') === null")
        assert browser.evaluate("document.querySelector('#time').textContent") == ""
        assert browser.console_errors() == []
