"""``sdfast.pipelines.derive``: the pipeline ``from_pipe`` builds, on the same component objects and options, with no
module cast (diffusers' ``from_pipe`` casts the shared components to float32 unless given a dtype)."""

import pytest
import torch

from sdfast.controlnet import build_random_controlnet
from sdfast.loading import build_random_pipeline
from sdfast.pipelines import derive

CLASSES = {
    "tiny": ["StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline", "StableDiffusionControlNetPipeline",
             "StableDiffusionControlNetImg2ImgPipeline", "StableDiffusionControlNetInpaintPipeline"],
    "tiny-xl": ["StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLInpaintPipeline",
                "StableDiffusionXLControlNetPipeline", "StableDiffusionXLControlNetImg2ImgPipeline",
                "StableDiffusionXLControlNetInpaintPipeline"],
}


@pytest.fixture(scope="module")
def pipes():
    out = {}
    for arch in CLASSES:
        pipe = build_random_pipeline(arch, dtype=torch.float16)  # built on the CPU in fp16: never run here
        pipe.vae.to(torch.float32)  # as the optimizer keeps an SDXL VAE
        out[arch] = (pipe, build_random_controlnet(f"{arch}-controlnet", dtype=torch.float16))
    return out


@pytest.mark.parametrize("arch, name", [(a, n) for a, names in CLASSES.items() for n in names])
def test_derive_is_from_pipe_without_the_cast(pipes, arch, name):
    import diffusers

    pipe, net = pipes[arch]
    extra = {"controlnet": net} if "ControlNet" in name else {}
    ours = derive(pipe, name, **extra)
    assert type(ours) is getattr(diffusers, name)
    assert pipe.unet.dtype == torch.float16 and pipe.vae.dtype == torch.float32  # nothing was cast
    assert all(p.dtype == torch.float16 for p in pipe.text_encoder.parameters())
    ref = getattr(diffusers, name).from_pipe(pipe, **extra)  # (casts the shared modules to fp32)
    assert set(ours.components) == set(ref.components)
    assert all(ours.components[k] is ref.components[k] for k in ref.components)  # the same objects
    options = {k: v for k, v in ref.config.items() if not isinstance(v, (list, tuple))}
    assert {k: ours.config.get(k) for k in options} == options
    pipe.to(torch.float16)  # undo from_pipe's cast for the next case
    pipe.vae.to(torch.float32)


def test_derive_passes_a_list_of_controlnets_and_names_what_is_missing(pipes):
    pipe, net = pipes["tiny"]
    ours = derive(pipe, "StableDiffusionControlNetPipeline", controlnet=[net, net])
    assert type(ours.controlnet).__name__ == "MultiControlNetModel" and list(ours.controlnet.nets) == [net, net]
    with pytest.raises(ValueError, match="needs \\['controlnet'\\]"):
        derive(pipe, "StableDiffusionControlNetPipeline")


def test_an_fp16_engine_stays_fp16_through_its_controlnet_and_derived_pipelines():
    import sdfast

    engine = sdfast.load("random:tiny", dtype=torch.float16, optimize=False, controlnet="random:tiny-controlnet")
    for task in ("img2img", "inpaint"):
        engine.pipeline_for(task)
    modules = (engine.pipe.unet, engine.pipe.vae, engine.pipe.text_encoder, *engine.controlnets)
    assert {p.dtype for m in modules for p in m.parameters()} == {torch.float16}
