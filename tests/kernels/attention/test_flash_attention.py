"""Flash attention kernel under the Triton interpreter (CPU): small shapes, every branch.

Branches covered: head_dim chunking (40 = 32+16 masked, 64 = 64, 80 = 64+16, 160 = 128+32,
512 = split output columns, 4 = below the 16-column minimum), full and partial key tiles, the
key-padding mask (incl. fully padded rows), the upcast (split-P) flag, fp32 / fp16, strided
(B, L, H, D) views, odd strides (no vectorization hint), and input validation. bf16 is tested on the
GPU only (tests/kernels/attention/test_attention_gpu.py): Triton 3.6's interpreter computes tl.dot on bf16
operands as raw 16-bit integers.
"""

import pytest
import torch

from kernels.attention.flash_attention import (
    _flash_attention_impl,
    attention_ref,
    flash_attention,
    flash_attention_configs,
    head_dim_chunks,
)
from kernels.testing import assert_close_rule

# (dtype, atol) — fp16/bf16 add the rounding of P for the P·V dot on top of torch_lowp's error
DTYPES = [(torch.float32, 1e-5), (torch.float16, 2e-3)]


def _qkv(B, H, Lq, Lk, D, dtype, layout="bhld"):
    if layout == "blhd":  # what a (B, L, H*D) projection gives, viewed as (B, H, L, D)
        q = torch.randn(B, Lq, H, D).to(dtype).transpose(1, 2)
        k = torch.randn(B, Lk, H, D).to(dtype).transpose(1, 2)
        v = torch.randn(B, Lk, H, D).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(B, H, Lq, D).to(dtype)
        k = torch.randn(B, H, Lk, D).to(dtype)
        v = torch.randn(B, H, Lk, D).to(dtype)
    return q, k, v


def _check(q, k, v, dtype, atol, name, **kw):
    out = flash_attention(q, k, v, **kw)
    kpm = kw.get("key_padding_mask")
    ref32 = attention_ref(q, k, v, key_padding_mask=kpm, scale=kw.get("scale"), upcast=True).float()
    if dtype == torch.float32:
        lowp = ref32
    else:
        lowp = attention_ref(q, k, v, key_padding_mask=kpm, scale=kw.get("scale"), upcast=False)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close_rule(out, ref32, lowp, atol=atol, name=name)
    return out


def test_head_dim_chunks():
    assert head_dim_chunks(40) == (32, 16)
    assert head_dim_chunks(64) == (64, 0)
    assert head_dim_chunks(80) == (64, 16)
    assert head_dim_chunks(160) == (128, 32)
    assert head_dim_chunks(512) == (512, 0)
    assert head_dim_chunks(4) == (16, 0)
    for d in range(1, 513):
        d0, d1 = head_dim_chunks(d)
        assert d0 + d1 >= d and d0 >= 16 and (d1 == 0 or d1 >= 16)


@pytest.mark.parametrize("dtype,atol", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "D,Lq,Lk",
    [(40, 77, 77), (40, 130, 7), (64, 1, 130), (64, 130, 77), (80, 7, 130), (160, 77, 7), (512, 7, 77), (4, 33, 7)],
)
def test_shapes(D, Lq, Lk, dtype, atol):
    q, k, v = _qkv(2, 2, Lq, Lk, D, dtype)
    _check(q, k, v, dtype, atol, f"D{D} Lq{Lq} Lk{Lk}")


@pytest.mark.parametrize("D", [40, 64])
def test_strided_blhd_views(D):
    # (B, L, H, D) memory seen as (B, H, L, D): the kernel reads the strides, no copy
    q, k, v = _qkv(2, 2, 77, 130, D, torch.float16, layout="blhd")
    assert not q.is_contiguous()
    _check(q, k, v, torch.float16, 2e-3, "blhd")


def test_fused_qkv_slices_and_odd_strides():
    # q, k, v as slices of one fused projection (B, L, 3, H, D), plus a layout whose strides are
    # odd numbers of elements (vector-alignment factor SA = 1)
    B, L, H, D = 2, 33, 2, 40
    qkv = torch.randn(B, L, 3, H, D, dtype=torch.float16)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    _check(q, k, v, torch.float16, 2e-3, "fused qkv")
    big = torch.randn(B, H, L, D + 3, dtype=torch.float16)  # row stride 43
    q2 = big[..., :D]
    _check(q2, k, v, torch.float16, 2e-3, "odd strides")


