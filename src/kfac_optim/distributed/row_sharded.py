"""The row-sharded strategy: layers whose parameters FSDP2 (``fully_shard``, HSDP) shards by rows.

Owns: recognising a model's row-sharded blocks and checking they can be preconditioned (one mesh,
parameters sharded by rows of one length, K-FAC on the whole job), their directions (gradient
rows gathered to a gradient worker, preconditioned whole, scattered back: ``fsdp.py``), the
local rows of their tensors and the sums over their shards (the step length's terms).
Must not know: how a direction is computed from a whole gradient (the caller's callback),
schedules, param groups. Factors and decompositions move as under :class:`DataParallel`, whose
strategy this one extends; blocks whose parameters are not sharded take its path too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

from kfac_optim.distributed import fsdp
from kfac_optim.distributed.comm import DEFAULT_BUCKET_BYTES
from kfac_optim.distributed.data_parallel import DataParallel
from kfac_optim.distributed.strategy import Precondition
from kfac_optim.methods import Method

if TYPE_CHECKING:
    from kfac_optim.layers import KroneckerBlock

logger = logging.getLogger(__name__)


def has_row_sharded_blocks(blocks: Sequence[KroneckerBlock]) -> bool:
    """Whether some block's weight is sharded by FSDP2 (a ``DTensor``)."""
    return any(fsdp.is_sharded(block.weight) for block in blocks)


class RowSharded(DataParallel):
    """K-FAC with FSDP2-sharded layers (``DistributionStrategy``); arguments as :class:`DataParallel`.

    Raises:
        ValueError: as :class:`DataParallel`; sharded blocks on different meshes, a block whose
            parameters are not all sharded or differ in rows (dim 0), or a process group that is
            not the whole job (plan ranks must be the mesh's global ranks).
    """

    def __init__(
        self,
        blocks: Sequence[KroneckerBlock],
        grad_worker_fraction: float | str = 1.0,
        process_group: dist.ProcessGroup | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        settings: Mapping[str, object] | None = None,
        method: Method | str = "eigen",
    ) -> None:
        super().__init__(blocks, grad_worker_fraction, process_group, bucket_bytes, settings, method)
        self.rows = self._row_preconditioner(bucket_bytes)

    def _row_preconditioner(self, bucket_bytes: int) -> fsdp.RowShardedPreconditioner:
        """The preconditioner of the blocks whose parameters are ``DTensor``s (checked here)."""
        sharded = {name: b for name, b in self.blocks.items() if fsdp.is_sharded(b.weight)}
        for name, block in sharded.items():
            params = block.parameters()
            if not all(fsdp.is_sharded(p) for p in params) or len({p.shape[0] for p in params}) != 1:
                raise ValueError(
                    f"model: K-FAC layer '{name}' ({type(block).__name__}) under FSDP2 needs all its parameters "
                    f"sharded by rows of one length, got shapes {[tuple(p.shape) for p in params]}"
                )
        layouts = {fsdp.mesh_layout(p) for b in sharded.values() for p in b.parameters()}
        if len(layouts) != 1:
            raise ValueError(f"model: K-FAC layers sharded by FSDP2 must share one device mesh, got {layouts}")
        (layout,) = layouts
        if self.comm.world_size != dist.get_world_size() or sorted(r for g in layout.shard_groups for r in g) != list(
            range(self.comm.world_size)
        ):
            raise ValueError("process_group: with FSDP2-sharded layers K-FAC must run on the whole job, "
                             "the mesh's ranks")
        mesh = next(iter(sharded.values())).weight.device_mesh
        shard_group = layout.group_of(dist.get_rank())

        def group_for(ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
            if sorted(ranks) == sorted(shard_group):
                return mesh.get_group(layout.shard_dim)
            return self.comm.subgroup(tuple(sorted(ranks)))

        return fsdp.RowShardedPreconditioner(
            {name: fsdp.row_shape(b.parameters()) for name, b in sharded.items()},
            {name: self.plan.block(name).grad_workers for name in sharded},
            self.plan.receiver_groups,
            layout,
            group_for,
            bucket_bytes,
            self.comm.bytes_sent,
        )

    whole_tensors = False

    def directions(self, blocks: Sequence[KroneckerBlock], precondition: Precondition,
                   dtype: torch.dtype) -> dict[Tensor, Tensor]:
        """:class:`DataParallel`'s directions for the blocks with whole parameters, then those of the
        sharded blocks, each a ``DTensor`` laid out as its parameter (this rank's rows)."""
        whole: list[KroneckerBlock] = []
        sharded_rows: dict[str, Tensor] = {}
        for block in blocks:
            if block.name not in self.rows.shapes:
                whole.append(block)
                continue
            rows = fsdp.gradient_rows(block.parameters())
            if rows is not None:
                sharded_rows[block.name] = rows
        directions = super().directions(whole, precondition, dtype)
        if sharded_rows:
            directions.update(self._row_directions(blocks, sharded_rows, precondition, dtype))
        return directions

    def _row_directions(self, blocks: Sequence[KroneckerBlock], sharded_rows: dict[str, Tensor],
                        precondition: Precondition, dtype: torch.dtype) -> dict[Tensor, Tensor]:
        """The directions of row-sharded blocks from their gradients' local rows ``sharded_rows``
        (the same blocks on every rank; a collective)."""
        by_name = {block.name: block for block in blocks}

        def precondition_whole(name: str, whole: Tensor) -> Tensor:
            """The block's direction as its parameters' row matrix, from its whole gradients'."""
            block = by_name[name]
            weight_grad, *bias_grad = fsdp.split_rows(whole, block.parameters())
            direction = precondition(block, block.joint_gradient(weight_grad, bias_grad[0] if bias_grad else None))
            assert direction is not None, f"{name}: preconditioned where its decompositions are missing"
            return fsdp.join_rows([part for _, part in block.split(direction)])

        with record_function("kfac.fsdp_rows"):
            ready = {name: rows for name, rows in sharded_rows.items() if self._is_ready(name)}
            rows_of = self.rows.preconditioned_rows(ready, precondition_whole, dtype)
        directions: dict[Tensor, Tensor] = {}
        for name, rows in rows_of.items():
            params = by_name[name].parameters()
            for param, direction in zip(params, fsdp.split_rows(rows, params), strict=True):
                directions[param] = fsdp.like_param(param, direction.to(param.dtype).contiguous())
        return directions

    def _is_ready(self, name: str) -> bool:
        """Whether block ``name``'s decompositions exist at its owners (on one process: here)."""
        if self.active:
            return name in self._ready
        return all(f.decomposition is not None for f in self.blocks[name].factors.values())

    def local(self, tensor: Tensor) -> Tensor:
        return fsdp.local(tensor)

    def resharded(self, param: Tensor) -> bool:
        """FSDP2 puts the sharded ``DTensor`` back after the forward, the unsharded copy for the backward."""
        return fsdp.is_sharded(param)

    def summed_over_shards(self, terms: Tensor, params: Sequence[Tensor]) -> Tensor:
        """Rows of sharded ``params`` summed over the shard group (one all-reduce), the others as they are."""
        summed = self.rows.sum_over_shards(terms.clone())
        return torch.stack([summed[i] if fsdp.is_sharded(p) else terms[i] for i, p in enumerate(params)])

    def preconditioning_bytes(self, dtype: torch.dtype) -> int:
        """The row path's peak (``RowShardedPreconditioner.peak_bytes``)."""
        return self.rows.peak_bytes(torch.empty((), dtype=dtype).element_size())
