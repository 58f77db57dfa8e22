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
    m[0].bias = None  # a parameter set to None (the watch lists only the tensors)...
    assert watch.changed()
    m[0].bias = nn.Parameter(torch.zeros(4))  # ...and back to a tensor
    assert watch.changed() and not watch.changed()
    m[0].register_parameter("extra", m[0].bias)  # one tensor moved to another slot
    m[0].bias = None
    assert watch.changed()
    m[1]._parameters = {k: nn.Parameter(v.detach().clone()) for k, v in m[1]._parameters.items()}  # a dict replaced
    assert watch.changed() and not watch.changed()
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


def test_python_side_forward_changes_below_the_root_are_changes():
    """Hooks, a replaced instance forward, an attention processor or FreeU-style factors change what a captured
    graph ran; hooks on the root do not (they run around the graph runner, outside the graph)."""
    m = _model()
    watch = WeightsWatch(m)
    h = m.register_forward_hook(lambda mod, a, out: out)  # the root: the benchmark's and the engine's own hooks
    assert not watch.changed()
    h.remove()
    h = m[0].register_forward_hook(lambda mod, a, out: out * 0)
    assert watch.changed()
    h.remove()
    assert watch.changed()
    h = m[2].register_forward_pre_hook(lambda mod, a: a)
    assert watch.changed()
    h.remove()
    watch.changed()
    m[1].forward = lambda x: x  # a forward replaced on the instance
    assert watch.changed()
    m[2].processor = object()  # diffusers' Attention.set_processor
    assert watch.changed()
    m[2].s1 = 0.9  # enable_freeu on an up block
    assert watch.changed() and not watch.changed()
    m[2].s1 = 1.1
    assert watch.changed()
    for factor in ("s2", "b1", "b2"):
        setattr(m[2], factor, 0.5)
        assert watch.changed() and not watch.changed()
    g = torch.nn.modules.module.register_module_forward_hook(lambda mod, a, out: out)
    try:
        assert watch.changed()
    finally:
        g.remove()
    assert watch.changed() and not watch.changed()


def test_graph_runner_runs_modules_with_hooks_below_the_root_eagerly():
    """A replayed graph would skip a hook (a calibration collecting activations, a user's hook): while a module
    below the root has one, the runner runs eagerly; hooks on the root run around the runner anyway."""
    from sdfast.runtime.cuda_graphs import GraphedForward

    m = _model()
    runner = GraphedForward(m, pool=None)
    assert not runner.hooked()
    h = m[2][0].register_forward_pre_hook(lambda mod, a: None)
    assert runner.hooked()  # seen at the next call, without waiting for the pipeline's check
    h.remove()
    assert runner.hooked()  # a removal takes no new handle id: eager (always right) until the next full check
    assert runner.watch.changed() and not runner.watch.hooked  # GraphCache.check at the next pipeline call
    root = m.register_forward_hook(lambda mod, a, out: out)
    assert not runner.hooked()
    root.remove()


def test_transformers_output_capturing_hooks_do_not_make_the_text_encoder_eager():
    """transformers installs hooks on the CLIP encoder layers at the first call (to collect hidden_states into
    the output, which a graph's static output holds): they are not a reason to run eagerly."""
    import sdfast

    engine = sdfast.load("random:tiny-xl", optimize=False)
    engine.txt2img("a cat", num_inference_steps=1, width=64, height=64, seed=0)
    te = engine.pipe.text_encoder_2
    assert any(m._forward_hooks for m in te.modules())  # the library's hooks are there
    assert not WeightsWatch(te).hooked

    def output_capturing_hook(mod, a, out):  # a hook of ours by that name: only transformers' is exempt
        return out

    m = _model()
    m[0].register_forward_hook(output_capturing_hook)
    assert WeightsWatch(m).hooked
    output_capturing_hook.__module__ = "transformers.utils.output_capturing"
    m = _model()
    m[0].register_forward_hook(output_capturing_hook)
    assert not WeightsWatch(m).hooked
    m[0].register_forward_hook(lambda mod, a, out: out)
    assert WeightsWatch(m).hooked


