"""Edge cases of the Python API that a new user hit (CPU, random:tiny): clear errors, not raw ones."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import sdfast
from sdfast.errors import InvalidRequestError


@pytest.mark.parametrize("kwargs, field", [
    ({"prompt": 123}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"scheduler": ["ddim"]}, "scheduler"),
    ({"guidance_scale": float("inf")}, "guidance_scale"),
    ({"guidance_scale": 1e308}, "guidance_scale"),  # finite, but overflows to NaN in the first step
    ({"guidance_scale": 100.5}, "guidance_scale"),
    ({"num_inference_steps": True}, "num_inference_steps"),
    ({"height": 10**6}, "height"),
    ({"width": 8200}, "width"),
    ({"num_images_per_prompt": 10**7}, "num_images_per_prompt"),
    ({"prompt": ["a"] * 9, "num_images_per_prompt": 8}, "num_images_per_prompt"),
    ({"num_inference_steps": 1001, "scheduler": "ddim"}, "num_inference_steps"),
    ({"num_inference_steps": 1000, "scheduler": "pndm"}, "num_inference_steps"),  # 1000 + steps_offset: past the end
    ({"num_inference_steps": 1000, "scheduler": "unipc"}, "num_inference_steps"),  # NaN at 1000
    ({"num_inference_steps": 51, "scheduler": "lcm"}, "num_inference_steps"),
    ({"prompt": "\ud800 cat"}, "prompt"),  # a lone surrogate: not Unicode text the tokenizer takes
    ({"prompt": ["a cat", "\udc00"]}, "prompt"),
    ({"negative_prompt": "\ud83d"}, "negative_prompt"),
])
def test_bad_arguments_are_invalid_request_errors_naming_the_field(tiny_engine, kwargs, field):
    kw = {"prompt": "a cat", "num_inference_steps": 2, **kwargs}
    with pytest.raises(InvalidRequestError) as info:
        tiny_engine.txt2img(kw.pop("prompt"), **kw)
    assert info.value.field == field


def test_numpy_scalars_are_accepted_like_python_numbers(tiny_engine):
    a = tiny_engine.txt2img("a cat", num_inference_steps=np.int64(1), guidance_scale=np.float32(7.5),
                            seed=np.int64(3), height=np.int64(32), width=32)[0]
    b = tiny_engine.txt2img("a cat", num_inference_steps=1, guidance_scale=7.5, seed=3, height=32, width=32)[0]
    assert a.info["seed"] == "3" and np.array_equal(np.asarray(a), np.asarray(b))


def test_truncation_warning_counts_tokens_and_is_exported(tiny_engine):
    with pytest.warns(sdfast.PromptTruncatedWarning, match=r"dropped \d+ token\(s\) of the prompt\(s\); use"):
        tiny_engine.txt2img("word " * 120, num_inference_steps=1, long_prompt="truncate", negative_prompt="short")


@pytest.mark.parametrize("bad", [{"attention": False}, "yes", [1]])
def test_optimize_must_be_a_bool_or_a_config(bad):
    with pytest.raises(TypeError, match="optimize must be"):
        sdfast.load("random:tiny", optimize=bad)


@pytest.mark.parametrize("kwargs, error", [
    ({"max_graphs": 0}, ValueError), ({"max_graphs": "a"}, ValueError), ({"attention": "yes"}, TypeError),
])
def test_optimize_config_values_are_checked(kwargs, error):
    with pytest.raises(error, match="OptimizeConfig"):
        sdfast.OptimizeConfig(**kwargs)


def test_a_pipeline_object_is_cast_when_asked_and_named_by_path(tmp_path):
    pipe = sdfast.load("random:tiny", optimize=False).pipe
    engine = sdfast.load(pipe, dtype=torch.float64, optimize=False)
    assert engine.pipe.unet.dtype == torch.float64
    pipe.to(torch.float32).save_pretrained(tmp_path / "tiny")
    assert sdfast.load(Path(tmp_path / "tiny"), optimize=False).name == str(tmp_path / "tiny")


def test_sparsify_takes_a_pipeline_like_quantize_and_rejects_other_things():
    engine = sdfast.load("random:tiny", optimize=False)
    assert sdfast.sparsify_(engine.pipe, sdfast.Sparse24Config(min_features=32)) > 0
    with pytest.raises(TypeError, match="nn.Module or a pipeline"):
        sdfast.sparsify_(5)


def test_unoptimize_after_quantizing_fused_projections():
    """With fuse_qkv, quantize_ converts to_q/to_k/to_v but never the fused to_qkv/to_kv (views of them,
    unused once they are converted), and unoptimize then restores the pipeline without error."""
    engine = sdfast.load("random:tiny", optimize=sdfast.OptimizeConfig(fuse_qkv=True))
    names = [n for n, m in engine.pipe.unet.named_modules() if n.endswith((".to_qkv", ".to_kv"))]
    assert names
    stats = sdfast.quantize_(engine.pipe.unet, sdfast.W8A8Config(min_features=32))
    assert not any(n.endswith((".to_qkv", ".to_kv")) for n in stats.layers)
    sdfast.unoptimize(engine.pipe)
    assert getattr(engine.pipe, "_sdfast", None) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert engine.txt2img("a cat", num_inference_steps=1)[0].size == (64, 64)


def test_device_and_dtype_arguments_are_checked():
    with pytest.raises(ValueError, match="device"):
        sdfast.load("random:tiny", device="nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no usable CUDA GPU"):
            sdfast.load("random:tiny", device="cuda")
    with pytest.raises(TypeError, match="dtype"):
        sdfast.load("random:tiny", dtype=torch.int8)
    with pytest.raises(TypeError, match="dtype"):
        sdfast.load("random:tiny", dtype="float8")
    assert sdfast.load("random:tiny", dtype="float32", optimize=False).dtype == torch.float32


@pytest.mark.parametrize("make", [
    lambda: sdfast.W8A8Config(min_features="a"), lambda: sdfast.W8A8Config(min_features=-1),
    lambda: sdfast.W4A16Config(n_grid=0), lambda: sdfast.W4A16Config(n_samples=True),
    lambda: sdfast.Int8OutlierConfig(min_features=0),
])
def test_quantization_config_integers_are_checked(make):
    with pytest.raises(ValueError, match="must be an integer >="):
        make()


def test_optimize_checks_its_config_and_refuses_to_silently_ignore_a_new_one():
    pipe = sdfast.load("random:tiny", optimize=False).pipe
    with pytest.raises(TypeError, match="OptimizeConfig or None"):
        sdfast.optimize(pipe, 123)
    sdfast.optimize(pipe)
    assert sdfast.optimize(pipe) is pipe and sdfast.optimize(pipe, sdfast.OptimizeConfig()) is pipe
    with pytest.raises(ValueError, match="unoptimize"):
        sdfast.optimize(pipe, sdfast.OptimizeConfig(fuse_norms=False))
    sdfast.unoptimize(pipe)
    assert sdfast.optimize(pipe, sdfast.OptimizeConfig(fuse_norms=False))._sdfast.config.fuse_norms is False


def test_host_out_of_memory_is_torch_out_of_memory_error(tiny_engine, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(type(tiny_engine.pipe), "__call__", fail)
    with pytest.raises(torch.OutOfMemoryError, match=r"out of host memory for 1 image\(s\) of 32x32 on cpu"):
        tiny_engine.txt2img("a cat", num_inference_steps=1, width=32, height=32)

    def other(*args, **kwargs):
        raise RuntimeError("some other failure")

    monkeypatch.setattr(type(tiny_engine.pipe), "__call__", other)
    with pytest.raises(RuntimeError, match="some other failure"):
        tiny_engine.txt2img("a cat", num_inference_steps=1)


def test_unoptimize_and_load_reject_what_they_cannot_use():
    from sdfast.errors import ModelNotFoundError

    with pytest.raises(TypeError, match="unoptimize expects"):
        sdfast.unoptimize(None)
    with pytest.raises(ModelNotFoundError, match="model is empty"):
        sdfast.load("  ")


def test_float64_is_refused_when_optimizing_before_anything_loads(monkeypatch):
    """The fused kernels take fp16/bf16/fp32: float64 with optimize=True is a TypeError at load, not on the first
    image; the stock pipeline still runs it, and optimize() refuses a float64 pipeline too."""
    import sdfast.loading

    monkeypatch.setattr(sdfast.loading, "load_pipeline", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(TypeError, match="optimize=False"):
        sdfast.load("random:tiny", dtype=torch.float64)
    monkeypatch.undo()
    engine = sdfast.load("random:tiny", dtype=torch.float64, optimize=False)
    assert engine.txt2img("a cat", num_inference_steps=1, height=64, width=64, seed=0)[0].size == (64, 64)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        sdfast.optimize(engine.pipe)


# --- issue 29 -----------------------------------------------------------------------------------


def test_a_float_size_is_told_to_be_an_integer(tiny_engine):
    """Issue 29, item 8: ``height=64.0`` said "must be a positive multiple of 8 (got 64.0)"."""
    with pytest.raises(InvalidRequestError, match=r"height: must be an integer, a positive multiple of 8 \(got float 64.0\)"):
        tiny_engine.txt2img("a cat", height=64.0)


class _Records(list):
    """Log records of one library logger (diffusers and transformers do not propagate to the root logger)."""


@pytest.fixture
def library_records():
    import logging

    records = _Records()
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in ("diffusers", "transformers")]
    for logger in loggers:
        logger.addHandler(handler)
    yield records
    for logger in loggers:
        logger.removeHandler(handler)


def test_lcm_from_an_sd_config_warns_of_no_ignored_attributes(tiny_engine, library_records):
    """Issue 29, item 8: ``scheduler="lcm"`` printed "The config attributes {'skip_prk_steps': True} were passed to
    LCMScheduler, but are not expected and will be ignored"."""
    from sdfast.schedulers import make_scheduler

    sched = make_scheduler("lcm", tiny_engine.pipe.scheduler.config)
    assert type(sched).__name__ == "LCMScheduler"
    assert sched.config.beta_schedule == tiny_engine.pipe.scheduler.config.beta_schedule
    assert not [r for r in library_records if "will be ignored" in r.getMessage()]


