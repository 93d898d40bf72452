"""Decompositions that do not fail on rank-deficient factors, and the thin (rank-aware) eigen solve.

Dense references: ``torch.kron`` of the factors and a direct solve of ``(G ⊗ A + λI) v = vec(∇W)``.
"""

from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import import_torchvision, kron_solve
from torch import nn

from kfac_optim import KFAC, AsyncConfig, CurvatureConfig, linalg


def low_rank_gram(dim: int, rank: int, zero_rows: int = 0) -> torch.Tensor:
    """A float64 PSD ``(dim, dim)`` Gram matrix of ``rank`` rows, the first ``zero_rows`` rows and
    columns exactly 0 (as a zero-padded convolution's)."""
    rows = torch.randn(rank, dim, dtype=torch.float64)
    rows[:, :zero_rows] = 0
    return rows.T @ rows / rank


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


@pytest.mark.parametrize("zero_rows", [0, 5])
def test_thin_eigen_solve_is_the_dense_damped_kronecker_solve(zero_rows: int) -> None:
    A, G = low_rank_gram(24, 3, zero_rows), low_rank_gram(10, 2)
    grad = torch.randn(10, 24, dtype=torch.float64)
    damping = 1e-2
    eig_a = linalg.symmetric_eigen(A, torch.float64, linalg.rank_threshold(damping, float(G.trace())))
    eig_g = linalg.symmetric_eigen(G, torch.float64, linalg.rank_threshold(damping, float(A.trace())))
    assert eig_a is not None and eig_g is not None
    assert eig_a.Q.shape == (24, 3) and eig_g.Q.shape == (10, 2)  # the rank, not the size
    assert relative_error(eig_a.Q @ torch.diag(eig_a.d) @ eig_a.Q.T, A) < 1e-12
    direction = linalg.eigen_precondition(grad, eig_a, eig_g, damping)
    assert relative_error(direction, kron_solve(G, A, grad, damping)) < 1e-6
    # One side thin, the other full.
    full_g = linalg.symmetric_eigen(G, torch.float64)
    assert full_g is not None and not full_g.thin
    direction = linalg.eigen_precondition(grad, eig_a, full_g, damping)
    assert relative_error(direction, kron_solve(G, A, grad, damping)) < 1e-6


def test_a_factor_of_few_rows_is_decomposed_through_its_range() -> None:
    # rank_bound rows: eigh of a (bound + oversampling)² matrix instead of the 160² one.
    A, G = low_rank_gram(160, 10, zero_rows=4), low_rank_gram(6, 6)
    grad = torch.randn(6, 160, dtype=torch.float64)
    damping = 1e-2
    eig_a = linalg.symmetric_eigen(A, torch.float64, linalg.rank_threshold(damping, float(G.trace())), rank_bound=10)
    eig_g = linalg.symmetric_eigen(G, torch.float64, linalg.rank_threshold(damping, float(A.trace())), rank_bound=6)
    assert eig_a is not None and eig_g is not None and eig_a.Q.shape == (160, 10)
    assert relative_error(eig_a.Q @ torch.diag(eig_a.d) @ eig_a.Q.T, A) < 1e-10
    assert relative_error(linalg.eigen_precondition(grad, eig_a, eig_g, damping),
                          kron_solve(G, A, grad, damping)) < 1e-6


