"""Decomposition methods as types: how a pair of factor decompositions is applied to a gradient.

Owns, per method: the per-factor damping shifts, the damped Kronecker preconditioning of a joint
gradient (or its variants: Adam's second moment in the eigenbasis, a root), its costs, the basis
it takes (:class:`Basis`), the state it keeps per block, and what the parameters outside K-FAC
get (:meth:`Method.outside_kfac`). How each factor is decomposed, travels between ranks, is saved
and sized is the other axis, the method's :attr:`Method.decomposer` (``kfac_optim.methods.decompositions``).
The optimizer turns its ``method`` argument into one of these (:func:`method_named`); below that
no method is named by a string or tested by type: blocks, checkpoints and the distributed layer
ask a method (or its decomposer) for what depends on it (docs/design.md §3).
Must not know: modules, hooks, ranks, schedules; a factor is read through
``decompositions.FactorView`` (``layers.factor.Factor`` is one), so this module imports nothing of ``layers``.

Factor kinds (see ``layers.factor``): **dense** ``(n, n)``, or ``(k, n, n)`` for ``k`` independent
blocks (grouped convolutions), and **diagonal** ``(n,)``. A joint gradient is ``(out, in)`` (or
``(k, out, in)``) with ``G`` on the left and ``A`` on the right. The methods' formulas:
docs/numerics.md, "Methods and the update" and "Eigen-Adam".

A method that defines ``precondition`` must declare its basis (``TypeError`` at class definition
otherwise), and an eigen method that needs full bases refuses the eigenbasis cap (``ValueError``
naming the method and ``max_rank``). Per-block state (:attr:`Method.stateful`, e.g.
:class:`EigenAdam`'s second moments) lives in the dict the block hands to
:meth:`Method.precondition` (``KroneckerBlock.method_state``), saved with the block's state.
A new method: a subclass registered with :func:`register_method` (docs/architecture.md).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

import torch
from torch import Tensor

from kfac_optim import linalg
from kfac_optim.methods.decompositions import Decomposer, Decomposition, EigenDecomposer, FactorView, InverseDecomposer
from kfac_optim.methods.power_refresh import PowerRefreshDecomposer
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
        return _factor_cost(a, costs.EIGH), _factor_cost(g, costs.EIGH)

    def precondition_cost(self, a: FactorView, g: FactorView) -> float:
        """One step's preconditioning of the pair's ``(out, in)`` gradient, in flop-equivalents. Default:
        rotating into both full eigenbases and back (four products) and a few elementwise passes."""
        return _rotations(a, g, a.dim, g.dim, products=2) + _elementwise(a, g, passes=4)

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


def _factor_cost(factor: FactorView, per_cube: float) -> float:
    """A dense factor's decomposition at ``per_cube·n³`` per block; a diagonal one's elementwise pass."""
    if factor.diagonal:
        return costs.ELEMENT * factor.dim
    return costs.dense_decomposition(factor.dim, factor.groups, per_cube)


def _rotations(a: FactorView, g: FactorView, a_columns: int, g_columns: int, products: int) -> float:
    """``products`` multiplications of the ``(out, in)`` gradient by each dense side's basis of
    ``a_columns`` / ``g_columns`` columns (a diagonal side is not rotated)."""
    total = 0.0
    if not a.diagonal:
        total += products * costs.rotation_cost(g.dim, a.dim, a_columns, a.groups)
    if not g.diagonal:
        total += products * costs.rotation_cost(a.dim, g.dim, g_columns, g.groups)
    return total


def _elementwise(a: FactorView, g: FactorView, passes: int) -> float:
    """``passes`` elementwise passes over the pair's ``(out, in)`` gradient."""
    return costs.ELEMENT * passes * a.dim * g.dim * max(a.groups, g.groups)


