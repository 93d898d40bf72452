"""The preconditioned directions of a step: ``(G ⊗ A + λI)⁻¹ ∇W`` per block, by parameter.

Owns: what preconditioning a block's whole gradient means at a step (its method and damping).
Must not know: where gradients and directions live and how they move between ranks (the
distribution strategy runs this callback where a block's whole gradient is, ``distributed/strategy.py``),
decompositions' freshness, schedules, the step's length, the SGD update.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.profiler import record_function

from kfac_optim.distributed.strategy import DistributionStrategy
from kfac_optim.layers import KroneckerBlock
from kfac_optim.methods import Method

logger = logging.getLogger(__name__)


@record_function("kfac.precondition")
def precondition(blocks: Sequence[KroneckerBlock], method: Method, damping: float, strategy: DistributionStrategy,
                 inv_dtype: torch.dtype) -> dict[Tensor, Tensor]:
    """Per-parameter update directions of the ``blocks`` that have a decomposition, by ``method`` at
    ``damping``; moved by ``strategy`` in ``inv_dtype``, each laid out as its parameter (this rank's
    part: under FSDP2 a ``DTensor`` of this rank's rows)."""

    def precondition_block(block: KroneckerBlock, grad: Tensor) -> Tensor | None:
        return block.precondition(grad, method, damping)

    return strategy.directions(blocks, precondition_block, inv_dtype)
