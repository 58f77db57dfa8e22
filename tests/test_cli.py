"""Issue 2: the CLI writes PNGs, and bad input is one line and exit code 2."""

import subprocess
import sys

import pytest
from PIL import Image

from sdfast.cli import main


def test_txt2img_writes_png(tmp_path, capsys):
    out = tmp_path / "img.png"
    assert main(["txt2img", "a photo of a cat", "--steps", "1", "--size", "40x24", "--seed", "1", "--out", str(out)]) == 0
    assert Image.open(out).size == (40, 24)
    captured = capsys.readouterr()
    assert f"saved {out}" in captured.out
    assert "random weights" in captured.err


def test_n_images_get_numbered_paths(tmp_path):
    assert main(["txt2img", "a cat", "--steps", "1", "--n", "2", "--size", "32x32", "--out", str(tmp_path / "x.png")]) == 0
    assert (tmp_path / "x_0.png").is_file() and (tmp_path / "x_1.png").is_file()


def test_png_carries_the_generation_parameters(tmp_path):
    """Each file holds what made it (the service's ``sdfast`` text chunk): enough to generate it again."""
    import json

    out = tmp_path / "x.png"
    args = ["txt2img", "a cat", "--steps", "1", "--n", "2", "--seed", "7", "--negative", "blur", "--guidance", "5",
            "--scheduler", "ddim", "--size", "40x24", "--out", str(out)]
    assert main(args) == 0
    for i in range(2):
        params = json.loads(Image.open(tmp_path / f"x_{i}.png").text["sdfast"])
        assert params == {"prompt": "a cat", "negative_prompt": "blur", "seed": 7 + i, "steps": 1, "guidance_scale": 5.0,
                          "scheduler": "ddim", "width": 40, "height": 24, "model": "random:tiny"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--size", "100x64"], "--size: width must be a positive multiple of 8"),
        (["--steps", "0"], "--steps: must be an integer >= 1"),
        (["--guidance", "-2"], "--guidance: must be a number in [0, 100]"),
        (["--guidance", "1e308"], "--guidance: must be a number in [0, 100]"),  # refused before the load, not NaN after
        (["--n", "0"], "--n: must be an integer >= 1"),
        (["--scheduler", "nope"], "known: ddim"),
        (["--model", "/does/not/exist"], "no such folder"),
        (["--model", "random:nope"], "random:tiny"),
        (["--size", "0x64"], "--size: width"),
        (["--size", "0x0"], "--size: height"),
        (["--guidance", "inf"], "--guidance"),
        (["--seed", "99999999999999999999"], "--seed: must be an integer"),
        (["--model", ""], "--model is empty"),
        (["--out", "x.unknownext"], "--out: sdfast writes .png, .jpg/.jpeg or .webp files (got '.unknownext')"),
        (["--out", "x.bmp"], "--out: sdfast writes .png, .jpg/.jpeg or .webp files (got '.bmp')"),  # PIL knows .bmp
        (["--quality", "80"], "--quality: only for .jpg/.jpeg and .webp files; PNG (x.png) is lossless"),
        (["--out", "x.jpg", "--quality", "101"], "--quality: must be an integer in [0, 100]"),
        (["--out", "/proc/x.png"], "cannot create a file in /proc"),
        (["--out", "/dev/null/x.png"], "/dev/null is a file, not a folder"),
        (["--size", "100000x100000"], "at most 8192"),
        (["--steps", "x"], "invalid int value"),
        (["--size", "-64x64"], "expected one argument"),
        (["--steps", "5000"], "--steps: at most 999"),
        (["--steps", "1000"], "at most 999"),
        (["--scheduler", "lcm", "--steps", "60"], "--steps: at most 50"),
        (["--vae-decoder-dtype", "int8"], "invalid choice: 'int8'"),
        (["--no-optimize", "--vae-decoder-dtype", "bfloat16"], "--vae-decoder-dtype is an optimization"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, monkeypatch, args, message):
    """Bad input answers before the model loads (one line, exit 2), and nothing is written."""
    import sdfast

    if message not in ("no such folder", "random:tiny"):  # those two are found by trying to load
        monkeypatch.setattr(sdfast, "load", lambda *a, **k: pytest.fail("the model was loaded before the input was checked"))
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["txt2img", "a cat", "--out", str(tmp_path / "x.png"), *args])
    except SystemExit as e:  # argparse's own errors exit from inside parse
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 or "note:" in err[0], err  # one line (after the random-weights note, when loading)
    assert err[-1].startswith("sdfast: error:") and message in err[-1]
    assert not (tmp_path / "x.png").exists()


