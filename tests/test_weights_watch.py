"""``WeightsWatch``: what the CUDA-graph cache checks before every pipeline call (CPU; no graphs needed)."""

import torch
from torch import nn

from sdfast.runtime.cuda_graphs import WeightsWatch


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.GroupNorm(2, 4), nn.Sequential(nn.Linear(4, 2, bias=False)))


def test_in_place_updates_are_not_changes():
    m = _model()
    watch = WeightsWatch(m)
    with torch.no_grad():
        m[0].weight.copy_(torch.randn(4, 4))  # a fused LoRA: the graphs read the storage
        m[2][0].weight.mul_(2)
    assert not watch.changed()


def test_replaced_moved_or_restructured_weights_are_changes():
    m = _model()
    watch = WeightsWatch(m)
    m[0].weight = nn.Parameter(torch.randn(4, 4))  # a replaced parameter
    assert watch.changed() and not watch.changed()
    m[1].weight.data = torch.ones(4)  # new storage under the same Parameter
    assert watch.changed()
    m.register_buffer("scale", torch.ones(1))  # a new buffer
    assert watch.changed()
    m[2][0] = nn.Linear(4, 2)  # a replaced submodule (what a LoRA loader does)
    assert watch.changed()
    m.to(torch.float64)  # every storage moves
    assert watch.changed() and not watch.changed()


def test_adapter_state_of_tuner_layers_is_watched():
    class Tuner(nn.Linear):  # the attributes of a PEFT BaseTunerLayer that decide its forward
        merged_adapters: list = []
        active_adapters = ["a"]
        disable_adapters = False

        def __init__(self):
            super().__init__(4, 4)
            self.scaling = {"a": 1.0}

    m = nn.Sequential(Tuner())
    watch = WeightsWatch(m)
    m[0].scaling["a"] = 0.5  # set_adapters(..., adapter_weights=[0.5])
    assert watch.changed()
    m[0].merged_adapters = ["a"]  # fuse_lora
    assert watch.changed()
    m[0].disable_adapters = True  # disable_lora
    assert watch.changed() and not watch.changed()
