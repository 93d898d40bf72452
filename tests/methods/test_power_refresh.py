"""``EigenAdam(refresh="power")``: the held eigenbasis refreshed by one warm-started step of orthogonal
iteration (``kfac_optim.methods.power_refresh``).

The dense reference is computed from first principles, in float64 (``helpers.gram_schmidt_refresh``):
the estimated eigenvalues ``e = diag(QᵀFQ)`` of the held basis ``Q``, then modified Gram–Schmidt on
the columns of ``(F + μI)·Q`` taken in descending order of ``e`` (``μ`` the documented lift), each
orthonormalized column written back to the slot it came from.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers import gram_schmidt_refresh
from torch import Tensor

from kfac_optim import EigenAdam, linalg
from kfac_optim.methods.decompositions import EigenDecomposer
from kfac_optim.methods.power_refresh import PowerRefreshDecomposer
from kfac_optim.schedule import costs


@dataclass
class RefreshedFactor:
    """The ``FactorView`` fields a decomposer reads: a dense factor ``(n, n)`` or ``(groups, n, n)``."""

    running: Tensor
    decomposition: linalg.Eigen | None = None
    diagonal: bool = False
    rank_bound: int | None = None

    @property
    def dim(self) -> int:
        return self.running.shape[-1]

    @property
    def groups(self) -> int:
        return self.running.shape[0] if self.running.dim() == 3 else 1

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.running.shape[:-2])

    @property
    def device(self) -> torch.device:
        return self.running.device


def decaying_gram(dim: int, seed: int, groups: int | None = None) -> Tensor:
    """A float64 PSD factor ``(dim, dim)`` (``(groups, dim, dim)``): the Gram of ``2·dim`` Gaussian rows
    whose columns' scales decay from 1 to 0.1 (distinct, spread eigenvalues, as a K-FAC factor's)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2 * dim, dim) if groups is None else (groups, 2 * dim, dim)
    scales = torch.logspace(0, -1, dim, dtype=torch.float64)
    rows = torch.randn(shape, generator=generator, dtype=torch.float64) * scales
    return rows.mT @ rows / (2 * dim)


def eigh_held(factor: Tensor, permutation: Tensor | None = None) -> linalg.Eigen:
    """The full eigendecomposition of ``factor`` (``(n, n)`` or batched), its columns permuted by ``permutation``."""
    eig = linalg.symmetric_eigen(factor, factor.dtype)
    assert eig is not None
    if permutation is None:
        return eig
    return linalg.Eigen(Q=eig.Q[..., permutation].contiguous(), d=eig.d[..., permutation].contiguous())


@pytest.mark.parametrize("groups", [None, 2])
def test_a_refresh_is_one_gram_schmidt_step_of_the_factor_times_the_held_basis(groups: int | None) -> None:
    before, after = decaying_gram(7, 0, groups), decaying_gram(7, 1, groups)
    held = eigh_held(before, torch.tensor([3, 0, 6, 1, 5, 2, 4]))  # slots in no eigenvalue order
    held_q = held.Q.clone()
    refreshed = PowerRefreshDecomposer().decompose(RefreshedFactor(after, held), 0.0, torch.float64)
    assert refreshed is not None and refreshed.complement is None
    assert torch.equal(held.Q, held_q)  # the held basis is not written to
    for block in range(1 if groups is None else groups):
        pick = (lambda t: t) if groups is None else (lambda t, block=block: t[block])
        expected_q, expected_d = gram_schmidt_refresh(pick(after), pick(held_q))
        torch.testing.assert_close(pick(refreshed.Q), expected_q, rtol=0, atol=1e-12)
        torch.testing.assert_close(pick(refreshed.d), expected_d, rtol=0, atol=1e-12)
    assert refreshed.Q.is_contiguous()


