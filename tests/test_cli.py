"""Issue 2: the CLI writes PNGs, and bad input is one line and exit code 2."""

import subprocess
import sys

import pytest
from PIL import Image

from sdfast.cli import main


def test_txt2img_writes_png(tmp_path, capsys):
    out = tmp_path / "img.png"
    assert main(["txt2img", "a photo of a cat", "--steps", "2", "--size", "72x48", "--seed", "1", "--out", str(out)]) == 0
    assert Image.open(out).size == (72, 48)
    captured = capsys.readouterr()
    assert f"saved {out}" in captured.out
    assert "random weights" in captured.err


def test_n_images_get_numbered_paths(tmp_path):
    assert main(["txt2img", "a cat", "--steps", "1", "--n", "2", "--out", str(tmp_path / "x.png")]) == 0
    assert (tmp_path / "x_0.png").is_file() and (tmp_path / "x_1.png").is_file()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--size", "100x64"], "width"),
        (["--steps", "0"], "num_inference_steps"),
        (["--guidance", "-2"], "guidance_scale"),
        (["--n", "0"], "num_images_per_prompt"),
        (["--scheduler", "nope"], "known: ddim"),
        (["--model", "/does/not/exist"], "no such folder"),
        (["--model", "random:nope"], "random:tiny"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, args, message):
    assert main(["txt2img", "a cat", "--out", str(tmp_path / "x.png"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("sdfast: error:") and message in err[-1]
    assert not (tmp_path / "x.png").exists()


def test_console_entry_point_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sdfast.cli", "txt2img", "x", "--size", "8x9"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
