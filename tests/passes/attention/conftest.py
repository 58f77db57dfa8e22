"""Fixtures of the attention pass tests."""

import pytest
import torch

from .helpers import tiny_unet


@pytest.fixture(autouse=True)
def _fresh_choices(fresh_choices):
    """No kernel choice (kernels.select) made before a test, none left after it."""
    yield


@pytest.fixture(scope="module")
def unet_case():
    unet = tiny_unet()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 8, 8, generator=g)
    t = torch.tensor([10, 500])
    ehs = torch.randn(2, 7, 32, generator=g)
    with torch.no_grad():
        ref = unet(x, t, ehs).sample
    return unet, (x, t, ehs), ref
