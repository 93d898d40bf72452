"""``KroneckerEstimator``: the Kronecker-factored curvature of a model's layers, for ``KFAC``.

Owns: the blocks (discovery), the statistics capture (hooks, the statistics worker,
``sample_fisher``), folding statistics into factors on factor steps (all at once or staggered),
the decompositions on decomposition steps (in line or on the background worker, and the rounds in
flight), the preconditioned directions of the blocks (with FSDP2's row path), the step count
that schedules all of this, and the one-time warnings about it.
Talks to the distributed layer through the ``Sharding`` it builds from ``RuntimeConfig`` and to
loss scaling through the ``MixedPrecision`` it is given.
Must not know: param groups, the KL clip, SGD's update, checkpoints' format (``checkpoint.py``).

One step of the optimizer reaches it in this order (docs/design.md §4)::

    estimator.update_curvature(statistics_scale)   # fold on factor steps, decompose on decomposition steps
    directions = estimator.precondition()          # (G ⊗ A + λI)⁻¹ ∇W per block, by parameter
    ...                                            # KL clip, SGD (the optimizer)
    estimator.advance()                            # count the step, arm the hooks for the next one
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from kfac_optim import batch_free, layers, linalg
from kfac_optim import fisher as fisher_lib
from kfac_optim.background import BackgroundDecompositions, Job, Result
from kfac_optim.capture import StatisticsCapture
from kfac_optim.config import KFACOptions, RuntimeConfig
from kfac_optim.damping import DampingRule, damping_rule
from kfac_optim.diagnostics import warn_user
from kfac_optim.costs import model_costs
from kfac_optim.intervals import IntervalSchedule, StepCosts
from kfac_optim.distributed import fsdp
from kfac_optim.distributed.sharding import Sharding
from kfac_optim.layers import KroneckerBlock, ModuleReport, discover_blocks
from kfac_optim.layers.attention import sequence_first_note
from kfac_optim.layers.registry import SkipLayers, find_layers
from kfac_optim.methods import Method, method_named
from kfac_optim.precision import MixedPrecision
from kfac_optim.stagger import FactorStagger
from kfac_optim.statistics_worker import StatisticsWorker

logger = logging.getLogger(__name__)

LARGE_FACTOR_DIM = 4096
"""Factors at least this wide take seconds to decompose on a CPU at full rank (``eigh`` is ``O(n³)``;
a rank-``r`` factor is decomposed in ``O(n²r)``, see ``linalg.symmetric_eigen``): noted once."""


def fold_statistics(
    blocks: Sequence[KroneckerBlock],
    folding: Sequence[KroneckerBlock],
    decay: float,
    reduction: str,
    statistics_scale: float | Tensor,
) -> None:
    """A factor step's statistics work after the capture: fold the pending statistics of
    ``folding`` (see ``KroneckerBlock.fold``), then forget whatever the other ``blocks`` hold."""
    for block in folding:
        block.fold(decay, reduction, statistics_scale)
    clear_pending(blocks)  # a no-op for blocks that folded or captured nothing


def clear_pending(blocks: Sequence[KroneckerBlock]) -> None:
    """Forget the pending statistics of ``blocks``."""
    for block in blocks:
        block.clear_pending()


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


FROZEN_NOTE = (" (frozen now, requires_grad=False: records nothing, its hooks tap nothing, and factors never used are "
               "not allocated; once unfrozen, its factors are allocated when it first records and it is preconditioned "
               "from the first decomposition step after its gradient appears, its factors starting empty as a new "
               "layer's, under its param group's settings)")
"""What :meth:`KroneckerEstimator.describe` adds to the row of a block whose parameters are all frozen now."""

COVERAGE_WARNING = 0.5
"""Below this share of the trainable weight-matrix elements preconditioned, a one-time warning at
construction names the largest modules without a block (docs/api.md, ``describe()``)."""


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
        self._model = model
        self.discovery = find_layers(model, trainable, curvature.skip_layers, curvature.factor_dtype,
                                     blocks=curvature.blocks, weight_sharing=curvature.weight_sharing,
                                     conv_positions=curvature.conv_positions)
        self.blocks = self.discovery.blocks
        self._warn_about_discovery(trainable)
        # First (before any hook exists): with several ranks it checks they all built K-FAC alike.
        self.sharding = Sharding(self.blocks, runtime.grad_worker_fraction, runtime.process_group,
                                 runtime.bucket_bytes, settings=options.rank_settings())
        self._check_method_state_is_local(runtime)
        self._precision = precision
        self._statistics = StatisticsWorker() if runtime.async_statistics else None
        self.capture = StatisticsCapture(
            self.blocks,
            precision.accumulate,
            every_backward=curvature.fisher == "empirical",
            worker=self._statistics,
            in_line=precision.under_apex,  # Apex's loss scale is read during backward
            model=model,  # its calls delimit samples (chunked forwards: capture.py)
        )
        self._last_fold: Future[None] | None = None  # async_statistics: the latest factor step's fold
        self.background = BackgroundDecompositions() if options.asynchronous is not None else None
        self.adopt_at: int | None = None  # the step at which the round in flight is adopted
        self._stagger = FactorStagger(self.blocks) if curvature.stagger else None
        self.steps = 0
        device = self.blocks[0].weight.device if self.blocks else torch.device("cpu")
        self.intervals = IntervalSchedule(options.factor_update_steps, options.inv_update_steps, device,
                                          remeasure=self.background is None)
        self.damping: DampingRule = damping_rule(options.damping,
                                                 distributed=self.sharding.active or self.sharding.row_sharded is not None)
        self._reported_overwritten: set[str] = set()
        self._reported_truncations: set[str] = set()
        self._warned = {"apex in line": False, "nothing sampled": False, "graph backward": False,
                        "nothing recorded": False, "torch.func": False}
        self._gradient_marks: list[tuple[int, int]] = []  # at the last factor step (_current_gradient_marks)
        self._checked_capture = False
        self._warned_bias: set[str] = set()  # blocks warned about a bias frozen or unfrozen after construction
        # Per K-FAC parameter (blocks in order): steps whose direction was non-finite (counted by the
        # KL clip, step_length.KLClip, left out of ν), on the device; and per block, how many were reported.
        self.nonfinite_directions = torch.zeros(len(self.parameters()), dtype=torch.int64, device=device)
        self._reported_nonfinite = [0] * len(self.blocks)
        self.arm()

    def _check_method_state_is_local(self, runtime: RuntimeConfig) -> None:
        """A stateful method (``EigenAdam``) keeps each block's state where the block is
        preconditioned: on every rank only when every rank preconditions every layer."""
        if not self.method.stateful:
            return
        if (self.sharding.active and self.sharding.plan.broadcasts_gradients) or self.sharding.row_sharded is not None:
            raise ValueError(
                f"method={self.method!r} keeps per-layer state on the ranks that precondition a layer, so it needs "
                f"every rank to precondition every layer: RuntimeConfig(grad_worker_fraction=1) and no FSDP2-sharded "
                f"layers (got RuntimeConfig.grad_worker_fraction={runtime.grad_worker_fraction!r})"
            )

    def _warn_about_discovery(self, trainable: set[Tensor]) -> None:
        """The one-time notes about the layers found: none, declined ones, too few weights
        preconditioned (under :data:`COVERAGE_WARNING`), sequence-first, costly factors."""
        note = sequence_first_note(self.blocks)
        if note is not None:
            warn_user(note)
        if not self.blocks:
            kinds = ", ".join(sorted({t.__name__ for t in layers.registered_blocks()}))
            warn_user(
                f"model has no supported layer to precondition (registered kinds: {kinds}; see KFAC.describe()): "
                "KFAC behaves as SGD",
            )
        reports = self.reports(trainable)
        unsupported = [r for r in reports if r.status == "unsupported"]
        if unsupported:
            warn_user(
                f"{len(unsupported)} layer(s) of registered kinds take the SGD path: "
                + "; ".join(f"{r.name}: {r.detail}" for r in unsupported)
            )
        covered, total = self.coverage(trainable)
        if self.blocks and total and covered < COVERAGE_WARNING * total:
            warn_user(self._coverage_note(trainable, reports, covered, total))
        large = [f"{block.name}.{name} ({factor.dim})" for block in self.blocks for name, factor in block.factors.items()
                 if factor.dim >= LARGE_FACTOR_DIM and not self.method.capped(factor)]  # capped: O(n²·rank)
        if large:
            logger.warning("K-FAC factors of dim >= %d take seconds each to decompose on a CPU at full rank "
                           "(rank-deficient ones, e.g. of convs on small feature maps, far less): %s; see "
                           "inv_update_steps, AsyncConfig and skip_layers (docs/design.md §4)",
                           LARGE_FACTOR_DIM, ", ".join(large))

    def _coverage_note(self, trainable: set[Tensor], reports: list[ModuleReport], covered: int, total: int) -> str:
        """The coverage warning: the share, the largest modules without a block, how to register one."""
        modules = dict(self._model.named_modules())
        sizes = []
        for report in reports:
            module = modules.get(report.name)
            if report.block is not None or module is None:
                continue
            size = sum(p.numel() for p in module.parameters(recurse=False)
                       if p in trainable and p.requires_grad and p.dim() >= 2)
            if size:
                sizes.append((size, report))
        largest = sorted(sizes, key=lambda item: -item[0])[:3]
        named = "; ".join(f"'{r.name}' ({r.kind}, {size} elements: {r.status})" for size, r in largest)
        return (f"K-FAC preconditions {covered}/{total} ({covered / total:.1%}) of the trainable weight-matrix "
                f"elements, under {COVERAGE_WARNING:.0%}: the rest take SGD's update. Largest without a block: {named}. "
                "A layer type gets K-FAC with kfac_optim.register_block(LayerType, BlockClass) (a KroneckerBlock "
                "subclass; docs/api.md, 'Block registry'); KFAC.describe() lists every module")

    def coverage(self, trainable: set[Tensor]) -> tuple[int, int]:
        """``(preconditioned, total)`` elements of the weight matrices (parameters of 2+ dims) among
        ``trainable`` that require grad now; preconditioned: held by a :meth:`preconditioning_blocks` block."""
        preconditioned = {p for block in self.preconditioning_blocks() for p in block.parameters()}
        matrices = [p for p in trainable if p.requires_grad and p.dim() >= 2]
        return sum(p.numel() for p in matrices if p in preconditioned), sum(p.numel() for p in matrices)

    def preconditioning_blocks(self) -> list[KroneckerBlock]:
        """The blocks that precondition now: not left to SGD (``sgd_reason``), their module still in the model."""
        modules = set(self._model.modules())
        return [block for block in self.blocks if block.sgd_reason is None and block.module in modules]

    def reports(self, trainable: set[Tensor]) -> list[ModuleReport]:
        """What happens now to every module's parameters among ``trainable`` (``KFAC.module_reports``):
        from the model and the blocks as they are at the call (``layers.registry.Discovery``)."""
        return self.discovery.reports(self._model, trainable)

    def parameters(self) -> list[Tensor]:
        """The blocks' parameters, in block order (the order of :attr:`nonfinite_directions`)."""
        return [param for block in self.blocks for param in block.parameters()]

    # -- schedules ---------------------------------------------------------------------------

    def damping_at(self, step: int) -> float:
        return self.damping.at(step)

    def folding_blocks(self, step: int) -> list[KroneckerBlock]:
        """The blocks that capture for and fold at ``step``: all on factor steps, or their phase's."""
        if self._stagger is not None and self._stagger.ready:
            return self._stagger.blocks_at(step, self.intervals.factor_interval(step))
        return self.blocks if self.intervals.is_factor_step(step) else []

    def is_inverse_step(self, step: int) -> bool:
        return self.intervals.is_inverse_step(step)

    def arm(self) -> None:
        """Let the hooks capture for the coming step when it is a factor step (for its layers)."""
        step = self.steps
        if self._stagger is not None and self._stagger.ready:
            only = self._stagger.modules_at(step, self.intervals.factor_interval(step))
            self.capture.arm(bool(only), only)
        else:
            self.capture.arm(bool(self.blocks) and self.intervals.captures_at(step))

    def advance(self) -> None:
        """Count a step and arm the hooks for the next one."""
        self.intervals.step_ended(self.steps)
        self.steps += 1
        self.arm()

    # -- statistics --------------------------------------------------------------------------

    def discard_pending_statistics(self) -> None:
        """Forget statistics captured since the last step (e.g. of a step that will not happen)."""
        if self._statistics is None:
            clear_pending(self.blocks)
        elif self.capture.recorded:  # after the worker's work on them (in order)
            self._statistics.submit(clear_pending, self.blocks)
        self.capture.forget()

    def settle_statistics(self) -> None:
        """With ``async_statistics``: wait until the worker has run everything submitted, so that
        the factors and pending statistics may be read here (a no-op otherwise)."""
        if self._statistics is not None:
            self._statistics.wait()
            self._last_fold = None

    def synchronize_factors(self, caller: str) -> None:
        """Make the running factors global now (a collective when a factor step happened since)."""
        self.settle_statistics()
        self.sharding.synchronize_factors(caller, confirm=True)

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
        loss = fisher_lib.sampled_loss(outputs, likelihood, generator)
        recorded_before = self.capture.recorded
        with self.capture.recording_outputs() as layer_outputs:
            if layer_outputs:  # back-propagate exactly as far as the hooked layer outputs
                torch.autograd.grad(loss, layer_outputs, retain_graph=True, allow_unused=True)
        if self.capture.recorded == recorded_before and not self._warned["nothing sampled"]:
            warn_user(
                "sample_fisher recorded no statistics: no K-FAC layer's output on the path to `outputs` was "
                "captured (reentrant torch.utils.checkpoint hides its layers from this pass; use "
                "use_reentrant=False); the factors are not updated",
                RuntimeWarning,
            )
            self._warned["nothing sampled"] = True

    # -- factors and decompositions ----------------------------------------------------------

    def update_curvature(self, statistics_scale: float | Tensor) -> None:
        """Fold the statistics on factor steps, refresh the decompositions on decomposition steps.

        Every K-FAC collective of a step with ``grad_worker_fraction=1`` happens here, so a rank
        that ran out of inputs under ``Join`` runs it too (:meth:`shadow_step`).
        """
        step, damping = self.steps, self.damping_at(self.steps)
        self.capture.flush()  # pairs held for a backward that kept its graph (capture.py)
        self.capture.drop_without_gradient()
        self.intervals.begin_step(step, self._average_costs, self._counted_costs)  # "auto": decide when undecided
        if self.sharding.decompositions_missing:  # a loaded checkpoint lacks some: from its factors
            self._decomposition_step(damping, only_missing=True)
        folding = self.folding_blocks(step)
        if folding:
            self._fold(folding, statistics_scale)
        else:
            self.discard_pending_statistics()  # a no-op when nothing was captured
        if self.is_inverse_step(step):
            self._warn_about_bias_changes()
            with self.intervals.timing_decomposition(step):
                self._decomposition_step(damping)
        elif self.adopt_at == step:  # AsyncConfig.delay: adopt the round in flight, the same step on every rank
            self._adopt_background_round()
            self.sharding.share_decompositions(self.method, self.options.curvature.inv_dtype)
        if self._statistics is not None:  # after any wait for the worker above
            self._report_statistics_worker()

    def _counted_costs(self) -> StepCosts | None:
        """The default automatic intervals' costs, counted from the blocks' shapes and the rows they
        captured since the last step (``kfac_optim.costs``; None: none captured). The same on every
        rank whose batch has the same shape, so no collective decides them."""
        self.settle_statistics()  # async_statistics: the rows are counted on the worker
        return model_costs(self.blocks, self.method.decomposition_cost, self.method.precondition_cost)

    def _average_costs(self, costs: list[float]) -> list[float]:
        """The calibration's costs summed over ranks (one all-reduce, at the same step on every rank)."""
        return self.sharding.sum_over_ranks(costs, "the automatic intervals' cost all-reduce")

    def shadow_step(self) -> None:
        """A joined rank's part in one step of the others (``distributed/join.py``): count it, fold
        nothing, and run the decomposition step's collectives (and decompositions) when it is one."""
        self.update_curvature(1.0)
        self.advance()

    def _fold(self, folding: list[KroneckerBlock], statistics_scale: float | Tensor) -> None:
        """A factor step's fold of ``folding``'s statistics, in line or on the statistics worker."""
        self._check_something_was_recorded()
        curvature = self.options.curvature
        if not self._checked_capture or (self._stagger is not None and not self._stagger.ready):
            self.settle_statistics()  # the one-time checks below read the pending statistics
        if not self._checked_capture:
            self._warn_about_silent_blocks()
            self._leave_batch_free_blocks_to_sgd()
        if self._stagger is not None and not self._stagger.ready:
            self._assign_stagger_phases()
        with record_function("kfac.fold"):
            fold = (self.blocks, folding, curvature.factor_decay, curvature.reduction, statistics_scale)
            if self._statistics is None or self._precision.under_apex():
                self.settle_statistics()
                fold_statistics(*fold)
            else:  # after the previous factor step's (at most one in flight), then this one's
                if self._last_fold is not None:
                    self._statistics.wait(self._last_fold)
                self._last_fold = self._statistics.submit(fold_statistics, *fold)
            self.capture.forget()
        self.sharding.factors_folded()

    def _report_statistics_worker(self) -> None:
        """With ``async_statistics``: warn once about pairs the worker dropped because their tensors
        were modified in place before it read them, and about Apex keeping the statistics in line."""
        overwritten = self.capture.overwritten.copy() - self._reported_overwritten
        if overwritten:
            self._reported_overwritten |= overwritten
            warn_user(
                f"K-FAC layer(s) {sorted(overwritten)}: an input or output-gradient was modified in place before "
                "the statistics worker (RuntimeConfig(async_statistics=True)) read it (e.g. an input buffer refilled "
                "in place); those statistics were dropped. Hand the model fresh tensors, or use "
                "RuntimeConfig(async_statistics=False)",
                RuntimeWarning,
            )
        if not self._warned["apex in line"] and self._precision.under_apex():
            self._warned["apex in line"] = True
            warn_user(
                "RuntimeConfig(async_statistics=True) does not apply under Apex amp (its loss scale is read during the "
                "backward pass): the statistics are computed in line"
            )

    def _assign_stagger_phases(self) -> None:
        """At an all-block factor step: fix the stagger phases from the statistics costs summed
        over ranks (a collective, also in Join's shadow step), once some rank recorded statistics."""
        assert self._stagger is not None
        costs = self.sharding.sum_over_ranks(self._stagger.unit_costs(), "the stagger phases' cost all-reduce")
        if sum(costs) > 0:
            self._stagger.set_costs(costs)
            logger.debug("stagger phases for interval %s: %s", self.options.factor_update_steps,
                         dict(zip(self._stagger.names, costs, strict=True)))

    def _warn_about_silent_blocks(self) -> None:
        """At the first factor step with any statistics: warn once about blocks whose hooks never
        fired (e.g. a layer called functionally, or whose output never reached the loss). Frozen
        blocks (their weight ``requires_grad=False``) record nothing by design and are left out."""
        active = [block for block in self.blocks if not block.frozen]
        silent = [block.name for block in active if block.pending_samples == 0]
        if len(silent) == len(active):
            return  # no statistics at all (a skipped backward, a torch.func loop): ask again next time
        self._checked_capture = True
        if silent:
            warn_user(
                f"K-FAC layer(s) {silent} produced no statistics at the first factor step (their hooks never "
                "fired: a layer called through its parameters rather than its forward, or whose output does "
                "not reach the loss); they take the SGD path until they do",
                RuntimeWarning,
            )

    def _leave_batch_free_blocks_to_sgd(self) -> None:
        """At the first factor step with statistics: layers whose input has no batch dimension take
        the SGD path (``batch_free``; :meth:`reports` says why, from ``KroneckerBlock.sgd_reason``)."""
        batch_free.leave_batch_free_blocks_to_sgd(self.blocks)

    def _warn_about_bias_changes(self) -> None:
        """Once per block: its bias was frozen or unfrozen after construction, which fixed whether the
        block holds it (``KroneckerBlock.create``). Attribute reads only (decomposition steps)."""
        for block in self.blocks:
            if block.name in self._warned_bias:
                continue
            if block.bias is not None and block.weight.requires_grad and not block.bias.requires_grad:
                what = ("its bias was frozen after KFAC was built: the weight is still preconditioned with the joint "
                        "[W | b] factors, not as with bias=False; freeze the bias before building KFAC for that")
            elif block.frozen_bias is not None and block.frozen_bias.requires_grad:
                what = ("its bias, frozen when KFAC was built and so left out of the block (bias=False's), was "
                        "unfrozen: it takes the SGD path; build a new KFAC to precondition it with the weight")
            else:
                continue
            self._warned_bias.add(block.name)
            warn_user(f"K-FAC layer '{block.name}': {what}")

    def _check_something_was_recorded(self) -> None:
        """Warn once when forwards ran inside a ``torch.func`` transform (not hooked), once when every
        backward of a factor step ran with ``create_graph=True`` (not recorded), and once when no
        output-gradient reached the hooks although the layers have gradients."""
        transformed, self.capture.transformed_skipped = self.capture.transformed_skipped, False
        if transformed and not self._warned["torch.func"]:
            warn_user(
                "K-FAC layers ran inside a torch.func transform (torch.func.grad, vjp, vmap, ...): its gradients "
                "never reach K-FAC's hooks, so those forwards add no statistics: the factors stay as they are "
                "(none yet: the step is SGD's); compute the gradients with "
                "loss.backward() for K-FAC to precondition them",
                RuntimeWarning,
            )
            self._warned["torch.func"] = True
        skipped, self.capture.graph_backward_skipped = self.capture.graph_backward_skipped, False
        arrivals, self.capture.arrivals = self.capture.arrivals, 0
        marks, self._gradient_marks = self._gradient_marks, self._current_gradient_marks()
        if self.capture.recorded:
            return
        if skipped and not self._warned["graph backward"]:
            warn_user(
                "every backward since the last step ran with create_graph=True: K-FAC records the "
                "output-gradients of the backward that produces .grad without create_graph (e.g. the "
                "final backward of a gradient penalty), so the factors were not updated on this step",
                RuntimeWarning,
            )
            self._warned["graph backward"] = True
        elif not arrivals and not transformed and not self._warned["nothing recorded"] and self.capture.active and (
            self._gradient_marks and self._gradient_marks != marks  # a backward wrote gradients since
        ):
            warn_user(
                "K-FAC recorded no statistics on this factor step: no output-gradient reached its hooks although "
                "its layers have gradients, so the factors were not updated. A model compiled with torch.compile "
                "and run before KFAC was created keeps the graphs traced without K-FAC's hooks (Dynamo does not "
                "guard on module hooks): create KFAC before the first compiled call, or call torch._dynamo.reset() "
                "after creating it (docs/design.md §4, 'Compiled models')",
                RuntimeWarning,
            )
            self._warned["nothing recorded"] = True

    def _current_gradient_marks(self) -> list[tuple[int, int]]:
        """Which gradient tensors the training blocks' weights hold, and their versions (no tensor
        is read): a change between factor steps means a backward wrote gradients in between."""
        return [(id(grad), grad._version) for block in self.blocks if (grad := block.weight.grad) is not None]

    def _decomposition_step(self, damping: float, only_missing: bool = False) -> None:
        """Make the factors global (lazy reduction), decompose what this rank owns, share them.

        With ``AsyncConfig``: first adopt the round the worker was given at the previous
        decomposition step (waiting for it if needed), then decompose in line only the factors
        that have no decomposition yet, share, and hand the rest to the worker as snapshots.
        """
        self.settle_statistics()
        with record_function("kfac.reduce_factors"):
            self.sharding.synchronize_factors()
        if self.background is not None and not only_missing:
            self._adopt_background_round()
        self._update_decompositions(damping, only_missing)
        with record_function("kfac.share_decompositions"):
            self.sharding.share_decompositions(self.method, self.options.curvature.inv_dtype)

    def _adopt_background_round(self) -> None:
        """Hold the decompositions of the worker's round (reporting the ones that failed)."""
        assert self.background is not None
        self.adopt_at = None
        self.adopt(self.background.collect())

    def adopt(self, results: list[tuple[Job, Result]]) -> None:
        """Hold each job's decomposition (None: report that it failed)."""
        for job, result in results:
            block, name = job.owner
            if result is None:
                self._report_failure(block, name)
            else:
                block.factors[name].adopt(result, job.method.keyed_shift(job.shift), job.version)
                self._report_truncation(block, name)

    def _report_truncation(self, block: KroneckerBlock, name: str) -> None:
        """Log (INFO, once per factor) the first decomposition of factor ``name`` of ``block`` that
        the eigenbasis cap truncated (``methods.Eigen``'s ``max_rank``): its rank and ``σ``. One host
        sync per decomposition of a capped factor until then."""
        decomposition = block.factors[name].decomposition
        key = f"{block.name}.{name}"
        if key in self._reported_truncations or not isinstance(decomposition, linalg.Eigen) \
                or decomposition.complement is None:
            return
        sigma = float(decomposition.complement)
        if sigma > 0:
            self._reported_truncations.add(key)
            logger.info("K-FAC layer '%s': %s (dim %d) truncated by the eigenbasis cap to its %d leading eigenpairs, "
                        "the other directions at their mean eigenvalue %.3g", block.name, name,
                        block.factors[name].dim, decomposition.Q.shape[-1], sigma)

    def _report_failure(self, block: KroneckerBlock, name: str) -> None:
        """One warning for a failed decomposition of factor ``name`` of ``block``."""
        block.failures += 1
        kept = (
            "its last good decomposition is kept"
            if block.factors[name].decomposition is not None
            else "it has no decomposition yet, so the layer takes the SGD direction until one succeeds"
        )
        warn_user(
            f"K-FAC layer '{block.name}': the {self.method.name} decomposition of {name} failed, float64 "
            f"retry included ({block.failures} failure(s) so far); {kept}",
            RuntimeWarning,
        )

    @record_function("kfac.decompose")
    def _update_decompositions(self, damping: float, only_missing: bool = False) -> None:
        """Refresh the decompositions of the initialized factors this rank owns (every factor on
        one process; with ``only_missing`` only those without one); report discards and failures.
        With ``AsyncConfig``, factors that hold a decomposition go to the worker."""
        method, inv_dtype = self.method, self.options.curvature.inv_dtype
        jobs: list[Job] = []
        factors = [(block, name, factor) for block in self.blocks for name, factor in block.factors.items()]
        if not factors:
            return
        # One host sync per decomposition step for the device-side health flags.
        flags = torch.cat(
            [torch.stack([f.initialized.long(), f.discarded]) for _, _, f in factors] + [self.nonfinite_directions]
        ).tolist()
        health = [flags[2 * i : 2 * i + 2] for i in range(len(factors))]
        self._report_nonfinite_directions(flags[2 * len(factors) :])
        for (block, name, factor), (initialized, discarded) in zip(factors, health):
            if discarded > factor.reported_discards:
                warn_user(
                    f"K-FAC layer '{block.name}': {discarded - factor.reported_discards} non-finite "
                    f"batch(es) of {name} statistics discarded; the factor keeps its previous value",
                    RuntimeWarning,
                )
                factor.reported_discards = discarded
            if not initialized or not self.sharding.decomposes(block.name, name):
                continue
            if only_missing and factor.decomposition is not None:
                continue
            shift = block.shifts(method, damping)[name]
            if not factor.needs_decomposition(method, shift):
                continue
            drop_below = block.rank_thresholds(method, damping)[name]
            if self.background is not None and factor.decomposition is not None and not only_missing:
                jobs.append(Job((block, name), factor.snapshot(), factor.version, method, shift, inv_dtype, drop_below))
            elif not factor.decompose(method, shift, inv_dtype, drop_below):
                self._report_failure(block, name)
            else:
                self._report_truncation(block, name)
        if self.background is not None:
            self.background.submit(jobs)
            # On every rank, jobs or not: the adopt step shares decompositions (a collective). When
            # no rank had a job (e.g. step 0, all in line) that exchange resends what receivers hold.
            delay = self.options.asynchronous.delay if self.options.asynchronous is not None else None
            if not only_missing and delay is not None:
                self.adopt_at = self.steps + delay

    def _report_nonfinite_directions(self, parameter_counts: list[int]) -> None:
        """Warn about layers whose direction was non-finite since the last report (see the KL clip)."""
        counts = iter(parameter_counts)
        for index, block in enumerate(self.blocks):
            count = max(next(counts) for _ in block.parameters())  # a layer's parameters fail together
            if count > self._reported_nonfinite[index]:
                warn_user(
                    f"K-FAC layer '{block.name}': {count - self._reported_nonfinite[index]} step(s) with a "
                    "non-finite gradient; that layer's update was non-finite and it was left out of the KL "
                    "clip, so the other layers were not affected",
                    RuntimeWarning,
                )
                self._reported_nonfinite[index] = count

    def restore(self, steps: int, saved: dict[str, dict], results: list[tuple[Job, Result]],
                adopt_at: int | None, round_saved: bool, intervals: dict | None = None,
                damping: dict | None = None) -> None:
        """Load validated blocks (``checkpoint.py``), the chosen automatic intervals (None: none
        chosen, calibrate from the next step), ``AdaptiveDamping``'s state (None: none saved) and
        the results of a saved round in flight.

        With ``AsyncConfig`` the round is held and adopted at its saved step (``adopt_at``), as in
        the run that saved it (the results of the factors this rank decomposes). Without, it is
        adopted at once: a synchronous run holds the newest decompositions it has, and refreshes
        them all at its next decomposition step anyway."""
        self.settle_statistics()  # work in flight writes into the factors being replaced
        if self.background is not None:  # a round in flight decomposes the factors being replaced
            self.background.close()
            self.adopt_at = None
        self.steps = int(steps)
        self.intervals.load_state_dict(intervals, self.steps)
        self.damping.load_state_dict(damping)
        for block in self.blocks:
            if block.name in saved:
                block.load_state_dict(saved[block.name], self.method)
        if self.background is None:
            self.adopt(results)
        elif round_saved:
            decomposes = self.sharding.decomposes
            self.background.hold([(job, r) for job, r in results if decomposes(job.owner[0].name, job.owner[1])])
            self.adopt_at = adopt_at  # on every rank alike, as it decides a collective
        self.sharding.loaded()
        self.arm()

    # -- preconditioning ---------------------------------------------------------------------

    def precondition(self) -> dict[Tensor, Tensor]:
        """Per-parameter update directions of the blocks that have a decomposition, at this step's damping
        (timed on the steps the automatic intervals measure).

        Under FSDP2 a direction is a ``DTensor`` laid out as its parameter (this rank's rows).
        """
        with self.intervals.timing_precondition(self.steps):
            return self._precondition()

    @record_function("kfac.precondition")
    def _precondition(self) -> dict[Tensor, Tensor]:
        damping, inv_dtype = self.damping_at(self.steps), self.options.curvature.inv_dtype
        joint: dict[str, Tensor] = {}
        sharded_rows: dict[str, Tensor] = {}
        for block in self.blocks:
            if self.sharding.is_row_sharded(block.name):
                rows = fsdp.gradient_rows(block.parameters())
                if rows is not None:
                    sharded_rows[block.name] = rows
                continue
            grad = block.grad_matrix()
            if grad is None:
                continue
            preconditioned = block.precondition(grad, self.method, damping)
            if preconditioned is not None:
                joint[block.name] = preconditioned
        with record_function("kfac.share_directions"):
            joint = self.sharding.share_directions(joint, inv_dtype)
        directions: dict[Tensor, Tensor] = {}
        for block in self.blocks:
            if block.name in joint:
                directions.update(block.split(joint[block.name]))
        if sharded_rows:
            directions.update(self._precondition_rows(sharded_rows, damping))
        return directions

    def _precondition_rows(self, sharded_rows: dict[str, Tensor], damping: float) -> dict[Tensor, Tensor]:
        """FSDP2's row path: the directions of row-sharded blocks from their gradients' local rows."""
        by_name = {block.name: block for block in self.blocks}

        def precondition(name: str, whole: Tensor) -> Tensor:
            """The block's direction as its parameters' row matrix, from its whole gradients'."""
            block = by_name[name]
            weight_grad, *bias_grad = fsdp.split_rows(whole, block.parameters())
            grad = block.joint_gradient(weight_grad, bias_grad[0] if bias_grad else None)
            direction = block.precondition(grad, self.method, damping)
            assert direction is not None, f"{name}: preconditioned where its decompositions are missing"
            return fsdp.join_rows([part for _, part in block.split(direction)])

        with record_function("kfac.fsdp_rows"):
            rows_of = self.sharding.precondition_sharded(sharded_rows, precondition, self.options.curvature.inv_dtype)
        directions: dict[Tensor, Tensor] = {}
        for name, rows in rows_of.items():
            params = by_name[name].parameters()
            for param, direction in zip(params, fsdp.split_rows(rows, params), strict=True):
                directions[param] = fsdp.like_param(param, direction.to(param.dtype).contiguous())
        return directions

    def memory_usage(self) -> dict[str, int]:
        """Bytes of K-FAC state on this rank, by category, and their ``"total"``.

        ``"factors"``: running A and G of every layer as allocated (every rank keeps all of them; a
        layer frozen since construction allocates its factors when it first records, ``Factor.allocated``);
        ``"pending"``: the buffers statistics are captured into (allocated likewise); ``"decompositions"``: the
        eigendecompositions or inverses this rank holds (all layers with ``f = 1``, about
        ``f`` of them otherwise); ``"sharded_preconditioning"``: under FSDP2, the most this rank
        holds at once while preconditioning sharded layers (gathered gradient rows and one whole
        gradient and direction; 0 without sharded layers). Momentum buffers are SGD's and not counted.
        """
        factors = [factor for block in self.blocks for factor in block.factors.values()]
        held = [factor.held_bytes() for factor in factors]  # 0 for a frozen layer's factors never used
        row_sharded = self.sharding.row_sharded
        itemsize = torch.empty((), dtype=self.options.curvature.inv_dtype).element_size()
        usage = {
            "factors": sum(running for running, _ in held),
            "pending": sum(pending for _, pending in held),
            "decompositions": sum(self.method.decomposer.nbytes(f.decomposition) for f in factors),
            "sharded_preconditioning": 0 if row_sharded is None else row_sharded.peak_bytes(itemsize),
        }
        usage["total"] = sum(usage.values())
        return usage

    def describe(self, trainable: set[Tensor]) -> str:
        """:meth:`KFAC.describe`, given the optimizer's parameters (``trainable``), from the state now:
        the share counts the weight matrices that require grad, those of blocks left to SGD excluded."""
        covered, total = self.coverage(trainable)
        share = covered / total if total else 1.0
        frozen = {block.name for block in self.blocks if block.frozen}
        preconditioning = len(self.preconditioning_blocks())
        lines = [
            f"KFAC ({self.method.name}): {preconditioning} blocks precondition {covered}/{total} "
            f"weight-matrix elements ({share:.1%})",
            *(f"  {report}{FROZEN_NOTE if report.block in frozen else ''}" for report in self.reports(trainable)),
        ]
        approximations = self.method.approximations([(block.name, block.A, block.G) for block in self.blocks])
        if approximations is not None:
            lines.append(approximations)
        lines.append(self.intervals.describe())
        return "\n".join(lines)
