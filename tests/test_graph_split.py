"""``GraphedForward._capture_graphs`` with a stand-in for ``torch.cuda.CUDAGraph`` (CPU): where the cut hook ends
the first capture and begins the second, once however often the module runs; one graph when it never runs; every
open capture ended exactly once when the forward or a capture call fails, the original error kept; the hook
removed in every case. Real captures and replays are checked on the GPU (``test_control_overlap_gpu.py``)."""

import contextlib

import pytest
import torch

from sdfast.runtime import cuda_graphs

LOG = []


class _Graph:
    made = 0
    fail_end = None  # the id whose capture_end raises, as an invalidated capture does

    def __init__(self):
        _Graph.made += 1
        self.id, self.state = _Graph.made, "new"

    def capture_begin(self, pool=None):
        assert self.state == "new"
        self.state = "capturing"
        LOG.append(("begin", self.id))

    def capture_end(self):
        LOG.append(("end", self.id))
        if self.state != "capturing":
            raise RuntimeError(f"capture_end of graph {self.id}, which is {self.state}")
        self.state = "ended"
        if _Graph.fail_end == self.id:
            raise RuntimeError("operation failed due to a previous error during capture")


@pytest.fixture(autouse=True)
def fake_graphs(monkeypatch):
    LOG.clear()
    _Graph.made, _Graph.fail_end = 0, None
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())


class _Net(torch.nn.Module):
    def __init__(self, calls=1, fail=None):
        super().__init__()
        self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        self.calls, self.fail = calls, fail

    def forward(self, x):
        if self.fail == "before":
            raise ValueError("before the cut")
        for _ in range(self.calls):
            x = self.a(x)
        if self.fail == "after":
            raise ValueError("after the cut")
        return self.b(x)


def _capture(net, cut):
    return cuda_graphs.GraphedForward(net, pool=None)._capture_graphs((torch.ones(1, 2),), {}, cut, None)


def test_the_cut_ends_the_first_capture_and_begins_the_second_once():
    net = _Net(calls=2)
    first, tail, out = _capture(net, net.a)
    assert (first.id, tail.id) == (1, 2) and out.shape == (1, 2)
    assert LOG == [("begin", 1), ("end", 1), ("begin", 2), ("end", 2)]
    assert not net.a._forward_hooks


def test_one_graph_without_a_cut_or_when_the_module_never_runs():
    net = _Net(calls=0)
    assert _capture(net, net.a)[1] is None and LOG == [("begin", 1), ("end", 1)]
    LOG.clear()
    assert _capture(net, None)[1] is None and LOG == [("begin", 2), ("end", 2)]


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_failing_forward_ends_the_open_capture_once(where):
    net = _Net(fail=where)
    with pytest.raises(ValueError, match="the cut"):
        _capture(net, net.a)
    ends = [e for e in LOG if e[0] == "end"]
    assert ends == ([("end", 1)] if where == "before" else [("end", 1), ("end", 2)])  # the cut ended 1, then 2
    assert not net.a._forward_hooks


def test_a_failing_end_at_the_cut_keeps_its_own_error():
    _Graph.fail_end = 1
    net = _Net()
    with pytest.raises(RuntimeError, match="previous error during capture"):
        _capture(net, net.a)
    assert LOG.count(("end", 1)) == 1 and not net.a._forward_hooks
