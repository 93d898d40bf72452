"""Work plan for distributed K-FAC: which rank decomposes which factor, and who preconditions.

Owns: the work items (one per Kronecker factor of a block), their cost model, a deterministic
load-balanced assignment of the items to ranks, the KAISA grad-worker structure for a
``grad_worker_fraction`` with the rank tuples that need a process group, and load and memory
figures for reports. It is data only, a pure function of block names, factor sizes and the world
size, so every rank computes the same plan without communicating.

Must not know: layers' math, tensors or ``torch.distributed``. Creating the process groups listed
by :attr:`Plan.groups` (once, in that order, on every rank) and running the collectives belong to
``comm.py`` and the optimizer.

Grid (KAISA, Pauloski et al. 2021, arXiv:2107.01739): with ``g`` gradient workers per block and
``n = world_size // g``, the ranks are laid out row-major in a ``g x n`` grid, rank ``r`` at row
``r // n`` and column ``r % n``::

    world_size=8, g=2 (f=1/2)     columns (worker groups):   (0, 4) (1, 5) (2, 6) (3, 7)
        0 1 2 3   <- row 0        rows (receiver groups):    (0, 1, 2, 3) (4, 5, 6, 7)
        4 5 6 7   <- row 1

Each block gets one column, its gradient workers. They all hold both of the block's
decompositions (computed by the block's owners, which lie in that column, and broadcast over the
column) and precondition its gradient; the gradient worker in row ``i`` then broadcasts the
preconditioned gradient over row ``i``.

- ``f = 1`` (comm-opt): one column of every rank, rows of one rank: every decomposition is
  broadcast to all ranks, gradients are never sent.
- ``f = 1/world_size`` (mem-opt): columns of one rank, one row of every rank: the owner alone
  holds the block's decompositions, preconditions, and broadcasts the result to all ranks.
- in between (hybrid): both broadcasts, over smaller groups.

With ``f = 1`` the A and G decompositions of a block are balanced as separate items; with
``f < 1`` one rank owns both (they are balanced as one unit), so each block has one owner, and
that owner is one of its gradient workers.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Literal

from kfac_optim.methods import Method, method_named

Factor = Literal["A", "G"]
FACTORS: tuple[Factor, Factor] = ("A", "G")
"""The Kronecker factors of a block, in the order used by every per-factor tuple here."""

CostModel = Callable[[int], float]
"""Relative cost of decomposing one ``(dim, dim)`` factor, as a function of ``dim``."""


STRATEGIES: tuple[str, ...] = ("comm-opt", "mem-opt", "hybrid-opt")
"""Names accepted for ``grad_worker_fraction`` (see :func:`resolve_grad_workers`)."""

_FRACTION_TOL = 1e-6
_REFINE_ROUNDS_PER_UNIT = 4


def eigh_cost(dim: int) -> float:
    """Cost model of one decomposition (eigh or inverse) of a ``(dim, dim)`` factor: ``dim**3``."""
    return float(dim) ** 3


@dataclass(frozen=True)
class WorkItem:
    """One decomposition to compute: factor ``factor`` of block ``block``.

    ``block`` is the block's unique name (the module name; ``""`` is valid for a root module).
    ``dim`` is ``d_in [+1]`` for ``"A"`` (``+1`` with a bias) and ``d_out`` for ``"G"``. The factor
    kind: dense ``(dim, dim)``, or ``count`` independent dense blocks ``(count, dim, dim)`` (a
    grouped convolution), or with ``diagonal`` a vector ``(dim,)``.
    """

    block: str
    factor: Factor
    dim: int
    diagonal: bool = False
    count: int = 1

    @property
    def elements(self) -> int:
        """Elements of the running factor."""
        return self.dim if self.diagonal else self.count * self.dim * self.dim

    def cost(self, model: CostModel) -> float:
        """Relative decomposition cost: ``count·model(dim)`` for dense factors, ``dim`` for diagonal ones."""
        if self.diagonal:
            return float(self.dim)
        return self.count * _cost(model, self.dim)

    def __post_init__(self) -> None:
        if not isinstance(self.block, str):
            raise TypeError(f"block must be a str, got {type(self.block).__name__}")
        if self.factor not in FACTORS:
            raise ValueError(f"factor must be one of {FACTORS}, got {self.factor!r}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"dim must be an int, got {type(self.dim).__name__}")
        if self.dim < 1:
            raise ValueError(f"dim must be >= 1, got {self.dim}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"count must be an int >= 1, got {self.count!r}")


def work_items(dims: Mapping[str, tuple[int, int]]) -> tuple[WorkItem, ...]:
    """The A and G work items of every block, from ``{block: (dim_A, dim_G)}``, sorted by name."""
    return _canonical(
        WorkItem(block, factor, dim)
        for block, pair in dims.items()
        for factor, dim in zip(FACTORS, pair, strict=True)
    )


def assign_work(
    items: Iterable[WorkItem],
    world_size: int,
    *,
    cost: CostModel = eigh_cost,
    colocate: bool = False,
    refine: bool = True,
) -> dict[WorkItem, int]:
    """Assign every work item to a rank, balancing the summed cost per rank.

    Greedy longest-processing-time (LPT): units (items, or with ``colocate`` all items of a block
    as one unit of summed cost) are taken by cost descending, ties by ``(block, factor)``, and
    each goes to the least-loaded rank (ties: the lowest rank). LPT's max load is at most
    ``(4/3 - 1/(3 * world_size))`` times the optimum (Graham 1969). With ``refine``, pairwise
    moves and swaps then lower the most-loaded rank while they can (see :func:`_refine`); the
    max load never rises.

    The result depends only on the set of items, ``world_size`` and ``cost``: not on the order of
    ``items``, so every rank computes the same assignment.

    Returns:
        ``{item: rank}`` with keys in canonical order (block name, then A before G).

    Raises:
        ValueError: ``world_size < 1``, an item given twice (same block and factor), or a cost
            that is negative or not finite.
    """
    _check_world_size(world_size)
    canonical = _canonical(items)
    units: list[tuple[WorkItem, ...]] = []
    for item in canonical:
        if colocate and units and units[-1][0].block == item.block:
            units[-1] += (item,)
        else:
            units.append((item,))
    unit_costs = [math.fsum(item.cost(cost) for item in unit) for unit in units]
    order = sorted(range(len(units)), key=lambda u: (-unit_costs[u], _item_key(units[u][0])))
    ranks = _balance([unit_costs[u] for u in order], world_size, refine=refine)
    owner = {item: rank for u, rank in zip(order, ranks) for item in units[u]}
    return {item: owner[item] for item in canonical}


def resolve_grad_workers(grad_worker_fraction: float | str, world_size: int) -> int:
    """Number of gradient workers per block for a grad-worker fraction or a strategy name.

    A number ``f`` in ``(0, 1]`` gives ``max(1, round(f * world_size))``; ``f * world_size`` must
    be (within 1e-6) an integer that divides ``world_size``, or below 1 (any
    ``f <= 1/world_size`` means mem-opt, as in KAISA). Names: ``"comm-opt"`` is ``f = 1``,
    ``"mem-opt"`` is ``f = 1/world_size``, ``"hybrid-opt"`` is the largest divisor of
    ``world_size`` that is at most ``world_size / 2`` (KAISA's ``f = 1/2`` for even world sizes;
    mem-opt for a prime world size; 1 at world size 1).

    Raises:
        ValueError: ``world_size < 1``, an unknown name, ``f`` outside ``(0, 1]``, or
            ``f * world_size`` not a divisor of ``world_size``; the message names
            ``grad_worker_fraction``.
        TypeError: ``grad_worker_fraction`` neither a real number nor a str.
    """
    _check_world_size(world_size)
    if isinstance(grad_worker_fraction, str):
        if grad_worker_fraction == "comm-opt":
            return world_size
        if grad_worker_fraction == "mem-opt":
            return 1
        if grad_worker_fraction == "hybrid-opt":
            return max([d for d in range(1, world_size // 2 + 1) if world_size % d == 0], default=1)
        raise ValueError(
            f"grad_worker_fraction must be a number in (0, 1] or one of {STRATEGIES}, "
            f"got {grad_worker_fraction!r}"
        )
    if isinstance(grad_worker_fraction, bool) or not isinstance(grad_worker_fraction, Real):
        raise TypeError(
            f"grad_worker_fraction must be a number in (0, 1] or one of {STRATEGIES}, "
            f"got {type(grad_worker_fraction).__name__}"
        )
    fraction = float(grad_worker_fraction)
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"grad_worker_fraction must be in (0, 1], got {grad_worker_fraction!r}")
    workers = fraction * world_size
    if workers < 1.0:
        return 1
    count = round(workers)
    if abs(workers - count) > _FRACTION_TOL or world_size % count != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"grad_worker_fraction * world_size must be a divisor of world_size={world_size} "
            f"(one of {divisors}), got RuntimeConfig.grad_worker_fraction={grad_worker_fraction!r} "
            f"-> {workers:g} gradient workers"
        )
    return count


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
    """

    world_size: int
    grad_workers: int
    items: tuple[WorkItem, ...]
    blocks: tuple[BlockPlan, ...]
    _by_name: dict[str, BlockPlan] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_world_size(self.world_size)
        if not 1 <= self.grad_workers <= self.world_size or self.world_size % self.grad_workers:
            raise ValueError(
                f"grad_workers must divide world_size={self.world_size}, got {self.grad_workers}"
            )
        if self.items != _canonical(self.items):
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
        columns = self.world_size // self.grad_workers
        return tuple(tuple(range(c, self.world_size, columns)) for c in range(columns))

    @property
    def receiver_groups(self) -> tuple[tuple[int, ...], ...]:
        """The grid's rows: the sets of ranks that share one gradient worker per block."""
        columns = self.world_size // self.grad_workers
        return tuple(
            tuple(range(row * columns, (row + 1) * columns)) for row in range(self.grad_workers)
        )

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

    def loads(self, cost: CostModel = eigh_cost) -> tuple[float, ...]:
        """Summed decomposition cost per rank."""
        totals: list[list[float]] = [[] for _ in range(self.world_size)]
        for item in self.items:
            totals[self._by_name[item.block].owner(item.factor)].append(item.cost(cost))
        return tuple(math.fsum(t) for t in totals)

    def lower_bound(self, cost: CostModel = eigh_cost) -> float:
        """A lower bound on the max load of any assignment with this plan's granularity.

        Units are items, or whole blocks when :attr:`colocated`; see :func:`load_lower_bound`.
        """
        per_block: dict[str, list[float]] = {}
        for item in self.items:
            per_block.setdefault(item.block, []).append(item.cost(cost))
        if self.colocated:
            units = [math.fsum(costs) for costs in per_block.values()]
        else:
            units = [c for costs in per_block.values() for c in costs]
        return load_lower_bound(units, self.world_size)

    def summary(self, rank: int, cost: CostModel = eigh_cost) -> str:
        """One log line for ``rank``: the decompositions it owns and its estimated cost share."""
        self._check_rank(rank)
        loads = self.loads(cost)
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
    cost: CostModel = eigh_cost,
    refine: bool = True,
) -> Plan:
    """Plan the work of blocks whose A and G items are ``items`` on ``world_size`` ranks.

    Decompositions are assigned by :func:`assign_work` (A and G of a block colocated when
    ``f < 1``); each block's gradient workers are the grid column of its owner(s). The plan is a
    pure function of the set of items and the arguments: identical on every rank.

    Raises:
        ValueError: as :func:`resolve_grad_workers` and :func:`assign_work`, or a block without
            exactly one A and one G item.
    """
    grad_workers = resolve_grad_workers(grad_worker_fraction, world_size)
    canonical = _canonical(items)
    per_block: dict[str, list[WorkItem]] = {}
    for item in canonical:
        per_block.setdefault(item.block, []).append(item)
    for name, block_items in per_block.items():
        if tuple(item.factor for item in block_items) != FACTORS:
            raise ValueError(f"block {name!r} needs one A and one G item, got {block_items}")
    owner = assign_work(
        canonical, world_size, cost=cost, colocate=grad_workers < world_size, refine=refine
    )
    columns = world_size // grad_workers
    blocks = []
    for name, (a_item, g_item) in per_block.items():
        owners = (owner[a_item], owner[g_item])
        blocks.append(
            BlockPlan(name, owners, tuple(range(owners[0] % columns, world_size, columns)))
        )
    return Plan(world_size, grad_workers, canonical, tuple(blocks))


