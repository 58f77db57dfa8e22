"""Test setup: GPU tests carry the ``gpu`` marker and are skipped without CUDA; without CUDA, every
Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` must be set before triton is
imported, hence here)."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Under pytest-xdist each worker process gets its share of the cores for torch's intra-op threads (2 workers on a
# 2-core CI machine: one thread each). With torch's default (every core per process) the workers' OpenMP threads
# spin at every barrier against each other: a tiny ControlNet call measured 10 s that way and 0.13 s with one
# thread (tests/server/test_controlnet_service.py, which set it for its module before this).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _WORKERS > 1 and not HAS_CUDA:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Triton picks interpreter or compiler when a kernel is decorated, i.e. at import: import every kernel
    # module now, so a test that sets TRITON_INTERPRET=0 for a while (the benchmark's, to run the references)
    # cannot leave compiled-mode kernels behind for the tests after it ("0 active drivers" on the CPU).
    import kernels.attention.flash_attention  # noqa: F401,E402
    import kernels.conv.im2col  # noqa: F401,E402
    import kernels.elementwise  # noqa: F401,E402
    import kernels.geglu  # noqa: F401,E402
    import kernels.gemm.fp8_static  # noqa: F401,E402
    import kernels.gemm.int8_outlier  # noqa: F401,E402
    import kernels.gemm.linear_tma  # noqa: F401,E402
    import kernels.sparse24.kernel  # noqa: F401,E402
    import kernels.sparse24.sparsegpt_block  # noqa: F401,E402
    import kernels.gemm.w4a16  # noqa: F401,E402
    import kernels.gemm.w8a8  # noqa: F401,E402
    import kernels.group_norm  # noqa: F401,E402
    import kernels.norm  # noqa: F401,E402


def pytest_configure(config):
    from kernels import select

    select.persist(False)  # tests measure; they neither read nor write the user's saved kernel choices


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


# GroupNorm plan knobs for Triton's interpreter: few, large programs. The interpreter pays per launch and per
# program (a GPU pays for idle SMs, which the default knobs avoid); measured on random:tiny, one 2-step txt2img
# 10.4 -> 7.3 s on the 2-core CI machine, the same pixels. The kernels' own tests (tests/kernels/) keep the
# default knobs, so every plan the GPU runs is still covered there.
INTERPRETER_GN_PLAN = {"target_programs": 1, "tile_elems": 1 << 16, "onepass_max_elems": 1 << 16}


@pytest.fixture(autouse=True)
def _interpreter_group_norm_plans(request, monkeypatch):
    if HAS_CUDA or "kernels" in request.node.path.parts:
        return
    from kernels.group_norm import plan

    for key, value in INTERPRETER_GN_PLAN.items():
        monkeypatch.setitem(plan.TUNING, key, value)


@pytest.fixture
def fresh_choices():
    """No kernel choice made or pinned before the test, none left after it; returns ``select.decisions``."""
    from kernels import select

    select.clear()
    with select.pinned({}):
        yield select.decisions
    select.clear()


@pytest.fixture
def tiny_engine():
    """A fresh ``random:tiny`` engine on the CPU (fp32); about 2 s to build."""
    import sdfast

    return sdfast.load("random:tiny")


@pytest.fixture(scope="module")
def stock_tiny():
    """``random:tiny`` on the CPU, stock pipeline, one per test module: for tests of the service, its workers and
    step batches, not of the kernels. One intra-op thread while it is in use: OpenMP
    threads that spin at every barrier run a tiny model many times slower on a shared 2-core machine."""
    import sdfast

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield sdfast.load("random:tiny", optimize=False)
    finally:
        torch.set_num_threads(threads)