DEFAULT_MAX_RANK = 128
""":class:`Eigen`'s default eigenbasis cap (docs/api.md "Eigenbasis cap"; measured in docs/tuning.md)."""
EIGEN_ADAM_MAX_RANK = 128
EIGEN_ADAM_THIN_WIDTH = 256
""":class:`EigenAdam`'s default thin basis: factors wider than 256 keep 128 eigenvectors (measured in
docs/tuning.md: below about 2.25× the rank the thin update costs as much as the full one)."""


def _thin_solve(a: FactorView, g: FactorView) -> bool:
    """Whether the pair is solved by ``linalg.eigen_precondition`` (two dense ungrouped factors),
    which takes thin and truncated decompositions."""
    return not (a.diagonal or g.diagonal or a.groups > 1 or g.groups > 1)


@dataclass(frozen=True)
class Eigen(Method):
    """Exact damping: ``V = Q_G [(Q_Gᵀ ∇ Q_A) / (d_G d_Aᵀ + λ)] Q_Aᵀ`` (no shifts). A diagonal
    factor is its own eigendecomposition (``Q = I``, ``d`` the diagonal, clamped at 0).

    ``max_rank`` (keyword; None: no cap): the eigenbasis cap. A dense factor wider than it, of a
    pair of dense ungrouped factors, whose rank exceeds it is held as its ``max_rank`` leading
    eigenpairs (a randomized eigensolver, O(n²·max_rank) instead of ``eigh``'s O(n³)) plus one
    isotropic eigenvalue for the rest of its spectrum, their mean; the preconditioning then solves
    that approximation exactly at O(out·in·max_rank) per capped side instead of O(out·in·n)
    (``linalg.symmetric_eigen``, ``linalg.complement_precondition``). Factors within the cap, and
    a capped one's factor of rank ≤ ``max_rank``, are solved exactly as without it. ``describe()``
    names the factors the cap applies to, and the log each factor it truncates.

    Subclasses reuse its decompositions, shipping and costs with their own ``precondition`` and
    :attr:`~Method.basis`: one declaring :attr:`Basis.FULL` gets full eigenbases (no thin bases, no
    cap: ``max_rank`` must be None, else ``ValueError`` at construction naming the method and cap).
    """

    max_rank: int | None = field(default=DEFAULT_MAX_RANK, kw_only=True)
    decomposer: EigenDecomposer = field(init=False, repr=False, compare=False)
    """``EigenDecomposer(max_rank)`` under :attr:`Basis.CAPPED`, full bases under :attr:`Basis.FULL`
    (where the cap never applies; ``capped`` says so)."""

    name: ClassVar[str] = "eigen"
    basis: ClassVar[Basis] = Basis.CAPPED

    def __post_init__(self) -> None:
        if self.max_rank is not None and (isinstance(self.max_rank, bool) or not isinstance(self.max_rank, int)
                                          or self.max_rank < 1):
            raise ValueError(f"Eigen max_rank must be an int >= 1 or None, got {self.max_rank!r}")
        if self.basis is Basis.INVERSE:
            raise TypeError(f"{type(self).__name__} is an Eigen: its basis must be Basis.FULL or Basis.CAPPED, "
                            "not INVERSE")
        if self.basis is Basis.FULL and self.max_rank is not None:
            raise ValueError(
                f"{type(self).__name__} takes full eigenbases (basis=Basis.FULL), so the eigenbasis cap does not "
                f"apply to it: max_rank must be None, got max_rank={self.max_rank!r}"
            )
        object.__setattr__(self, "decomposer", EigenDecomposer(self.max_rank if self.basis is Basis.CAPPED else None))

    def _capped_in_pair(self, factor: FactorView, a: FactorView, g: FactorView) -> bool:
        """Whether the cap truncates ``factor`` of the pair ``(a, g)`` once its rank exceeds the cap."""
        return _thin_solve(a, g) and self.capped(factor)

    def decomposition_cost(self, a: FactorView, g: FactorView) -> tuple[float, float]:
        """A capped factor (of a thin-solved pair): the randomized range eigensolver at the cap's
        columns (``costs.RANGE·n²·(max_rank + oversampling)``); the others as :class:`Method`'s."""
        def cost(factor: FactorView) -> float:
            if self._capped_in_pair(factor, a, g):
                columns = self.max_rank + linalg.LOW_RANK_OVERSAMPLE
                return costs.RANGE * float(factor.dim) ** 2 * columns
            return _factor_cost(factor, costs.EIGH)

        return cost(a), cost(g)

    def precondition_cost(self, a: FactorView, g: FactorView) -> float:
        """The rotations of ``linalg.eigen_precondition`` (or of the complement's solve, about three
        products per capped side) at each basis's columns: ``max_rank`` for a capped side."""
        a_columns = self.max_rank if self._capped_in_pair(a, a, g) else a.dim
        g_columns = self.max_rank if self._capped_in_pair(g, a, g) else g.dim
        capped = a_columns < a.dim or g_columns < g.dim
        return _rotations(a, g, a_columns, g_columns, products=3 if capped else 2) + _elementwise(a, g, passes=4)

    def shifts(self, a: FactorView, g: FactorView, damping: float) -> tuple[float, float]:
        return 0.0, 0.0

    def approximations(self, pairs: Sequence[tuple[str, FactorView, FactorView]]) -> str | None:
        capped = [f"{layer}.{side} ({factor.dim})" for layer, a, g in pairs if _thin_solve(a, g)
                  for side, factor in (("A", a), ("G", g)) if self.capped(factor)]
        if not capped:
            return None
        return (f"eigenbasis cap max_rank={self.max_rank}: once their rank exceeds it, held as their "
                f"{self.max_rank} leading eigenpairs plus one eigenvalue (the mean of the rest) for the remaining "
                f"directions: {', '.join(capped)}")

    def rank_thresholds(self, a: FactorView, g: FactorView, damping: float) -> tuple[float | None, float | None]:
        """For two dense ungrouped factors (the solve of ``linalg.eigen_precondition``), each factor's
        :func:`linalg.rank_threshold` from the other's trace; None otherwise, and always None under
        :attr:`Basis.FULL` (full bases: every eigenvalue kept)."""
        if self.basis is not Basis.CAPPED or not _thin_solve(a, g):
            return None, None
        traces = torch.stack([torch.trace(a.running), torch.trace(g.running)]).tolist()
        return linalg.rank_threshold(damping, traces[1]), linalg.rank_threshold(damping, traces[0])

    def precondition(self, grad: Tensor, a: FactorView, g: FactorView, damping: float,
                     state: dict[str, Tensor]) -> Tensor:
        ea, eg = a.decomposition, g.decomposition
        if not (a.diagonal or g.diagonal or a.groups > 1):
            return linalg.eigen_precondition(grad, ea, eg, damping)
        d_a = ea if a.diagonal else ea.d
        d_g = eg if g.diagonal else eg.d
        rotated = grad if g.diagonal else eg.Q.mT @ grad
        if not a.diagonal:
            rotated = rotated @ ea.Q
        rotated = rotated / (d_g.unsqueeze(-1) * d_a.unsqueeze(-2) + damping)
        if not a.diagonal:
            rotated = rotated @ ea.Q.mT
        return rotated if g.diagonal else eg.Q @ rotated


