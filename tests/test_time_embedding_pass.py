"""The time-embedding packing pass (``sdfast.passes.time_embedding``): the packed projections give each ResNet
block the bias it computed alone, see in-place weight updates, repack after a replacement, and leave blocks they
cannot serve to compute their own."""

import copy
import logging

import pytest
import torch
from torch import nn

import sdfast
from sdfast.config import OptimizeConfig
from sdfast.passes import norms, time_embedding
from sdfast.passes.state import BLOCK_TEMB, TEMB_PACK


@pytest.fixture(scope="module")
def tiny_unet():
    """The tiny UNet with the norm pass, built once (tests get copies)."""
    unet = sdfast.load("random:tiny", optimize=False).pipe.unet
    norms.apply(unet)
    return unet


@pytest.fixture
def unets(tiny_unet):
    """(reference, packed): copies of the tiny UNet with the norm pass, the second to get the time-embedding pass."""
    return copy.deepcopy(tiny_unet), copy.deepcopy(tiny_unet)


@pytest.fixture
def inputs():
    g = torch.Generator().manual_seed(0)
    return dict(sample=torch.randn(2, 4, 8, 8, generator=g), timestep=torch.tensor(10),
                encoder_hidden_states=torch.randn(2, 7, 32, generator=g))


def _run(unet, inputs, **kw):
    with torch.no_grad():
        return unet(**{**inputs, **kw}, return_dict=False)[0]


def _resnets(unet):
    from diffusers.models.resnet import ResnetBlock2D

    return [m for m in unet.modules() if isinstance(m, ResnetBlock2D)]


def _count_projections(monkeypatch):
    """Counts calls of the ResNet blocks' ``time_emb_proj`` modules (``nn.Linear`` with 32 inputs here)."""
    calls = []
    forward = nn.Linear.forward

    def counting(self, x):
        calls.append(self.out_features)
        return forward(self, x)

    monkeypatch.setattr(nn.Linear, "forward", counting)
    return calls


def test_packed_projections_match_each_block_computing_its_own(unets, inputs, monkeypatch):
    ref, unet = unets
    assert time_embedding.apply(unet) == len(_resnets(unet)) == 8
    assert time_embedding.apply(unet) == 0  # already applied
    calls = _count_projections(monkeypatch)
    want = _run(ref, inputs)
    n_ref = len(calls)
    calls.clear()
    got = _run(unet, inputs)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert len(calls) == n_ref - 8  # the 8 blocks' projections ran as one GEMM (F.linear, not their modules)
    # a second call at another timestep: the leader recomputes, nobody reuses the first call's bias
    torch.testing.assert_close(_run(unet, inputs, timestep=torch.tensor(500)), _run(ref, inputs, timestep=torch.tensor(500)),
                               atol=2e-4, rtol=1e-4)


def test_packed_parameters_are_views_so_in_place_updates_are_seen(unets, inputs):
    ref, unet = unets
    time_embedding.apply(unet)
    pack = TEMB_PACK.get(unet)
    blocks = _resnets(unet)
    storage = pack._weight().untyped_storage().data_ptr()
    assert all(b.time_emb_proj.weight.untyped_storage().data_ptr() == storage for b in blocks)
    with torch.no_grad():  # a LoRA fused in place, into the projection and conv1's bias
        for m in (ref, unet):
            b = _resnets(m)[3]
            b.time_emb_proj.weight.mul_(3.0)
            b.conv1.bias.add_(0.5)
            b0 = _resnets(m)[0]
            b0.time_emb_proj.bias.copy_(torch.linspace(-1, 1, b0.time_emb_proj.out_features))
    torch.testing.assert_close(_run(unet, inputs), _run(ref, inputs), atol=2e-4, rtol=1e-4)


def test_a_replaced_parameter_is_repacked(unets, inputs, caplog):
    ref, unet = unets
    time_embedding.apply(unet)
    for m in (ref, unet):
        b = _resnets(m)[5]
        b.time_emb_proj.weight = nn.Parameter(b.time_emb_proj.weight.detach() * 2, requires_grad=False)
    with caplog.at_level(logging.INFO, logger="sdfast"):
        got = _run(unet, inputs)
    assert "repacked" in caplog.text
    torch.testing.assert_close(got, _run(ref, inputs), atol=2e-4, rtol=1e-4)
    pack = TEMB_PACK.get(unet)
    assert len(pack.slices) == 8
    assert _resnets(unet)[5].time_emb_proj.weight.untyped_storage().data_ptr() == pack._weight().untyped_storage().data_ptr()


