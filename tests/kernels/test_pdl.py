"""``kernels.pdl``: when our kernels launch with programmatic dependent launch. (That PDL launches give the
same results as plain ones is a GPU test: ``test_norm_gpu.py``.)"""

from __future__ import annotations

import torch

from kernels import pdl


def test_off_on_the_cpu_and_in_the_interpreter(monkeypatch):
    t = torch.zeros(1)
    for interp in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interp)
        assert not pdl.enabled(t)
        assert pdl.launch_options(t) == {"PDL": False}  # no launch_pdl key: the interpreter has no such launch


def test_on_for_sm90_cuda_tensors_unless_switched_off(monkeypatch):
    class FakeCuda:  # what enabled() reads of a tensor: its device
        device = torch.device("cuda", 0)

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(pdl, "_sm90_or_newer", lambda index: index == 0)
    assert pdl.enabled(FakeCuda())
    assert pdl.launch_options(FakeCuda()) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("SDFAST_PDL", "0")
    assert not pdl.enabled(FakeCuda())
    monkeypatch.delenv("SDFAST_PDL")
    monkeypatch.setattr(pdl, "_sm90_or_newer", lambda index: False)  # an Ampere GPU: griddepcontrol is sm_90+
    assert pdl.launch_options(FakeCuda()) == {"PDL": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(pdl, "_sm90_or_newer", lambda index: True)
    assert not pdl.enabled(FakeCuda())