def imbalance(loads: Sequence[float]) -> float:
    """The most-loaded rank's load over the mean load (1.0 is perfect, and when all are 0)."""
    total = math.fsum(loads)
    return max(loads) * len(loads) / total if total > 0 else 1.0


def load_lower_bound(costs: Iterable[float], world_size: int) -> float:
    """A lower bound on the max load of any assignment of these unit costs to ``world_size`` ranks.

    ``max(mean load, largest cost, c[m-1] + c[m])`` with ``c`` sorted descending and
    ``m = world_size``: of the ``m + 1`` largest units two share a rank.
    """
    _check_world_size(world_size)
    ordered = sorted(costs, reverse=True)
    bound = max(math.fsum(ordered) / world_size, ordered[0] if ordered else 0.0)
    if len(ordered) > world_size:
        bound = max(bound, ordered[world_size - 1] + ordered[world_size])
    return bound


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank keeps for K-FAC state (gradients and momentum not included).

    Attributes:
        factors: running A and G factors.
        decompositions: eigendecompositions (``Q`` and ``d``) or inverses.
    """

    factors: int
    decompositions: int

    def __post_init__(self) -> None:
        if self.factors < 0 or self.decompositions < 0:
            raise ValueError(f"byte counts must be >= 0, got {self}")

    @property
    def total(self) -> int:
        """All bytes counted."""
        return self.factors + self.decompositions


def memory_per_rank(
    plan: Plan,
    method: Method | str = "eigen",
    *,
    factor_itemsize: int = 4,
    inv_itemsize: int = 4,
) -> tuple[MemoryEstimate, ...]:
    """Estimate per rank the bytes of factors and decompositions under ``plan``.

    Every rank keeps every block's running factors (:attr:`WorkItem.elements` each: local
    statistics are reduced lazily before decomposition steps). A rank keeps both decompositions of
    each block it is a gradient worker of, of ``method.decomposer.elements(...)`` each (e.g. ``dim**2 + dim``
    for a dense factor's ``Q`` and ``d`` under eigen, ``dim**2`` for its inverse, ``dim`` for a
    diagonal one). ``method``: a :class:`~kfac_optim.methods.Method` or its name. Itemsizes are
    bytes per element (fp32: 4).

    Raises:
        ValueError: an unknown ``method`` or an itemsize < 1.
    """
    method = method_named(method)
    for name, size in (("factor_itemsize", factor_itemsize), ("inv_itemsize", inv_itemsize)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    factors = factor_itemsize * sum(item.elements for item in plan.items)
    decompositions = [0] * plan.world_size
    for item in plan.items:
        elements = method.decomposer.elements(item.diagonal, item.dim, item.count)
        for rank in plan.block(item.block).grad_workers:
            decompositions[rank] += inv_itemsize * elements
    return tuple(MemoryEstimate(factors, d) for d in decompositions)


def _item_key(item: WorkItem) -> tuple[str, str]:
    return (item.block, item.factor)


def _canonical(items: Iterable[WorkItem]) -> tuple[WorkItem, ...]:
    """Items sorted by (block, factor); raises ValueError for a (block, factor) given twice."""
    ordered = tuple(sorted(items, key=_item_key))
    for first, second in zip(ordered, ordered[1:]):
        if _item_key(first) == _item_key(second):
            raise ValueError(f"work item {_item_key(first)} given more than once")
    return ordered


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


def _cost(cost: CostModel, dim: int) -> float:
    value = float(cost(dim))
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"cost must be finite and >= 0, got cost({dim}) = {value}")
    return value


def _balance(costs: Sequence[float], world_size: int, *, refine: bool) -> list[int]:
    """Ranks for units given in LPT order (cost descending, ties already broken by key)."""
    heap = [(0.0, rank) for rank in range(world_size)]
    ranks = []
    for unit_cost in costs:
        load, rank = heapq.heappop(heap)
        ranks.append(rank)
        heapq.heappush(heap, (load + unit_cost, rank))
    if refine:
        _refine(costs, ranks, world_size)
    return ranks


def _refine(costs: Sequence[float], ranks: list[int], world_size: int) -> None:
    """Lower the most-loaded rank's load by pairwise moves and swaps, in place.

    Each round takes the most-loaded rank ``p`` (lowest on ties) and, over every less-loaded
    rank ``q``, every unit ``i`` on ``p`` and every unit ``j`` on ``q`` or none, applies the
    exchange (``i`` to ``q``, ``j`` to ``p``) that minimises ``max(load p, load q)`` afterwards,
    if that is below the old load of ``p`` (first found on ties: lowest ``q``, then unit order).
    It stops when no such exchange exists. Each exchange strictly lowers the sum of squared
    loads, so this terminates; ``_REFINE_ROUNDS_PER_UNIT * len(costs)`` rounds bound it anyway.
    """
    members: list[list[int]] = [[] for _ in range(world_size)]
    for unit, rank in enumerate(ranks):
        members[rank].append(unit)
    loads = [math.fsum(costs[u] for u in units) for units in members]
    for _ in range(_REFINE_ROUNDS_PER_UNIT * len(costs)):
        p = max(range(world_size), key=lambda r: (loads[r], -r))
        best: tuple[float, int, int, int | None] | None = None
        for q in range(world_size):
            gap = loads[p] - loads[q]
            if gap <= 0:
                continue
            for i in members[p]:
                for j in (None, *members[q]):
                    delta = costs[i] - (0.0 if j is None else costs[j])
                    if 0 < delta < gap:
                        peak = max(loads[p] - delta, loads[q] + delta)
                        if best is None or peak < best[0]:
                            best = (peak, q, i, j)
        if best is None:
            return
        _, q, i, j = best
        members[p].remove(i)
        members[q].append(i)
        ranks[i] = q
        if j is not None:
            members[q].remove(j)
            members[p].append(j)
            ranks[j] = p
        for r in (p, q):
            loads[r] = math.fsum(costs[u] for u in members[r])