def test_transformers_output_capturing_hooks_installed_after_the_snapshot_change_nothing():
    """The graph runner snapshots a text encoder before its first (capture) call, and transformers installs its
    output-capturing hooks during that call. Those hooks must not count as a change: they did, and every text
    encoder's graph was captured a second time at the next pipeline call (once per encoder, tens of ms on SDXL). A hook of the user's still does."""
    import sdfast

    engine = sdfast.load("random:tiny-xl", optimize=False)
    te = engine.pipe.text_encoder_2
    watch = WeightsWatch(te)
    assert not any(m._forward_hooks for m in te.modules())  # nothing installed yet
    engine.txt2img("a cat", num_inference_steps=1, width=64, height=64, seed=0)
    assert any(m._forward_hooks for m in te.modules())  # transformers' hooks, from the first call
    assert not watch.changed()
    layer = next(m for m in te.modules() if m._forward_hooks)  # a module that has transformers' hook
    layer.register_forward_hook(lambda mod, a, out: out)
    assert watch.changed() and watch.hooked


def test_check_early_checks_now_and_the_next_check_leaves_those_out_once():
    """``GraphCache.check_early`` (the engine's check of the denoising nets while the text encoders run): the full
    check happens at once (a replaced weight drops that runner's graphs), the pipeline's ``check`` that follows
    leaves those runners out, and only that one; ``forget_early`` cancels it."""
    from sdfast.runtime.cuda_graphs import GraphCache, GraphedForward

    unet, vae = _model(), _model()
    cache = object.__new__(GraphCache)  # its pool and stream need CUDA: only the bookkeeping is under test
    cache.runners = {"unet": GraphedForward(unet, pool=None), "vae_decoder": GraphedForward(vae, pool=None)}
    cache._early = frozenset()
    runner = cache.runners["unet"]
    runner.graphs["signature"] = None
    unet[0].weight = nn.Parameter(torch.randn(4, 4))
    assert cache.check_early([unet]) == 1 and not runner.graphs  # checked now: the stale graph is gone
    assert cache.checked_early() == {"unet"}
    assert cache.check(names=("vae_decoder",)) == 1 and cache.checked_early() == {"unet"}  # only a full check takes it
    cache.runners["vae_decoder"].check_due = False
    assert cache.check() == 1 and not runner.check_due and cache.runners["vae_decoder"].check_due
    assert cache.check() == 2 and runner.check_due  # once only
    runner.check_due = False
    cache.check_early([unet])
    cache.forget_early()
    assert cache.check() == 2 and runner.check_due


def test_an_unchanged_module_is_checked_by_its_fingerprint_alone():
    """The check before every call (about 2,000 modules on SDXL) compares the fingerprint and stops there when it is
    the same; only a changed fingerprint computes the state, and one that leaves the state as it was (a parameter
    replaced by another over the same storage) renews the fingerprint, so the next check is the short one again."""
    m = _model()
    watch = WeightsWatch(m)
    computed = []
    state = watch._state
    watch._state = lambda: computed.append(1) or state()
    assert not watch.changed() and not computed
    h = m.register_forward_hook(lambda mod, a, out: out)  # the root's hooks come and go at every engine call
    m.flag = True
    assert not watch.changed() and not computed
    h.remove()
    assert not watch.changed() and not computed
    m[0].weight = nn.Parameter(m[0].weight.data)  # a new object over the same storage: the same state
    assert not watch.changed() and computed == [1]
    assert not watch.changed() and computed == [1]
    m[0].weight.data = torch.zeros(4, 4)
    assert watch.changed()


def test_changes_the_sizes_do_not_show_are_changes():
    """What the fingerprint must see although no dict changes size: a hook removed and another registered on the
    same module, a forward set where another attribute went, a child or a parameter swapped for another."""
    m = _model()
    watch = WeightsWatch(m)
    h = m[0].register_forward_hook(lambda mod, a, out: out)
    assert watch.changed() and watch.hooked
    h.remove()
    h = m[0].register_forward_hook(lambda mod, a, out: out)
    assert watch.changed() and watch.hooked
    h.remove()
    assert watch.changed() and not watch.hooked
    m[1].extra = 1
    assert not watch.changed()
    del m[1].extra
    m[1].forward = lambda x: x
    assert watch.changed()
    m[2][0] = nn.Linear(4, 2, bias=False)
    assert watch.changed()
    b = m[0].bias
    m[0].weight, m[0].bias = nn.Parameter(b.data.new_zeros(4, 4)), b
    assert watch.changed() and not watch.changed()
    del m[1].forward
    m[1].processor = object()
    assert watch.changed() and not watch.changed()
