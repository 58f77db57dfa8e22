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
    a = tiny_engine.txt2img("a cat", seed=3, num_inference_steps=2, height=32, width=32)
    b = loaded.txt2img("a cat", seed=3, num_inference_steps=2, height=32, width=32)
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


# --- issue 29 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("drop, component", [
    ("first_stage_model.", "the VAE (first_stage_model.*)"),
    ("cond_stage_model.", "the text encoder"),
])
def test_a_single_file_missing_a_component_is_model_not_found_naming_it(tmp_path, drop, component):
    """Issue 29, item 5: diffusers' bare ``SingleFileComponentError`` ("Failed to load AutoencoderKL") came through
    ``sdfast.load``; a ModelNotFoundError naming the component is what callers catch."""
    from safetensors.torch import save_file

    from tests.ldm_checkpoint import original_state_dict

    sd = original_state_dict(sdfast.load("random:tiny", optimize=False, seed=3).pipe, "sd1")
    save_file({k: v for k, v in sd.items() if not k.startswith(drop)}, str(tmp_path / "partial.safetensors"))
    with pytest.raises(sdfast.ModelNotFoundError, match="is incomplete") as info:
        sdfast.load(str(tmp_path / "partial.safetensors"), optimize=False)
    assert component in str(info.value)


def test_hub_id_offline_recommends_the_hf_command(monkeypatch):
    """Issue 29, item 7: the pinned huggingface_hub answers ``huggingface-cli`` with "Use `hf` instead"."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(sdfast.HubOfflineError) as info:
        sdfast.load("someone/some-model-that-is-not-cached")
    assert "`hf download someone/some-model-that-is-not-cached --local-dir DIR`" in str(info.value)
    assert "huggingface-cli" not in str(info.value)
    assert "`--model DIR`" in str(info.value)  # the same message reaches CLI users, who have no sdfast.load


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("folder") / "tiny"
    sdfast.load("random:tiny", optimize=False).pipe.save_pretrained(path)
    return path


def _broken_copy(tiny_folder, tmp_path, edit):
    import shutil

    path = tmp_path / "broken"
    shutil.copytree(tiny_folder, path)
    edit(path)
    return path


def _set_unet_in_channels(path):
    import json

    config = json.loads((path / "unet" / "config.json").read_text())
    config["in_channels"] = "four"
    (path / "unet" / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("edit, message", [
    (lambda p: (p / "text_encoder" / "config.json").unlink(), "component 'text_encoder' (CLIPTextModel)"),
    (lambda p: (p / "vae" / "config.json").write_text('{"a":'), "component 'vae' (AutoencoderKL): "),
    (lambda p: (p / "scheduler" / "scheduler_config.json").write_text("[1]"), "component 'scheduler' (PNDMScheduler)"),
    (_set_unet_in_channels, "component 'unet'"),
])
def test_a_broken_component_config_names_the_component(tiny_folder, tmp_path, edit, message):
    """Issue 29, item 8: a text encoder without its config.json failed on every weight's shape with transformers'
    "You set `ignore_mismatched_sizes` to `False`" (an option sdfast does not have), a bad config value with a bare
    TypeError; the error names the component."""
    with pytest.raises(sdfast.ModelNotFoundError) as info:
        sdfast.load(str(_broken_copy(tiny_folder, tmp_path, edit)), optimize=False)
    assert message in str(info.value)
    assert "ignore_mismatched_sizes" not in str(info.value)


def test_loading_a_folder_uses_no_deprecated_argument(tiny_folder):
    """Issue 29, item 8: ``from_pretrained(torch_dtype=...)`` printed diffusers' "`torch_dtype` is deprecated"."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sdfast.load(str(tiny_folder), optimize=False)
    assert not [w for w in caught if "torch_dtype" in str(w.message)]


def test_the_torchvision_messages_are_dropped_only_while_loading():
    """Issue 29, item 8: the filter for transformers' "requires torchvision" message is scoped to the load."""
    import logging

    from sdfast.loading import quiet_loading

    logger = logging.getLogger("transformers.utils.import_utils")
    record = logging.LogRecord(logger.name, logging.WARNING, __file__, 1,
                               "`CLIPImageProcessor` requires torchvision (not installed); falling back to x", None, None)
    other = logging.LogRecord(logger.name, logging.WARNING, __file__, 1, "something else", None, None)
    diffusers = logging.getLogger("diffusers.models.modeling_utils")
    empty = logging.LogRecord(diffusers.name, logging.WARNING, __file__, 1, "There are modules in AutoencoderKL that "
                              "should be kept in float32: []. Casting directly with `to()` ...", None, None)
    with quiet_loading():
        assert not logger.filter(record) and logger.filter(other) and not diffusers.filter(empty)
    assert logger.filter(record) and diffusers.filter(empty)


# --- inpainting checkpoints (issue 31) ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch, family, cls", [("tiny-inpaint", "sd1", "StableDiffusionInpaintPipeline"),
                                               ("tiny-xl-inpaint", "sdxl", "StableDiffusionXLInpaintPipeline")])
def test_a_single_file_inpainting_checkpoint_loads_as_its_inpaint_architecture(tmp_path, monkeypatch, arch, family, cls):
    """A checkpoint whose UNet ``conv_in`` takes 9 input channels loads offline with the inpaint configs: the
    pipeline class an inpainting checkpoint's model_index.json names, every weight as saved, inpaint's image."""
    import numpy as np
    from PIL import Image
    from safetensors.torch import save_file

    from sdfast.loading import _checkpoint_architecture
    from tests.ldm_checkpoint import original_state_dict

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = sdfast.load(f"random:{arch}", optimize=False, seed=3)
    path = tmp_path / f"{arch}.safetensors"
    save_file(original_state_dict(source.pipe, family), str(path))
    assert _checkpoint_architecture(path) == arch
    loaded = sdfast.load(str(path), optimize=False)
    assert type(loaded.pipe).__name__ == cls and loaded.pipe.unet.config.in_channels == 9
    assert loaded.tasks == ("inpaint",)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        if getattr(source.pipe, name, None) is None:
            continue
        ours, ref = getattr(loaded.pipe, name).state_dict(), getattr(source.pipe, name).state_dict()
        assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref), name
    image = Image.fromarray((np.random.RandomState(0).rand(32, 32, 3) * 255).astype(np.uint8))
    mask = np.zeros((32, 32), np.uint8)
    mask[8:24, 8:24] = 255
    a, b = (e.inpaint(image, mask, "a cat", seed=5, num_inference_steps=2)[0] for e in (loaded, source))
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_a_conv_in_of_no_shipped_shape_names_the_shapes_there_are(tmp_path):
    from safetensors.torch import save_file

    odd = {"cond_stage_model.transformer.text_model.final_layer_norm.weight": torch.ones(4),
           "model.diffusion_model.input_blocks.0.0.weight": torch.randn(32, 5, 3, 3)}
    save_file(odd, str(tmp_path / "odd.safetensors"))
    with pytest.raises(sdfast.ModelNotFoundError) as info:
        sdfast.load(str(tmp_path / "odd.safetensors"))
    assert "a sd1 checkpoint whose UNet has 32 conv_in channels and 5 input channels" in str(info.value)
    assert "sd15 (320), tiny (32), sd15-inpaint (320, 9 input channels), tiny-inpaint (32, 9 input channels)" \
        in str(info.value)
