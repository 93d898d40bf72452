"""The preconditioned directions of a step: ``(G ⊗ A + λI)⁻¹ ∇W`` per block, by parameter.

Owns: running the blocks' ``precondition`` on their gradients where they are whole (then sharing
the directions over the ranks that did not compute them) and, under FSDP2, on the gradients' rows
gathered per block (``RowShardedPreconditioner``), and splitting the results back per parameter.
Must not know: decompositions' freshness, schedules, the step's length, the SGD update.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.profiler import record_function

from kfac_optim.distributed import fsdp
from kfac_optim.distributed.sharding import Sharding
from kfac_optim.layers import KroneckerBlock
from kfac_optim.methods import Method

logger = logging.getLogger(__name__)


@record_function("kfac.precondition")
def precondition(blocks: Sequence[KroneckerBlock], method: Method, damping: float, sharding: Sharding,
                 inv_dtype: torch.dtype) -> dict[Tensor, Tensor]:
    """Per-parameter update directions of the ``blocks`` that have a decomposition, by ``method`` at
    ``damping``; shared through ``sharding`` in ``inv_dtype``. Under FSDP2 a direction is a
    ``DTensor`` laid out as its parameter (this rank's rows)."""
    joint: dict[str, Tensor] = {}
    sharded_rows: dict[str, Tensor] = {}
    for block in blocks:
        if sharding.is_row_sharded(block.name):
            rows = fsdp.gradient_rows(block.parameters())
            if rows is not None:
                sharded_rows[block.name] = rows
            continue
        grad = block.grad_matrix()
        if grad is None:
            continue
        preconditioned = block.precondition(grad, method, damping)
        if preconditioned is not None:
            joint[block.name] = preconditioned
    with record_function("kfac.share_directions"):
        joint = sharding.share_directions(joint, inv_dtype)
    directions: dict[Tensor, Tensor] = {}
    for block in blocks:
        if block.name in joint:
            directions.update(block.split(joint[block.name]))
    if sharded_rows:
        directions.update(_precondition_rows(blocks, sharded_rows, method, damping, sharding, inv_dtype))
    return directions


def _precondition_rows(blocks: Sequence[KroneckerBlock], sharded_rows: dict[str, Tensor], method: Method,
                       damping: float, sharding: Sharding, inv_dtype: torch.dtype) -> dict[Tensor, Tensor]:
    """FSDP2's row path: the directions of row-sharded blocks from their gradients' local rows."""
    by_name = {block.name: block for block in blocks}

    def precondition_whole(name: str, whole: Tensor) -> Tensor:
        """The block's direction as its parameters' row matrix, from its whole gradients'."""
        block = by_name[name]
        weight_grad, *bias_grad = fsdp.split_rows(whole, block.parameters())
        grad = block.joint_gradient(weight_grad, bias_grad[0] if bias_grad else None)
        direction = block.precondition(grad, method, damping)
        assert direction is not None, f"{name}: preconditioned where its decompositions are missing"
        return fsdp.join_rows([part for _, part in block.split(direction)])

    with record_function("kfac.fsdp_rows"):
        rows_of = sharding.precondition_sharded(sharded_rows, precondition_whole, inv_dtype)
    directions: dict[Tensor, Tensor] = {}
    for name, rows in rows_of.items():
        params = by_name[name].parameters()
        for param, direction in zip(params, fsdp.split_rows(rows, params), strict=True):
            directions[param] = fsdp.like_param(param, direction.to(param.dtype).contiguous())
    return directions
