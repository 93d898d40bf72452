"""``KroneckerEstimator``: the Kronecker-factored curvature of a model's layers, for ``KFAC``.

Owns: the blocks (discovery), the step count that schedules the curvature work, and the step's
verbs over four objects chosen once at construction: the statistics pipeline (capture and fold, in
line or on the statistics worker: ``pipeline.py``), the fold schedule (all blocks on factor
steps, or staggered: ``folds.py``), the decomposition steps (in line or in background rounds:
``decomposition_steps.py``) and the reporter (one-time warnings, ``describe()``, ``memory_usage()``:
``reporter.py``); the directions come from ``update/directions.py``.
Talks to the distributed layer through the strategy it chooses from ``RuntimeConfig`` and to
loss scaling through the ``MixedPrecision`` it is given.
Its checkpoint state is a tree of owners (``kfac_optim.state``): its step, the intervals and the
round in flight (which resume at that step), and its children (blocks, damping, stagger).
Must not know: param groups, the step's length, SGD's update, the checkpoint's framing (``checkpoint.py``).

One step of the optimizer reaches it in this order (docs/design.md §4)::

    estimator.update_curvature(statistics_scale)   # fold on factor steps, decompose on decomposition steps
    directions = estimator.precondition()          # (G ⊗ A + λI)⁻¹ ∇W per block, by parameter
    ...                                            # the step's length, SGD (the optimizer)
    estimator.advance()                            # count the step, arm the hooks for the next one
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from kfac_optim import fisher as fisher_lib
from kfac_optim.capture import batch_free
from kfac_optim.capture.weight_uses import WeightUseCheck
from kfac_optim.config import KFACOptions, RuntimeConfig
from kfac_optim.distributed.strategies import strategy_for
from kfac_optim.distributed.strategy import DistributionStrategy
from kfac_optim.estimator.decomposition_steps import DecompositionSteps, decomposition_steps
from kfac_optim.estimator.folds import fold_schedule
from kfac_optim.estimator.pipeline import statistics_pipeline
from kfac_optim.layers import KroneckerBlock, ModuleReport, discover_blocks
from kfac_optim.layers.block_states import BlockStates
from kfac_optim.layers.registry import SkipLayers, find_layers
from kfac_optim.methods import Method, method_named
from kfac_optim.precision import MixedPrecision
from kfac_optim.reporter import LARGE_FACTOR_DIM, Reporter, memory_usage
from kfac_optim.schedule.costs import model_costs
from kfac_optim.schedule.intervals import IntervalSchedule, StepCosts
from kfac_optim.state import Stateful, check_children, load_children, save_children, within
from kfac_optim.update import directions
from kfac_optim.update.damping import DampingRule, damping_rule

logger = logging.getLogger(__name__)

__all__ = ["LARGE_FACTOR_DIM", "KroneckerEstimator", "block_dims", "unwrap_model"]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module that owns the layers: inside DDP / DataParallel wrappers and ``torch.compile``."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def block_dims(model: nn.Module, skip_layers: SkipLayers = ()) -> dict[str, tuple[int, int]]:
    """``{module name: (dim_A, dim_G)}`` of the blocks ``KFAC(model, ...)`` builds with these ``skip_layers``.

    The same discovery as the optimizer's default (every parameter, frozen ones included; ``skip_layers``, grouped convs
    preconditioned too). It builds the blocks, so their factors are allocated on the model's device:
    build the model under ``torch.device("meta")`` to get the sizes without allocating anything.
    """
    model = unwrap_model(model)
    blocks = discover_blocks(model, set(model.parameters()), skip_layers, torch.float32)
    return {block.name: (block.A.dim, block.G.dim) for block in blocks}



class KroneckerEstimator:
    """The blocks of ``model``'s layers whose parameters are in ``trainable``, their factors and
    decompositions, kept on the schedule of ``options`` (see the module docstring).

    ``precision``: the optimizer's loss-scale handling (the hooks accumulate through it).
    ``runtime``: the process group, strategy and threads; with several ranks the construction is a
    collective that checks every rank has the same ``options`` and layers.
    """

    def __init__(
        self,
        model: nn.Module,
        trainable: set[Tensor],
        options: KFACOptions,
        runtime: RuntimeConfig,
        precision: MixedPrecision,
    ) -> None:
        curvature = options.curvature
        self.options = options
        self.method: Method = method_named(options.method)
        self.discovery = find_layers(model, trainable, curvature.skip_layers, curvature.factor_dtype,
                                     blocks=curvature.blocks, weight_sharing=curvature.weight_sharing,
                                     conv_positions=curvature.conv_positions)
        self.blocks = self.discovery.blocks
        self.reporter = Reporter(model, self.discovery, self.method, trainable)
        # First (before any hook exists): with several ranks it checks they all built K-FAC alike.
        self.strategy: DistributionStrategy = strategy_for(
            self.blocks, runtime.grad_worker_fraction, runtime.process_group, runtime.bucket_bytes,
            settings=options.rank_settings(), method=self.method)
        self._check_method_state_is_local(runtime)
        self.statistics = statistics_pipeline(self.blocks, model, precision,
                                              every_backward=curvature.fisher == "empirical",
                                              on_worker=runtime.async_statistics, decay=curvature.factor_decay,
                                              reduction=curvature.reduction, resharded=self.strategy.resharded)
        self.capture = self.statistics.capture
        self.weight_uses = WeightUseCheck(model, self.blocks)  # once, at the first forward (weight_uses.py)
        self.capture.hold(self.weight_uses.handles)
        device = self.blocks[0].weight.device if self.blocks else torch.device("cpu")
        # Per K-FAC parameter (blocks in order): steps whose direction was non-finite (counted by the
        # step's length, step_length.py, left out of ν), on the device; reported at decomposition steps.
        self.nonfinite_directions = torch.zeros(len(self.parameters()), dtype=torch.int64, device=device)
        self.decomposition_steps: DecompositionSteps = decomposition_steps(
            self.blocks, self.method, curvature.inv_dtype, self.strategy, self.reporter, self.nonfinite_directions,
            options.asynchronous)
        self.steps = 0
        self.intervals = IntervalSchedule(options.factor_update_steps, options.decomposition_update_steps, device,
                                          remeasure=self.decomposition_steps.remeasures)
        self.folds = fold_schedule(self.blocks, self.intervals, stagger=curvature.stagger,
                                   sum_over_ranks=self.strategy.sum_over_ranks)
        distributed = self.strategy.active or not self.strategy.whole_tensors
        self.damping: DampingRule = damping_rule(options.damping, distributed=distributed)
        self.state_children: dict[str, Stateful] = {
            "blocks": BlockStates(self.blocks, self.method), "damping": self.damping, "stagger": self.folds}
        """The owners of checkpoint state under their keys (``kfac_optim.state``), loaded in this order."""
        self.arm()

    def _check_method_state_is_local(self, runtime: RuntimeConfig) -> None:
        """A stateful method (``EigenAdam``) keeps each block's state where the block is
        preconditioned: on every rank only when every rank preconditions every layer."""
        if not self.method.stateful:
            return
        if self.strategy.broadcasts_directions or not self.strategy.whole_tensors:
            raise ValueError(
                f"method={self.method!r} keeps per-layer state on the ranks that precondition a layer, so it needs "
                f"every rank to precondition every layer: RuntimeConfig(grad_worker_fraction=1) and no FSDP2-sharded "
                f"layers (got RuntimeConfig.grad_worker_fraction={runtime.grad_worker_fraction!r})"
            )

    def reports(self, trainable: set[Tensor]) -> list[ModuleReport]:
        """What happens now to every module's parameters among ``trainable`` (``KFAC.module_reports``)."""
        return self.reporter.reports(trainable)

    def parameters(self) -> list[Tensor]:
        """The blocks' parameters, in block order (the order of :attr:`nonfinite_directions`)."""
        return [param for block in self.blocks for param in block.parameters()]

    def describe(self, trainable: set[Tensor]) -> str:
        """:meth:`KFAC.describe`, given the optimizer's parameters (``trainable``): ``Reporter.describe``."""
        return self.reporter.describe(trainable, self.intervals.describe())

    def memory_usage(self) -> dict[str, int]:
        """Bytes of K-FAC state on this rank, by category, and their ``"total"`` (``reporter.memory_usage``)."""
        return memory_usage(self.blocks, self.method,
                            self.strategy.preconditioning_bytes(self.options.curvature.inv_dtype))

    # -- schedules ---------------------------------------------------------------------------

    def damping_at(self, step: int) -> float:
        return self.damping.at(step)

    def folding_blocks(self, step: int) -> list[KroneckerBlock]:
        """The blocks that capture for and fold at ``step``: all on factor steps, or their phase's."""
        return self.folds.blocks_at(step)

    def is_decomposition_step(self, step: int) -> bool:
        return self.intervals.is_decomposition_step(step)

    def arm(self) -> None:
        """Let the hooks capture for the coming step when it is a factor step (for its layers)."""
        self.folds.arm(self.capture, self.steps)

    # -- the step ----------------------------------------------------------------------------

    def update_curvature(self, statistics_scale: float | Tensor, moves: Callable[[], bool] | None = None) -> None:
        """Fold the statistics on factor steps, refresh the decompositions on decomposition steps.

        ``moves``: whether this step can move a parameter (the optimizer's: some lr is not 0), asked
        only when a factor step recorded nothing (``Reporter.recording``); None: it can.

        Every K-FAC collective of a step with ``grad_worker_fraction=1`` happens here, so a rank
        that ran out of inputs under ``Join`` runs it too (:meth:`shadow_step`).
        """
        step, damping = self.steps, self.damping_at(self.steps)
        self.capture.flush()  # pairs held for a backward that kept its graph (capture.py)
        self.capture.drop_without_gradient()
        self.intervals.begin_step(step, self._average_costs, self._counted_costs)  # "auto": decide when undecided
        if self.strategy.decompositions_missing:  # a loaded checkpoint lacks some: from its factors
            self.statistics.settle()
            self.decomposition_steps.complete(damping)
        folding = self.folds.blocks_at(step)
        if folding:
            self._fold(folding, statistics_scale, moves)
        else:
            self.statistics.discard_pending()  # a no-op when nothing was captured
        if self.is_decomposition_step(step):
            self.reporter.bias_changes()
            with self.intervals.timing_decomposition(step):
                self.statistics.settle()
                self.decomposition_steps.step(damping, step)
        else:
            self.decomposition_steps.between(step)  # AsyncConfig.delay: adopt a round due now
        self.statistics.report()  # after any wait for the worker above

    def _fold(self, folding: list[KroneckerBlock], statistics_scale: float | Tensor,
              moves: Callable[[], bool] | None) -> None:
        """A factor step's fold of ``folding``'s statistics, after the checks of what was recorded."""
        self.reporter.recording(self.statistics.recording(), moves)
        if self.reporter.awaiting_statistics:  # until a factor step recorded statistics
            self.statistics.settle()  # the checks read the pending statistics
            self.reporter.silent_blocks(folding)  # all blocks, but a resumed staggered run's phase
            batch_free.leave_batch_free_blocks_to_sgd(folding)  # reports() says why (sgd_reason)
        self.folds.before_fold(self.statistics.settle)  # stagger: the phases, once
        self.statistics.fold(folding, statistics_scale)
        self.strategy.factors_folded()

    def precondition(self) -> dict[Tensor, Tensor]:
        """Per-parameter update directions of the blocks that have a decomposition, at this step's damping
        (timed on the steps the automatic intervals measure).

        Under FSDP2 a direction is a ``DTensor`` laid out as its parameter (this rank's rows).
        """
        with self.intervals.timing_precondition(self.steps):
            return directions.precondition(self.blocks, self.method, self.damping_at(self.steps), self.strategy,
                                           self.options.curvature.inv_dtype)

    def advance(self) -> None:
        """Count a step and arm the hooks for the next one."""
        self.intervals.step_ended(self.steps)
        self.steps += 1
        self.arm()

    def shadow_step(self) -> None:
        """A joined rank's part in one step of the others (``distributed/join.py``): count it, fold
        nothing, and run the decomposition step's collectives (and decompositions) when it is one."""
        self.update_curvature(1.0)
        self.advance()

    def _counted_costs(self) -> StepCosts | None:
        """The default automatic intervals' costs, counted from the blocks' shapes and the rows they
        captured since the last step (``kfac_optim.schedule.costs``; None: none captured). The same on every
        rank whose batch has the same shape, so no collective decides them."""
        self.statistics.settle()  # async_statistics: the rows are counted on the worker
        return model_costs(self.blocks, self.method.decomposition_cost, self.method.precondition_cost)

    def _average_costs(self, costs: list[float]) -> list[float]:
        """The calibration's costs summed over ranks (one all-reduce, at the same step on every rank)."""
        return self.strategy.sum_over_ranks(costs, "the automatic intervals' cost all-reduce")

    # -- statistics --------------------------------------------------------------------------

    def discard_pending_statistics(self) -> None:
        """Forget statistics captured since the last step (e.g. of a step that will not happen)."""
        self.statistics.discard_pending()

    def settle_statistics(self) -> None:
        """With ``async_statistics``: wait until the worker has run everything submitted, so that
        the factors and pending statistics may be read here (a no-op otherwise)."""
        self.statistics.settle()

    def synchronize_factors(self, caller: str) -> None:
        """Make the running factors global now (a collective when a factor step happened since)."""
        self.statistics.settle()
        self.strategy.synchronize_factors(caller, confirm=True)

    @record_function("kfac.sample_fisher")
    def sample_fisher(self, outputs: Tensor, likelihood: fisher_lib.Likelihood,
                      generator: torch.Generator | None) -> None:
        """Capture this batch's statistics at targets sampled from the model (``fisher="sampled"``).

        Call it on every (micro-)batch between the forward pass and ``loss.backward()``, with the
        model's ``outputs`` and the ``likelihood`` its training loss assumes: "cross_entropy"
        (logits ``(N, C)``, or ``(N, T, C)`` / ``(N, ..., C)`` for sequences: each sample's loss is the mean
        over its positions, in the units of the empirical Fisher of a mean-over-tokens loss) or "mse"
        (see ``kfac_optim.fisher``). On a step that updates factors
        it back-propagates the loss at sampled targets with ``torch.autograd.grad`` with respect to
        the K-FAC layers' outputs of this forward (one more backward pass, down to the first
        K-FAC layer and without weight gradients, however the parameters reach the graph, e.g.
        FSDP2's unsharded copies; ``.grad`` is left alone and the graph is kept for the training
        loss; the outputs are held from the forward until then);
        on the other steps and under ``torch.no_grad()`` it returns at once (eval mode records as training mode does).
        ``generator`` draws the targets (default: torch's global generator). Loss scaling
        (GradScaler, Apex) needs nothing more: the sampled loss is never scaled, as its
        output-gradients are per-sample and of order one.
        """
        if self.options.curvature.fisher != "sampled":
            raise RuntimeError(
                "sample_fisher needs KFAC(..., curvature=CurvatureConfig(fisher='sampled')); this optimizer uses "
                "CurvatureConfig(fisher='empirical')"
            )
        fisher_lib.check_likelihood(likelihood)
        if not torch.is_grad_enabled():
            return
        if not outputs.requires_grad:
            raise ValueError("outputs must be the model's output computed with grad enabled (it does not require grad)")
        if not self.capture.armed:
            return  # not a factor step (the hooks capture nothing)
        loss = fisher_lib.sampled_loss(outputs, likelihood, generator, self.capture.real_positions())
        recorded_before = self.capture.recorded
        with self.capture.recording_outputs() as layer_outputs:
            if layer_outputs:  # back-propagate exactly as far as the hooked layer outputs
                torch.autograd.grad(loss, layer_outputs, retain_graph=True, allow_unused=True)
        if self.capture.recorded == recorded_before:
            self.reporter.nothing_sampled()

    # -- checkpoints (kfac_optim.state's protocol) ---------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"steps", "intervals", "round", **its children's}``: this rank's state, local (the
        statistics worker and a round in flight are waited for). The intervals and the round in
        flight resume at the saved step; every other owner is a child (:attr:`state_children`)."""
        self.statistics.settle()
        return {"steps": self.steps, "intervals": self.intervals.state_dict(),
                "round": self.decomposition_steps.state_dict(), **save_children(self.state_children)}

    def check_state(self, state: Any) -> None:
        """Raise ``ValueError`` naming the key if ``state`` (a :meth:`state_dict`) does not fit; nothing changes."""
        if not isinstance(state, dict) or "steps" not in state:
            raise ValueError("expected a dict with 'steps' and 'blocks'")
        steps = state["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"'steps' must be an int >= 0, got {steps!r}")
        check_children(self.state_children, state)
        with within("'intervals'"):
            self.intervals.check_state(state.get("intervals"))
        with within("'round'"):
            self.decomposition_steps.check_state(state.get("round"), steps)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checked :meth:`state_dict`: the step, the intervals at it, the children in
        order, then the round in flight (over the loaded factors)."""
        self.statistics.settle()  # work in flight writes into the factors being replaced
        self.steps = int(state["steps"])
        self.intervals.load_state_dict(state.get("intervals"), self.steps)
        load_children(self.state_children, state)
        self.decomposition_steps.load_state_dict(state.get("round"))
        self.strategy.loaded()
        self.arm()
