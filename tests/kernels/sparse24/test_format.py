"""CPU tests of kernels/sparse24/format.py: our compressed format and torch's CUTLASS layout."""

import pytest
import torch

from kernels.sparse24 import format as fmt
from kernels.sparse24 import prune


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _groups(w):
    n, k = w.shape
    return w.reshape(n, k // 4, 4)


# ---------------------------------------------------------------------------------------------
# compression
# ---------------------------------------------------------------------------------------------


def test_compress_format_by_hand():
    w = torch.tensor([[0.0, 5.0, 0.0, 7.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 3.0, 4.0]])
    values, meta = fmt.compress_24(w)
    assert values.tolist() == [[5.0, 7.0, 1.0, 2.0, 3.0, 4.0]]
    # group 0 keeps (1, 3): 1 | 3 << 2 = 13; group 1 keeps (0, 2): 8; group 2 keeps (2, 3): 14
    assert meta.dtype == torch.uint8 and meta.shape == (1, 2)
    assert meta.tolist() == [[13 | (8 << 4), 14]]
    assert fmt.meta_to_indices(meta, 12).tolist() == [[[1, 3], [0, 2], [2, 3]]]


@pytest.mark.parametrize("shape", [(320, 320), (64, 1280), (5, 12), (3, 36), (1, 4)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_compress_decompress_round_trip_exact(shape, dtype):
    w = torch.randn(shape).to(dtype)
    pruned, _ = prune.prune_24_magnitude(w)
    # groups with fewer than two non-zeros (kept weights that are exactly zero) must survive too
    pruned[0, :4] = 0
    if shape[1] >= 8:
        pruned[-1, 4:8] = torch.tensor([0, 0, 0, 3], dtype=dtype)
    values, meta = fmt.compress_24(pruned)
    n, k = shape
    assert values.shape == (n, k // 2) and values.dtype == dtype
    assert meta.shape == (n, (k // 4 + 1) // 2) and meta.dtype == torch.uint8
    back = fmt.decompress_24(values, meta)
    assert back.dtype == dtype
    assert torch.equal(back.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       pruned.view(torch.int16 if dtype != torch.float32 else torch.int32))
    idx = fmt.meta_to_indices(meta, k)
    assert bool((idx[..., 0] < idx[..., 1]).all())


def test_compress_rejects_non_24():
    w = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"not 2:4 sparse: row 0, group 0"):
        fmt.compress_24(w)


def test_meta_and_values_validation():
    values, meta = fmt.compress_24(prune.prune_24_magnitude(torch.randn(4, 16))[0])
    with pytest.raises(ValueError, match="bytes per row"):
        fmt.meta_to_indices(meta, 32)
    with pytest.raises(TypeError, match="uint8"):
        fmt.meta_to_indices(meta.to(torch.int16), 16)
    with pytest.raises(ValueError, match="rows"):
        fmt.decompress_24(values, meta[:2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cutlass_format_round_trip_cpu(dtype):
    pruned, _ = prune.prune_24_magnitude(torch.randn(64, 128).to(dtype))
    packed, meta = fmt.to_cutlass_format(pruned)
    assert packed.shape == (64, 64) and meta.dtype == torch.int16
    # the kept values are ours, in the same order; only the metadata layout differs
    values, _ = fmt.compress_24(pruned)
    assert torch.equal(packed, values)
    assert torch.equal(fmt.from_cutlass_format(packed, meta), pruned)


def test_cutlass_format_validation():
    with pytest.raises(ValueError, match="not 2:4"):
        fmt.to_cutlass_format(torch.randn(64, 128, dtype=torch.float16))
    with pytest.raises(TypeError, match="float16/bfloat16"):
        fmt.to_cutlass_format(prune.prune_24_magnitude(torch.randn(64, 128))[0])
    with pytest.raises(ValueError, match="N % 32"):
        fmt.to_cutlass_format(prune.prune_24_magnitude(torch.randn(48, 128, dtype=torch.float16))[0])