def test_factors_count_the_rows_that_bound_their_rank() -> None:
    conv = nn.Conv2d(3, 4, 3)
    optimizer = KFAC(conv, lr=0.1, decomposition_update_steps=100, factor_update_steps=1)
    for _ in range(3):
        conv(torch.randn(5, 3, 6, 6)).square().mean().backward()
        optimizer.step()
    block = optimizer.blocks[0]
    assert block.A.rank_bound == block.G.rank_bound == 3 * 5 * 4 * 4  # 3 batches of 5 samples, 4x4 positions
    assert torch.linalg.matrix_rank(block.A.running.double()) <= block.A.rank_bound
    restored = KFAC(nn.Conv2d(3, 4, 3), lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    restored.load_state_dict(optimizer.state_dict())
    assert restored.blocks[0].A.rank_bound == 240


def test_dropped_eigenvalues_change_the_solve_by_at_most_the_documented_tolerance() -> None:
    # Full rank, with a tail of eigenvalues just under the threshold: they are dropped (thin),
    # and the direction moves by no more than RANK_RTOL relative.
    damping = 1e-2
    G = low_rank_gram(8, 8)
    basis, _ = torch.linalg.qr(torch.randn(30, 30, dtype=torch.float64))
    threshold = linalg.rank_threshold(damping, float(G.trace()))
    spectrum = torch.cat([torch.full((24,), 0.9 * threshold, dtype=torch.float64),
                          torch.rand(6, dtype=torch.float64) + 1])
    A = basis @ torch.diag(spectrum) @ basis.T
    eig_a = linalg.symmetric_eigen(A, torch.float64, threshold)
    eig_g = linalg.symmetric_eigen(G, torch.float64)
    assert eig_a is not None and eig_g is not None and eig_a.Q.shape == (30, 6)
    grad = torch.randn(8, 30, dtype=torch.float64)
    assert relative_error(linalg.eigen_precondition(grad, eig_a, eig_g, damping),
                          kron_solve(G, A, grad, damping)) < linalg.RANK_RTOL


def full_rank_factor(dim: int, zero_rows: int = 0) -> torch.Tensor:
    """A float64 PSD factor of full rank on its nonzero block, a decaying spectrum (as K-FAC's)."""
    basis, _ = torch.linalg.qr(torch.randn(dim - zero_rows, dim - zero_rows, dtype=torch.float64))
    spectrum = 0.8 ** torch.arange(dim - zero_rows, dtype=torch.float64) + 1e-3
    factor = torch.zeros(dim, dim, dtype=torch.float64)
    factor[zero_rows:, zero_rows:] = basis @ torch.diag(spectrum) @ basis.T
    return factor


def capped_approximation(eig: linalg.Eigen) -> torch.Tensor:
    """``Q diag(d) Qᵀ + σ (I − Q Qᵀ)``, dense."""
    projector = eig.Q @ eig.Q.T
    sigma = 0.0 if eig.complement is None else float(eig.complement)
    return eig.Q @ torch.diag(eig.d) @ eig.Q.T + sigma * (torch.eye(len(eig.Q), dtype=eig.Q.dtype) - projector)


@pytest.mark.parametrize("zero_rows", [0, 4])
def test_a_factor_truncated_at_the_rank_cap_keeps_its_top_eigenpairs_and_the_mean_of_the_rest(zero_rows: int) -> None:
    A, G = full_rank_factor(40, zero_rows), full_rank_factor(12)
    damping = 1e-3
    eig_a = linalg.symmetric_eigen(A, torch.float64, linalg.rank_threshold(damping, float(G.trace())), max_rank=8)
    assert eig_a is not None and eig_a.Q.shape == (40, 8) and eig_a.complement is not None
    exact, basis = torch.linalg.eigh(A[zero_rows:, zero_rows:])
    # the leading eigenpairs (randomized, two power iterations; the spectrum decays by 0.8 per
    # eigenvalue): eigenvalues to 1e-5, the subspace to 1e-2
    assert torch.allclose(eig_a.d, exact[-8:], rtol=1e-5)
    projector = eig_a.Q[zero_rows:] @ eig_a.Q[zero_rows:].T
    top = basis[:, -8:]
    assert relative_error(projector @ top, top) < 1e-2
    assert torch.equal(eig_a.Q[:zero_rows], torch.zeros(zero_rows, 8, dtype=torch.float64))
    # σ: the mean of the discarded eigenvalues of the nonzero block
    expected_sigma = (exact.sum() - exact[-8:].sum()) / (40 - zero_rows - 8)
    assert torch.allclose(eig_a.complement, expected_sigma.reshape(1), rtol=1e-4)


@pytest.mark.parametrize("caps", [(8, None), (None, 5), (8, 5)])
def test_the_capped_eigen_solve_is_the_dense_solve_of_the_approximated_factors(
    caps: tuple[int | None, int | None]
) -> None:
    A, G = full_rank_factor(40, zero_rows=4), full_rank_factor(12)
    grad = torch.randn(12, 40, dtype=torch.float64)
    grad[:, :4] = 0  # the zero rows' gradient columns (as a zero-padded conv's)
    damping = 1e-2
    eig_a = linalg.symmetric_eigen(A, torch.float64, linalg.rank_threshold(damping, float(G.trace())), max_rank=caps[0])
    eig_g = linalg.symmetric_eigen(G, torch.float64, linalg.rank_threshold(damping, float(A.trace())), max_rank=caps[1])
    assert eig_a is not None and eig_g is not None
    for eig, cap in zip((eig_a, eig_g), caps):
        assert (eig.complement is not None) == (cap is not None)
        assert eig.complement is None or float(eig.complement) > 0
    # dense reference: (Ĝ ⊗ Â + λI)⁻¹ vec(∇W) with Â, Ĝ formed densely from Q, d and σ
    expected = kron_solve(capped_approximation(eig_g), capped_approximation(eig_a), grad, damping)
    assert relative_error(linalg.eigen_precondition(grad, eig_a, eig_g, damping), expected) < 1e-10
    # and σ matters: with 0 for the complement (a plain thin solve) the direction differs
    plain = linalg.eigen_precondition(grad, linalg.Eigen(eig_a.Q, eig_a.d), linalg.Eigen(eig_g.Q, eig_g.d), damping)
    assert relative_error(plain, expected) > 1e-3


def test_a_cap_at_or_above_the_rank_gives_the_exact_thin_solve() -> None:
    # rank 6 ≤ cap < dim 40: not truncated (σ = 0), the same direction as without a cap.
    A, G = low_rank_gram(40, 6, zero_rows=3), full_rank_factor(12)
    grad = torch.randn(12, 40, dtype=torch.float64)
    damping = 1e-2
    threshold = linalg.rank_threshold(damping, float(G.trace()))
    eig_g = linalg.symmetric_eigen(G, torch.float64)
    assert eig_g is not None
    dense = kron_solve(G, A, grad, damping)  # the reference: (G ⊗ A + λI)⁻¹ vec(∇W), solved densely
    for bound in (6, None):  # a known rank bound, or none (the capped eigensolve runs and finds rank 6)
        uncapped = linalg.symmetric_eigen(A, torch.float64, threshold, rank_bound=bound)
        assert uncapped is not None and uncapped.Q.shape == (40, 6)
        uncapped_direction = linalg.eigen_precondition(grad, uncapped, eig_g, damping)
        assert relative_error(uncapped_direction, dense) < 1e-6
        if bound is not None:  # bit for bit the uncapped one's: the same decomposition and solve
            capped = linalg.symmetric_eigen(A, torch.float64, threshold, rank_bound=bound, max_rank=10)
            assert capped is not None and capped.complement is None
            assert torch.equal(linalg.eigen_precondition(grad, capped, eig_g, damping), uncapped_direction)
        # at the cap exactly: σ = 0 comes along (the layout of a truncated factor), the same solve
        capped = linalg.symmetric_eigen(A, torch.float64, threshold, rank_bound=bound, max_rank=6)
        assert capped is not None and capped.Q.shape == (40, 6)
        assert (torch.equal(capped.complement, torch.zeros(1, dtype=torch.float64)) if bound
                else float(capped.complement) < 1e-12)
        capped_direction = linalg.eigen_precondition(grad, capped, eig_g, damping)
        assert relative_error(capped_direction, dense) < 1e-6
        assert relative_error(capped_direction, uncapped_direction) < 1e-10
    # a cap at or above the size changes nothing at all
    assert linalg.symmetric_eigen(A, torch.float64, threshold, max_rank=40).complement is None


def test_zero_rows_are_deflated_exactly_in_a_full_decomposition() -> None:
    # Zero rows and columns, full rank elsewhere: full Q with the zero rows' unit vectors.
    A = low_rank_gram(12, 40, zero_rows=3)
    eig = linalg.symmetric_eigen(A, torch.float64)
    assert eig is not None and eig.Q.shape == (12, 12)
    assert torch.equal(eig.d[:3], torch.zeros(3, dtype=torch.float64))
    assert relative_error(eig.Q @ torch.diag(eig.d) @ eig.Q.T, A) < 1e-12
    assert torch.allclose(eig.Q.T @ eig.Q, torch.eye(12, dtype=torch.float64), atol=1e-12)
    # A zero factor: thin with no columns (the solve is ∇/λ), or the identity basis.
    zero = torch.zeros(4, 4)
    assert linalg.symmetric_eigen(zero, torch.float32, 0.0).Q.shape == (4, 0)
    assert torch.equal(linalg.symmetric_eigen(zero, torch.float32).Q, torch.eye(4))


def decomposition_failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kfac_optim.linalg" and "failed" in r.getMessage()]


def test_conv_over_maps_smaller_than_its_kernel_decomposes_in_float32(caplog: pytest.LogCaptureFixture) -> None:
    # The minimal case: A is 4609 x 4609 (zero-padding taps: 4096 zero columns), rank ~33.
    # torch.linalg.eigh fails to converge on it in float32 (and takes ~70 s to say so).
    conv = nn.Conv2d(512, 512, 3, padding=1)
    optimizer = KFAC(conv, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    x = torch.relu(torch.randn(32, 512, 1, 1))
    caplog.set_level(logging.DEBUG, logger="kfac_optim.linalg")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        conv(x).square().mean().backward()
        optimizer.step()
    assert decomposition_failures(caplog) == []  # no float64 retry either
    block = optimizer.blocks[0]
    for factor in block.factors.values():
        eig = factor.decomposition
        assert isinstance(eig, linalg.Eigen) and eig.Q.dtype == torch.float32
        assert eig.thin  # rank ≤ 33 of 4609 and 512
        assert relative_error(eig.Q @ torch.diag(eig.d) @ eig.Q.T, factor.running) < 1e-4


def test_resnet18_layer4_first_step_decomposes_every_factor_in_float32(caplog: pytest.LogCaptureFixture) -> None:
    # torchvision's ResNet-18 at 32 px: layer4 sees 1x1 maps (the rest of the model decomposes as
    # before; preconditioning only layer4 keeps the test fast).
    torchvision = import_torchvision()
    model = torchvision.models.resnet18(num_classes=10)
    others = [
        re.escape(name)
        for name, module in model.named_modules()
        if isinstance(module, (nn.Conv2d, nn.Linear)) and not name.startswith("layer4.")
    ]
    optimizer = KFAC(model, lr=0.1, momentum=0.9, curvature=CurvatureConfig(skip_layers=others), factor_update_steps=1,
                     decomposition_update_steps=10)
    assert [b.name for b in optimizer.blocks] == [
        "layer4.0.conv1", "layer4.0.conv2", "layer4.0.downsample.0", "layer4.1.conv1", "layer4.1.conv2",
    ]
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    caplog.set_level(logging.DEBUG, logger="kfac_optim.linalg")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert decomposition_failures(caplog) == []
    for block in optimizer.blocks:
        for factor in block.factors.values():
            eig = factor.decomposition
            assert isinstance(eig, linalg.Eigen) and eig.Q.dtype == torch.float32, block.name
            assert relative_error(eig.Q @ torch.diag(eig.d) @ eig.Q.T, factor.running) < 1e-4, block.name


def test_a_layer_without_a_decomposition_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = KFAC(net, lr=0.1, decomposition_update_steps=1, factor_update_steps=1)
    real_eigh = torch.linalg.eigh

    def failing_eigh(matrix: torch.Tensor, *args, **kwargs):
        raise torch.linalg.LinAlgError("forced failure")

    def step(seed: int) -> None:
        torch.manual_seed(seed)
        F.cross_entropy(net(torch.randn(16, 4)), torch.randint(0, 3, (16,))).backward()
        optimizer.step()
        optimizer.zero_grad()

    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(torch.linalg, "eigh", failing_eigh)
    with pytest.warns(RuntimeWarning) as record:
        step(0)
    assert len(record) == 2 * len(optimizer.blocks)  # one warning per factor, nothing else
    assert all("no decomposition yet, so the layer takes the SGD direction" in str(w.message) for w in record)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # reported once: as a warning
    assert any("forced failure" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    monkeypatch.setattr(torch.linalg, "eigh", real_eigh)
    step(1)
    monkeypatch.setattr(torch.linalg, "eigh", failing_eigh)
    with pytest.warns(RuntimeWarning) as record:
        step(2)
    assert all("last good decomposition is kept" in str(w.message) for w in record)


def test_async_round_is_adopted_at_the_next_decomposition_step() -> None:
    # decomposition_update_steps=3: step 0 decomposes in line; step 3 snapshots the factors and hands them
    # to the worker; step 6 adopts exactly their decompositions (layers use step 0's until then).
    net = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 3))
    optimizer = KFAC(net, lr=0.1, decomposition_update_steps=3, asynchronous=AsyncConfig(), factor_update_steps=1)
    block = optimizer.blocks[0]
    snapshots = {}
    for step in range(7):
        F.cross_entropy(net(torch.randn(16, 20)), torch.randint(0, 3, (16,))).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 3:
            snapshots = {name: (f.running.clone(), f.version) for name, f in block.factors.items()}
            thresholds = block.rank_thresholds(optimizer.method, 0.1)
        if step in (3, 5):
            assert block.A.decomposed_key == (1, 0.0)  # still step 0's
    for name, factor in block.factors.items():
        running, version = snapshots[name]
        expected = linalg.symmetric_eigen(running, torch.float32, thresholds[name])
        assert factor.decomposed_key == (version, 0.0)
        assert torch.equal(factor.decomposition.Q, expected.Q) and torch.equal(factor.decomposition.d, expected.d)


def test_async_delay_adopts_the_round_that_many_steps_later() -> None:
    net = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 3))
    optimizer = KFAC(net, lr=0.1, decomposition_update_steps=4, asynchronous=AsyncConfig(delay=1),
                     factor_update_steps=1)
    block = optimizer.blocks[0]
    for step in range(6):
        F.cross_entropy(net(torch.randn(16, 20)), torch.randint(0, 3, (16,))).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 4:
            submitted = block.A.version
            assert block.A.decomposed_key == (1, 0.0)  # step 0's, while step 4's round is in flight
    assert block.A.decomposed_key == (submitted, 0.0)  # adopted at step 5
    with pytest.raises(ValueError, match="async_delay"):
        KFAC(net, asynchronous=AsyncConfig(delay=0), factor_update_steps=1, decomposition_update_steps=10)


