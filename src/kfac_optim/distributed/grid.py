"""The KAISA rank grid: how many gradient workers each block has, and which ranks form the groups.

Owns: the grad-worker fraction and its named strategies (:func:`resolve_grad_workers`), the grid's
columns (a block's possible gradient workers) and rows (the ranks that share one gradient worker
per block).
Must not know: blocks, factors, costs, tensors or ``torch.distributed`` (``plan.py`` puts each
block in a column; ``comm.py`` creates the groups).

Grid (KAISA, Pauloski et al. 2021, arXiv:2107.01739): with ``g`` gradient workers per block and
``n = world_size // g``, the ranks are laid out row-major in a ``g x n`` grid, rank ``r`` at row
``r // n`` and column ``r % n``::

    world_size=8, g=2 (f=1/2)     columns (worker groups):   (0, 4) (1, 5) (2, 6) (3, 7)
        0 1 2 3   <- row 0        rows (receiver groups):    (0, 1, 2, 3) (4, 5, 6, 7)
        4 5 6 7   <- row 1

Each block gets one column, its gradient workers: they hold both of its decompositions (broadcast
over the column by the block's owners) and precondition its gradient; the gradient worker in row
``i`` then broadcasts the direction over row ``i``. ``f = 1`` (comm-opt): one column of every rank,
gradients never sent; ``f = 1/world_size`` (mem-opt): columns of one rank, one row of every rank;
in between (hybrid): both broadcasts, over smaller groups (docs/design.md §5, "Strategies").
"""

from __future__ import annotations

from numbers import Real

from kfac_optim.distributed.balance import check_world_size

STRATEGIES: tuple[str, ...] = ("comm-opt", "mem-opt", "hybrid-opt")
"""Names accepted for ``grad_worker_fraction`` (see :func:`resolve_grad_workers`)."""

_FRACTION_TOL = 1e-6


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
    check_world_size(world_size)
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


def worker_groups(world_size: int, grad_workers: int) -> tuple[tuple[int, ...], ...]:
    """The grid's columns: the possible gradient-worker sets, column ``c`` first at rank c."""
    columns = world_size // grad_workers
    return tuple(tuple(range(c, world_size, columns)) for c in range(columns))


def receiver_groups(world_size: int, grad_workers: int) -> tuple[tuple[int, ...], ...]:
    """The grid's rows: the sets of ranks that share one gradient worker per block."""
    columns = world_size // grad_workers
    return tuple(tuple(range(row * columns, (row + 1) * columns)) for row in range(grad_workers))
