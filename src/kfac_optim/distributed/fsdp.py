"""K-FAC for parameters sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``) and HSDP.

Owns: recognising row-sharded ``DTensor`` parameters and their mesh, choosing which rank
preconditions each block for which ranks, moving a block's gradient rows to that rank and its
preconditioned rows back, and summing per-shard partial sums (the KL-clip term).
Must not know: how a direction is computed from a whole gradient (the caller passes that as a
function), factors, schedules, param groups.

Layout: ``fully_shard`` keeps every parameter as a ``DTensor`` sharded on dim 0 over the *shard
group* of ``s`` ranks (``torch.chunk``'s rule: rank ``k`` holds rows ``[k·c, min((k+1)·c, out))``,
``c = ceil(out / s)``), replicated over the other mesh dimension under HSDP. A block's gradients,
as the row matrix ``(out, cols)`` of :func:`row_shape` (``[∇W | ∇b]``), are sharded the same way,
and hold DDP's averaged gradient cut into rows.

Data flow (docs/design.md §5, "FSDP2 and HSDP"): ``V = G⁻¹ ∇W A⁻¹`` needs whole columns, so each
block is preconditioned whole, once per *service group* (the plan's rows or the shard groups,
whichever is larger), by one of its gradient workers: (1) its shard group ``gather``s the block's
rows to it, padded to ``c``; (2) it rebuilds the whole gradients and preconditions them with the
block; (3) it ``scatter``s the result's rows back over the service group. Blocks move in buckets
(one ``gather`` and one ``scatter`` per bucket of one preconditioner), so a rank holds whole
gradients only of the blocks it preconditions, one bucket at a time. Bytes per step and block:
``c·cols`` entries sent by each rank of the shard group and received by each of the service group.
Collectives use the gradients' device (NCCL for CUDA, gloo for CPU).
"""

from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from kfac_optim.distributed.comm import DEFAULT_BUCKET_BYTES, collective

logger = logging.getLogger(__name__)

Precondition = Callable[[str, Tensor], Tensor]
"""``(block name, whole gradient row matrix (out, cols)) -> preconditioned (out, cols)``."""


