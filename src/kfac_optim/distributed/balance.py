"""Load balancing: units of work with known costs, spread over ranks so the busiest does least.

Owns: the deterministic longest-processing-time assignment with its refinement (:func:`balance`),
the lower bound on any assignment's max load (:func:`load_lower_bound`) and the imbalance figure
of a report (:func:`imbalance`).
Must not know: what a unit is (factors, blocks), what its cost counts, grids or groups; it sees
numbers only (``plan.py`` builds the units and their costs).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence

_REFINE_ROUNDS_PER_UNIT = 4


def balance(costs: Sequence[float], world_size: int, *, refine: bool) -> list[int]:
    """Ranks for units given in LPT order (cost descending, ties already broken by the caller's key).

    Greedy longest-processing-time: each unit goes to the least-loaded rank (ties: the lowest
    rank). LPT's max load is at most ``(4/3 - 1/(3 * world_size))`` times the optimum (Graham
    1969). With ``refine``, pairwise moves and swaps then lower the most-loaded rank while they can
    (see :func:`_refine`); the max load never rises.
    """
    heap = [(0.0, rank) for rank in range(world_size)]
    ranks = []
    for unit_cost in costs:
        load, rank = heapq.heappop(heap)
        ranks.append(rank)
        heapq.heappush(heap, (load + unit_cost, rank))
    if refine:
        _refine(costs, ranks, world_size)
    return ranks


def imbalance(loads: Sequence[float]) -> float:
    """The most-loaded rank's load over the mean load (1.0 is perfect, and when all are 0)."""
    total = math.fsum(loads)
    return max(loads) * len(loads) / total if total > 0 else 1.0


def load_lower_bound(costs: Iterable[float], world_size: int) -> float:
    """A lower bound on the max load of any assignment of these unit costs to ``world_size`` ranks.

    ``max(mean load, largest cost, c[m-1] + c[m])`` with ``c`` sorted descending and
    ``m = world_size``: of the ``m + 1`` largest units two share a rank.
    """
    check_world_size(world_size)
    ordered = sorted(costs, reverse=True)
    bound = max(math.fsum(ordered) / world_size, ordered[0] if ordered else 0.0)
    if len(ordered) > world_size:
        bound = max(bound, ordered[world_size - 1] + ordered[world_size])
    return bound


def check_world_size(world_size: int) -> None:
    """``TypeError``/``ValueError`` naming ``world_size`` unless it is an int >= 1."""
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


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