def test_output_layout_is_blhd():
    q, k, v = _qkv(2, 2, 7, 7, 64, torch.float16)
    out = flash_attention(q, k, v)
    B, H, L, D = out.shape
    assert out.stride() == (L * H * D, D, H * D, 1)
    merged = out.transpose(1, 2).reshape(B, L, H * D)
    assert merged.data_ptr() == out.data_ptr()  # free reshape


@pytest.mark.parametrize("dtype,atol", DTYPES, ids=["fp32", "fp16"])
def test_key_padding_mask(dtype, atol):
    B, H, Lq, Lk, D = 2, 2, 33, 77, 40
    q, k, v = _qkv(B, H, Lq, Lk, D, dtype)
    kpm = torch.ones(B, Lk, dtype=torch.bool)
    kpm[0, 50:] = False  # padding over a partial tile
    kpm[1, ::3] = False  # scattered
    out = _check(q, k, v, dtype, atol, "mask", key_padding_mask=kpm)
    # a padded key never enters the softmax: changing it changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 60] = 1e4
    v2[0, :, 60] = 1e4
    out2 = flash_attention(q, k2, v2, key_padding_mask=kpm)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_key_padding_mask_broadcast_and_all_padded():
    B, H, Lq, Lk, D = 2, 1, 9, 40, 64
    q, k, v = _qkv(B, H, Lq, Lk, D, torch.float32)
    kpm = torch.zeros(1, Lk, dtype=torch.bool)
    kpm[0, :5] = True
    _check(q, k, v, torch.float32, 1e-5, "broadcast mask", key_padding_mask=kpm)
    none = torch.zeros(B, Lk, dtype=torch.bool)
    none[1, 3] = True
    out = flash_attention(q, k, v, key_padding_mask=none)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all()  # every key padded -> zeros, documented
    torch.testing.assert_close(out[1], v[1, :, 3:4].expand(H, Lq, D))


def test_upcast_flag():
    # Probabilities built so that rounding P to fp16 for P.V loses the whole answer: key 0 has
    # p = 1 and v = -57, keys 1..76 have p = 0.75 + 0.8 * 2**-12 (fp16 rounds it to 0.75) and
    # v = 1. Exact output ~ 76 * 0.8 * 2**-12 / 58 = 2.6e-4; with P in fp16 it is 0.
    # upcast_softmax keeps P fp32-accurate (P_hi + P_lo) and must recover it.
    import math

    Lk, D = 77, 64
    target = 0.75 + 0.8 * 2**-12
    b1 = torch.tensor(math.log(target)).half()
    b2 = ((math.log(target) - b1.double()) * 64).half()
    q = torch.zeros(1, 1, 3, D, dtype=torch.float16)
    q[..., 0], q[..., 1] = 1.0, 1.0 / 64
    k = torch.zeros(1, 1, Lk, D, dtype=torch.float16)
    k[0, 0, 1:, 0], k[0, 0, 1:, 1] = b1, b2
    v = torch.zeros(1, 1, Lk, D, dtype=torch.float16)
    v[0, 0, 0, 0] = -(Lk - 1) * 0.75
    v[0, 0, 1:, 0] = 1.0
    p_true = math.exp(b1.double() + b2.double() / 64)
    assert 0.5 < (p_true - 0.75) / 2**-12 < 0.95  # the construction holds: fp16(p) == 0.75
    ref = attention_ref(q, k, v, scale=1.0).float()  # fp32 reference
    exact = (Lk - 1) * (p_true - 0.75) / (1 + (Lk - 1) * p_true)
    assert abs(ref[0, 0, 0, 0].item() - exact) < 1e-6
    plain = flash_attention(q, k, v, scale=1.0).float()
    up = flash_attention(q, k, v, scale=1.0, upcast_softmax=True).float()
    assert (plain - ref).abs().max().item() > 1e-4  # P rounded to fp16: answer lost
    assert (up - ref).abs().max().item() < 2e-6  # fp32-like P: answer kept
    # and on ordinary inputs the upcast result obeys the usual rule
    q, k, v = _qkv(2, 1, 33, 77, 80, torch.float16)
    _check(q, k, v, torch.float16, 2e-3, "upcast", upcast_softmax=True)


def test_scale_argument():
    q, k, v = _qkv(1, 1, 7, 13, 40, torch.float32)
    _check(q, k, v, torch.float32, 1e-5, "scale", scale=0.37)