class DampedInverse(Method):
    """π-factored damping (Martens & Grosse 2015): ``V = (G + (√λ/π) I)⁻¹ ∇ (A + π√λ I)⁻¹`` with
    ``π = sqrt((tr A / dim A) / (tr G / dim G))`` (1 if either trace is 0), over all blocks of a
    grouped factor together. A diagonal factor's inverse is the vector ``1 / (d + shift)``.
    Dense inverses whatever the rank: no eigenbasis cap (:class:`Eigen`'s ``max_rank``) applies,
    so a wide factor costs O(n³) to invert and O(out·in·n) per step to apply."""

    name = "inverse"
    basis: ClassVar[Basis] = Basis.INVERSE
    decomposer: ClassVar[Decomposer] = InverseDecomposer()

    def shifts(self, a: FactorView, g: FactorView, damping: float) -> tuple[float, float]:
        a_mean, g_mean = a.mean_eigenvalue(), g.mean_eigenvalue()
        pi = (a_mean / g_mean) ** 0.5 if a_mean > 0 and g_mean > 0 else 1.0
        root = damping**0.5
        return pi * root, root / pi

    def decomposition_cost(self, a: FactorView, g: FactorView) -> tuple[float, float]:
        """A Cholesky inverse per dense factor (``costs.INVERSE·n³``)."""
        return _factor_cost(a, costs.INVERSE), _factor_cost(g, costs.INVERSE)

    def precondition_cost(self, a: FactorView, g: FactorView) -> float:
        """``G⁻¹ ∇ A⁻¹``: one product per dense side."""
        return _rotations(a, g, a.dim, g.dim, products=1)

    def precondition(self, grad: Tensor, a: FactorView, g: FactorView, damping: float,
                     state: dict[str, Tensor]) -> Tensor:
        ia, ig = a.decomposition, g.decomposition
        if not (a.diagonal or g.diagonal or a.groups > 1):
            return linalg.inverse_precondition(grad, ia, ig)
        left = grad * ig.unsqueeze(-1) if g.diagonal else ig @ grad
        return left * ia.unsqueeze(-2) if a.diagonal else left @ ia


