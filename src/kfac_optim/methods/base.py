"""The method seam: what every decomposition method declares and computes (:class:`Method`), the
basis it takes (:class:`Basis`), and the cost terms the built-in methods share.

Owns: the :class:`Method` interface (shifts, precondition, costs, state, outside_kfac) and its
class-definition check that a method declaring ``precondition`` names its basis.
Must not know: modules, hooks, ranks, schedules; a factor is read through
``decompositions.FactorView``. The methods' formulas: docs/numerics.md, "Methods and the update".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import Enum
from typing import ClassVar

import torch
from torch import Tensor

from kfac_optim.methods.decompositions import Decomposer, Decomposition, FactorView
from kfac_optim.schedule import costs


class Basis(Enum):
    """The decomposition of a dense factor that a method's :meth:`Method.precondition` takes
    (a diagonal factor is always its eigenvalues, its basis the identity)."""

    FULL = "full"
    """Full eigenbases: ``linalg.Eigen`` with ``Q (..., n, n)``, every eigenvalue, no complement."""
    CAPPED = "capped"
    """Eigenbases that may be thin (``Q (n, r)``) or capped with an isotropic complement ``σ``
    (``linalg.Eigen.complement``). What the complement of ``Q``'s columns gets is the method's:
    :class:`Eigen`'s solve counts the dropped eigenvalues as 0 or ``σ``; :class:`EigenAdam` gives
    that part of the gradient an elementwise second moment."""
    INVERSE = "inverse"
    """Damped inverses ``(F + shift·I)⁻¹ (..., n, n)``: :class:`DampedInverse`'s."""


