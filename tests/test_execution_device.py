"""``runtime.execution_device``: one pipeline instance answers ``_execution_device`` from a cache that follows
its components, and falls back to diffusers' walk whenever an offloading hook is present."""

import json
from types import SimpleNamespace

import pytest
import torch
from diffusers import DiffusionPipeline

from sdfast.runtime import execution_device


@pytest.fixture
def pipe():
    """A stock (not optimized) ``random:tiny`` pipeline on the CPU."""
    import sdfast

    return sdfast.load("random:tiny", optimize=False).pipe


def _stock(pipe):
    return DiffusionPipeline._execution_device.fget(pipe)


def test_cached_answer_is_stocks_and_only_this_instance_changes(pipe):
    cls = type(pipe)
    assert execution_device.install(pipe) and execution_device.install(pipe)  # idempotent
    assert type(pipe) is not cls and isinstance(pipe, cls)
    assert type(pipe).__name__ == cls.__name__ and type(pipe).__module__ == cls.__module__
    assert pipe._execution_device == _stock(pipe)
    assert pipe.__dict__["_sdfast_execution_device"]["device"] == _stock(pipe)
    execution_device.uninstall(pipe)
    assert type(pipe) is cls and "_sdfast_execution_device" not in pipe.__dict__


def test_cache_is_not_consulted_when_components_change(pipe, monkeypatch):
    execution_device.install(pipe)
    walks = []
    stock = DiffusionPipeline._execution_device.fget
    monkeypatch.setattr(DiffusionPipeline, "_execution_device",
                        property(lambda self: walks.append(1) or stock(self)))
    pipe._execution_device, pipe._execution_device
    assert len(walks) == 1  # cached after the first walk
    pipe.vae = type(pipe.vae).from_config(pipe.vae.config)  # a replaced component: walked again
    pipe._execution_device
    assert len(walks) == 2
    pipe.text_encoder.to(torch.float64)  # same device, same identity: still cached
    pipe._execution_device
    assert len(walks) == 2


def test_offloading_hooks_always_take_stocks_walk(pipe, monkeypatch):
    execution_device.install(pipe)

    class Hook:
        execution_device = "cpu"

    pipe.unet._hf_hook = Hook()  # as accelerate's cpu offload leaves it
    walks = []
    stock = DiffusionPipeline._execution_device.fget
    monkeypatch.setattr(DiffusionPipeline, "_execution_device",
                        property(lambda self: walks.append(1) or stock(self)))
    for _ in range(3):
        assert pipe._execution_device == torch.device("cpu")
    assert len(walks) == 3


def test_saved_pipeline_names_the_diffusers_class(pipe, tmp_path):
    name = type(pipe).__name__
    execution_device.install(pipe)
    pipe.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "model_index.json").read_text())["_class_name"] == name


def test_optimize_installs_and_unoptimize_removes(pipe):
    import sdfast

    cls = type(pipe)
    sdfast.optimize(pipe)
    assert execution_device.installed(pipe) and isinstance(pipe, cls)
    sdfast.unoptimize(pipe)
    assert type(pipe) is cls


def test_leaf_level_offloading_hooks_are_seen(pipe, monkeypatch):
    execution_device.install(pipe)
    pipe._execution_device  # cached
    leaf = next(m for m in pipe.unet.modules() if not list(m.children()))
    leaf._diffusers_hook = SimpleNamespace(get_hook=lambda name: None)  # leaf-level group offloading: leaves only
    walks = []
    stock = DiffusionPipeline._execution_device.fget
    monkeypatch.setattr(DiffusionPipeline, "_execution_device",
                        property(lambda self: walks.append(1) or stock(self)))
    pipe._execution_device, pipe._execution_device
    assert len(walks) == 2


def test_a_further_subclass_of_the_pipeline_still_works(pipe):
    execution_device.install(pipe)
    pipe.__class__ = type("Mine", (type(pipe),), {})
    assert pipe._execution_device == _stock(pipe)
    assert execution_device.install(pipe)  # a subclass of ours: installs over it, no recursion
    assert pipe._execution_device == _stock(pipe)


# -- diffusers models: device and dtype ----------------------------------------------------------------------------
def _stock_model(model, name):
    from diffusers import ModelMixin

    return getattr(ModelMixin, name).fget(model)


def test_model_answers_are_stocks_and_only_this_instance_changes(pipe):
    unet, cls = pipe.unet, type(pipe.unet)
    assert execution_device.install_model(unet) and execution_device.install_model(unet)  # idempotent
    assert type(unet) is not cls and isinstance(unet, cls) and type(unet).__name__ == cls.__name__
    assert not execution_device.install_model(pipe.text_encoder)  # transformers: not a diffusers model
    assert (unet.device, unet.dtype) == (_stock_model(unet, "device"), _stock_model(unet, "dtype"))
    unet.to(torch.float64)
    assert unet.dtype == torch.float64 == _stock_model(unet, "dtype")
    execution_device.uninstall_model(unet)
    assert type(unet) is cls


def test_model_dtype_skips_the_fp32_modules_as_stock_does(pipe, monkeypatch):
    vae = pipe.vae
    execution_device.install_model(vae)
    vae.to(torch.float16)
    first = next(n for n, _ in vae.named_parameters()).split(".")[0]
    getattr(vae, first).to(torch.float32)  # the first parameters kept in fp32, as _keep_in_fp32_modules asks
    monkeypatch.setattr(type(vae), "_keep_in_fp32_modules", [first], raising=False)
    assert vae.dtype == torch.float16 == _stock_model(vae, "dtype")
    monkeypatch.setattr(type(vae), "_keep_in_fp32_modules", [], raising=False)
    assert vae.dtype == torch.float32 == _stock_model(vae, "dtype")


def test_model_with_a_diffusers_hook_asks_stock(pipe):
    from diffusers.hooks import apply_layerwise_casting

    vae = pipe.vae
    execution_device.install_model(vae)
    apply_layerwise_casting(vae, storage_dtype=torch.float16, compute_dtype=torch.float32)
    assert vae.dtype == torch.float32 == _stock_model(vae, "dtype")  # the hook's compute dtype, not the storage's
    assert next(vae.parameters()).dtype == torch.float16


def test_optimize_installs_on_the_models_and_unoptimize_removes(pipe):
    import sdfast

    classes = {name: type(m) for name, m in pipe.components.items()}
    sdfast.optimize(pipe)
    assert "_sdfast_original_class" in type(pipe.unet).__dict__ and "_sdfast_original_class" in type(pipe.vae).__dict__
    sdfast.unoptimize(pipe)
    assert {name: type(m) for name, m in pipe.components.items()} == classes