def rotate(grad: Tensor, a: FactorView, g: FactorView, scratch: Tensor) -> Tensor:
    """``R = U_Gᵀ ∇ U_A``: the joint gradient in the factors' eigenbases (a diagonal factor's is ``I``),
    in a fresh tensor (never ``grad`` itself). ``scratch``: a tensor shaped as ``grad`` that holds
    the intermediate product when both sides rotate (its content is then overwritten)."""
    if g.diagonal and a.diagonal:
        return grad.clone()
    if a.diagonal:
        return g.decomposition.Q.mT @ grad
    if g.diagonal:
        return grad @ a.decomposition.Q
    return torch.matmul(g.decomposition.Q.mT, grad, out=scratch) @ a.decomposition.Q


def unrotate(rotated: Tensor, a: FactorView, g: FactorView, scratch: Tensor) -> Tensor:
    """``U_G R U_Aᵀ``, the inverse of :func:`rotate` (the bases are full and orthonormal), in a fresh
    tensor unless neither side rotates (then ``rotated`` itself); ``scratch`` as in :func:`rotate`."""
    if g.diagonal and a.diagonal:
        return rotated
    if a.diagonal:
        return g.decomposition.Q @ rotated
    if g.diagonal:
        return rotated @ a.decomposition.Q.mT
    return g.decomposition.Q @ torch.matmul(rotated, a.decomposition.Q.mT, out=scratch)


REFRESHES: dict[str, type[EigenDecomposer]] = {"eigh": EigenDecomposer, "power": PowerRefreshDecomposer}
""":class:`EigenAdam`'s ``refresh`` choices: how a held basis is refreshed at a decomposition step."""


