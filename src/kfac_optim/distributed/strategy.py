"""The distribution-strategy seam: what K-FAC asks of wherever its state and work live.

Owns: the :class:`DistributionStrategy` protocol, the callback a strategy preconditions a block
with (:data:`Precondition`), the plan's work items of the blocks and the whole-gradient path of
the directions that the strategies share (:func:`whole_gradient_directions`).
Must not know: which strategies exist and how one is chosen (``strategies.py``), collectives,
FSDP2, how a direction is computed (the caller's callback).

One strategy is chosen at construction (``strategies.strategy_for``) and asked for everything
that depends on where tensors live: which factors this rank decomposes, when factors become
global, which directions this rank computes and receives, which part of a tensor it holds. The
rest of the package never tests for ranks or shards (docs/design.md §5, "Strategies").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor
from torch.profiler import record_function

from kfac_optim.distributed.comm import Communicator
from kfac_optim.distributed.plan import Plan, WorkItem
from kfac_optim.methods import Method

if TYPE_CHECKING:
    from kfac_optim.layers import KroneckerBlock

__all__ = ["DistributionStrategy", "Precondition", "WholeTensors", "block_work_items", "whole_gradient_directions"]

Precondition = Callable[["KroneckerBlock", Tensor], "Tensor | None"]
"""``(block, its whole joint gradient) -> its joint direction``, or None where this rank holds no
decomposition of the block (``KroneckerBlock.precondition`` at the step's method and damping)."""


class DistributionStrategy(Protocol):
    """Where the blocks' factors, decompositions and directions live, and how they move.

    Attributes:
        plan: which rank decomposes which factor and who preconditions (``plan.py``; one rank:
            all of it here).
        comm: the collectives over the group K-FAC runs on (inactive on one rank).
        decompositions_missing: a loaded checkpoint lacks a decomposition of an initialized
            factor: the next step decomposes from the loaded factors.
    """

    plan: Plan
    comm: Communicator
    decompositions_missing: bool

    @property
    def active(self) -> bool:
        """Whether K-FAC runs on more than one rank."""
        ...

    @property
    def whole_tensors(self) -> bool:
        """Whether this rank holds the whole parameters and gradients of every K-FAC layer (a
        tensor's norm is then local)."""
        ...

    @property
    def broadcasts_directions(self) -> bool:
        """Whether some rank receives directions it did not compute from its own gradients."""
        ...

    def decomposes(self, block: str, factor: str) -> bool:
        """Whether this rank computes the decomposition of ``factor`` of ``block``."""
        ...

    def owned_factors(self) -> tuple[str, ...]:
        """``"<block>.<factor>"`` of every factor this rank decomposes."""
        ...

    def bytes_communicated(self) -> dict[str, int]:
        """Bytes sent so far, by kind (``factors``, ``decompositions``, ``directions``)."""
        ...

    def factors_folded(self) -> None:
        """Record a factor step: the ranks' running factors may now differ."""
        ...

    def synchronize_factors(self, caller: str = "KFAC.step()", confirm: bool = False) -> None:
        """Make every rank's running factors the global ones (a collective when they may differ);
        ``caller`` names the call for messages, ``confirm`` checks every rank makes it."""
        ...

    def sum_over_ranks(self, values: list[float], what: str) -> list[float]:
        """``values`` summed over the ranks (a collective named ``what``)."""
        ...

    def share_decompositions(self, method: Method, dtype: torch.dtype) -> None:
        """After this rank decomposed what it decomposes: hand the decompositions (``method``'s,
        in ``dtype``) to the ranks that precondition with them."""
        ...

    def directions(self, blocks: Sequence[KroneckerBlock], precondition: Precondition,
                   dtype: torch.dtype) -> dict[Tensor, Tensor]:
        """Per-parameter directions of ``blocks``, each laid out as its parameter (this rank's part),
        computed with ``precondition`` and moved in ``dtype``; a block left out takes SGD's path."""
        ...

    def local(self, tensor: Tensor) -> Tensor:
        """This rank's part of a parameter, gradient or direction."""
        ...

    def summed_over_shards(self, terms: Tensor, params: Sequence[Tensor]) -> Tensor:
        """``terms`` ``(P, count)``, sums over the local parts of ``params`` (one row each), as sums
        over the whole parameters."""
        ...

    def preconditioning_bytes(self, dtype: torch.dtype) -> int:
        """The most bytes this rank holds at once to precondition others' gradients (in ``dtype``)."""
        ...

    def resharded(self, param: Tensor) -> bool:
        """Whether the parameter object a module holds after its forward is not the one its backward
        writes the gradient of (the capture then finds the gradient's node in the backward)."""
        ...

    def loaded(self) -> None:
        """After the blocks loaded a checkpoint (the same one on every rank)."""
        ...


class WholeTensors:
    """The tensor-layout part of :class:`DistributionStrategy` for a strategy under which every rank
    holds the whole parameters and gradients of every K-FAC layer (no sharded parameters)."""

    whole_tensors = True

    def local(self, tensor: Tensor) -> Tensor:
        return tensor

    def summed_over_shards(self, terms: Tensor, params: Sequence[Tensor]) -> Tensor:
        return terms

    def preconditioning_bytes(self, dtype: torch.dtype) -> int:
        return 0

    def resharded(self, param: Tensor) -> bool:
        return False


def block_work_items(blocks: Sequence[KroneckerBlock]) -> list[WorkItem]:
    """The plan's work items of ``blocks``: one per factor, with its dimension and kind."""
    return [
        WorkItem(block.name, name, factor.dim, factor.diagonal, factor.groups)
        for block in blocks
        for name, factor in block.factors.items()
    ]


def whole_gradient_directions(
    blocks: Sequence[KroneckerBlock],
    precondition: Precondition,
    share: Callable[[Mapping[str, Tensor]], dict[str, Tensor]],
) -> dict[Tensor, Tensor]:
    """Per-parameter directions of the ``blocks`` whose whole gradients this rank holds.

    Each block with a gradient is preconditioned here (``precondition``; None: no decomposition
    here); ``share`` maps the joint directions computed, by block name, to those this rank applies
    (the computed ones plus any received). Each is then split per parameter (``KroneckerBlock.split``).
    """
    joint: dict[str, Tensor] = {}
    for block in blocks:
        grad = block.grad_matrix()
        if grad is None:
            continue
        preconditioned = precondition(block, grad)
        if preconditioned is not None:
            joint[block.name] = preconditioned
    with record_function("kfac.share_directions"):
        joint = share(joint)
    directions: dict[Tensor, Tensor] = {}
    for block in blocks:
        if block.name in joint:
            directions.update(block.split(joint[block.name]))
    return directions