def test_a_chunked_long_prompt_logs_no_token_length_warning(tiny_engine, library_records):
    """Issue 29, item 8: a 5000-character prompt, chunked, still logged transformers' "Token indices sequence length
    is longer than the specified maximum ... will result in indexing errors" (from diffusers' textual-inversion
    check, which tokenizes the whole text). The tokenizer's own once-only flag is left as it was."""
    flags = tiny_engine.pipe.tokenizer.deprecation_warnings
    key = "sequence-length-is-longer-than-the-specified-maximum"
    flags.pop(key, None)  # the tokenizer is shared (cached): as if it had never warned
    tiny_engine.txt2img(("a watercolor lighthouse " * 300)[:5000], num_inference_steps=1, seed=0)
    assert tiny_engine.last_prompt_report.chunks > 1
    assert not [r for r in library_records if "Token indices sequence length" in r.getMessage()]
    assert key not in flags


def test_kernel_choices_are_not_logged_on_a_cpu_without_the_interpreter(monkeypatch, caplog, fresh_choices):
    """Issue 29, item 8: ``-v`` on the CPU logged "conv3x3: using cuDNN" and "geglu_projection: using cuBLAS and the
    GEGLU kernel", where no GPU choice is made."""
    import logging

    from kernels import dispatch
    from kernels.conv import conv3x3 as c3
    from kernels.geglu import projection as gp

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(dispatch, "_logged", set())
    caplog.set_level(logging.INFO, logger="sdfast.kernels")
    x, w = torch.randn(1, 8, 6, 6), torch.randn(4, 8, 3, 3)
    torch.testing.assert_close(c3.conv3x3(x, w), torch.nn.functional.conv2d(x, w, padding=1))
    gp.geglu_projection(torch.randn(3, 16), torch.randn(32, 16))
    choice_lines = [r.getMessage() for r in caplog.records if "conv3x3" in r.getMessage() or "cublas" in r.getMessage()]
    assert not choice_lines  # (the GEGLU activation's own fallback to its reference is logged, as every kernel's)


