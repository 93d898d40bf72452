"""Uneven inputs: ``KFAC`` under ``torch.distributed.algorithms.Join`` (DDP's join context manager).

Owns: the join hook (what a rank that ran out of inputs does while the others still step, and
once all have joined) and the checks that ``Join`` is used in the way the hook relies on.
Must not know: how factors are folded or decomposed (the estimator's ``shadow_step``, handed in,
runs the same code as ``step()``), the plan's details, the optimizer's private state (it is given
the distribution strategy, the shadow step and the optimizer's public ``param_groups`` / ``state``).

Usage: ``with Join([ddp_model, optimizer]): for batch in this_ranks_batches: ...`` with one
forward, backward and ``step()`` per batch, the DDP model first. Once per iteration the others
run, the main hook follows the same factor / decomposition schedule, joins the all-reduce of the
running factors with its own (folding nothing more, docs/design.md §5), decomposes the factors it
owns and joins the decomposition broadcasts. Once every rank has joined, the post hook makes the
factors global and gives every rank the momentum buffers of the last rank to join, so the ranks
leave ``Join`` identical.

Refused when ``Join`` is built: ``grad_worker_fraction < 1`` (a joined rank has no gradient to
precondition and broadcast) and layers sharded by FSDP2 (every step's row gathers and sums over
the shards need every rank's gradient rows). Not seen by a joined rank: steps the others skip (a
``GradScaler`` overflow) and ``no_sync`` gradient accumulation; there the ranks' collectives no
longer match (an error, or with gloo possibly an abort).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import JoinHook
from torch.optim import Optimizer

from kfac_optim.distributed.strategy import DistributionStrategy


class KFACJoinHook(JoinHook):
    """The join hook of one ``KFAC`` optimizer (see the module docstring)."""

    def __init__(self, support: JoinSupport) -> None:
        super().__init__()
        self._support = support

    def main_hook(self) -> None:
        """Take part in one ``step()`` of the ranks that still have inputs."""
        self._support.shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        """All ranks joined: make the factors global and adopt the last joiner's momentum buffers."""
        strategy = self._support.strategy
        if not strategy.active:
            return
        strategy.synchronize_factors("Join's KFAC post hook")
        _adopt_momentum_of_last_joiner(self._support.optimizer, strategy, is_last_joiner)


class JoinSupport:
    """What ``KFAC`` needs to be a ``Joinable``: its hook, device and process group, and the checks.

    ``strategy``: the estimator's distribution strategy. ``shadow_step``: a joined rank's part in one
    step of the others (``KroneckerEstimator.shadow_step``). ``optimizer``: for its public
    ``param_groups`` and ``state`` (the momentum buffers), held weakly: the optimizer owns this object,
    and a strong reference back would put the optimizer, the model and a DDP wrapper's reducer
    (which holds the process group) in a reference cycle that outlives the user's last reference:
    until a garbage collection, in a spawned rank often the one of interpreter shutdown, which tears
    the reducer down with the interpreter while gloo's native threads still run.
    ``model``: the model as given to ``KFAC`` (the DDP wrapper, when there is one, whose join
    configuration tells whether it runs under ``Join``).
    """

    def __init__(self, strategy: DistributionStrategy, shadow_step: Callable[[], None], optimizer: Optimizer,
                 model: nn.Module) -> None:
        self.strategy = strategy
        self.shadow_step = shadow_step
        self._optimizer = weakref.ref(optimizer)
        self._ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer this object belongs to (alive while this object is reachable through it)."""
        optimizer = self._optimizer()
        assert optimizer is not None, "JoinSupport outlived its optimizer"
        return optimizer

    def hook(self) -> KFACJoinHook:
        """The join hook; refuses what it cannot shadow (every rank calls this in ``Join(...)``).

        Raises:
            ValueError: layers sharded by FSDP2 (the strategy does not hold whole tensors), or
                ``grad_worker_fraction < 1`` on more than one rank.
        """
        if not self.strategy.whole_tensors:
            raise ValueError(
                "KFAC under Join needs whole parameters on every rank: with layers sharded by FSDP2 "
                "(fully_shard) every step gathers gradient rows and sums over the shards, collectives a rank "
                "that ran out of inputs cannot take part in (nor in FSDP2's own); give every rank the same "
                "number of batches"
            )
        if self.strategy.broadcasts_directions:
            raise ValueError(
                "KFAC under Join needs RuntimeConfig(grad_worker_fraction=1) (comm-opt): with "
                f"{self.strategy.plan.grad_workers} gradient worker(s) per layer a rank that ran out of inputs "
                "would have to precondition gradients it does not have"
            )
        return KFACJoinHook(self)

    @property
    def device(self) -> torch.device:
        """The device of the first parameter (for ``Join``'s own all-reduces)."""
        return self.optimizer.param_groups[0]["params"][0].device

    @property
    def process_group(self) -> Any:
        """The group K-FAC runs on (the default group's object when none was given, as DDP's)."""
        group = self.strategy.comm.group
        return dist.group.WORLD if group is None else group

    def check_step(self, config: Any) -> None:
        """At ``step()``, with the optimizer's ``Joinable`` join configuration (``enable``, ``is_first_joinable``):
        refuse a ``Join`` the hook cannot work in, on every rank at once.

        Raises:
            ValueError: ``KFAC`` is the first joinable (``Join``'s per-iteration all-reduce would
                then be matched against the DDP model's), or the DDP model is under ``Join`` and
                ``KFAC`` is not (a joined rank would not take part in K-FAC's collectives).
        """
        if config.enable and config.is_first_joinable:
            raise ValueError("Join: pass the DDP model before the KFAC optimizer, Join([model, optimizer])")
        ddp_config = getattr(self._ddp, "_join_config", None)
        if ddp_config is not None and ddp_config.enable and not config.enable and self.strategy.active:
            raise ValueError(
                "the DDP model runs under Join but its KFAC optimizer does not: pass both, "
                "Join([model, optimizer])"
            )


def _adopt_momentum_of_last_joiner(optimizer: Optimizer, strategy: DistributionStrategy, is_last_joiner: bool) -> None:
    """Every rank takes the momentum buffers of the highest-ranked last joiner (DDP's choice of the
    rank whose parameters it broadcasts); a buffer that rank lacks is dropped."""
    comm = strategy.comm
    everyone = tuple(range(comm.world_size))
    what = "Join's KFAC post hook: the broadcast of momentum buffers"
    params = [p for group in optimizer.param_groups for p in group["params"]]
    device = params[0].device
    last = torch.zeros(comm.world_size, device=device)
    last[comm.rank] = float(is_last_joiner)
    (last,) = comm.all_reduce_sum([last], what=what).wait()
    source = int(last.nonzero().max())
    held = torch.tensor([float("momentum_buffer" in optimizer.state.get(p, {})) for p in params], device=device)
    (held,) = comm.broadcast([held], source, everyone, what=what).wait()
    present = [p for p, flag in zip(params, held.tolist(), strict=True) if flag]
    buffers = [optimizer.state.get(p, {}).get("momentum_buffer") for p in present]
    buffers = [torch.zeros_like(p) if b is None else b for p, b in zip(present, buffers, strict=True)]
    received = comm.broadcast(buffers, source, everyone, what=what).wait()
    for p in params:
        optimizer.state.get(p, {}).pop("momentum_buffer", None)
    for p, buffer in zip(present, received, strict=True):
        optimizer.state[p]["momentum_buffer"] = buffer
