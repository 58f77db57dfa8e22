"""Test setup: GPU tests carry the ``gpu`` marker and are skipped without CUDA; without CUDA, every
Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` must be set before triton is
imported, hence here)."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def tiny_engine():
    """A fresh ``random:tiny`` engine on the CPU (fp32); about 2 s to build."""
    import sdfast

    return sdfast.load("random:tiny")
