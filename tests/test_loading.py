"""Issue 2: every way to give ``model``, the tokenizer, and bad model input."""

import pytest
import torch

import sdfast
from sdfast.architectures import ARCHITECTURES, write_config_folder
from sdfast.loading import clip_tokenizer


def test_tokenizer_ids_are_clips():
    assert clip_tokenizer()("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]


def test_second_tokenizer_pads_with_exclamation_mark():
    ids = clip_tokenizer("!")("a cat", padding="max_length", max_length=8).input_ids
    assert ids == [49406, 320, 2368, 49407, 0, 0, 0, 0]
    ids = clip_tokenizer()("a cat", padding="max_length", max_length=8).input_ids
    assert ids == [49406, 320, 2368, 49407, 49407, 49407, 49407, 49407]


def test_random_tiny_defaults_to_cpu_fp32():
    engine = sdfast.load("random:tiny")
    assert engine.device.type == "cpu" and engine.dtype == torch.float32
    assert engine.default_size == 64


def test_random_weights_are_seeded():
    a = sdfast.load("random:tiny", seed=1).pipe.unet.conv_in.weight
    b = sdfast.load("random:tiny", seed=1).pipe.unet.conv_in.weight
    c = sdfast.load("random:tiny", seed=2).pipe.unet.conv_in.weight
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_unknown_random_architecture_lists_known():
    from sdfast.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="random:tiny.*random:sdxl"):
        sdfast.load("random:nope")


def test_folder_round_trip(tmp_path, tiny_engine):
    tiny_engine.pipe.save_pretrained(tmp_path / "tiny")
    loaded = sdfast.load(str(tmp_path / "tiny"))
    a = tiny_engine.txt2img("a cat", seed=3, num_inference_steps=2)
    b = loaded.txt2img("a cat", seed=3, num_inference_steps=2)
    assert a[0].tobytes() == b[0].tobytes()


def test_pipeline_object_is_used_as_is(tiny_engine):
    assert sdfast.load(tiny_engine.pipe).pipe is tiny_engine.pipe


def test_missing_path_says_so(tmp_path):
    with pytest.raises(sdfast.ModelNotFoundError, match="no such folder"):
        sdfast.load(str(tmp_path / "absent"))


def test_folder_without_index_names_the_file(tmp_path):
    with pytest.raises(sdfast.ModelNotFoundError, match="model_index.json"):
        sdfast.load(str(tmp_path))


def test_incomplete_folder_names_the_component(tmp_path, tiny_engine):
    tiny_engine.pipe.save_pretrained(tmp_path / "p")
    import shutil

    shutil.rmtree(tmp_path / "p" / "vae")
    with pytest.raises(sdfast.ModelNotFoundError, match="vae"):
        sdfast.load(str(tmp_path / "p"))


@pytest.mark.parametrize("text, message", [
    ("{not json", "not a valid pipeline index (JSONDecodeError"),
    ("[1, 2]", "expected a JSON object"),
    ('{"unet": ["diffusers", "UNet2DConditionModel"]}', "'_class_name'"),
    ('{"_class_name": "StableDiffusionPipeline", "unet": []}', "component 'unet' must be [library, class]"),
])
def test_a_malformed_index_is_named(tmp_path, text, message):
    """A truncated or hand-edited model_index.json is a ModelNotFoundError naming the file, not a traceback."""
    (tmp_path / "model_index.json").write_text(text)
    with pytest.raises(sdfast.ModelNotFoundError, match="model_index.json") as info:
        sdfast.load(str(tmp_path))
    assert message in str(info.value)


def test_hub_id_offline_fails_at_once(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(sdfast.HubOfflineError, match="local folder"):
        sdfast.load("someone/some-model-that-is-not-cached")


def test_bad_model_type():
    with pytest.raises(TypeError):
        sdfast.load(42)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_config_folders_are_complete(tmp_path, name):
    import json

    root = write_config_folder(name, tmp_path / name)
    index = json.loads((root / "model_index.json").read_text())
    assert index["unet"] == ["diffusers", "UNet2DConditionModel"]
    assert (root / "unet" / "config.json").is_file() and (root / "scheduler" / "scheduler_config.json").is_file()


def test_random_weights_leave_the_global_rng_alone_and_bad_seeds_are_refused():
    import sdfast

    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    a = sdfast.load("random:tiny", optimize=False, seed=5)
    assert torch.equal(torch.rand(3), want)  # the caller's random state is untouched
    b = sdfast.load("random:tiny", optimize=False, seed=5)
    assert torch.equal(a.pipe.unet.conv_in.weight, b.pipe.unet.conv_in.weight)  # same seed, same weights
    for bad in ("x", -1, 1.5, True):
        with pytest.raises(ValueError, match="seed"):
            sdfast.load("random:tiny", optimize=False, seed=bad)