def is_sharded(tensor: Tensor | None) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a parameter or gradient of an FSDP2 module)."""
    return isinstance(tensor, DTensor)


def local(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor``: its local shard for a ``DTensor``, else ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def like_param(param: Tensor, direction: Tensor) -> Tensor:
    """``direction`` (this rank's rows) laid out as ``param``: a ``DTensor`` with its mesh and
    placements when ``param`` is one, else ``direction`` itself."""
    if not isinstance(param, DTensor):
        return direction
    return DTensor.from_local(
        direction, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def row_shape(params: Sequence[Tensor]) -> tuple[int, int]:
    """``(rows, cols)`` of the *row matrix* of ``params`` (a block's parameters, sharing dim 0):
    each parameter's trailing dims flattened, placed side by side (``[W | b]`` for most blocks).

    FSDP2 shards every parameter by rows, so rows of this matrix are what move between ranks,
    whatever the block's own joint-gradient layout (grouped, transposed): the preconditioner
    rebuilds whole gradients from it (:func:`split_rows`) and hands them to the block.
    """
    return params[0].shape[0], sum(math.prod(p.shape[1:]) for p in params)


def gradient_rows(params: Sequence[Tensor]) -> Tensor | None:
    """This rank's rows of the row matrix of ``params``' gradients, or None if the first (the
    weight) has no gradient; a missing gradient of another parameter counts as zeros."""
    if params[0].grad is None:
        return None
    grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in params]
    return join_rows(grads)


def split_rows(rows: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    """``rows`` ``(r, cols)`` of a row matrix cut into one tensor per parameter, ``(r, *p.shape[1:])``
    (whole gradients when ``r`` is every row; views of ``rows``)."""
    widths = [math.prod(p.shape[1:]) for p in params]
    return [part.reshape(len(rows), *p.shape[1:]) for part, p in zip(rows.split(widths, dim=1), params, strict=True)]


def join_rows(tensors: Sequence[Tensor]) -> Tensor:
    """The row matrix of per-parameter tensors sharing dim 0 (the inverse of :func:`split_rows`)."""
    return torch.cat([t.reshape(len(t), math.prod(t.shape[1:])) for t in tensors], dim=1)  # rows may be 0


@dataclass(frozen=True)
class MeshLayout:
    """Where the rows of FSDP-sharded parameters live: the shard groups of one device mesh.

    Attributes:
        shard_groups: the ranks (global) of each shard group, each in mesh order; shard index =
            position in its group. Together they hold every rank once.
        shard_dim: the mesh dimension parameters are sharded over (``Shard(0)`` there).
    """

    shard_groups: tuple[tuple[int, ...], ...]
    shard_dim: int

    @property
    def shard_size(self) -> int:
        return len(self.shard_groups[0])

    def group_of(self, rank: int) -> tuple[int, ...]:
        return next(group for group in self.shard_groups if rank in group)

    def shard_index(self, rank: int) -> int:
        return self.group_of(rank).index(rank)

    def rows(self, out: int, rank: int) -> tuple[int, int]:
        """``(first row, row count)`` of an ``out``-row parameter on ``rank``."""
        chunk = math.ceil(out / self.shard_size)
        first = min(self.shard_index(rank) * chunk, out)
        return first, min(chunk, out - first)


def mesh_layout(param: DTensor) -> MeshLayout:
    """The :class:`MeshLayout` of an FSDP2 parameter.

    Raises:
        ValueError: placements other than one ``Shard(0)`` and ``Replicate()`` elsewhere (e.g.
            tensor parallelism's ``Shard(1)``), which K-FAC's row movement does not handle.
    """
    placements = tuple(param.placements)
    shard_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    if (
        len(shard_dims) != 1
        or type(placements[shard_dims[0]]) is not Shard
        or placements[shard_dims[0]].dim != 0
        or not all(isinstance(p, Replicate) for i, p in enumerate(placements) if i != shard_dims[0])
    ):
        raise ValueError(
            f"model: K-FAC supports FSDP2 parameters sharded on dim 0 over one mesh dimension "
            f"(Shard(0), Replicate() on the others), got placements {placements}"
        )
    shard_dim = shard_dims[0]
    ranks = param.device_mesh.mesh.movedim(shard_dim, -1).reshape(-1, param.device_mesh.mesh.shape[shard_dim])
    return MeshLayout(tuple(tuple(int(r) for r in row) for row in ranks.tolist()), shard_dim)


@dataclass(frozen=True)
class Route:
    """How one block's gradient is preconditioned for one service group.

    ``preconditioner``: the rank that gathers, preconditions and scatters; ``gather_group``: its
    shard group (the ranks that send rows); ``service_group``: the ranks that receive rows.
    """

    preconditioner: int
    gather_group: tuple[int, ...]
    service_group: tuple[int, ...]


def service_groups(rows: Sequence[tuple[int, ...]], layout: MeshLayout) -> tuple[tuple[int, ...], ...]:
    """The larger of the plan's rows and the mesh's shard groups, as sorted rank tuples.

    Raises:
        ValueError: neither partition refines the other (then no rank can serve a row whose
            ranks span parts of several shard groups); the message names ``grad_worker_fraction``.
    """
    shards = [tuple(sorted(g)) for g in layout.shard_groups]
    if all(any(set(row) <= set(group) for group in shards) for row in rows):
        return tuple(sorted(shards))
    if all(any(set(group) <= set(row) for row in rows) for group in shards):
        return tuple(sorted(tuple(sorted(row)) for row in rows))
    raise ValueError(
        f"grad_worker_fraction: its gradient-worker rows {list(rows)} and the FSDP shard groups "
        f"{shards} must nest (each row inside a shard group, or each shard group inside a row)"
    )


def assign_routes(
    blocks: Mapping[str, tuple[int, int]],
    grad_workers: Mapping[str, tuple[int, ...]],
    rows: Sequence[tuple[int, ...]],
    layout: MeshLayout,
) -> dict[str, tuple[Route, ...]]:
    """One :class:`Route` per block and service group, balancing preconditioning work.

    ``blocks``: ``{name: (out, cols)}`` of the gradient row matrices; ``grad_workers``: the plan's
    gradient workers of each block (they hold its decompositions). Blocks are taken by cost
    ``out·cols·(out + cols)`` (the two-sided product) descending, ties by name, and each service
    group's route goes to the least-loaded of the block's gradient workers in it (ties: lowest
    rank). A pure function of its arguments: every rank computes the same routes.
    """
    groups = service_groups(rows, layout)
    load: dict[int, float] = defaultdict(float)
    routes: dict[str, list[Route]] = {}
    order = sorted(blocks, key=lambda n: (-blocks[n][0] * blocks[n][1] * sum(blocks[n]), n))
    for name in order:
        out, cols = blocks[name]
        cost = out * cols * (out + cols)
        for group in groups:
            candidates = [w for w in grad_workers[name] if w in group]
            if not candidates:  # cannot happen for a plan row inside a service group
                raise ValueError(f"block {name!r} has no gradient worker among ranks {group}")
            chosen = min(candidates, key=lambda r: (load[r], r))
            load[chosen] += cost
            routes.setdefault(name, []).append(Route(chosen, layout.group_of(chosen), group))
    return {name: tuple(routes[name]) for name in sorted(routes)}


@dataclass
class _Bucket:
    """Blocks one preconditioner serves for this rank's service group, moved together."""

    route: Route
    names: list[str]


class RowShardedPreconditioner:
    """Preconditions FSDP-sharded blocks on this rank: gathers, preconditions, scatters rows.

    Args:
        blocks: ``{name: (out, cols)}`` of the sharded blocks' gradient row matrices (every rank the same).
        grad_workers: ``{name: ranks}`` holding each block's decompositions (the plan's).
        rows: the plan's receiver groups (rank tuples); ranks are global ranks.
        layout: the mesh the blocks' parameters are sharded over.
        group_for: returns the process group of a tuple of global ranks this rank belongs to.
        bucket_bytes: upper bound on the whole gradients one bucket carries to its preconditioner.
        bytes_sent: a counter (the communicator's) that gets the bytes this rank sends, under
            ``"fsdp_rows"`` (gradient and direction rows) and ``"fsdp_kl_clip"``.
    """

    WHAT = "KFAC.step(): the FSDP2 {} of gradient rows"

    def __init__(
        self,
        blocks: Mapping[str, tuple[int, int]],
        grad_workers: Mapping[str, tuple[int, ...]],
        rows: Sequence[tuple[int, ...]],
        layout: MeshLayout,
        group_for: Callable[[tuple[int, ...]], dist.ProcessGroup | None],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        bytes_sent: Counter[str] | None = None,
    ) -> None:
        self.rank = dist.get_rank()
        self.bytes_sent: Counter[str] = Counter() if bytes_sent is None else bytes_sent
        self.layout = layout
        self.shapes = dict(blocks)
        self.routes = assign_routes(blocks, grad_workers, rows, layout)
        self._group_for = group_for
        self._bucket_bytes = bucket_bytes
        self.shard_group = group_for(layout.group_of(self.rank))
        mine = [name for name, routes in self.routes.items() if any(r.preconditioner == self.rank for r in routes)]
        logger.info("FSDP2: rank %d preconditions %d of %d sharded layers: %s", self.rank, len(mine), len(blocks), mine)

    def my_route(self, name: str) -> Route:
        """The route that serves this rank for block ``name``."""
        return next(r for r in self.routes[name] if self.rank in r.service_group)

    def buckets(self, names: Sequence[str], itemsize: int) -> list[_Bucket]:
        """This rank's buckets for ``names``: by preconditioner (ascending), blocks by name, each
        bucket's whole gradients at most ``bucket_bytes`` (a larger block travels alone)."""
        by_route: dict[Route, list[str]] = defaultdict(list)
        for name in sorted(names):
            by_route[self.my_route(name)].append(name)
        buckets: list[_Bucket] = []
        for route in sorted(by_route, key=lambda r: r.preconditioner):
            used = 0
            for name in by_route[route]:
                size = math.prod(self.shapes[name]) * itemsize
                if not buckets or buckets[-1].route != route or used + size > self._bucket_bytes:
                    buckets.append(_Bucket(route, []))
                    used = 0
                buckets[-1].names.append(name)
                used += size
        return buckets

    def peak_bytes(self, itemsize: int) -> int:
        """The most bytes :meth:`preconditioned_rows` holds at once on this rank, for every block:
        the largest bucket it preconditions (gathered rows of every shard) plus one block's whole
        gradient and direction; 0 on a rank that preconditions nothing. Rows sent and received
        (about this rank's shard of the gradients) are not counted."""
        peak = 0
        for bucket in self.buckets(list(self.shapes), itemsize):
            if bucket.route.preconditioner == self.rank:
                gathered = self.layout.shard_size * sum(self._chunk_sizes(bucket))
                largest = max(math.prod(self.shapes[name]) for name in bucket.names)
                peak = max(peak, (gathered + 2 * largest) * itemsize)
        return peak

    def preconditioned_rows(
        self, grads: Mapping[str, Tensor], precondition: Precondition, dtype: torch.dtype
    ) -> dict[str, Tensor]:
        """This rank's rows of every block's preconditioned gradient.

        ``grads``: this rank's rows ``(rows, cols)`` of the gradient row matrix of every block to
        precondition (the same names on every rank); ``dtype``: the dtype the rows travel and
        come back in. Every rank of the job must call this with the same names.

        Buckets go one after the other. A preconditioner holds one bucket's gathered rows
        ``(shards, entries)`` at a time, plus one block's whole gradient and direction: each
        direction is written back over the rows it came from, which are then scattered. Every
        other rank posts its sends and receives without waiting, so only preconditioners wait.
        """
        if not grads:
            return {}
        device = next(iter(grads.values())).device
        in_flight: list[tuple[dist.Work | None, Tensor]] = []
        received_parts: list[tuple[_Bucket, Tensor]] = []
        for bucket in self.buckets(list(grads), torch.empty((), dtype=dtype).element_size()):
            route = bucket.route
            sizes = self._chunk_sizes(bucket)
            received = torch.empty(sum(sizes), dtype=dtype, device=device)
            received_parts.append((bucket, received))
            gathered = None
            if self.rank in route.gather_group:
                mine = torch.zeros(sum(sizes), dtype=dtype, device=device)
                for name, part in zip(bucket.names, mine.split(sizes), strict=True):
                    rows = grads[name]
                    part.view(self._chunk(name), self.shapes[name][1])[: len(rows)].copy_(rows)
                work, gathered = self._gather(route, mine)
                in_flight.append((work, mine))
            if route.preconditioner != self.rank:
                in_flight.append((self._scatter(route, received, None), received))
                continue
            assert gathered is not None  # a preconditioner gathers from its own shard group
            self._wait(work, "gather")
            offset = 0
            for name, size in zip(bucket.names, sizes, strict=True):
                out, cols = self.shapes[name]
                rows = gathered[:, offset : offset + size].view(self.layout.shard_size, self._chunk(name), cols)
                whole = rows.reshape(-1, cols)[:out]  # a copy: the shards' rows are not adjacent
                direction = precondition(name, whole).to(dtype)
                _copy_rows(rows, direction)
                offset += size
            self._wait(self._scatter(route, received, gathered), "scatter")  # then the bucket's directions can go
        for work, _ in in_flight:
            self._wait(work, "gather and scatter")
        results: dict[str, Tensor] = {}
        for bucket, received in received_parts:
            for name, part in zip(bucket.names, received.split(self._chunk_sizes(bucket)), strict=True):
                _, count = self.layout.rows(self.shapes[name][0], self.rank)
                results[name] = part.view(self._chunk(name), self.shapes[name][1])[:count]
        return results

    def sum_over_shards(self, partial: Tensor) -> Tensor:
        """The sum over this rank's shard group of per-shard ``partial`` sums (any shape), in place."""
        if self.layout.shard_size > 1:
            with collective("KFAC.step(): the all-reduce of the KL-clip terms over the FSDP2 shard group",
                            self.shard_group):
                dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=self.shard_group)
            self.bytes_sent["fsdp_kl_clip"] += partial.nbytes
        return partial

    # -- helpers -----------------------------------------------------------------------------

    def _chunk(self, name: str) -> int:
        return math.ceil(self.shapes[name][0] / self.layout.shard_size)

    def _chunk_sizes(self, bucket: _Bucket) -> list[int]:
        """Entries of each block's padded rows in the bucket's flat buffers."""
        return [self._chunk(name) * self.shapes[name][1] for name in bucket.names]

    def _members(self, ranks: tuple[int, ...]) -> tuple[dist.ProcessGroup | None, list[int]]:
        """The process group of ``ranks`` and its members (global ranks) in group-rank order."""
        group = self._group_for(ranks)
        members = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        return group, members

    def _gather(self, route: Route, mine: Tensor) -> tuple[dist.Work | None, Tensor | None]:
        """Send this rank's padded rows ``mine`` to the route's preconditioner, asynchronously.

        On the preconditioner, the second item is a ``(shards, entries)`` tensor with every
        shard's rows in shard-index order (filled once the work completes); elsewhere None.
        """
        root = route.preconditioner == self.rank
        if len(route.gather_group) == 1:
            return None, mine.unsqueeze(0)
        group, members = self._members(route.gather_group)
        gathered = mine.new_empty(len(members), len(mine)) if root else None
        gather_list = None if gathered is None else [gathered[self.layout.shard_index(r)] for r in members]
        with collective(self.WHAT.format("gather"), group):
            work = dist.gather(mine, gather_list, group=group,
                               group_dst=members.index(route.preconditioner), async_op=True)
        if not root:
            self.bytes_sent["fsdp_rows"] += mine.nbytes
        return work, gathered

    def _scatter(self, route: Route, received: Tensor, send: Tensor | None) -> dist.Work | None:
        """Scatter the rows of ``send`` ``(shards, entries)`` (on the preconditioner) over the
        service group, each rank getting its shard index's, into ``received``, asynchronously
        (None: nothing to wait for)."""
        if len(route.service_group) == 1:
            if send is not None:
                received.copy_(send[self.layout.shard_index(self.rank)])
            return None
        group, members = self._members(route.service_group)
        scatter_list = None if send is None else [send[self.layout.shard_index(r)] for r in members]
        with collective(self.WHAT.format("scatter"), group):
            work = dist.scatter(
                received, scatter_list, group=group, group_src=members.index(route.preconditioner), async_op=True
            )
        if send is not None:
            self.bytes_sent["fsdp_rows"] += (len(members) - 1) * received.nbytes
        return work

    def _wait(self, work: dist.Work | None, what: str) -> None:
        if work is not None:
            with collective(self.WHAT.format(what), None):
                work.wait()


def _copy_rows(rows: Tensor, direction: Tensor) -> None:
    """Write ``direction`` ``(out, cols)`` over the first ``out`` rows of ``rows`` ``(shards, chunk, cols)``
    (a strided view: shard by shard)."""
    chunk = rows.shape[1]
    for index, part in enumerate(direction.split(chunk)):
        rows[index, : len(part)].copy_(part)