class _Wrapped(nn.Module):
    """A projection wrapper, as PEFT's LoRA layers are: not a plain ``nn.Linear``."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base
        self.calls = 0

    @property
    def out_features(self):
        return self.base_layer.out_features

    def forward(self, x):
        self.calls += 1
        return self.base_layer(x) * 1.5


@pytest.mark.parametrize("index", [0, 4])  # the leader, another block
def test_a_wrapped_projection_or_conv_is_run_by_its_block(unets, inputs, index):
    ref, unet = unets
    time_embedding.apply(unet)
    for m in (ref, unet):
        b = _resnets(m)[index]
        b.time_emb_proj = _Wrapped(b.time_emb_proj)
        _resnets(m)[index + 1].conv1.register_forward_hook(lambda mod, i, o: o + 0.25)
    got = _run(unet, inputs)
    torch.testing.assert_close(got, _run(ref, inputs), atol=2e-4, rtol=1e-4)
    assert _resnets(unet)[index].time_emb_proj.calls == 1
    pack = TEMB_PACK.get(unet)
    assert id(_resnets(unet)[index]) not in pack.slices and len(pack.slices) == 7
    # the wrapped block's base layer holds its own storage, not a view keeping the dropped pack alive
    w = _resnets(unet)[index].time_emb_proj.base_layer.weight
    assert w.untyped_storage().nbytes() == w.numel() * w.element_size()


def test_a_block_called_alone_computes_its_own_bias(unets, inputs):
    ref, unet = unets
    time_embedding.apply(unet)
    _run(unet, inputs)  # the leader has seen this call's temb
    b_ref, b = _resnets(ref)[2], _resnets(unet)[2]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, b.in_channels, 8, 8, generator=g)
    temb = torch.randn(2, b.time_emb_proj.in_features, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(b(x, temb), b_ref(x, temb), atol=2e-5, rtol=1e-5)


def test_no_repack_inside_cuda_graph_capture(unets, inputs, monkeypatch, caplog):
    """A change seen while a CUDA graph is being captured: no new storage then; every block computes its own."""
    ref, unet = unets
    time_embedding.apply(unet)
    for m in (ref, unet):
        b = _resnets(m)[1]
        b.conv1.bias = nn.Parameter(b.conv1.bias.detach() + 1, requires_grad=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with caplog.at_level(logging.INFO, logger="sdfast"):
        got = _run(unet, inputs)
    assert "repacked" not in caplog.text
    torch.testing.assert_close(got, _run(ref, inputs), atol=2e-4, rtol=1e-4)


def test_undo_gives_each_parameter_its_own_storage(unets, inputs):
    ref, unet = unets
    want = _run(ref, inputs)
    assert time_embedding.apply(unet) == 8
    assert time_embedding.undo(unet) == 8
    assert time_embedding.undo(unet) == 0
    ptrs = [b.time_emb_proj.weight.untyped_storage().data_ptr() for b in _resnets(unet)]
    assert len(set(ptrs)) == len(ptrs)
    assert all(BLOCK_TEMB.get(b) is None for b in _resnets(unet))
    torch.testing.assert_close(_run(unet, inputs), want, atol=2e-4, rtol=1e-4)


def test_optimize_packs_the_unet_unless_turned_off():
    pipe = sdfast.load("random:tiny", optimize=False).pipe
    sdfast.optimize(pipe)
    assert pipe._sdfast.counts["temb"] == 8 and TEMB_PACK.get(pipe.unet) is not None
    sdfast.unoptimize(pipe)
    assert getattr(pipe.unet, "_sdfast_temb_pack", None) is None
    sdfast.optimize(pipe, OptimizeConfig(batch_temb=False))
    assert "temb" not in pipe._sdfast.counts and getattr(pipe.unet, "_sdfast_temb_pack", None) is None


def test_to_dtype_repacks_and_keeps_no_old_pack(unets, inputs, caplog):
    """``unet.to(dtype)`` gives every parameter new storage: the next call repacks (logged), and the pack object holds
    no reference to the old packed weight (its storage lives in the parameters only). Here a round trip through
    bf16 (the values rounded the same way in both UNets), compared in fp32."""
    ref, unet = unets
    time_embedding.apply(unet)
    pack = TEMB_PACK.get(unet)
    for m in (ref, unet):
        m.to(torch.bfloat16).to(torch.float32)
    with caplog.at_level(logging.INFO, logger="sdfast"):
        got = _run(unet, inputs)
    assert "repacked" in caplog.text and pack._weight().dtype == torch.float32
    assert not any(isinstance(v, torch.Tensor) and v.numel() >= pack._weight().numel() for v in vars(pack).values())
    torch.testing.assert_close(got, _run(ref, inputs), atol=2e-4, rtol=1e-4)


def test_repack_under_inference_mode_keeps_ordinary_parameters(unets, inputs):
    """A repack inside ``torch.inference_mode`` (a UNet called there after ``.to(...)``) must not turn parameters into
    inference tensors: stock's stay trainable afterwards, so must ours."""
    _, unet = unets
    time_embedding.apply(unet)
    unet.to(torch.float64).to(torch.float32)
    with torch.inference_mode():
        unet(**inputs, return_dict=False)
    w = _resnets(unet)[2].time_emb_proj.weight
    assert not w.is_inference() and w.untyped_storage().data_ptr() == \
        TEMB_PACK.get(unet)._weight().untyped_storage().data_ptr()
    w.requires_grad_(True)  # raises for an inference tensor