@dataclass(frozen=True, repr=True)
class EigenAdam(Eigen):
    """Adam's second moment in K-FAC's eigenbasis: the eigenvalue-corrected K-FAC of George et al.
    (NeurIPS 2018) in the Adam form that SOAP uses in Shampoo's basis (Vyas et al. 2024).

    With ``U_A``, ``U_G`` the eigenvectors of the running factors (refreshed on decomposition steps,
    as :class:`Eigen`'s) and the joint gradient ``∇ (out, in [+1])``::

        R = U_Gᵀ ∇ U_A                                       (rotated gradient)
        v ← β₂ v + (1 − β₂) R²,   t ← t + 1                  (per block, elementwise)
        V = U_G [R / (sqrt(v / (1 − β₂ᵗ)) + ε)] U_Aᵀ

    The factors' eigenvalues and the damping ``λ`` do not enter: ``v`` replaces ``d_G d_Aᵀ + λ``
    (the per-entry second moment George et al. estimate from per-sample gradients is here the
    running mean of the mini-batch gradient's, as in SOAP); ``ε`` is the only regularizer. The
    first moment is SGD's momentum, applied after the KL clip on ``V`` (``beta1`` None), or, with
    ``beta1`` (keyword, in [0, 1)), SOAP's: Adam's first moment of the gradient, kept by the method
    in the parameters' coordinates and rotated with the bases held now, over the root::

        m ← β₁ m + (1 − β₁) ∇,   V = U_G [U_Gᵀ (m / (1 − β₁ᵗ)) U_A / (sqrt(v̂) + ε)] U_Aᵀ

    (two more products per step; the param groups then need ``momentum=0``, and the parameters
    outside K-FAC take ``beta1`` as their β₁: :meth:`first_moment`).
    A diagonal factor (an embedding's ``A``) has the identity as its basis, so its side is not
    rotated. When the bases are refreshed ``v`` is kept as is, not re-projected (SOAP's choice:
    the running factors and so the bases move slowly, and nothing else need be held).

    ``max_rank``, ``thin_width`` (keywords; ``max_rank`` None: full bases everywhere): the thin basis
    of wide factors. A dense factor wider than ``thin_width`` (≥ ``max_rank``), of a pair of dense
    ungrouped factors, is held as at most ``max_rank`` leading eigenvectors ``Q`` (:class:`Eigen`'s cap: a randomized
    eigensolver, O(n²·max_rank); its isotropic ``σ`` is not used). Its side's ``U`` above is then ``Q (n, r)``, and the
    part of the gradient outside the kept eigenvectors, ``O = ∇ − U_G R U_Aᵀ``, takes Adam's elementwise
    update in the parameters' own coordinates with its own second moment::

        w ← β₂ w + (1 − β₂) O²,   V = U_G [R / (sqrt(v̂) + ε)] U_Aᵀ + O / (sqrt(w / (1 − β₂ᵗ)) + ε)

    at O(out·in·max_rank) per capped side instead of O(out·in·n). A pair with no capped side is
    computed as without the cap, bit for bit (no ``w``). When a thin basis changes its column
    count (the factor's rank grows in the first steps) ``v`` keeps its entries of the leading
    eigenvectors (its trailing rows and columns) and the new ones start at 0.
    A step whose gradient has a non-finite entry leaves the state unchanged (its direction is
    non-finite, and the KL clip leaves that layer out and reports it).
    With ``beta1`` and a capped side, ``m̂`` is split as ``∇`` is and its two parts take the places
    of ``R`` and ``O`` over the roots. State per block: ``v`` (shaped as ``R``, in the decomposition
    dtype), ``t``, ``w`` (shaped as the joint gradient) when a side is capped, and ``m`` (shaped as
    the joint gradient) with ``beta1``.

    ``refresh`` (keyword, :data:`REFRESHES`): how a held basis is refreshed at a decomposition step.
    ``"eigh"`` (the default): decomposed afresh (``eigh``, or the cap's randomized eigensolver), its
    columns in ascending order of the eigenvalues. ``"power"``: SOAP's refresh, one step of orthogonal
    iteration warm-started from the basis held, ``Q ← QR(F·Q)`` with the columns orthonormalized in
    the order of their estimated eigenvalues and each written back to its slot, so ``v`` stays
    aligned with it unpermuted (``kfac_optim.methods.power_refresh``; the first decomposition, and a
    restore that holds no basis, is ``"eigh"``'s). It costs one product and one QR (O(n²·max_rank)
    on a capped side, against the eigensolver's three QRs; docs/tuning.md "EigenAdam's basis
    refresh"), so the bases can follow the factors every few steps.
    """

    beta2: float = 0.95
    eps: float = 1e-8
    max_rank: int | None = field(default=EIGEN_ADAM_MAX_RANK, kw_only=True)
    thin_width: int = field(default=EIGEN_ADAM_THIN_WIDTH, kw_only=True)
    beta1: float | None = field(default=None, kw_only=True)
    refresh: str = field(default="eigh", kw_only=True)

    name: ClassVar[str] = "eigen_adam"
    basis: ClassVar[Basis] = Basis.CAPPED
    stateful: ClassVar[bool] = True
    uses_damping: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"EigenAdam beta2 must be in [0, 1), got {self.beta2}")
        if not 0.0 < self.eps < math.inf:
            raise ValueError(f"EigenAdam eps must be a finite number > 0, got {self.eps}")
        if self.beta1 is not None and (isinstance(self.beta1, bool) or not isinstance(self.beta1, int | float)
                                       or not 0.0 <= self.beta1 < 1.0):
            raise ValueError(f"EigenAdam beta1 must be None or a number in [0, 1), got {self.beta1!r}")
        if isinstance(self.thin_width, bool) or not isinstance(self.thin_width, int) or (
                self.max_rank is not None and self.thin_width < self.max_rank):
            raise ValueError(f"EigenAdam thin_width must be an int >= max_rank ({self.max_rank}), "
                             f"got {self.thin_width!r}")
        if self.refresh not in REFRESHES:
            raise ValueError(f"EigenAdam refresh must be one of {sorted(REFRESHES)}, got {self.refresh!r}")
        cap = (self.max_rank, self.thin_width) if self.max_rank is not None else (None, None)
        object.__setattr__(self, "decomposer", REFRESHES[self.refresh](*cap))

    def outside_kfac(self) -> tuple[float, float] | None:
        """Adam's update with this method's ``(beta2, eps)`` (its directions have Adam's scale)."""
        return self.beta2, self.eps

    def first_moment(self) -> float | None:
        """:attr:`beta1` (None: SGD's momentum on the directions)."""
        return self.beta1

    def rank_thresholds(self, a: FactorView, g: FactorView, damping: float) -> tuple[float | None, float | None]:
        """0 for a capped factor (thin: its rounding-floor eigenvalues dropped, at most ``max_rank``
        kept), None (the full basis) for every other: the damping does not enter."""
        return (0.0 if self._capped_in_pair(a, a, g) else None), (0.0 if self._capped_in_pair(g, a, g) else None)

    def decomposition_cost(self, a: FactorView, g: FactorView) -> tuple[float, float]:
        """``refresh="power"``: a dense factor's refresh at ``costs.POWER_REFRESH·n²·c`` per block (``c``:
        ``max_rank`` on a capped side, else ``n``; the first decomposition's ``eigh`` is not counted);
        ``"eigh"``: :class:`Eigen`'s."""
        if self.refresh == "eigh":
            return super().decomposition_cost(a, g)

        def cost(factor: FactorView) -> float:
            if self._capped_in_pair(factor, a, g):
                return costs.POWER_REFRESH * float(factor.dim) ** 2 * self.max_rank
            return _factor_cost(factor, costs.POWER_REFRESH)

        return cost(a), cost(g)

    def precondition_cost(self, a: FactorView, g: FactorView) -> float:
        """Full rotations and Adam's elementwise update of the rotated gradient (about ten passes);
        with a capped side, three rotations at ``max_rank`` columns there (the projection) and
        about ten more passes for the outside part. With ``beta1``, the rotation of ``m̂`` (one
        product per side more, two with a capped side) and its update (about three passes)."""
        a_columns = self.max_rank if self._capped_in_pair(a, a, g) else a.dim
        g_columns = self.max_rank if self._capped_in_pair(g, a, g) else g.dim
        first = self.beta1 is not None
        if a_columns == a.dim and g_columns == g.dim:
            return _rotations(a, g, a.dim, g.dim, products=2 + first) + _elementwise(a, g, passes=10 + 3 * first)
        return (_rotations(a, g, a_columns, g_columns, products=3 + 2 * first)
                + _elementwise(a, g, passes=20 + 3 * first))

    def approximations(self, pairs: Sequence[tuple[str, FactorView, FactorView]]) -> str | None:
        capped = [f"{layer}.{side} ({factor.dim})" for layer, a, g in pairs
                  for side, factor in (("A", a), ("G", g)) if self._capped_in_pair(factor, a, g)]
        if not capped:
            return None
        return (f"thin eigenbasis max_rank={self.max_rank} above width {self.thin_width}: at most {self.max_rank} "
                f"leading eigenvectors, the gradient outside them takes elementwise Adam: {', '.join(capped)}")

    def precondition(self, grad: Tensor, a: FactorView, g: FactorView, damping: float,
                     state: dict[str, Tensor]) -> Tensor:
        if _thin_side(a) or _thin_side(g):
            return self._thin_precondition(grad, a, g, state)
        # Three tensors shaped as ∇ per call (R, one scratch, the result) and the rest in place:
        # on a CPU, fresh pages for each temporary cost more than this elementwise arithmetic.
        scratch = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        rotated = rotate(grad, a, g, scratch)
        v, t = self._moments(state, rotated)
        # 0·x is 0 for every finite x and nan for ±inf and nan: R is finite iff Σ 0·R = 0 (on the device).
        finite = torch.mul(rotated, 0.0, out=scratch).sum().eq(0)
        t.add_(finite.to(t.dtype))
        torch.mul(v, self.beta2, out=scratch).addcmul_(rotated, rotated, value=1.0 - self.beta2)
        torch.where(finite, scratch, v, out=v)
        if self.beta1 is not None:  # Adam's m̂, rotated with the bases held now, replaces R above the root
            rotated = rotate(self._first_moment(state, grad, finite, t), a, g, scratch)
        torch.div(v, 1.0 - torch.pow(self.beta2, t), out=scratch).sqrt_().add_(self.eps)
        return unrotate(rotated.div_(scratch), a, g, scratch)

    def _first_moment(self, state: dict[str, Tensor], grad: Tensor, finite: Tensor, t: Tensor) -> Tensor:
        """``m ← β₁ m + (1 − β₁) ∇`` (in the parameters' coordinates, kept as is where ``finite`` is
        False) and the bias-corrected ``m / (1 − β₁ᵗ)`` in a fresh tensor."""
        if "m" not in state or state["m"].shape != grad.shape:
            state["m"] = torch.zeros_like(grad)
        m = state["m"]
        torch.where(finite, torch.mul(m, self.beta1).add_(grad, alpha=1.0 - self.beta1), m, out=m)
        return torch.div(m, 1.0 - torch.pow(self.beta1, t))

    def _moments(self, state: dict[str, Tensor], rotated: Tensor) -> tuple[Tensor, Tensor]:
        """The block's ``v`` (shaped as ``rotated``; resized keeping its trailing entries when the
        basis changed its column count) and ``t``, created at 0 on its first step."""
        if "t" not in state:  # the block's first preconditioned step
            state["t"] = torch.zeros((), dtype=rotated.dtype, device=rotated.device)
        held = state.get("v")
        if held is None or held.shape != rotated.shape:
            v = torch.zeros_like(rotated)
            if held is not None:
                rows, columns = min(held.shape[-2], v.shape[-2]), min(held.shape[-1], v.shape[-1])
                v[..., v.shape[-2] - rows :, v.shape[-1] - columns :] = held[..., held.shape[-2] - rows :,
                                                                             held.shape[-1] - columns :]
            state["v"] = v
        return state["v"], state["t"]

    def _thin_precondition(self, grad: Tensor, a: FactorView, g: FactorView, state: dict[str, Tensor]) -> Tensor:
        """The update of a pair with a thin side (the class docstring's second formula)."""
        rotated = _thin_rotate(grad, a, g)
        v, t = self._moments(state, rotated)
        outside = grad - _thin_unrotate(rotated, a, g)
        if "w" not in state or state["w"].shape != grad.shape:
            state["w"] = torch.zeros_like(grad)
        w = state["w"]
        finite = (torch.mul(rotated, 0.0).sum() + torch.mul(outside, 0.0).sum()).eq(0)
        t.add_(finite.to(t.dtype))
        correction = 1.0 - torch.pow(self.beta2, t)
        for moment, part in ((v, rotated), (w, outside)):
            updated = torch.mul(moment, self.beta2).addcmul_(part, part, value=1.0 - self.beta2)
            torch.where(finite, updated, moment, out=moment)
        if self.beta1 is not None:  # Adam's m̂ split as ∇ is, in place of R and O above the roots
            first = self._first_moment(state, grad, finite, t)
            rotated = _thin_rotate(first, a, g)
            outside = first.sub_(_thin_unrotate(rotated, a, g))
        for moment, part in ((v, rotated), (w, outside)):
            part.div_(torch.div(moment, correction).sqrt_().add_(self.eps))
        return _thin_unrotate(rotated, a, g).add_(outside)


