"""The attention backends on CPU: the Triton kernel's key-padding masks (interpreter), the chunked TF32 path
(fp32 math on the CPU) and its restoring of the caller's TF32 flag."""

import pytest
import torch

from sdfast.passes import attention as ap
from sdfast.passes.attention import backends as bk

from .helpers import random_qkv


def test_triton_backend_key_padding_mask():
    q, k, v = random_qkv(Lk=40)
    keep = torch.ones(2, 40, dtype=torch.bool)
    keep[1, 20:] = False
    mask4 = keep[:, None, None, :]
    out = ap.AttentionDispatcher("triton")(q, k, v, attn_mask=mask4)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask4)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert ap.key_padding_from_mask(mask4, 2, 40).shape == (2, 40)
    with pytest.raises(NotImplementedError):
        ap.key_padding_from_mask(torch.zeros(2, 1, 1, 40), 2, 40)  # additive float mask
    with pytest.raises(NotImplementedError):
        ap.key_padding_from_mask(torch.ones(2, 2, 1, 40, dtype=torch.bool), 2, 40)  # per-head


@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_tf32_backend_is_chunked_fp32_math_on_the_cpu(monkeypatch, mask):
    monkeypatch.setattr(bk, "_SCORE_CHUNK_ELEMS", 2 * 3 * 37 * 7)  # 7 query rows per chunk: 6 chunks, the last short
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g) for n in (40, 37, 37))
    m = None
    if mask == "bool":
        m = torch.rand(2, 1, 40, 37, generator=g) > 0.3
        m[..., 0] = True
    elif mask == "float":
        m = torch.randn(1, 3, 1, 37, generator=g)
    out = bk._tf32_backend(q, k, v, m, 0.25, False)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(NotImplementedError, match="fp32"):
        bk._tf32_backend(q.half(), k.half(), v.half(), None, 0.25, False)


@pytest.mark.parametrize("api", ["untouched", "legacy", "new"])
def test_tf32_matmul_flag_is_restored_through_the_callers_api(api):
    m = torch.backends.cuda.matmul
    saved = m.fp32_precision
    try:
        if api == "legacy":
            m.allow_tf32 = False
        elif api == "new":
            m.fp32_precision = "ieee"
        before = m.fp32_precision
        with bk._tf32_matmuls():
            assert m.fp32_precision == "tf32"
        # "none" (never set) reads back as "ieee" once the legacy flag was written: the same setting (no TF32)
        assert m.fp32_precision == before or (before, m.fp32_precision) == ("none", "ieee")
        if api != "new":
            assert m.allow_tf32 is False
    finally:
        m.fp32_precision = saved
