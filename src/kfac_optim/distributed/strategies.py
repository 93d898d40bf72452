"""The registry of distribution strategies and the choice of one, once, at construction.

Owns: the registered strategies (a name, when one applies, how to build it) and
:func:`strategy_for`, which builds the newest registered one that applies to the blocks and the
process group. Built in, newest first: ``"row_sharded"`` (a block's weight is sharded by FSDP2),
``"data_parallel"`` (more than one rank), ``"single_process"`` (always).
Must not know: what a strategy does (``strategy.py`` says what it is asked), the optimizer.

A new strategy is one module with its class and one :func:`register_strategy` call; registered
after the built-in ones, it is tried before them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from kfac_optim.distributed.comm import DEFAULT_BUCKET_BYTES, group_rank_and_size
from kfac_optim.distributed.data_parallel import DataParallel
from kfac_optim.distributed.row_sharded import RowSharded, has_row_sharded_blocks
from kfac_optim.distributed.single import SingleProcess
from kfac_optim.distributed.strategy import DistributionStrategy
from kfac_optim.methods import Method

if TYPE_CHECKING:
    from kfac_optim.layers import KroneckerBlock

__all__ = ["StrategySetting", "register_strategy", "strategy_for", "unregister_strategy"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StrategySetting:
    """What a strategy is chosen from and built with.

    ``blocks``: the optimizer's Kronecker blocks; ``world_size``: the ranks of ``process_group``
    (1 without ``torch.distributed``); ``grad_worker_fraction``, ``process_group``,
    ``bucket_bytes``: ``RuntimeConfig``'s; ``settings``: the options every rank must share;
    ``method``: the decomposition method.
    """

    blocks: Sequence[KroneckerBlock]
    world_size: int
    grad_worker_fraction: float | str
    process_group: dist.ProcessGroup | None
    bucket_bytes: int
    settings: Mapping[str, object]
    method: Method | str


@dataclass(frozen=True)
class _Registration:
    name: str
    applies: Callable[[StrategySetting], bool]
    build: Callable[[StrategySetting], DistributionStrategy]


_registered: list[_Registration] = []


def register_strategy(name: str, applies: Callable[[StrategySetting], bool],
                      build: Callable[[StrategySetting], DistributionStrategy]) -> None:
    """Register the strategy ``name``: built by ``build`` where ``applies``, tried before every
    strategy registered earlier.

    Raises:
        ValueError: ``name`` is registered already.
    """
    if any(r.name == name for r in _registered):
        raise ValueError(f"name: a distribution strategy {name!r} is registered already")
    _registered.append(_Registration(name, applies, build))


def unregister_strategy(name: str) -> None:
    """Remove the strategy ``name``.

    Raises:
        ValueError: ``name`` is not registered.
    """
    for index, registration in enumerate(_registered):
        if registration.name == name:
            del _registered[index]
            return
    raise ValueError(f"name: no distribution strategy {name!r} is registered")


def strategy_for(blocks: Sequence[KroneckerBlock], grad_worker_fraction: float | str = 1.0,
                 process_group: dist.ProcessGroup | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 settings: Mapping[str, object] | None = None, method: Method | str = "eigen") -> DistributionStrategy:
    """The strategy for ``blocks`` on ``process_group`` (None: the whole job, or one process): the
    newest registered one that applies. Arguments as :class:`StrategySetting`'s; with several
    ranks the construction is a collective (see ``DataParallel``)."""
    setting = StrategySetting(blocks, group_rank_and_size(process_group)[1], grad_worker_fraction, process_group,
                              bucket_bytes, settings or {}, method)
    registration = next(r for r in reversed(_registered) if r.applies(setting))
    logger.debug("K-FAC distribution strategy: %s", registration.name)
    return registration.build(setting)


def _data_parallel(cls: type[DataParallel]) -> Callable[[StrategySetting], DistributionStrategy]:
    def build(s: StrategySetting) -> DistributionStrategy:
        return cls(s.blocks, s.grad_worker_fraction, s.process_group, s.bucket_bytes, s.settings, s.method)
    return build


register_strategy("single_process", lambda s: True, lambda s: SingleProcess(
    s.blocks, s.grad_worker_fraction, s.process_group, s.bucket_bytes, s.method))
register_strategy("data_parallel", lambda s: s.world_size > 1, _data_parallel(DataParallel))
register_strategy("row_sharded", lambda s: has_row_sharded_blocks(s.blocks), _data_parallel(RowSharded))
