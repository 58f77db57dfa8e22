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


def _result_png(browser) -> bytes:
    import base64

    src = browser.evaluate("document.querySelector('#result img').src")
    assert src.startswith("data:image/png;base64,")
    return base64.b64decode(src.split(",", 1)[1])


def test_page_img2img_and_inpainting_upload_and_submit(live, tmp_path):
    """Issue 31: the mode picker shows the image upload and strength (img2img) and the mask upload (inpainting); a
    chosen image sets the size; the page sends them as multipart, and its result is the API's for the same input."""
    import io
    import json

    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(0)
    image, mask = tmp_path / "init.png", tmp_path / "mask.png"
    Image.fromarray((rng.rand(64, 96, 3) * 255).astype(np.uint8)).save(image)
    m = np.zeros((64, 96), np.uint8)
    m[16:48, 24:72] = 255
    Image.fromarray(m).save(mask)

    def pick(mode):
        browser.evaluate(f"(() => {{ const s = document.querySelector('#mode'); s.value = '{mode}';"
                         " s.dispatchEvent(new Event('change')); })()")

    def shown(box):
        return not browser.evaluate(f"document.querySelector('#{box}').hidden")

    def generate_and_read():
        browser.evaluate("document.querySelector('#result').replaceChildren()")
        browser.click("#generate")
        browser.wait_for("(() => { const i = document.querySelector('#result img'); return i && i.complete"
                         " && i.naturalWidth; })() || document.querySelector('#status').textContent", timeout=60)
        assert browser.evaluate("document.querySelector('#status').textContent") == ""
        png = _result_png(browser)
        return png, json.loads(Image.open(io.BytesIO(png)).text["sdfast"])

    ARTIFACTS.mkdir(exist_ok=True)
    with Chromium(CHROMIUM) as browser:
        browser.navigate(live.url + "/", headers={"Authorization": f"Bearer {live.key}"})
        browser.wait_for("document.querySelector('#width').value === '64'", timeout=10)
        assert not any(shown(b) for b in ("image-box", "mask-box", "strength-box"))  # txt2img: none of them
        pick("img2img")
        assert shown("image-box") and shown("strength-box") and not shown("mask-box")
        assert browser.evaluate("document.querySelector('#strength').value") == "0.8"
        browser.set_files("#image", [image])
        browser.wait_for("document.querySelector('#width').value === '96'", timeout=10)  # the image's size
        browser.type_into("#prompt", "a watercolor")
        browser.type_into("#steps", "4")
        browser.type_into("#seed", "7")
        browser.type_into("#strength", "0.5")
        _, params = generate_and_read()
        assert (params["task"], params["strength"], params["seed"], params["width"], params["height"]) == (
            "img2img", 0.5, 7, 96, 64)

        pick("inpaint")
        assert shown("mask-box") and browser.evaluate("document.querySelector('#strength').value") == "1"
        browser.set_files("#mask", [mask])
        png, params = generate_and_read()
        assert (params["task"], params["strength"], params["width"]) == ("inpaint", 1.0, 96)
        with live.client() as c:  # the same request through the API: the same image
            r = c.post("/v1/inpaint", files={"image": image.read_bytes(), "mask_image": mask.read_bytes()},
                       data={"prompt": "a watercolor", "num_inference_steps": "4", "seed": "7", "width": "96",
                             "height": "64", "guidance_scale": "7.5"})
        assert r.status_code == 200, r.text
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), np.asarray(Image.open(io.BytesIO(r.content))))

        browser.type_into("#strength", "0")  # the service's 422 names the field, which is marked
        browser.click("#generate")
        status = browser.wait_for("document.querySelector('#status').textContent", timeout=30)
        assert status.startswith("422: strength:"), status
        assert browser.evaluate("document.querySelector('#strength').classList.contains('invalid')")
        browser.screenshot(ARTIFACTS / "server_page_inpaint.png")
        assert browser.console_errors() == []


def test_page_controlnet_upload_only_with_controlnets(live, tmp_path):
    """Issue 31: the control image upload is shown only when ``/health`` lists ControlNets; in txt2img a chosen
    control image sets the size and goes as multipart with the scale; the result is the API's for the same input; a
    missing control image is the service's 422, its upload marked."""
    import io
    import json

    import numpy as np
    import torch
    from PIL import Image

    import sdfast
    from server.app import create_app

    from .helpers import serving

    control = tmp_path / "edges.png"
    Image.fromarray((np.random.RandomState(1).rand(72, 64, 3) * 255).astype(np.uint8)).save(control)
    with Chromium(CHROMIUM) as browser:  # a service without a ControlNet: no upload
        browser.navigate(live.url + "/", headers={"Authorization": f"Bearer {live.key}"})
        browser.wait_for("document.querySelector('#width').value === '64'", timeout=10)
        assert browser.evaluate("document.querySelector('#control-box').hidden")
        assert browser.evaluate("document.querySelector('#control-scale-box').hidden")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine runs in this process (see test_controlnet_service)
    engine = sdfast.load("random:tiny", controlnet="random:tiny-controlnet", optimize=False)
    try:
        with serving(create_app(engine, api_key="", controlnet="random:tiny-controlnet")) as url, \
                Chromium(CHROMIUM) as browser:
            browser.navigate(url + "/")
            browser.wait_for("document.querySelector('#width').value === '64'", timeout=10)
            assert not browser.evaluate("document.querySelector('#control-box').hidden")
            assert "ControlNet: random:tiny-controlnet" in browser.evaluate(
                "document.querySelector('#model').textContent")
            browser.type_into("#prompt", "a house")
            browser.type_into("#steps", "2")
            browser.type_into("#seed", "5")
            browser.click("#generate")  # no control image yet: the service's 422, the upload marked
            status = browser.wait_for("document.querySelector('#status').textContent", timeout=30)
            assert status.startswith("422: control_image: is required"), status
            assert browser.evaluate("document.querySelector('#control').classList.contains('invalid')")

            browser.set_files("#control", [control])
            browser.wait_for("document.querySelector('#height').value === '72'", timeout=10)  # its size
            browser.type_into("#control-scale", "0.5")
            browser.click("#generate")
            browser.wait_for("(() => { const i = document.querySelector('#result img'); return i && i.complete"
                             " && i.naturalWidth; })() || document.querySelector('#status').textContent", timeout=60)
            assert browser.evaluate("document.querySelector('#status').textContent") == ""
            png = _result_png(browser)
            params = json.loads(Image.open(io.BytesIO(png)).text["sdfast"])
            assert params["controlnets"] == ["random:tiny-controlnet"] and params["controlnet_conditioning_scale"] == [0.5]
            assert (params["width"], params["height"]) == (64, 72)
            assert browser.console_errors() == []
            import httpx

            r = httpx.post(url + "/v1/txt2img", files={"control_image": control.read_bytes()}, timeout=60,
                           data={"prompt": "a house", "num_inference_steps": "2", "seed": "5", "width": "64",
                                 "height": "72", "guidance_scale": "7.5", "controlnet_conditioning_scale": "0.5"})
            assert r.status_code == 200, r.text
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), np.asarray(Image.open(io.BytesIO(r.content))))
    finally:
        torch.set_num_threads(threads)