def test_txt2img_validates_its_request_once_and_the_engine_runs_that_request(tmp_path, monkeypatch):
    """Issue 30, item 5: the CLI checked its arguments and then ``Engine.txt2img`` checked them again. Now it
    builds one ``Txt2ImgRequest`` (one validation, before the load) and ``Engine.run`` takes it as it is."""
    import sdfast.request
    from sdfast.engine import Engine

    checks, runs = [], []
    check = sdfast.request.check_request
    monkeypatch.setattr(sdfast.request, "check_request", lambda **kw: checks.append(kw) or check(**kw))
    run = Engine.run
    monkeypatch.setattr(Engine, "run", lambda self, request, **kw: runs.append(request) or run(self, request, **kw))
    args = ["txt2img", "a cat", "--steps", "1", "--seed", "3", "--negative", "blur", "--out", str(tmp_path / "x.png")]
    assert main(args) == 0
    assert len(checks) == 1 and len(runs) == 1
    assert runs[0].prompts == ("a cat",) and runs[0].negative_prompts == ("blur",) and runs[0].seeds == (3,)
    assert runs[0].height is None and runs[0].num_inference_steps == 1  # the model's native size, resolved by run


def test_out_folder_gets_sdfast_png_inside(tmp_path):
    assert main(["txt2img", "a cat", "--steps", "1", "--size", "32x32", "--out", str(tmp_path / "new") + "/"]) == 0
    (tmp_path / "old").mkdir()
    assert main(["txt2img", "a cat", "--steps", "1", "--size", "32x32", "--out", str(tmp_path / "old")]) == 0
    assert (tmp_path / "new" / "sdfast.png").is_file() and (tmp_path / "old" / "sdfast.png").is_file()


