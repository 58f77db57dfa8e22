"""``ControlEmbedding``: a ControlNet's control-image embedding computed once per call (CPU: the slot logic and how the
graph runner finds each conditioning's argument; the graphs are GPU tests, ``test_controlnet_gpu``)."""

import torch
from torch.utils import _pytree as pytree

from sdfast.controlnet import build_random_controlnet
from sdfast.runtime.control_embedding import ControlEmbedding
from sdfast.runtime.cross_kv import CrossKV
from sdfast.runtime.cuda_graphs import GraphedForward


def _inputs(net, batch=2):
    g = torch.Generator().manual_seed(0)
    sample = torch.randn(batch, 4, 8, 8, generator=g)
    ctx = torch.randn(batch, 77, net.config.cross_attention_dim, generator=g)
    cond = torch.rand(batch, 3, 64, 64, generator=g)
    return sample, torch.tensor(10), ctx, cond


def _residuals(out):
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def test_reading_the_slot_equals_the_stock_step_and_only_for_that_image():
    net = build_random_controlnet("tiny-controlnet")
    emb = ControlEmbedding(net)
    assert emb.layers() == [net.controlnet_cond_embedding]
    assert emb.params() and emb.params()[0] is next(net.controlnet_cond_embedding.parameters())
    sample, t, ctx, cond = _inputs(net)
    with torch.no_grad():
        ref = _residuals(net(sample, t, ctx, cond, return_dict=False))
        slots = emb.fill(cond)
        assert torch.equal(slots["embedding"], net.controlnet_cond_embedding(cond))
        with emb.reading(slots, cond):
            same = _residuals(net(sample, t, ctx, cond, return_dict=False))
        poisoned = {"embedding": torch.full_like(slots["embedding"], 5.0)}
        with emb.reading(poisoned, cond):
            other = _residuals(net(sample, t, ctx, cond.clone(), return_dict=False))  # another tensor: embedded
            bad = _residuals(net(sample, t, ctx, cond, return_dict=False))
    assert all(torch.equal(a, b) for a, b in zip(same, ref))
    assert all(torch.equal(a, b) for a, b in zip(other, ref))
    assert not all(torch.equal(a, b) for a, b in zip(bad, ref))
    assert "forward" not in net.controlnet_cond_embedding.__dict__  # restored: the weights watch sees no change


def test_a_forward_another_pass_set_is_restored():
    net = build_random_controlnet("tiny-controlnet")
    module = net.controlnet_cond_embedding
    own = module.forward
    module.forward = own  # an instance forward (what a pass leaves)
    emb = ControlEmbedding(net)
    _, _, _, cond = _inputs(net)
    with torch.no_grad(), emb.reading(emb.fill(cond), cond):
        assert module.forward is not own
    assert module.__dict__["forward"] is own


def test_state_follows_in_place_changes_of_the_image_and_weights():
    net = build_random_controlnet("tiny-controlnet")
    emb = ControlEmbedding(net)
    params = emb.params()
    _, _, _, cond = _inputs(net)
    s0 = emb.state(cond, params)
    assert emb.state(cond, params) == s0
    cond.mul_(0.5)
    s1 = emb.state(cond, params)
    assert s1 != s0
    with torch.no_grad():
        params[-1].add_(1)
    assert emb.state(cond, params) != s1


def test_the_runner_finds_each_conditioning_by_name_or_position():
    net = build_random_controlnet("tiny-controlnet")
    kv, emb = CrossKV(net), ControlEmbedding(net)
    assert kv.layers() == []  # stock attention processors: no K/V to take out of the step
    runner = GraphedForward(net, pool=None, conditionings=(kv, emb), parallel_compile=False)
    sample, t, ctx, cond = _inputs(net)
    for args, kwargs in (((sample, t, ctx, cond), {}),
                         ((sample, t), {"encoder_hidden_states": ctx, "controlnet_cond": cond})):
        leaves = pytree.tree_leaves((args, kwargs))
        found = runner._conditioning_indices(leaves, args, kwargs)
        assert len(found) == 1 and found[0][0] is emb and leaves[found[0][1]] is cond
    args = (sample, t, ctx)  # no control image among the arguments
    assert runner._conditioning_indices(list(args), args, {}) == []
