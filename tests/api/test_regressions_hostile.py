"""Regression tests of the features a hostile review attacked (chunked encoders, the loss's
option attributes, the Trainer's ε and chunk size, the threshold's cosine): the minimal input of
each defect it found, one test each. N ≤ 8, milliseconds each."""

from __future__ import annotations

import pytest
import torch

from hnclip_kernels import chunked_encode


# ---- an encoder pooling over its batch returned one row per chunk, concatenated silently:
# (3, D) for N = 7 in chunks of 3, where the unchunked call gives (1, D)
@pytest.mark.parametrize("chunk_size", [3, 10])
def test_chunked_encode_rejects_an_output_without_one_row_per_input_row(chunk_size):
    x = torch.randn(7, 4)
    with pytest.raises(ValueError, match="one row per input row"):
        chunked_encode(lambda a: a.sum(0, keepdim=True), x, chunk_size)
    with pytest.raises(ValueError, match="one row per input row"):
        chunked_encode(lambda a: a.sum(), x, chunk_size)
    assert torch.equal(chunked_encode(lambda a: 2 * a, x, chunk_size), 2 * x)


# ---- a guard, not a fixed defect: NumPy integers (a config's or an argparse-into-NumPy chunk
# size) are integers, and come back as Python ints; NumPy floats and bools are not
def test_numpy_integer_chunk_sizes_are_accepted():
    import numpy as np

    from hnclip_kernels.chunked import check_chunk_size

    x = torch.randn(5, 4)
    for size in (np.int64(2), np.int32(2), np.uint8(2)):
        assert type(check_chunk_size(size)) is int
        assert torch.equal(chunked_encode(lambda a: 3 * a, x, size), 3 * x)
    for bad in (np.float64(2.0), np.bool_(True)):
        with pytest.raises(TypeError, match="chunk_size"):
            chunked_encode(lambda a: a, x, bad)
