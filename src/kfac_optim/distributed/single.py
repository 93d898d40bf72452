"""The single-process strategy: every factor, decomposition and direction lives here.

Owns: the answers of a :class:`~kfac_optim.distributed.strategy.DistributionStrategy` on one
rank (every factor decomposed here, factors always global, directions computed here, tensors
whole), with the plan of one rank (its validation of ``grad_worker_fraction`` and its summary).
Must not know: collectives, other ranks, FSDP2, how factors, decompositions or directions are
computed (the blocks and the caller's callback do that).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from kfac_optim.distributed.comm import DEFAULT_BUCKET_BYTES, Communicator
from kfac_optim.distributed.plan import Plan, make_plan
from kfac_optim.distributed.strategy import Precondition, WholeTensors, block_work_items, whole_gradient_directions
from kfac_optim.methods import Method

if TYPE_CHECKING:
    from kfac_optim.layers import KroneckerBlock

logger = logging.getLogger(__name__)


class SingleProcess(WholeTensors):
    """K-FAC on one rank (``DistributionStrategy``).

    Args:
        blocks: the optimizer's Kronecker blocks.
        grad_worker_fraction: checked as on several ranks (see ``plan.resolve_grad_workers``).
        process_group: a group of one rank, or None.
        bucket_bytes: checked as on several ranks (at least 1).
        method: the decomposition method, whose costs the plan counts.

    Raises:
        ValueError: a bad ``grad_worker_fraction`` or ``bucket_bytes``, or a ``process_group``
            that cannot be used (see :class:`Communicator`).
    """

    def __init__(
        self,
        blocks: Sequence[KroneckerBlock],
        grad_worker_fraction: float | str = 1.0,
        process_group: dist.ProcessGroup | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        method: Method | str = "eigen",
    ) -> None:
        self.plan: Plan = make_plan(block_work_items(blocks), 1, grad_worker_fraction, method=method)
        self.comm = Communicator(process_group, (), bucket_bytes)
        self.blocks = list(blocks)
        self.decompositions_missing = False
        if blocks:
            logger.info("K-FAC plan: %s", self.plan.summary(0))

    active = False
    broadcasts_directions = False

    def decomposes(self, block: str, factor: str) -> bool:
        return True

    def owned_factors(self) -> tuple[str, ...]:
        return tuple(f"{item.block}.{item.factor}" for item in self.plan.owned(0))

    def bytes_communicated(self) -> dict[str, int]:
        return dict.fromkeys(("factors", "decompositions", "directions"), 0)

    def factors_folded(self) -> None:
        pass

    def synchronize_factors(self, caller: str = "KFAC.step()", confirm: bool = False) -> None:
        pass

    def sum_over_ranks(self, values: list[float], what: str) -> list[float]:
        return list(values)

    def share_decompositions(self, method: Method, dtype: torch.dtype) -> None:
        self.decompositions_missing = False

    def directions(self, blocks: Sequence[KroneckerBlock], precondition: Precondition,
                   dtype: torch.dtype) -> dict[Tensor, Tensor]:
        return whole_gradient_directions(blocks, precondition, _computed)

    def loaded(self) -> None:
        """Asks for a decomposition pass at the next step when the checkpoint lacks a
        decomposition of an initialized factor (saved by a rank that did not hold it)."""
        factors = [factor for block in self.blocks for factor in block.factors.values()]
        initialized = torch.stack([f.initialized for f in factors]).tolist() if factors else []
        self.decompositions_missing = any(
            init and f.decomposition is None for f, init in zip(factors, initialized, strict=True)
        )


def _computed(directions: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """One rank's share of the directions: the ones it computed."""
    return dict(directions)