@pytest.mark.parametrize("fmt, pil", [("png", "PNG"), ("jpeg", "JPEG"), ("jpg", "JPEG"), ("webp", "WEBP")])
def test_encode_image_writes_the_format_with_the_parameters(fmt, pil):
    """Issue 29, item 6: one encoder for the CLI and the service; the parameters survive in every format."""
    import io

    from PIL import Image

    from sdfast.png import encode_image, read_parameters

    params = {"prompt": "un chat é 猫", "seed": 2**63 - 1, "negative_prompt": None}
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8))
    data = encode_image(image, fmt, parameters=params)
    out = Image.open(io.BytesIO(data))
    assert out.format == pil and out.size == (40, 24) and read_parameters(out) == params
    if pil == "PNG":
        assert np.array_equal(np.asarray(out), np.asarray(image))  # lossless
    else:  # a lower quality gives fewer bytes
        assert len(encode_image(image, fmt, quality=30)) < len(encode_image(image, fmt, quality=95))


@pytest.mark.parametrize("fmt, quality, message", [
    ("gif", None, "image format must be png, jpeg or webp"),
    ("png", 80, "quality: PNG is lossless"),
    ("jpeg", -1, r"quality: must be an integer in \[0, 100\]"),
    ("webp", 101, r"quality: must be an integer in \[0, 100\]"),
    ("jpeg", 50.5, "quality: must be an integer"),
    ("jpeg", True, "quality: must be an integer"),
])
def test_encode_image_refuses_what_it_cannot_honour(fmt, quality, message):
    from PIL import Image

    from sdfast.png import encode_image

    with pytest.raises(ValueError, match=message):
        encode_image(Image.new("RGB", (8, 8)), fmt, quality=quality)


def test_every_public_name_the_docs_use_is_in_the_package():
    """``NothingQuantizedWarning`` (what ``quantize_`` warns when nothing was converted, named in the README) and
    ``GenerationCancelled`` (what ``Engine.txt2img(should_stop=...)`` raises) were only reachable through
    private modules: a user could not filter or catch them as ``sdfast.<name>``."""
    import sdfast
    from sdfast.errors import GenerationCancelled
    from sdfast.passes.quantize import NothingQuantizedWarning

    assert sdfast.NothingQuantizedWarning is NothingQuantizedWarning
    assert sdfast.GenerationCancelled is GenerationCancelled
    missing = [name for name in sdfast.__all__ if not hasattr(sdfast, name)]
    assert not missing