def _thin_side(factor: FactorView) -> bool:
    """Whether ``factor``'s held basis is thin (``Q (n, r)``, ``r < n``): a capped factor's."""
    decomposition = factor.decomposition
    return isinstance(decomposition, linalg.Eigen) and decomposition.Q.shape[-1] < decomposition.Q.shape[-2]


def _thin_rotate(grad: Tensor, a: FactorView, g: FactorView) -> Tensor:
    """``Q_Gᵀ ∇ Q_A`` for a pair of dense ungrouped factors with bases ``Q (n, r)`` (full or thin)."""
    return torch.linalg.multi_dot([g.decomposition.Q.T, grad, a.decomposition.Q])


def _thin_unrotate(rotated: Tensor, a: FactorView, g: FactorView) -> Tensor:
    """``Q_G R Q_Aᵀ``: back from :func:`_thin_rotate`'s coordinates (the projection of ∇ for ``R`` its rotation)."""
    return torch.linalg.multi_dot([g.decomposition.Q, rotated, a.decomposition.Q.T])


METHODS: dict[str, type[Method]] = {"eigen": Eigen, "inverse": DampedInverse, "eigen_adam": EigenAdam}
"""The methods the optimizer's ``method`` argument names (:func:`register_method` adds one)."""


def register_method(cls: type[Method]) -> type[Method]:
    """Register ``cls`` under its ``name`` for the optimizer's ``method`` argument (usable as a class
    decorator; a method in its own module registers itself there). ``ValueError`` when the name is
    taken by another class."""
    if METHODS.setdefault(cls.name, cls) is not cls:
        raise ValueError(f"method name {cls.name!r} is taken by {METHODS[cls.name].__name__}")
    return cls


def method_named(name: str | Method) -> Method:
    """The :class:`Method` registered as ``name`` (:data:`METHODS`: ``"eigen"``, ``"inverse"``,
    ``"eigen_adam"``, ...) with its defaults; a :class:`Method` is returned as is. ``TypeError`` when
    the method has no :attr:`Method.decomposer`."""
    if isinstance(name, Method):
        method = name
    elif name not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {name!r}")
    else:
        method = METHODS[name]()
    if not isinstance(getattr(method, "decomposer", None), Decomposer):
        raise TypeError(f"method {type(method).__name__} has no decomposer: set Method.decomposer to a "
                        "kfac_optim.methods.decompositions.Decomposer (how its factors are decomposed, "
                        "shipped and saved)")
    return method