def test_op_is_registered_and_traceable():
    q, k, v = _qkv(1, 2, 7, 9, 40, torch.float16)
    out = torch.ops.sdfast.flash_attention(q, k, v, None, 40**-0.5, False)
    assert torch.isfinite(out).all()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fo = torch.ops.sdfast.flash_attention(fq, fk, fv, None, 0.1, False)
        assert fo.shape == q.shape and fo.stride() == out.stride() and fo.dtype == q.dtype
    torch.library.opcheck(torch.ops.sdfast.flash_attention.default, (q, k, v, None, 40**-0.5, False))


def test_reference_fallback_without_interpreter(monkeypatch, caplog):
    # the one logged fallback point: no Triton possible -> the reference runs, and it is logged
    import kernels.attention.flash_attention as fa
    import kernels.dispatch as dispatch

    monkeypatch.setattr(dispatch, "interpret_mode", lambda: False)
    monkeypatch.setattr(fa, "use_triton", dispatch.use_triton)
    dispatch._logged.discard(("flash_attention", "tensors on ['cpu'] and TRITON_INTERPRET is not set"))
    q, k, v = _qkv(1, 1, 5, 6, 40, torch.float32)
    with caplog.at_level("INFO", logger="sdfast.kernels"):
        out = _flash_attention_impl(q, k, v, None, 40**-0.5, False)
    assert "flash_attention" in caplog.text
    torch.testing.assert_close(out, attention_ref(q, k, v))


def test_empty_lengths():
    q, k, v = _qkv(1, 1, 0, 5, 40, torch.float32)
    assert flash_attention(q, k, v).shape == (1, 1, 0, 40)
    q, k, v = _qkv(1, 1, 3, 0, 40, torch.float32)
    assert (flash_attention(q, k, v) == 0).all()


def test_configs_cpu():
    cfgs = flash_attention_configs(512, 2, torch.device("cpu"))
    assert len(cfgs) == 1 and cfgs[0].kwargs["DV0"] == 256  # the split-columns branch
    cfgs = flash_attention_configs(40, 2, None)
    assert cfgs[0].kwargs["D0"] == 32 and cfgs[0].kwargs["D1"] == 16


def test_bad_inputs():
    q, k, v = _qkv(1, 2, 7, 9, 40, torch.float16)
    with pytest.raises(ValueError, match="4D"):
        flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match="expected q"):
        flash_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="expected q"):
        flash_attention(q, k[..., :32], v[..., :32])
    with pytest.raises(ValueError, match="lengths differ"):
        flash_attention(q, k, v[:, :, :5])
    with pytest.raises(TypeError, match="dtypes differ"):
        flash_attention(q, k.float(), v)
    with pytest.raises(TypeError, match="not supported"):
        flash_attention(q.to(torch.int32), k.to(torch.int32), v.to(torch.int32))
    big = torch.randn(1, 1, 4, 1000, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="head_dim 1000"):
        flash_attention(big, big, big)
    with pytest.raises(TypeError, match="bool"):
        flash_attention(q, k, v, key_padding_mask=torch.ones(1, 9))
    with pytest.raises(ValueError, match="key_padding_mask must be"):
        flash_attention(q, k, v, key_padding_mask=torch.ones(1, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="scale"):
        flash_attention(q, k, v, scale=-1.0)


def test_length_bucket():
    """The autotuning bucket: the largest power of two <= n, at least 16 (SD's +128 px second size stays in it)."""
    from kernels.attention.buckets import length_bucket

    assert [length_bucket(n) for n in (1, 15, 16, 64, 77, 80, 127, 128, 4096, 5120, 8191)] == [
        16, 16, 16, 64, 64, 64, 64, 128, 4096, 4096, 4096]


def test_config_pruning_depends_on_the_length_bucket_only():
    """The autotuner keys on length buckets, so the configs it times for a bucket must not depend on which of its
    lengths came first: the pruning bound is the top of the bucket."""
    import triton

    from kernels.attention import flash_attention as fa

    tiles = ((128, 64), (128, 128), (64, 64), (128, 32))
    cfgs = [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, D0=64, D1=0, DV0=64, DV1=0)) for bm, bn in tiles]

    def kept(lq, lk):
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in fa._prune_configs(cfgs, {"LQ": lq, "LK": lk})]

    assert kept(32, 77) == kept(63, 77) == [(64, 64)]  # bucket 32: tiles of up to 64 queries
    assert kept(64, 77) == kept(80, 77) == kept(127, 77) == list(tiles)  # bucket 64: up to 128
    assert kept(64, 16) == kept(64, 31) == [(128, 32)]  # keys: bucket 16, tiles of up to 32 keys