def test_an_eigenbasis_stays_in_its_slots_with_its_signs() -> None:
    """A held eigenbasis of the factor itself is a fixed point, whatever its slots' order and its
    columns' signs: slot ``j`` keeps its eigenvector, so a second moment kept per slot stays aligned."""
    factor = decaying_gram(6, 2)
    held = eigh_held(factor, torch.tensor([4, 1, 5, 0, 2, 3]))
    signs = torch.tensor([1.0, -1.0, -1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    held = linalg.Eigen(Q=held.Q * signs, d=held.d)
    refreshed = PowerRefreshDecomposer().decompose(RefreshedFactor(factor, held), 0.0, torch.float64)
    assert refreshed is not None
    torch.testing.assert_close(refreshed.Q, held.Q, rtol=0, atol=1e-10)
    torch.testing.assert_close(refreshed.d, held.d, rtol=0, atol=1e-12)


def test_repeated_refreshes_converge_to_the_factors_eigenbasis() -> None:
    """Orthogonal iteration from an eigenbasis of another factor: ``QᵀFQ`` becomes diagonal (the
    eigenvalues 8, 4, ..., 1/4 halve, so each refresh shrinks the off-diagonal part about 2×)."""
    generator = torch.Generator().manual_seed(3)
    rotation, _ = torch.linalg.qr(torch.randn(6, 6, generator=generator, dtype=torch.float64))
    factor = rotation @ torch.diag(2.0 ** torch.arange(3, -3, -1, dtype=torch.float64)) @ rotation.T
    view = RefreshedFactor(factor, eigh_held(decaying_gram(6, 4)))
    decomposer = PowerRefreshDecomposer()

    def off_diagonal() -> float:
        rotated = view.decomposition.Q.T @ factor @ view.decomposition.Q
        return float((rotated - torch.diag(rotated.diagonal())).norm() / factor.norm())

    first = off_diagonal()
    for _ in range(60):
        view.decomposition = decomposer.decompose(view, 0.0, torch.float64)
    assert first > 0.1 and off_diagonal() < 1e-12
    torch.testing.assert_close(view.decomposition.d.sort().values, torch.linalg.eigvalsh(factor), rtol=1e-10, atol=0)


def test_a_capped_thin_basis_refreshes_as_subspace_iteration_with_the_mean_of_the_rest() -> None:
    before, after = decaying_gram(8, 5), decaying_gram(8, 6)
    eigh, power = EigenDecomposer(max_rank=3, min_dim=4), PowerRefreshDecomposer(max_rank=3, min_dim=4)
    held = eigh.decompose(RefreshedFactor(before), 0.0, torch.float64, drop_below=0.0)
    assert held is not None and held.Q.shape == (8, 3) and held.complement is not None
    refreshed = power.decompose(RefreshedFactor(after, held), 0.0, torch.float64, drop_below=0.0)
    assert refreshed is not None
    expected_q, expected_d = gram_schmidt_refresh(after, held.Q)
    torch.testing.assert_close(refreshed.Q, expected_q, rtol=0, atol=1e-12)
    torch.testing.assert_close(refreshed.d, expected_d, rtol=0, atol=1e-12)
    expected_sigma = (after.trace() - expected_d.sum()) / (8 - 3)
    torch.testing.assert_close(refreshed.complement, expected_sigma.reshape(1), rtol=1e-12, atol=0)


@pytest.mark.parametrize("held", ["none", "thinner", "full_where_capped"])
def test_without_a_basis_of_the_current_layout_it_decomposes_as_eigh_does(held: str) -> None:
    """The first decomposition (none held), a thin basis with fewer columns than the cap (the factor's
    rank was still growing) and a full basis where the cap now applies are decomposed afresh."""
    factor = decaying_gram(8, 7)
    eigh, power = EigenDecomposer(max_rank=3, min_dim=4), PowerRefreshDecomposer(max_rank=3, min_dim=4)
    start = {"none": None, "thinner": linalg.Eigen(Q=torch.eye(8, 2, dtype=torch.float64), d=torch.ones(2)),
             "full_where_capped": eigh_held(decaying_gram(8, 8))}[held]
    expected = eigh.decompose(RefreshedFactor(factor), 0.0, torch.float64, drop_below=0.0)
    refreshed = power.decompose(RefreshedFactor(factor, start), 0.0, torch.float64, drop_below=0.0)
    assert expected is not None and refreshed is not None
    assert torch.equal(refreshed.Q, expected.Q) and torch.equal(refreshed.d, expected.d)


def test_a_non_finite_factor_fails_the_refresh_and_leaves_the_held_basis_alone() -> None:
    factor = decaying_gram(6, 9)
    held = eigh_held(decaying_gram(6, 10))
    held_q = held.Q.clone()
    factor[1, 2] = factor[2, 1] = float("nan")
    assert PowerRefreshDecomposer().decompose(RefreshedFactor(factor, held), 0.0, torch.float64) is None
    assert torch.equal(held.Q, held_q)


def test_the_automatic_intervals_count_a_power_refresh_as_one_product_and_one_qr() -> None:
    """``costs.POWER_REFRESH·n²·c`` per factor: ``c = max_rank`` on a capped side (``A``, 8 wide over a
    ``thin_width`` of 4), ``c = n`` on a full one (``G``, 2 wide); ``"eigh"`` keeps ``Eigen``'s counts."""
    a, g = RefreshedFactor(torch.zeros(8, 8)), RefreshedFactor(torch.zeros(2, 2))
    power = EigenAdam(refresh="power", max_rank=3, thin_width=4)
    assert power.decomposition_cost(a, g) == (costs.POWER_REFRESH * 8**2 * 3, costs.POWER_REFRESH * 2**3)
    assert EigenAdam(max_rank=3, thin_width=4).decomposition_cost(a, g)[1] == costs.EIGH * 2**3