def test_a_repack_to_fewer_than_two_blocks_and_undo(unets, inputs):
    """All but one projection wrapped: the repack packs nothing (every block computes its own), and ``undo`` after it
    restores plain parameters with their own storage."""
    ref, unet = unets
    time_embedding.apply(unet)
    for m in (ref, unet):
        for b in _resnets(m)[1:]:
            b.time_emb_proj = _Wrapped(b.time_emb_proj)
    torch.testing.assert_close(_run(unet, inputs), _run(ref, inputs), atol=2e-4, rtol=1e-4)
    pack = TEMB_PACK.get(unet)
    assert pack.leader is None and not pack.slices
    w = _resnets(unet)[3].time_emb_proj.base_layer.weight
    assert w.untyped_storage().nbytes() == w.numel() * w.element_size()
    assert time_embedding.undo(unet) == 0


def test_refresh_repacks_before_a_call(unets, inputs):
    """``refresh`` (the optimizer calls it before each pipeline call's CUDA-graph check) repacks at once after a change,
    so that the check sees the final storage; nothing to do without a change or without the pass."""
    ref, unet = unets
    assert time_embedding.refresh(unet) is False  # not applied
    time_embedding.apply(unet)
    assert time_embedding.refresh(unet) is False
    for m in (ref, unet):
        b = _resnets(m)[4]
        b.time_emb_proj.bias = nn.Parameter(b.time_emb_proj.bias.detach() + 1, requires_grad=False)
    assert time_embedding.refresh(unet) is True and time_embedding.refresh(unet) is False
    pack = TEMB_PACK.get(unet)
    assert pack.state() == pack._state
    torch.testing.assert_close(_run(unet, inputs), _run(ref, inputs), atol=2e-4, rtol=1e-4)


def test_batch_one_and_call_order(unets, inputs):
    """CFG off (batch 1) gives each block its (1, C) slice; the leader is the first down block's first ResNet, and the
    pack lists the mid block before the up blocks (the order a UNet call runs them)."""
    ref, unet = unets
    time_embedding.apply(unet)
    one = {k: (v[:1] if k != "timestep" else v) for k, v in inputs.items()}
    torch.testing.assert_close(_run(unet, one), _run(ref, one), atol=2e-4, rtol=1e-4)
    pack = TEMB_PACK.get(unet)
    assert pack.leader is unet.down_blocks[0].resnets[0]
    order = [id(b) for b in pack.blocks]
    assert order.index(id(unet.mid_block.resnets[0])) < order.index(id(unet.up_blocks[0].resnets[0]))
