"""Work plan for distributed K-FAC: which rank decomposes which factor, and who preconditions.

Owns: the assignment of the work items (``work.py``: one per Kronecker factor of a block, with its
method's cost) to ranks, load-balanced (``balance.py``) and deterministic, the placement of each
block in a column of the KAISA rank grid (``grid.py``) for a ``grad_worker_fraction``, with the
rank tuples that need a process group, and the load figures of reports. It is data only, a pure
function of the blocks' names, factor sizes and kinds, the method and the world size, so every
rank computes the same plan without communicating.

Must not know: layers' math, tensors or ``torch.distributed``. Creating the process groups listed
by :attr:`Plan.groups` (once, in that order, on every rank) and running the collectives belong to
``comm.py`` and the optimizer; memory figures to ``plan_memory.py``.

Costs: each factor weighs what its method says its decomposition costs
(``Method.decomposition_cost``, in the unit of ``work.py``: a full ``eigh`` of an ``n``-wide factor
is ``n³``), so a factor under :class:`~kfac_optim.methods.Eigen`'s eigenbasis cap weighs its
randomized eigensolver's ``O(n²·max_rank)``, not a full ``eigh``'s ``O(n³)``.

With ``f = 1`` the A and G decompositions of a block are balanced as separate items; with
``f < 1`` one rank owns both (they are balanced as one unit), so each block has one owner, and
that owner is one of its gradient workers (the grid: ``grid.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kfac_optim.distributed import grid
from kfac_optim.distributed.balance import balance, check_world_size, imbalance, load_lower_bound
from kfac_optim.distributed.work import FACTORS, Factor, WorkItem, blocks_of, canonical, item_costs, item_key
from kfac_optim.methods import Method


def assign_work(
    items: Iterable[WorkItem],
    world_size: int,
    *,
    method: Method | str = "eigen",
    colocate: bool = False,
    refine: bool = True,
) -> dict[WorkItem, int]:
    """Assign every work item to a rank, balancing the summed cost per rank.

    Each item costs what ``method`` (a :class:`~kfac_optim.methods.Method` or its name) says its
    decomposition costs (``work.item_costs``). Units (items, or with ``colocate`` all items of a
    block as one unit of summed cost) are taken by cost descending, ties by ``(block, factor)``,
    and balanced by ``balance.balance``: greedy longest-processing-time, each to the least-loaded
    rank (ties: the lowest), then with ``refine`` pairwise moves and swaps that lower the
    most-loaded rank.

    The result depends only on the set of items, ``world_size`` and the method: not on the order
    of ``items``, so every rank computes the same assignment.

    Returns:
        ``{item: rank}`` with keys in canonical order (block name, then A before G).

    Raises:
        ValueError: ``world_size < 1``, an item given twice (same block and factor), a block
            without exactly one A and one G item, or a cost that is negative or not finite.
    """
    check_world_size(world_size)
    return _assign(item_costs(items, method), world_size, colocate=colocate, refine=refine)


def _assign(costs: Mapping[WorkItem, float], world_size: int, *, colocate: bool, refine: bool) -> dict[WorkItem, int]:
    """:func:`assign_work` of the items of ``costs`` (canonical order) at those costs."""
    units: list[tuple[WorkItem, ...]] = []
    for item in costs:
        if colocate and units and units[-1][0].block == item.block:
            units[-1] += (item,)
        else:
            units.append((item,))
    unit_costs = [math.fsum(costs[item] for item in unit) for unit in units]
    order = sorted(range(len(units)), key=lambda u: (-unit_costs[u], item_key(units[u][0])))
    ranks = balance([unit_costs[u] for u in order], world_size, refine=refine)
    owner = {item: rank for u, rank in zip(order, ranks) for item in units[u]}
    return {item: owner[item] for item in costs}


@dataclass(frozen=True)
class BlockPlan:
    """Where one block's work happens.

    Attributes:
        block: the block's name.
        owners: ranks that compute the decompositions of ``(A, G)``, in :data:`FACTORS` order.
        grad_workers: ascending ranks (one grid column) that hold both decompositions and
            precondition the block's gradient; the owners are among them.
    """

    block: str
    owners: tuple[int, int]
    grad_workers: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.owners) != len(FACTORS):
            raise ValueError(f"owners must hold one rank per factor {FACTORS}, got {self.owners}")
        if not self.grad_workers or list(self.grad_workers) != sorted(set(self.grad_workers)):
            raise ValueError(
                f"grad_workers must be ascending distinct ranks, got {self.grad_workers}"
            )
        if not set(self.owners) <= set(self.grad_workers):
            raise ValueError(
                f"owners {self.owners} of block {self.block!r} must be among its "
                f"grad_workers {self.grad_workers}"
            )

    def owner(self, factor: Factor) -> int:
        """Rank that computes the decomposition of ``factor`` (``"A"`` or ``"G"``)."""
        if factor not in FACTORS:
            raise ValueError(f"factor must be one of {FACTORS}, got {factor!r}")
        return self.owners[FACTORS.index(factor)]


@dataclass(frozen=True)
class Plan:
    """The distributed work plan: decomposition owners and gradient workers of every block.

    Build it with :func:`make_plan`. Ranks are ``0 .. world_size - 1`` of the group K-FAC runs on.

    Attributes:
        world_size: number of ranks.
        grad_workers: gradient workers per block (``f * world_size``).
        items: every work item, in canonical order (block name, then A before G).
        blocks: one :class:`BlockPlan` per block, sorted by name.
        costs: each item's decomposition cost (``work.item_costs``: the method's, in ``work.py``'s
            unit), in the order of ``items``; None: those of the default method
            (:class:`~kfac_optim.methods.Eigen`). :meth:`loads`, :meth:`lower_bound` and
            :meth:`summary` weigh the items by them.
    """

    world_size: int
    grad_workers: int
    items: tuple[WorkItem, ...]
    blocks: tuple[BlockPlan, ...]
    costs: tuple[float, ...] | None = None
    _by_name: dict[str, BlockPlan] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_world_size(self.world_size)
        if not 1 <= self.grad_workers <= self.world_size or self.world_size % self.grad_workers:
            raise ValueError(
                f"grad_workers must divide world_size={self.world_size}, got {self.grad_workers}"
            )
        if self.items != canonical(self.items):
            raise ValueError("items must be distinct and in canonical (block, factor) order")
        names = [bp.block for bp in self.blocks]
        if names != sorted({item.block for item in self.items}):
            raise ValueError("blocks must be the items' blocks, sorted by name, each once")
        for bp in self.blocks:
            if bp.grad_workers not in self.worker_groups:
                raise ValueError(
                    f"grad_workers {bp.grad_workers} of block {bp.block!r} are not a column of "
                    f"the {self.grad_workers} x {self.world_size // self.grad_workers} rank grid"
                )
            if self.colocated and bp.owners[0] != bp.owners[1]:
                raise ValueError(f"block {bp.block!r}: with f < 1 one rank owns both factors")
        object.__setattr__(self, "_by_name", {bp.block: bp for bp in self.blocks})
        if self.costs is None:
            object.__setattr__(self, "costs", tuple(item_costs(self.items).values()))
        if len(self.costs) != len(self.items):
            raise ValueError(f"costs must hold one cost per item ({len(self.items)}), got {len(self.costs)}")

    @property
    def colocated(self) -> bool:
        """Whether one rank owns both decompositions of each block (``f < 1``)."""
        return self.grad_workers < self.world_size

    @property
    def broadcasts_decompositions(self) -> bool:
        """Whether owners send decompositions to other gradient workers (``f > 1/world_size``)."""
        return self.grad_workers > 1

    @property
    def broadcasts_gradients(self) -> bool:
        """Whether gradient workers send preconditioned gradients to other ranks (``f < 1``)."""
        return self.grad_workers < self.world_size

    @property
    def worker_groups(self) -> tuple[tuple[int, ...], ...]:
        """The grid's columns: the possible gradient-worker sets, column ``c`` first at rank c."""
        return grid.worker_groups(self.world_size, self.grad_workers)

    @property
    def receiver_groups(self) -> tuple[tuple[int, ...], ...]:
        """The grid's rows: the sets of ranks that share one gradient worker per block."""
        return grid.receiver_groups(self.world_size, self.grad_workers)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Every distinct rank tuple some broadcast runs over, sorted; create one group each.

        Decompositions are broadcast over a block's ``grad_workers`` (when more than one) and
        preconditioned gradients over each row of :attr:`receiver_groups` (when more than one
        rank). Tuples of one rank need no group and are left out. A tuple of every rank may be
        served by the default group. Every rank must create these groups, in this order.
        """
        tuples: set[tuple[int, ...]] = set()
        if self.broadcasts_decompositions:
            tuples.update(bp.grad_workers for bp in self.blocks)
        if self.broadcasts_gradients and self.blocks:
            tuples.update(self.receiver_groups)
        return tuple(sorted(tuples))

    def block(self, name: str) -> BlockPlan:
        """The plan of block ``name`` (``KeyError`` if it is not planned)."""
        return self._by_name[name]

    def owned(self, rank: int) -> tuple[WorkItem, ...]:
        """The work items whose decomposition ``rank`` computes, in canonical order."""
        self._check_rank(rank)
        return tuple(
            item for item in self.items if self._by_name[item.block].owner(item.factor) == rank
        )

    def is_grad_worker(self, name: str, rank: int) -> bool:
        """Whether ``rank`` holds block ``name``'s decompositions and preconditions its gradient."""
        self._check_rank(rank)
        return rank in self._by_name[name].grad_workers

    def receiver_group(self, rank: int) -> tuple[int, ...]:
        """The row of ``rank``: the ranks among which one gradient worker per block broadcasts."""
        self._check_rank(rank)
        return self.receiver_groups[rank // (self.world_size // self.grad_workers)]

    def grad_source(self, name: str, rank: int) -> int:
        """The rank whose preconditioned gradient of block ``name`` ``rank`` uses (itself if a
        gradient worker): the block's gradient worker in ``rank``'s row."""
        self._check_rank(rank)
        return self._by_name[name].grad_workers[rank // (self.world_size // self.grad_workers)]

    def loads(self) -> tuple[float, ...]:
        """Summed decomposition cost per rank (:attr:`costs`)."""
        totals: list[list[float]] = [[] for _ in range(self.world_size)]
        for item, cost in zip(self.items, self.costs, strict=True):
            totals[self._by_name[item.block].owner(item.factor)].append(cost)
        return tuple(math.fsum(t) for t in totals)

    def lower_bound(self) -> float:
        """A lower bound on the max load of any assignment with this plan's granularity.

        Units are items, or whole blocks when :attr:`colocated`; see
        ``balance.load_lower_bound``.
        """
        per_block: dict[str, list[float]] = {}
        for item, cost in zip(self.items, self.costs, strict=True):
            per_block.setdefault(item.block, []).append(cost)
        if self.colocated:
            units = [math.fsum(costs) for costs in per_block.values()]
        else:
            units = [c for costs in per_block.values() for c in costs]
        return load_lower_bound(units, self.world_size)

    def summary(self, rank: int) -> str:
        """One log line for ``rank``: the decompositions it owns and its estimated cost share."""
        self._check_rank(rank)
        loads = self.loads()
        total = math.fsum(loads)
        share = loads[rank] / total if total > 0 else 0.0
        owned = ", ".join(f"{item.block or '<root>'}.{item.factor}" for item in self.owned(rank))
        workers = sum(rank in bp.grad_workers for bp in self.blocks)
        return (
            f"rank {rank}/{self.world_size}: cost share {share:.1%} (even share "
            f"{1 / self.world_size:.1%}, max/mean {imbalance(loads):.2f}), gradient worker for "
            f"{workers}/{len(self.blocks)} blocks, decomposes [{owned}]"
        )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")


def make_plan(
    items: Iterable[WorkItem],
    world_size: int,
    grad_worker_fraction: float | str = 1.0,
    *,
    method: Method | str = "eigen",
    refine: bool = True,
) -> Plan:
    """Plan the work of blocks whose A and G items are ``items`` on ``world_size`` ranks.

    Decompositions are assigned by :func:`assign_work` at ``method``'s costs (A and G of a block
    colocated when ``f < 1``); each block's gradient workers are the grid column of its owner(s).
    The plan is a pure function of the set of items and the arguments: identical on every rank.

    Raises:
        ValueError: as ``grid.resolve_grad_workers`` and :func:`assign_work`, or a block without
            exactly one A and one G item.
    """
    grad_workers = grid.resolve_grad_workers(grad_worker_fraction, world_size)
    costs = item_costs(items, method)
    owner = _assign(costs, world_size, colocate=grad_workers < world_size, refine=refine)
    columns = world_size // grad_workers
    blocks = []
    for name, (a_item, g_item) in blocks_of(tuple(costs)).items():
        owners = (owner[a_item], owner[g_item])
        blocks.append(
            BlockPlan(name, owners, tuple(range(owners[0] % columns, world_size, columns)))
        )
    return Plan(world_size, grad_workers, tuple(costs), tuple(blocks), tuple(costs.values()))
