"""``cudnn_autotune``: cuDNN's benchmark mode only inside warm-up and capture, the flag restored after."""

from __future__ import annotations

import pytest
import torch

from sdfast import OptimizeConfig
from sdfast.runtime.cuda_graphs import cudnn_autotune


@pytest.mark.parametrize("before", [False, True])
def test_on_inside_restored_after(before, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", before)
    with cudnn_autotune():
        assert torch.backends.cudnn.benchmark is True
    assert torch.backends.cudnn.benchmark is before
    with pytest.raises(RuntimeError, match="boom"), cudnn_autotune():
        raise RuntimeError("boom")
    assert torch.backends.cudnn.benchmark is before  # restored on the way out of an error too
    with cudnn_autotune(False):
        assert torch.backends.cudnn.benchmark is before


def test_config_flag_defaults_on_and_is_checked():
    assert OptimizeConfig().cudnn_benchmark is True
    with pytest.raises(TypeError, match="cudnn_benchmark"):
        OptimizeConfig(cudnn_benchmark="yes")