def test_out_without_extension_gets_png_for_one_and_many(tmp_path):
    assert main(["txt2img", "a cat", "--steps", "1", "--size", "32x32", "--out", str(tmp_path / "one")]) == 0
    assert main(["txt2img", "a cat", "--steps", "1", "--n", "2", "--size", "32x32", "--out", str(tmp_path / "many")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many_0.png", "many_1.png", "one.png"]


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_serve_port_out_of_range_is_an_argument_error(port, capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", "random:tiny", "--port", port])
    assert info.value.code == 2 and "port must be an integer in [0, 65535]" in capsys.readouterr().err


def test_serve_on_a_taken_port_fails_before_loading(capsys, monkeypatch):
    import socket

    import sdfast

    pytest.importorskip("uvicorn")
    monkeypatch.setattr(sdfast, "load", lambda *a, **k: pytest.fail("the model was loaded before the port was checked"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "random:tiny", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"sdfast: error: --port: cannot listen on 127.0.0.1:{port} (Address already in use)"]


def test_bench_help_works_from_the_installed_command():
    proc = subprocess.run([sys.executable, "-m", "sdfast.cli", "bench", "--help"], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0 and "--systems" in proc.stdout, proc.stderr[-500:]


def test_console_entry_point_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sdfast.cli", "txt2img", "x", "--size", "8x9"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_verbose_log_lines_name_their_source_once():
    import logging

    from sdfast.cli import _LogFormat

    def line(name, msg):
        return _LogFormat().format(logging.LogRecord(name, logging.INFO, __file__, 1, msg, None, None))

    assert line("sdfast.optimize", "sdfast: optimized 3 modules") == "sdfast: optimized 3 modules"
    assert line("sdfast.server", "worker: out of memory") == "sdfast.server: worker: out of memory"


def test_scheduler_help_lists_every_scheduler(capsys):
    from sdfast.schedulers import SCHEDULERS

    with pytest.raises(SystemExit):
        main(["txt2img", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in SCHEDULERS)


def test_a_non_finite_image_is_one_line_exit_1(tmp_path, capsys, monkeypatch):
    """sdfast's own NonFiniteOutputError (e.g. broken weights) is one error line, not a traceback."""
    import sdfast
    from sdfast.errors import NonFiniteOutputError

    class Engine:
        device, dtype = "cpu", "torch.float32"

        def run(self, *a, **k):  # the CLI hands its built request to Engine.run
            raise NonFiniteOutputError("the decoded image holds NaN or Inf values")

    monkeypatch.setattr(sdfast, "load", lambda *a, **k: Engine())
    assert main(["txt2img", "a cat", "--out", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "sdfast: error: the decoded image holds NaN or Inf values"


# --- issue 29 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, fmt, extra", [("x.jpg", "JPEG", []), ("x.jpeg", "JPEG", ["--quality", "60"]),
                                              ("x.webp", "WEBP", [])])
def test_out_extension_picks_the_format_and_the_parameters_go_in_it(tmp_path, name, fmt, extra):
    """Issue 29, item 6: ``--out x.jpg`` wrote PNG bytes under the .jpg name."""
    from sdfast.png import read_parameters

    out = tmp_path / name
    assert main(["txt2img", "a cat", "--steps", "1", "--seed", "4", "--no-optimize", "--out", str(out), *extra]) == 0
    img = Image.open(out)
    assert img.format == fmt and img.size == (64, 64)
    params = read_parameters(img)
    assert params["prompt"] == "a cat" and params["seed"] == 4 and params["steps"] == 1


_HEAVY = ("torch", "diffusers", "transformers", "triton", "server", "benchmarks")


def test_help_and_argument_errors_import_nothing_heavy():
    """Issue 29, item 8: ``sdfast --help`` and argparse errors took about 8 s (importing sdfast.cli imported torch and
    diffusers). ``import sdfast`` stays light too, and its API names still resolve (lazily)."""
    code = f"""
import sys
import sdfast, sdfast.cli
from sdfast.cli import main
for argv in (["--help"], ["txt2img", "--help"], ["txt2img", "a", "--steps", "x"], ["serve", "--port", "x"]):
    try:
        main(argv)
    except SystemExit:
        pass
heavy = sorted(m for m in {_HEAVY!r} if m in sys.modules)
assert not heavy, heavy
assert sdfast.OptimizeConfig.__name__ == "OptimizeConfig" and "lcm" in sdfast.SCHEDULERS and sdfast.Engine
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_a_folder_run_prints_no_library_noise(tmp_path):
    """Issue 29, item 8: a fresh process loading a folder with ``-v`` on the CPU printed transformers' "requires
    torchvision" messages, diffusers' "`torch_dtype` is deprecated", LCM's "config attributes ... will be ignored",
    "Token indices sequence length is longer than ..." for a chunked 5000-character prompt, and kernel choices
    ("conv3x3: using cuDNN", "using cuBLAS") where there is no GPU to choose on."""
    import os

    import sdfast

    sdfast.load("random:tiny", optimize=False).pipe.save_pretrained(tmp_path / "tiny")
    prompt = ("a watercolor painting of a lighthouse " * 140)[:5000]
    env = dict(os.environ, TRITON_INTERPRET="0")  # a user's CPU: no Triton interpreter
    proc = subprocess.run([sys.executable, "-m", "sdfast.cli", "-v", "txt2img", prompt, "--model", str(tmp_path / "tiny"),
                           "--steps", "1", "--scheduler", "lcm", "--out", str(tmp_path / "x.png")],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "long prompt encoded in" in proc.stderr  # the prompt was chunked, and -v logs sdfast's decisions
    for noise in ("requires torchvision", "torch_dtype", "will be ignored", "Token indices sequence length",
                  "conv3x3", "cuBLAS", "cuDNN"):
        assert noise not in proc.stderr, (noise, proc.stderr[-3000:])


def _incomplete_checkpoint(tmp_path, drop: str):
    from safetensors.torch import save_file

    import sdfast
    from tests.ldm_checkpoint import original_state_dict

    sd = original_state_dict(sdfast.load("random:tiny", optimize=False, seed=3).pipe, "sd1")
    path = tmp_path / "partial.safetensors"
    save_file({k: v for k, v in sd.items() if not k.startswith(drop)}, str(path))
    return path


@pytest.mark.parametrize("command", ["txt2img", "serve"])
def test_a_checkpoint_without_its_vae_is_one_error_line(tmp_path, capsys, command):
    """Issue 29, item 5: a single file without ``first_stage_model.*`` ended in diffusers' SingleFileComponentError
    traceback (exit 1), from ``txt2img`` and ``serve``."""
    path = _incomplete_checkpoint(tmp_path, "first_stage_model.")
    args = ["txt2img", "a cat", "--out", str(tmp_path / "x.png")] if command == "txt2img" else ["serve", "--port", "0"]
    assert main([*args[:1], "--model", str(path), *args[1:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("sdfast: error: checkpoint") and "no weights for the VAE (first_stage_model.*)" in err[-1]
    assert not any("Traceback" in line for line in err)


def _init_png(tmp_path, size=(51, 43)):
    import numpy as np

    path = tmp_path / "init.png"
    Image.fromarray((np.random.RandomState(0).rand(size[1], size[0], 3) * 255).astype(np.uint8)).save(path)
    return path


def test_img2img_writes_the_images_at_the_init_images_size_with_its_parameters(tmp_path, capsys):
    from sdfast.png import read_parameters

    init, out = _init_png(tmp_path), tmp_path / "edit.png"
    assert main(["img2img", str(init), "a cat", "--strength", "0.5", "--steps", "4", "--seed", "2", "--n", "2",
                 "--out", str(out)]) == 0
    for i in range(2):
        with Image.open(tmp_path / f"edit_{i}.png") as img:
            params = read_parameters(img)
            assert img.size == (48, 40)  # 51 x 43 rounded down to multiples of 8
    assert params["strength"] == 0.5 and params["init_image"] == str(init) and params["seed"] == 3
    assert "saved" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["{missing}", "a cat"], "image: cannot read"),
    (["{init}", "a cat", "--strength", "0"], "--strength: must be a number in (0, 1]"),
    (["{init}", "a cat", "--strength", "0.1", "--steps", "5"], "--strength: 0.1 x 5 steps runs no step"),
    (["{init}", "a cat", "--size", "64x64"], "unrecognized arguments: --size"),
    (["{wide}", "a cat"], "image: mode I;16 images are clipped by the conversion to 8 bits"),
])
def test_img2img_bad_input_is_one_line_exit_2_before_the_load(tmp_path, capsys, monkeypatch, args, message):
    import numpy as np

    import sdfast

    monkeypatch.setattr(sdfast, "load", lambda *a, **k: pytest.fail("the model was loaded before the input was checked"))
    wide = tmp_path / "16bit.png"  # PIL's conversion to RGB would clip it: refused as the service and the engine do
    Image.fromarray(np.full((40, 48), 40000, np.uint16)).save(wide)
    args = [a.format(missing=tmp_path / "nope.png", init=_init_png(tmp_path), wide=wide) for a in args]
    try:
        code = main(["img2img", *args, "--out", str(tmp_path / "x.png")])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("sdfast: error:") and message in err[-1], err
    assert not (tmp_path / "x.png").exists()



def test_inpaint_writes_the_images_and_a_mask_of_another_size_is_one_line(tmp_path, capsys):
    import numpy as np

    from sdfast.png import read_parameters

    init, mask, out = _init_png(tmp_path, (48, 40)), tmp_path / "mask.png", tmp_path / "inpainted.png"
    m = np.zeros((40, 48), np.uint8)
    m[8:24, 16:40] = 255
    Image.fromarray(m).save(mask)
    assert main(["inpaint", str(init), str(mask), "a cat", "--steps", "3", "--seed", "1", "--out", str(out)]) == 0
    with Image.open(out) as img:
        assert img.size == (48, 40) and read_parameters(img)["mask_image"] == str(mask)
    Image.fromarray(m[:32]).save(mask)
    assert main(["inpaint", str(init), str(mask), "a cat", "--out", str(tmp_path / "x.png")]) == 2
    assert "sdfast: error: mask: must be the image's size, 48x40, got 48x32" in capsys.readouterr().err


def test_txt2img_with_a_controlnet_writes_the_engines_image_and_its_parameters(tmp_path):
    import numpy as np

    import sdfast
    from sdfast.png import read_parameters

    control, out = _init_png(tmp_path, (32, 32)), tmp_path / "cn.png"
    assert main(["txt2img", "a cat", "--controlnet", "random:tiny-controlnet", "--control-image", str(control),
                 "--controlnet-scale", "0.7", "--steps", "2", "--seed", "1", "--no-optimize", "--out", str(out)]) == 0
    engine = sdfast.load("random:tiny", controlnet="random:tiny-controlnet", optimize=False)
    with Image.open(control) as c:
        ref = engine.txt2img("a cat", control_image=c.convert("RGB"), controlnet_conditioning_scale=0.7,
                             num_inference_steps=2, seed=1)[0]
    with Image.open(out) as img:
        assert img.size == (32, 32) and np.array_equal(np.asarray(img), np.asarray(ref))  # the control image's size
        params = read_parameters(img)
    assert params["controlnet"] == ["random:tiny-controlnet"] and params["controlnet_conditioning_scale"] == [0.7]


@pytest.mark.parametrize("args, message", [
    (["--controlnet", "random:tiny-controlnet"], "--control-image: one per --controlnet"),
    (["--control-image", "{init}"], "--control-image: one per --controlnet"),
    (["--controlnet-scale", "0.5"], "--controlnet-scale: only with --controlnet"),
    (["--controlnet", "random:tiny-controlnet", "--control-image", "{missing}"], "--control-image: cannot read"),
    (["--controlnet", "random:tiny-controlnet", "--control-image", "{init}", "--controlnet-scale", "-1"],
     "--controlnet-scale: must be a number in [0, 10]"),
    (["--controlnet", "random:tiny-controlnet", "--control-image", "{init}", "--control-start", "0.6",
      "--control-end", "0.5"], "--control-start: must be below control_guidance_end"),
    (["--control-end", "0.5"], "--control-end: only with --controlnet"),
    (["--controlnet", "random:nope", "--control-image", "{init}"], "--controlnet: unknown built-in ControlNet"),
    (["--controlnet", "{missing}", "--control-image", "{init}"], "--controlnet: "),
    (["--controlnet", "random:tiny-controlnet", "--controlnet", "random:tiny-controlnet", "--control-image", "{init}",
      "--control-image", "{init}", "--control-start", "0.1", "--control-start", "0.2", "--control-start", "0.3"],
     "--control-start: one value, or a list of one per control image (2), got 3"),
])
def test_controlnet_bad_input_is_one_line_exit_2_before_the_load(tmp_path, capsys, monkeypatch, args, message):
    import sdfast

    monkeypatch.setattr(sdfast, "load", lambda *a, **k: pytest.fail("the model was loaded before the input was checked"))
    args = [a.format(missing=tmp_path / "nope.png", init=_init_png(tmp_path)) for a in args]
    try:
        code = main(["txt2img", "a cat", *args, "--out", str(tmp_path / "x.png")])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("sdfast: error:") and message in err[-1], err


def test_img2img_and_inpaint_take_the_files_as_flags_too(tmp_path, capsys):
    import numpy as np

    from sdfast.png import read_parameters

    init, mask = _init_png(tmp_path, (32, 32)), tmp_path / "mask.png"
    m = np.zeros((32, 32), np.uint8)
    m[8:24, 8:24] = 255
    Image.fromarray(m).save(mask)
    common = ["--steps", "2", "--seed", "1", "--no-optimize"]
    assert main(["img2img", "a cat", "--image", str(init), *common, "--out", str(tmp_path / "a.png")]) == 0
    assert main(["img2img", str(init), "a cat", *common, "--out", str(tmp_path / "b.png")]) == 0
    with Image.open(tmp_path / "a.png") as a, Image.open(tmp_path / "b.png") as b:
        assert np.array_equal(np.asarray(a), np.asarray(b)) and read_parameters(a)["init_image"] == str(init)
    assert main(["inpaint", "a cat", "--image", str(init), "--mask", str(mask), *common,
                 "--out", str(tmp_path / "c.png")]) == 0
    with Image.open(tmp_path / "c.png") as c:
        assert read_parameters(c)["mask_image"] == str(mask) and read_parameters(c)["prompt"] == "a cat"
    capsys.readouterr()
    for args, message in [(["img2img", "a", "cat", "--image", str(init)], "img2img takes PROMPT as positional"),
                          (["inpaint", str(init), "a cat"], "inpaint takes IMAGE MASK PROMPT as positional"),
                          (["inpaint", "a cat", "--image", str(init)], "--mask: give it with --image")]:
        assert main([*args, "--out", str(tmp_path / "x.png")]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--cache-interval", "0"], "--cache-interval: must be an integer in [1, 1000]"),
    (["--cache-interval", "1001"], "--cache-interval: must be an integer in [1, 1000]"),
    (["--cache-interval", "2.5"], "invalid int value"),
    (["--cache-branch", "-1"], "--cache-branch: must be an integer in [0, 15]"),
])
def test_deep_cache_bad_values_are_one_line_exit_2_before_the_load(tmp_path, capsys, monkeypatch, args, message):
    import sdfast

    monkeypatch.setattr(sdfast, "load", lambda *a, **k: pytest.fail("the model was loaded before the input was checked"))
    try:
        code = main(["txt2img", "a cat", "--out", str(tmp_path / "x.png"), *args])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("sdfast: error:") and message in err[0], err
    assert not (tmp_path / "x.png").exists()


def test_deep_cache_flags_run_and_a_branch_the_model_lacks_is_exit_2(tmp_path, capsys):
    """``--cache-interval 2 --cache-branch 1`` runs DeepCache (the file records it); random:tiny has four skip
    branches, so ``--cache-branch 4`` is refused after the load, before any step, naming the flag."""
    import json

    out = tmp_path / "x.png"
    base = ["txt2img", "a cat", "--model", "random:tiny", "--no-optimize", "--steps", "3", "--size", "32x32",
            "--seed", "1", "--cache-interval", "2"]
    assert main([*base, "--cache-branch", "1", "--out", str(out)]) == 0
    params = json.loads(Image.open(out).text["sdfast"])
    assert (params["cache_interval"], params["cache_branch"]) == (2, 1)
    capsys.readouterr()
    assert main([*base, "--cache-branch", "4", "--out", str(tmp_path / "y.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("sdfast: error: --cache-branch:") and "[0, 3]" in err[-1], err
    assert not (tmp_path / "y.png").exists()


def test_image_files_are_turned_upright_by_their_exif_orientation(tmp_path):
    """As diffusers' ``load_image`` and the service: a 96x64 JPEG tagged "rotate 90" (orientation 6) is a 64x96
    image; a 16-bit mask keeps its mode for the request to refuse."""
    import numpy as np

    from sdfast.cli import _read_image

    image = Image.new("RGB", (96, 64), (200, 10, 10))
    exif = image.getexif()
    exif[0x0112] = 6
    image.save(tmp_path / "rotated.jpg", exif=exif.tobytes())
    assert _read_image(str(tmp_path / "rotated.jpg")).size == (64, 96)
    Image.fromarray(np.full((40, 48), 40000, np.uint16)).save(tmp_path / "mask16.png")
    assert _read_image(str(tmp_path / "mask16.png"), "mask").mode.startswith("I")
