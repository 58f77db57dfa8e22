"""GPU tests of the GEGLU activation kernel (``kernels.geglu.geglu``) at every GEGLU shape of SD1.5 and SDXL
(``benchmarks.sd_shapes``), fp16 and bf16, against diffusers' formula. The output is allocated by the op, so the
caching allocator is first filled with NaN (``kernels.testing.poison_allocator``): an element the kernel forgets to
write stays NaN. GEGLU in one CUDA graph with GroupNorm and LayerNorm: tests/kernels/group_norm/test_group_norm_gpu.py
(GEGLU's other GPU tests: test_projection_gpu.py, test_triton_tma_gemm_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks import sd_shapes
from kernels.geglu import geglu, geglu_ref
from kernels.testing import assert_close_rule, poison_allocator

pytestmark = pytest.mark.gpu

ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 5e-5}


@pytest.mark.parametrize("shape", sd_shapes.unique_geglu_shapes(), ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_geglu_sd_shapes(shape, dtype):
    h = (torch.randn(*shape, device="cuda") * 2).to(dtype)
    poison_allocator(h.numel() * h.element_size())
    out = geglu(h)
    hidden, gate = h.float().chunk(2, dim=-1)
    assert_close_rule(out, hidden * F.gelu(gate), geglu_ref(h, upcast=False), atol=ATOL[dtype])