class Method(ABC):
    """A way to apply ``(G ⊗ A + λI)⁻¹`` (exactly or approximately) from per-factor decompositions:
    how the pair is applied (:meth:`precondition`, :meth:`shifts`, its costs) over a
    :attr:`decomposer` (how each factor is decomposed, shipped, saved and sized)."""

    name: str
    decomposer: Decomposer
    """How this method's factors are decomposed, travel between ranks, are saved in checkpoints and
    sized (``kfac_optim.methods.decompositions``): a class attribute or a field set at construction."""
    uses_damping: ClassVar[bool] = True
    """Whether the damping λ enters :meth:`precondition` (False: ``AdaptiveDamping`` is refused)."""
    basis: ClassVar[Basis]
    """The decomposition :meth:`precondition` takes (:class:`Basis`). A class that defines
    ``precondition`` declares it in its own body (checked when the class is defined), so a
    subclass never inherits a basis its own ``precondition`` was not written for."""
    stateful: ClassVar[bool] = False
    """Whether :meth:`precondition` keeps per-block state across steps in its ``state`` argument
    (it must then see every step's gradient of its blocks on the rank that holds the state)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "precondition" in vars(cls) and not isinstance(vars(cls).get("basis"), Basis):
            raise TypeError(
                f"{cls.__name__} defines precondition but does not declare the basis it takes: set the class "
                f"attribute basis = Basis.FULL, Basis.CAPPED or Basis.INVERSE (kfac_optim.methods.Basis)"
            )

    def decompose(
        self, factor: FactorView, shift: float, dtype: torch.dtype, drop_below: float | None = None
    ) -> Decomposition | None:
        """The decomposition of ``factor.running`` in ``dtype`` by :attr:`decomposer` (None: it failed).
        ``drop_below``: eigenvalues that may count as 0 (``KroneckerBlock.rank_thresholds``)."""
        return self.decomposer.decompose(factor, shift, dtype, drop_below)

    @abstractmethod
    def shifts(self, a: FactorView, g: FactorView, damping: float) -> tuple[float, float]:
        """The damping shifts ``(A, G)`` this method adds to the factors before decomposing."""

    def rank_thresholds(self, a: FactorView, g: FactorView, damping: float) -> tuple[float | None, float | None]:
        """Per factor ``(A, G)``, the eigenvalue below which :meth:`decompose` may treat eigenvalues
        as 0 (its ``drop_below``); None: keep every one (the default)."""
        return None, None

    def capped(self, factor: FactorView) -> bool:
        """Whether this method holds ``factor`` at a bounded rank (:class:`Eigen`'s eigenbasis cap), so
        that its decomposition costs O(n²·rank) rather than O(n³) (:meth:`Decomposer.capped`)."""
        return self.decomposer.capped(factor)

    def decomposition_cost(self, a: FactorView, g: FactorView) -> tuple[float, float]:
        """The cost of decomposing ``a`` and ``g`` once, in ``kfac_optim.schedule.costs``' flop-equivalents
        (the default automatic intervals' cost model). Default: a full ``eigh`` of every dense
        factor, one elementwise pass over a diagonal one."""
        return factor_cost(a, costs.EIGH), factor_cost(g, costs.EIGH)

    def precondition_cost(self, a: FactorView, g: FactorView) -> float:
        """One step's preconditioning of the pair's ``(out, in)`` gradient, in flop-equivalents. Default:
        rotating into both full eigenbases and back (four products) and a few elementwise passes."""
        return rotations_cost(a, g, a.dim, g.dim, products=2) + elementwise_cost(a, g, passes=4)

    @abstractmethod
    def precondition(self, grad: Tensor, a: FactorView, g: FactorView, damping: float,
                     state: dict[str, Tensor]) -> Tensor:
        """The preconditioned joint gradient from the factors' decompositions (in their dtype).
        ``state``: the block's method state, updated in place by a :attr:`stateful` method (else unused)."""

    def keyed_shift(self, shift: float) -> float:
        """The part of ``shift`` a decomposition depends on (its cache key; :meth:`Decomposer.keyed_shift`)."""
        return self.decomposer.keyed_shift(shift)

    def outside_kfac(self) -> tuple[float, float] | None:
        """What the parameters without a K-FAC direction take: None (the default) SGD's update, as
        the group says; ``(beta2, eps)``: ``torch.optim.Adam``'s update with these (the group's
        momentum as β₁), for a method whose directions have Adam's scale (it then needs dense
        gradients: ``update.adam.outside_kfac_for`` checks)."""
        return None

    def first_moment(self) -> float | None:
        """Adam's ``β₁`` when :meth:`precondition` keeps the first moment itself (before its
        normalization, as SOAP does): the param groups then need ``momentum=0``, and the parameters
        outside K-FAC take it as their β₁ (``update.adam.outside_kfac_for`` checks). None (the default):
        the group's SGD momentum acts on the directions."""
        return None

    def approximations(self, pairs: Sequence[tuple[str, FactorView, FactorView]]) -> str | None:
        """One line for ``KFAC.describe()`` naming the factors of ``pairs`` (``(layer, A, G)``) that
        this method approximates beyond K-FAC's Kronecker factorization, and how (None: none)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"



def factor_cost(factor: FactorView, per_cube: float) -> float:
    """A dense factor's decomposition at ``per_cube·n³`` per block; a diagonal one's elementwise pass."""
    if factor.diagonal:
        return costs.ELEMENT * factor.dim
    return costs.dense_decomposition(factor.dim, factor.groups, per_cube)


def rotations_cost(a: FactorView, g: FactorView, a_columns: int, g_columns: int, products: int) -> float:
    """``products`` multiplications of the ``(out, in)`` gradient by each dense side's basis of
    ``a_columns`` / ``g_columns`` columns (a diagonal side is not rotated)."""
    total = 0.0
    if not a.diagonal:
        total += products * costs.rotation_cost(g.dim, a.dim, a_columns, a.groups)
    if not g.diagonal:
        total += products * costs.rotation_cost(a.dim, g.dim, g_columns, g.groups)
    return total


def elementwise_cost(a: FactorView, g: FactorView, passes: int) -> float:
    """``passes`` elementwise passes over the pair's ``(out, in)`` gradient."""
    return costs.ELEMENT * passes * a.dim * g.dim * max(a.groups, g.groups)


