"""The data-parallel strategy (KAISA): factors all-reduced, decompositions sharded by the plan.

Owns: when running factors are made global (lazily, right before a decomposition), which
decompositions this rank computes and holds, and sharing decompositions and preconditioned
gradients over the gradient workers of ``grad_worker_fraction`` (docs/design.md §5).
Must not know: how factors, decompositions or directions are computed (the blocks and the
caller's callback do that), schedules, param groups, sharded parameters (``row_sharded.py``).

**Lazy factor reduction.** Averaging the ranks' running factors right before a decomposition
equals averaging the batch statistics at every factor step, when every rank folds on the same
steps. A rank whose layer saw no input folds nothing and keeps its factor; a rank whose factor
was never initialized takes part with zeros and is not counted in the mean.

**Decompositions.** Only the plan's owner computes one. On every decomposition step the ranks
agree, in one small all-reduce, on which decompositions exist and with which damping shift;
owners broadcast them over the block's gradient workers. Gradient workers precondition; with
``f < 1`` the gradient worker of each row broadcasts the direction over its row, so every rank
ends the step with the same directions. Every rank's DDP-averaged gradients are identical, so
whether a block has a gradient is the same on every rank: receivers know what to expect.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence, Set
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from kfac_optim.distributed.comm import DEFAULT_BUCKET_BYTES, Communicator, Pending, group_rank_and_size
from kfac_optim.distributed.consistency import Description, check_same_on_every_rank, describe
from kfac_optim.distributed.plan import FACTORS, Plan, make_plan
from kfac_optim.distributed.strategy import Precondition, WholeTensors, block_work_items, whole_gradient_directions
from kfac_optim.methods import Method

if TYPE_CHECKING:
    from kfac_optim.layers import Factor, KroneckerBlock

logger = logging.getLogger(__name__)


class DataParallel(WholeTensors):
    """K-FAC on the ranks of a data-parallel job: this rank's part of the plan (``DistributionStrategy``).

    Args:
        blocks: the optimizer's Kronecker blocks (unique names; the same on every rank).
        grad_worker_fraction: KAISA's ``f`` in ``(0, 1]`` or a strategy name, see
            :func:`~kfac_optim.distributed.plan.resolve_grad_workers`.
        process_group: the group K-FAC runs on (None: the whole job when ``torch.distributed``
            is initialized; a single process otherwise).
        bucket_bytes: upper bound on one flat communication buffer.
        settings: ``{name: value}`` of the options that every rank must share (the optimizer's
            K-FAC hyperparameters); with more than one rank they are compared across ranks at
            construction, with the resolved grad-worker count and the layer list (names, kinds,
            weight shapes and dtypes, bias), before any other collective (see ``consistency``).
        method: the decomposition method, whose costs the plan balances (``Method.decomposition_cost``).

    Raises:
        ValueError: a bad ``grad_worker_fraction`` for this world size (the message names it),
            a ``process_group`` that cannot be used (see :class:`Communicator`), or settings or
            layers that differ across ranks (on every rank; the message names the first).
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
        self.rank, world_size = group_rank_and_size(process_group)
        self.plan: Plan = make_plan(block_work_items(blocks), world_size, grad_worker_fraction, method=method)
        if world_size > 1:
            described: dict[str, Description] = {name: describe(v) for name, v in (settings or {}).items()}
            described["grad_worker_fraction"] = f"{self.plan.grad_workers} gradient worker(s) per layer"
            described["layers"] = tuple(_describe_block(b) for b in blocks)
            device = blocks[0].weight.device if blocks else _backend_device(process_group)
            check_same_on_every_rank(described, process_group, device)
        self.comm = Communicator(process_group, self.plan.groups, bucket_bytes)
        by_name = {b.name: b for b in blocks}
        self.blocks: dict[str, KroneckerBlock] = {bp.block: by_name[bp.block] for bp in self.plan.blocks}
        self.decompositions_missing = False
        self._folded = False
        self._ready: set[str] = set()
        if blocks:
            logger.info("K-FAC plan: %s", self.plan.summary(self.rank))

    @property
    def active(self) -> bool:
        """Whether K-FAC runs on more than one rank."""
        return self.comm.active


    @property
    def broadcasts_directions(self) -> bool:
        """Whether gradient workers broadcast directions over their rows (``f < 1``, several ranks)."""
        return self.active and self.plan.broadcasts_gradients

    def decomposes(self, block: str, factor: str) -> bool:
        """Whether this rank computes the decomposition of ``factor`` of ``block``."""
        return self.plan.block(block).owner(factor) == self.rank

    # -- factors -----------------------------------------------------------------------------

    def owned_factors(self) -> tuple[str, ...]:
        """``"<block>.<factor>"`` of every factor this rank decomposes."""
        return tuple(f"{item.block}.{item.factor}" for item in self.plan.owned(self.rank))

    def bytes_communicated(self) -> dict[str, int]:
        """The communicator's bytes sent so far, by kind (factors, decompositions, directions)."""
        return {kind: self.comm.bytes_sent[kind] for kind in ("factors", "decompositions", "directions")}

    def factors_folded(self) -> None:
        """Record a factor step: the ranks' running factors may now differ."""
        self._folded = True

    @property
    def factors_global(self) -> bool:
        """Whether every rank holds the global factors now (no factor step since the last
        reduction, or one rank): :meth:`synchronize_factors` then communicates nothing."""
        return not (self.active and self._folded and self.blocks)

    def synchronize_factors(self, caller: str = "KFAC.step()", confirm: bool = False) -> None:
        """Replace every rank's running factors by the global ones (a collective on all ranks).

        Runs only if a factor step happened since the last time; every rank takes the same
        factor steps, so all ranks agree on whether to communicate. ``caller``: the call this runs
        in, for messages. ``confirm``: for public calls that users may make on one rank only
        (``KFAC.synchronize_factors()``): every rank's call is first confirmed through
        the store (:meth:`Communicator.confirm_every_rank_calls`), so a call on one rank raises an
        error naming it instead of meeting another collective.
        """
        if self.factors_global:
            self._folded = False
            return
        if confirm:
            self.comm.confirm_every_rank_calls(
                caller, "a factor step happened since the last decomposition step: the ranks average their factors"
            )
        factors = [factor for block in self.blocks.values() for factor in block.factors_to_reduce()]
        what = f"{caller}: the all-reduce of the running factors"
        running = [f.running for f in factors]
        symmetric = [f.running.dim() == 2 for f in factors]  # one (n, n) matrix: its triangle travels
        sums = self.comm.all_reduce_sum(running, symmetric=symmetric, in_place=True, what=what, tag="factors")
        initialized = torch.stack([f.initialized for f in factors]).to(factors[0].running.dtype)
        rows = torch.tensor([f.rows_since_sync for f in factors], dtype=torch.float64, device=initialized.device)
        counts = self.comm.all_reduce_sum([initialized, rows], what=what, tag="factors")
        ranks, row_sums = counts.wait()
        for factor, total, count, row_sum in zip(factors, sums.wait(), ranks, row_sums.tolist(), strict=True):
            factor.set_global(total, count, int(row_sum))
        for block in self.blocks.values():
            block.after_factor_reduction()  # e.g. a tied weight's A, G from its uses' global factors
        self._folded = False

    def sum_over_ranks(self, values: list[float], what: str) -> list[float]:
        """``values`` summed over all ranks (a collective on all ranks; themselves on one rank)."""
        if not self.active:
            return list(values)
        sums = self.comm.all_reduce_sum([torch.tensor(values, dtype=torch.float64, device=self._device())], what=what)
        return sums.wait()[0].tolist()

    # -- decompositions ----------------------------------------------------------------------

    def share_decompositions(self, method: Method, dtype: torch.dtype) -> None:
        """After owners decomposed: agree on what exists, broadcast to gradient workers.

        ``method`` (what a decomposition is made of) and ``dtype`` (its dtype) shape the receive buffers.
        """
        self.decompositions_missing = False
        if not self.active or not self.blocks:
            return
        items = self.plan.items
        device = self._device()
        decomposer = method.decomposer
        local = []
        for item in items:
            factor = self.blocks[item.block].factors[item.factor]
            held = self.decomposes(item.block, item.factor) and factor.decomposition is not None
            key = factor.decomposed_key
            columns = decomposer.columns(factor) if held else 0
            local.append((1.0, float("nan") if key is None else key[1], columns) if held else (0.0, 0.0, 0))
        what = "KFAC.step(): the exchange of decompositions"
        local_flags = torch.tensor(local, dtype=torch.float64, device=device)
        (flags,) = self.comm.all_reduce_sum([local_flags], what=what, tag="decompositions").wait()
        available = {
            (item.block, item.factor): (held > 0, shift, int(columns))
            for item, (held, shift, columns) in zip(items, flags.tolist())
        }
        self._ready = {
            name for name in self.blocks if all(available[(name, f)][0] for f in FACTORS)
        }
        if not self.plan.broadcasts_decompositions:
            return
        sends: dict[tuple[tuple[int, ...], int], list[tuple[Factor, float, int]]] = defaultdict(list)
        for item in items:
            block_plan = self.plan.block(item.block)
            held, shift, columns = available[(item.block, item.factor)]
            if held and self.rank in block_plan.grad_workers:
                factor = self.blocks[item.block].factors[item.factor]
                sends[(block_plan.grad_workers, block_plan.owner(item.factor))].append((factor, shift, columns))
        pending: list[tuple[int, list[tuple[Factor, float, int]], Pending]] = []
        for (workers, src), members in sorted(sends.items(), key=lambda kv: kv[0]):
            if src == self.rank:
                tensors = [t for factor, _, _ in members for t in decomposer.tensors(factor)]
            else:
                tensors = [
                    t for factor, _, columns in members for t in decomposer.buffers(factor, dtype, device, columns)
                ]
            symmetric = [flag for factor, _, _ in members for flag in decomposer.symmetric(factor)]
            work = self.comm.broadcast(tensors, src, workers, symmetric=symmetric, what=what, tag="decompositions")
            pending.append((src, members, work))
        for src, members, work in pending:
            received = work.wait()
            if src == self.rank:
                continue
            start = 0
            for factor, shift, _ in members:
                count = len(decomposer.symmetric(factor))
                factor.adopt(decomposer.from_tensors(factor, received[start : start + count]), shift)
                start += count

    # -- directions --------------------------------------------------------------------------

    def directions(self, blocks: Sequence[KroneckerBlock], precondition: Precondition,
                   dtype: torch.dtype) -> dict[Tensor, Tensor]:
        """The directions of ``blocks`` (whole gradients on every rank): gradient workers compute
        them, :meth:`share_directions` hands them over the rows."""
        names = {block.name for block in blocks}
        return whole_gradient_directions(blocks, precondition, lambda joint: self.share_directions(joint, dtype, names))

    def share_directions(self, directions: Mapping[str, Tensor], dtype: torch.dtype,
                         among: Set[str]) -> dict[str, Tensor]:
        """Every block's preconditioned ``(out, in [+1])`` gradient, from its gradient workers.

        ``directions``: the ones this rank computed (as a gradient worker), by block name.
        Returns them plus, with ``f < 1``, those received from the gradient worker of this
        rank's row, of the blocks named in ``among``; ``dtype`` is theirs. Blocks without a
        gradient or without decompositions at their owners have none (the SGD path on every rank).
        """
        if not (self.active and self.plan.broadcasts_gradients and self.blocks):
            return dict(directions)
        row = self.plan.receiver_group(self.rank)
        by_source: dict[int, list[str]] = defaultdict(list)
        for name, block in self.blocks.items():
            if name in among and name in self._ready and block.weight.grad is not None:
                by_source[self.plan.grad_source(name, self.rank)].append(name)
        device = self._device()
        pending = []
        for src in sorted(by_source):
            names = by_source[src]
            if src == self.rank:
                tensors = [directions[name] for name in names]
            else:
                tensors = [torch.empty(self.blocks[n].direction_shape(), dtype=dtype, device=device) for n in names]
            what = "KFAC.step(): the broadcast of preconditioned gradients"
            pending.append((names, self.comm.broadcast(tensors, src, row, what=what, tag="directions")))
        shared = dict(directions)
        for names, work in pending:
            shared.update(zip(names, work.wait(), strict=True))
        return shared

    # -- checkpoints -------------------------------------------------------------------------

    def loaded(self) -> None:
        """After the blocks loaded a checkpoint (the same one on every rank).

        Drops decompositions of blocks this rank is not a gradient worker of, and asks for a
        decomposition pass at the next step when the checkpoint lacks a decomposition of an
        initialized factor (saved by a rank that did not hold it, e.g. under ``f < 1``).
        """
        self._folded = False
        factors = self._factors()
        initialized = torch.stack([f.initialized for f in factors]).tolist() if factors else []
        self.decompositions_missing = any(
            init and f.decomposition is None for f, init in zip(factors, initialized, strict=True)
        )
        self._ready = {
            name for name, block in self.blocks.items()
            if all(f.decomposition is not None for f in block.factors.values())
        }
        for name, block in self.blocks.items():
            if not self.plan.is_grad_worker(name, self.rank):
                for factor in block.factors.values():
                    factor.adopt(None, 0.0)

    # -- helpers -----------------------------------------------------------------------------

    def _factors(self) -> list[Factor]:
        return [block.factors[f] for block in self.blocks.values() for f in FACTORS]

    def _device(self) -> torch.device:
        return next(iter(self.blocks.values())).weight.device


def _describe_block(block: KroneckerBlock) -> str:
    """One entry of the layer list ranks compare: name, kind, weight shape and dtype, bias."""
    weight = block.weight
    bias = " + bias" if block.bias is not None else ""
    return f"{block.name!r}: {type(block.module).__name__} weight {tuple(weight.shape)} {weight.dtype}{bias}"


def _backend_device(process_group: dist.ProcessGroup | None) -> torch.device:
    """Where a small collective's tensor must live without a model tensor to go by."""
    if dist.get_backend(process_group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
