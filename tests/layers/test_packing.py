"""Packing of symmetric factors for communication (``linalg.pack_symmetric`` / ``unpack_symmetric``).

References from the definition: the packed vector holds exactly the entries on and above the
diagonal (compared as multisets against ``torch.triu_indices``), unpacking restores the matrix
bit for bit, and packing is linear (an all-reduce of packed buffers is the packed sum).
"""

from __future__ import annotations

import pytest
import torch

from kfac_optim.linalg import pack_symmetric, triu_size, unpack_symmetric

SIZES = [0, 1, 2, 3, 4, 5, 8, 9, 64, 65, 130]


def symmetric(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    m = torch.randn(n, n, dtype=torch.float64, generator=generator)
    return m + m.T


@pytest.mark.parametrize("n", SIZES)
def test_packed_entries_are_the_upper_triangle(n: int) -> None:
    matrix = symmetric(n, seed=n)
    packed = pack_symmetric(matrix)
    rows, cols = torch.triu_indices(n, n)
    assert packed.shape == (triu_size(n),)
    torch.testing.assert_close(packed.sort().values, matrix[rows, cols].sort().values, rtol=0, atol=0)


@pytest.mark.parametrize("n", SIZES)
def test_unpack_restores_the_matrix_bit_for_bit(n: int) -> None:
    matrix = symmetric(n, seed=n)
    torch.testing.assert_close(unpack_symmetric(pack_symmetric(matrix), n), matrix, rtol=0, atol=0)


@pytest.mark.parametrize("n", [7, 64])
def test_packing_is_linear_so_a_summed_buffer_is_the_summed_matrix(n: int) -> None:
    a, b = symmetric(n, seed=1), symmetric(n, seed=2)
    total = unpack_symmetric(pack_symmetric(a) + pack_symmetric(b), n)
    torch.testing.assert_close(total, a + b, rtol=0, atol=0)


def test_pack_and_unpack_write_into_given_buffers() -> None:
    n = 9
    matrix = symmetric(n, seed=3)
    bucket = torch.full((triu_size(n) + 5,), float("nan"), dtype=torch.float64)
    part = bucket[2 : 2 + triu_size(n)]
    assert pack_symmetric(matrix, out=part) is part
    assert torch.isnan(bucket[:2]).all() and torch.isnan(bucket[-3:]).all()  # nothing outside
    out = torch.full((n, n), float("nan"), dtype=torch.float64)
    assert unpack_symmetric(part, n, out=out) is out
    torch.testing.assert_close(out, matrix, rtol=0, atol=0)
