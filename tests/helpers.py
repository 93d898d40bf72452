"""Shared test helpers: small models' batches, dense references, optimizer state snapshots, and
whether this environment's torchvision works with its torch (:func:`torchvision_problem`).

One definition each (tests/project/test_test_layout.py checks that no helper name is defined in more
than one test file). The distributed ones (spawning gloo ranks) are in tests/distributed_helpers.py.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import io
from types import ModuleType

import pytest
import torch

from kfac_optim import KFAC
from kfac_optim.methods.power_refresh import lift


def kron_solve(G: torch.Tensor, A: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """(G ⊗ A + λI)⁻¹ vec(∇W) with the row-major vec that torch.kron matches (dense, in G's dtype)."""
    dense = torch.kron(G, A) + damping * torch.eye(G.shape[0] * A.shape[0], dtype=G.dtype)
    return torch.linalg.solve(dense, grad.reshape(-1)).reshape(grad.shape)


def seeded_batch(
    input_shape: tuple[int, ...], classes: int, seed: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)``: ``x`` standard normal of ``input_shape`` (in ``dtype``, default the default
    dtype), then ``y`` uniform class labels in ``[0, classes)``, one per row of ``x``; both drawn,
    in that order, from one generator seeded with ``seed`` (the same batch for the same arguments)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(input_shape, generator=generator, dtype=dtype)
    return x, torch.randint(0, classes, (input_shape[0],), generator=generator)


def running_factors(optimizer: KFAC) -> dict[str, torch.Tensor]:
    """A copy of every block's running factors, ``{"<block>.<A|G>": (dim, dim)}`` (later steps
    update them in place)."""
    return {f"{b.name}.{n}": f.running.clone() for b in optimizer.blocks for n, f in b.factors.items()}


@functools.cache
def torchvision_problem() -> str | None:
    """Why torchvision cannot be used with this torch, with the fix; None when it imports (or is not
    installed: then the tests that need it skip, see :func:`import_torchvision`).

    A torchvision wheel is built against one torch build: pip checks the version (torchvision pins
    ``torch==X``), not the build, so a CUDA torchvision beside a CPU-only torch of the same version
    installs without a word and then fails at import (``operator torchvision::nms does not exist``).
    """
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # noqa: BLE001 (any import failure is the problem we report)
        return (
            f"torchvision {importlib.metadata.version('torchvision')} does not work with torch {torch.__version__} "
            f"({type(error).__name__}: {error}): they are not one build pair (a torchvision wheel works only with "
            "the torch build it was built for: the same version, CPU-only or the same CUDA). Fix: install both "
            "as one pair: `pip install --force-reinstall torch torchvision` (PyPI's), or with "
            "`--extra-index-url https://download.pytorch.org/whl/cpu` added for CPU-only builds (README.md, Install)"
        )
    return None


def import_torchvision() -> ModuleType:
    """``torchvision``, or skip the calling test: not installed, or unusable with this torch (the one
    check that fails then is tests/project/test_install.py, with the fix)."""
    problem = torchvision_problem()
    if problem is not None:
        pytest.skip("torchvision does not work with this torch: tests/project/test_install.py says why and the fix")
    return pytest.importorskip("torchvision")


def checkpoint_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bytes:
    """``torch.save`` of the model's and the optimizer's state dicts, as the bytes a file would hold."""
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    return buffer.getvalue()


def gram_schmidt_refresh(factor: torch.Tensor, held: torch.Tensor,
                         lift_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense reference of ``EigenAdam(refresh="power")``'s refresh of one factor ``(n, n)`` from the
    orthonormal ``held (n, c)``, in ``factor``'s dtype: the estimated eigenvalues ``e = diag(heldᵀ F held)``,
    then modified Gram–Schmidt on the columns of ``(F + μI)·held`` (``μ = lift(n, lift_dtype)·max |e|``,
    ``lift_dtype`` the dtype the optimizer's factor is held in, default ``factor``'s) in descending
    order of ``e``, each orthonormalized column written back to its slot. Returns it and ``e`` clamped at 0."""
    held = held.to(factor.dtype)
    estimated = torch.einsum("ij,ik,kj->j", held, factor, held)
    mu = lift(factor.shape[-1], lift_dtype or factor.dtype) * estimated.abs().max()
    columns = (factor + mu * torch.eye(len(factor), dtype=factor.dtype)) @ held
    refreshed = torch.empty_like(held)
    done: list[torch.Tensor] = []
    for slot in sorted(range(held.shape[1]), key=lambda j: -float(estimated[j])):
        column = columns[:, slot].clone()
        for earlier in done:
            column -= (earlier @ column) * earlier
        column /= column.norm()
        done.append(column)
        refreshed[:, slot] = column
    return refreshed, estimated.clamp(min=0)