def test_the_eigenbasis_cap_in_the_optimizer_is_described_logged_and_checkpointed(
    caplog: pytest.LogCaptureFixture
) -> None:
    from kfac_optim.methods import Eigen

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(40, 12), nn.Tanh(), nn.Linear(12, 3))
    optimizer = KFAC(net, lr=0.1, method=Eigen(max_rank=8), factor_update_steps=1, decomposition_update_steps=2)
    assert "eigenbasis cap max_rank=8" in optimizer.describe() and "0.A (41), 0.G (12)" in optimizer.describe()
    assert "2.A (13)" in optimizer.describe()  # 12 inputs + bias > 8: capped too; 2.G (3) is not
    caplog.set_level(logging.INFO, logger="kfac_optim.reporter")
    for _ in range(3):  # 3 batches of 32 rows: rank 40 + 1 > 8
        F.cross_entropy(net(torch.randn(32, 40)), torch.randint(0, 3, (32,))).backward()
        optimizer.step()
    eig = optimizer.blocks[0].A.decomposition
    assert eig.Q.shape == (41, 8) and float(eig.complement) > 0
    assert "'0': A (dim 41) truncated by the eigenbasis cap to its 8 leading eigenpairs" in caplog.text
    restored_net = nn.Sequential(nn.Linear(40, 12), nn.Tanh(), nn.Linear(12, 3))
    restored = KFAC(restored_net, lr=0.1, method=Eigen(max_rank=8), factor_update_steps=1, decomposition_update_steps=2)
    restored.load_state_dict(optimizer.state_dict())
    assert torch.equal(restored.blocks[0].A.decomposition.complement, eig.complement)
    with pytest.raises(ValueError, match="max_rank must be an int >= 1 or None"):
        Eigen(max_rank=0)
