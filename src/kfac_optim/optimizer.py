"""``KFAC``: a ``torch.optim.Optimizer`` whose ``step()`` is the whole K-FAC update.

Owns: the ``torch.optim`` contract (param groups, SGD's arguments, ``state``) and the order of work
inside ``step()``.
Delegates: the curvature (blocks, statistics, factors, decompositions, preconditioning) to a
``KroneckerEstimator`` (``estimator/``); the step's length (KL clip, graft or none) to a
``StepLength`` (``update/step_length.py``); Adam's step outside K-FAC to ``update/grafting.py``;
SGD's update to ``update/sgd.py``; the read-only views to ``optimizer_views.py``; settings to
``config.py``; checkpoints to ``checkpoint.py``; loss scaling to ``precision.py``; ``Join`` to
``distributed/join.py``.

One step, for every K-FAC layer with joint weight ``W = [W | b]`` and gradient ``∇W``
(docs/design.md §4 and §4.1; ``k`` is the step counter, ``λ`` the damping at ``k``)::

    if GradScaler found inf/nan:         drop this backward's statistics, return
    ∇ ← ∇ / s under GradScaler;          batch G ← batch G / s²                    (loss scale s)
    if k % factor_update_steps(k) == 0:  A, G ← decay·(A, G) + (1 − decay)·(batch A, batch G)
    if k % decomposition_update_steps(k) == 0:     refresh the decompositions of A and G (the method's)
    V   = (G ⊗ A + λI)⁻¹ ∇W                               (per layer, as the method applies it)
    ν   = Σ lr‖∇W‖² / Σ lr⟨V, ∇W⟩, at most sqrt(kl_clip / |Σ lr² ⟨V, ∇W⟩|)   (UpdateConfig)
    d   = ν·V  for K-FAC parameters,  ∇p  (or Adam's step, by the method) for every other one
    UpdateConfig.decoupled_weight_decay:  p ← p·(1 − lr·weight_decay), and SGD's decay is 0
    then exactly torch.optim.SGD on d: weight decay, momentum/dampening/nesterov, p ← p − lr·d
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.distributed.algorithms.join import Joinable, JoinHook
from torch.optim.optimizer import Optimizer, ParamsT
from torch.profiler import record_function

from kfac_optim import checkpoint
from kfac_optim import fisher as fisher_lib
from kfac_optim.config import (
    AsyncConfig,
    CurvatureConfig,
    Damping,
    IntSchedule,
    KFACOptions,
    RuntimeConfig,
    UpdateConfig,
    check_hyperparameter,
)
from kfac_optim.distributed.join import JoinSupport
from kfac_optim.estimator.estimator import LARGE_FACTOR_DIM, KroneckerEstimator, block_dims, unwrap_model
from kfac_optim.layers import discover_blocks
from kfac_optim.layers.positions import RealPositions
from kfac_optim.methods import Method, method_named
from kfac_optim.optimizer_views import KFACViews
from kfac_optim.precision import MixedPrecision
from kfac_optim.update.adam import outside_kfac_for
from kfac_optim.update.sgd import sgd_update
from kfac_optim.update.step_length import StepLength, TrustRegion, step_length_for

__all__ = ["KFAC", "LARGE_FACTOR_DIM", "block_dims", "discover_blocks"]

logger = logging.getLogger(__name__)


class KFAC(KFACViews, Optimizer, Joinable):
    """K-FAC natural-gradient descent with SGD's update rule, as one optimizer.

    Replaces ``torch.optim.SGD(model.parameters(), lr, momentum, dampening, weight_decay,
    nesterov)`` by ``KFAC(model, lr, momentum, dampening, weight_decay, nesterov, ...)``. Layers
    of registered kinds (``nn.Linear``, ``nn.Conv1d/2d/3d``, ``nn.Embedding``,
    ``nn.MultiheadAttention``, and any added with ``kfac_optim.register_block`` or
    ``CurvatureConfig(blocks=...)``) are preconditioned by their Kronecker-factored Fisher; every
    other parameter follows SGD exactly (:meth:`describe` lists which is which).

    Args:
        model: the model being trained (plain or wrapped in DistributedDataParallel); hooks are
            registered on its supported layers.
        lr, momentum, dampening, weight_decay, nesterov, maximize, foreach: as torch.optim.SGD.
        params: param groups; default: every parameter of ``model`` in one group, frozen ones
            (``requires_grad=False``) included, as ``SGD(model.parameters())``: their layers get blocks
            at once, record nothing while frozen (their factors are allocated when they first record),
            and train (preconditioned) once unfrozen. A bias frozen while its weight trains leaves the
            block of ``bias=False``. A
            list given here means only these parameters (``describe()`` lists the frozen layers).
            Parameters outside ``model`` (a loss's temperature) take the SGD path (:meth:`describe`).
        damping: λ, a float > 0, a callable ``step -> float``, or a
            ``kfac_optim.AdaptiveDamping``: λ adapted every few steps by Levenberg–Marquardt from
            the reduction ratio of the quadratic model; it needs ``step(closure)`` (docs/api.md
            "Adaptive damping").
        kl_clip: bound on the KL-divergence estimate of the applied step ``lr·ν·V``: below it the
            step promises SGD's first-order decrease at the lr, so the lr sets it as SGD's
            (``UpdateConfig.trust_region``); None: K-FAC's directions unscaled.
        factor_update_steps: fold statistics every this many steps (int ≥ 1 or callable), or
            "auto" (default) / a ``kfac_optim.schedule.intervals.AutoIntervals``: chosen from the cost
            counted from the layers' and the first batch's shapes, reproducible; a
            ``MeasuredIntervals`` times the first steps instead (docs/api.md "Automatic intervals").
        decomposition_update_steps: refresh decompositions every this many steps (int ≥ 1, callable, "auto").
        method: "eigen" (exact damping of ``G ⊗ A``) or "inverse" (π-factored damping), or a
            ``kfac_optim.Method`` instance.
        curvature: :class:`~kfac_optim.config.CurvatureConfig`: the Fisher's kind, loss reduction,
            weight sharing, factor decay, staggering, dtypes, skipped layers, block overrides.
        asynchronous: :class:`~kfac_optim.config.AsyncConfig`: decompositions on a background
            worker (None: in line).
        runtime: :class:`~kfac_optim.config.RuntimeConfig`: process group, distributed strategy,
            GradScaler, the statistics thread.
        update: :class:`~kfac_optim.config.UpdateConfig`: how directions become the step: the
            trust region's base lr, decoupled weight decay, grafting.

    Mixed precision: ``scaler.step(optimizer)`` with a ``torch.amp.GradScaler`` skips the whole
    step on inf/nan gradients (factors, momentum, step count and parameters untouched) and
    otherwise unscales the gradients here; under NVIDIA Apex amp (O1/O2) pass the optimizer
    through ``amp.initialize`` as any other.
    """

    # torch.amp.GradScaler.step: call step() with ``grad_scale``/``found_inf`` set, unscaling left to us.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        model: nn.Module,
        lr: float | Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        params: ParamsT | None = None,
        maximize: bool = False,
        foreach: bool | None = None,
        damping: Damping = KFACOptions.damping,
        kl_clip: float | None = KFACOptions.kl_clip,
        factor_update_steps: IntSchedule = KFACOptions.factor_update_steps,
        decomposition_update_steps: IntSchedule = KFACOptions.decomposition_update_steps,
        method: Literal["eigen", "inverse", "eigen_adam", "root"] | Method = KFACOptions.method,
        curvature: CurvatureConfig | None = None,
        asynchronous: AsyncConfig | None = None,
        runtime: RuntimeConfig | None = None,
        update: UpdateConfig | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        for name, value in (("lr", lr), ("momentum", momentum), ("dampening", dampening),
                            ("weight_decay", weight_decay)):
            check_hyperparameter(name, value)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov requires momentum > 0 and dampening = 0")
        for name, value, kind in (("curvature", curvature, CurvatureConfig), ("runtime", runtime, RuntimeConfig),
                                  ("update", update, UpdateConfig)):
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"{name} must be a {kind.__name__} or None, got {type(value).__name__}")
        curvature, runtime = curvature or CurvatureConfig(), runtime or RuntimeConfig()
        self._options = KFACOptions(damping, kl_clip, factor_update_steps, decomposition_update_steps, method,
                                    curvature, asynchronous, update or UpdateConfig())
        self._trust_region = TrustRegion(self._options.kl_clip, self._options.update.trust_region)
        self.model = unwrap_model(model)
        if params is None:  # frozen ones too, as SGD(model.parameters()): a layer unfrozen later then trains
            params = list(self.model.parameters())
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach)
        super().__init__(params, defaults)
        Joinable.__init__(self)
        trainable = {p for group in self.param_groups for p in group["params"]}  # the model's and any outside it
        self._outside_adam = outside_kfac_for(
            method_named(self._options.method), self._options.update.grafting,
            self._options.update.decoupled_weight_decay, self.param_groups, self.model,
            trainable)  # checked before any hook
        self._precision = MixedPrecision(self, runtime.grad_scaler,
                                         statistics_loss_scaled=curvature.fisher == "empirical")
        self.estimator = KroneckerEstimator(self.model, trainable, self._options, runtime, self._precision)
        self._join = JoinSupport(self.estimator.strategy, self.estimator.shadow_step, self, model)
        self._checkpointing = checkpoint.Checkpointing(self, self.estimator)
        self._step_length: StepLength = step_length_for(
            self._options.update, self._options.kl_clip, self._trust_region, self.estimator.parameters,
            self.estimator.strategy, self.estimator.nonfinite_directions)
        logger.info("%s", self.describe())

    def __setstate__(self, state: dict[str, Any]) -> None:
        """``Optimizer.__setstate__`` with SGD's defaults for options older state dicts lack."""
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)

    # -- the training loop's calls -----------------------------------------------------------

    def remove_hooks(self) -> None:
        """Detach the capture hooks from the model (the optimizer then never updates factors)."""
        self.estimator.capture.remove()

    def discard_pending_statistics(self) -> None:
        """Forget statistics captured since the last step (e.g. of a step that will not happen)."""
        self.estimator.discard_pending_statistics()

    @contextlib.contextmanager
    def mask(self, mask: Tensor) -> Iterator[None]:
        """Forwards run inside count only the real positions of ``mask`` in K-FAC's statistics
        (padding): ``mask`` is bool (or 0/1 integers), True at real positions, shaped as the
        leading dims of the sequence layers' inputs, samples first (``(N, T)``: a tokenizer's
        ``attention_mask``). The backward may run after the block. One host sync per use to count
        the real positions. See docs/api.md "Sequence models"."""
        with self.estimator.capture.masked(RealPositions.of(mask)):
            yield

    @contextlib.contextmanager
    def samples(self, count: int) -> Iterator[None]:
        """The forwards run inside hold ``count`` samples: N, what the loss of their backward averages
        over (docs/numerics.md, "What N is"), for every layer, counted once however many times the
        model or its submodules are called inside. For what the model's call cannot tell: packed
        rows without ``position_ids`` or ``cu_seq_lens_*`` keywords, a model called without a tensor
        argument, submodules called outside the model's forward. Does not nest; ``KFAC.mask`` may
        be used inside or around it."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an int >= 1 (the samples the loss averages over), got {count!r}")
        with self.estimator.capture.stating(count):
            yield

    @torch.compiler.disable
    def sample_fisher(self, outputs: Tensor, likelihood: fisher_lib.Likelihood,
                      generator: torch.Generator | None = None) -> None:
        """Capture this batch's statistics at targets sampled from the model (``fisher="sampled"``),
        between the forward pass and ``loss.backward()``; see ``KroneckerEstimator.sample_fisher``."""
        self.estimator.sample_fisher(outputs, likelihood, generator)

    @torch.compiler.disable
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``Optimizer.zero_grad``; also drops statistics of backward passes no step consumed (and
        marks the coming step's start for ``MeasuredIntervals``' calibration)."""
        self.estimator.intervals.step_started(self.estimator.steps)
        self.estimator.discard_pending_statistics()
        super().zero_grad(set_to_none=set_to_none)

    # -- the step ----------------------------------------------------------------------------

    @torch.compiler.disable
    @torch.no_grad()
    @record_function("kfac.step")
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one K-FAC step (see the module docstring for the order of work).

        A ``torch.compile`` boundary (as are :meth:`zero_grad` and :meth:`sample_fisher`): a compiled
        train step runs the model compiled and this step eagerly, so its Python state (the step
        counter, the schedules, the capture's arming) advances exactly as without compile, which
        Dynamo's tracing of optimizers would drop (docs/api.md "torch.compile").
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        estimator = self.estimator
        if self._precision.skip_step():
            estimator.discard_pending_statistics()
            return loss
        params = [p for group in self.param_groups for p in group["params"]]
        maximize = any(group["maximize"] for group in self.param_groups)
        measurement = estimator.damping.begin(estimator.steps, closure, loss, params, maximize)  # AdaptiveDamping
        statistics_scale = self._precision.unscale(params)
        if statistics_scale is None:  # captured under a loss scale nobody told us
            estimator.discard_pending_statistics()
            statistics_scale = 1.0
        self._precision.bind_master_params(estimator.blocks)
        self._join.check_step(self._join_config)

        # fold on factor steps, decompose on decomposition steps
        estimator.update_curvature(statistics_scale, self._moves)
        directions = estimator.precondition()           # V = (G ⊗ A + λI)⁻¹ ∇W, by parameter
        directions = self._step_length.apply(directions, self.param_groups, self.state)  # ν·V, M·‖s‖/‖M‖ or V
        adam: dict[Tensor, Tensor] = {}
        if self._outside_adam is not None:              # eigen_adam: Adam's step for the other parameters
            adam = self._outside_adam.directions(self.param_groups, self.state, directions)
        sgd_update(self.param_groups, self.state, directions, adam,  # SGD on ν·V, or on ∇p for the others
                   self._options.update.decoupled_weight_decay)
        if measurement is not None:                     # AdaptiveDamping's step: ρ, then λ
            estimator.settle_statistics()
            measurement.finish(estimator.blocks)
        estimator.advance()
        return loss

    def _moves(self) -> bool:
        """Whether this step can move a parameter: some group's lr is not 0 (read only when a factor
        step recorded no statistics: a step at lr 0 is no evidence of hooks gone missing)."""
        return any(bool(group["lr"] != 0) for group in self.param_groups)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``Optimizer.add_param_group``; the group's lr now is also saved as its base lr,
        ``"kfac_base_lr"`` (a clone of a tensor lr), unless the group names one (docs/design.md §4.1)."""
        super().add_param_group(param_group)
        self._trust_region.add_group(self.param_groups[-1], len(self.param_groups) - 1)

    def trust_region_lr(self, group: dict[str, Any]) -> float | Tensor:
        """The lr at which the KL bound ``kl_clip`` holds for ``group`` (``UpdateConfig.trust_region``).

        "base_lr": the group's ``"kfac_base_lr"``: its lr when it was added to the optimizer (set
        it to choose; ``state_dict()`` carries it); a group loaded from a state dict of an earlier
        release gets its ``"initial_lr"`` (set by ``torch.optim.lr_scheduler``), else its lr now.
        "scheduled_lr": the group's lr. "lr_squared" (the default): 1 for every group, so ν bounds the
        direction and the applied step ``lr·ν·V`` has the KL bound ``kl_clip·lr²``.
        """
        return self._trust_region.lr(group)

    # -- NVIDIA Apex amp ---------------------------------------------------------------------

    @property
    def most_recent_scale(self) -> float:
        """Apex amp's hook into optimizers: 1.0 (``KFAC`` reads Apex's loss scale itself)."""
        return 1.0

    @most_recent_scale.setter
    def most_recent_scale(self, value: float) -> None:
        """Apex sets this exactly when it skips a step on overflow: drop that backward's statistics."""
        self.estimator.discard_pending_statistics()

    # -- checkpoints (checkpoint.py) and collectives ----------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``Optimizer.load_state_dict`` plus the ``"kfac"`` entry that ``state_dict()`` adds.

        The entry is checked after the pre hooks a user registered (keys, shapes against this
        model, finiteness): a checkpoint that does not fit raises ``ValueError`` naming the layer and
        the field, and the optimizer is left exactly as it was; see ``kfac_optim.checkpoint``.
        """
        with self._checkpointing.loading(self):
            super().load_state_dict(state_dict)

    def kfac_state_dict(self) -> dict[str, Any]:
        """The ``"kfac"`` entry of ``state_dict()``: the step, every block's factors (packed) and the
        decompositions held here by module name, and ``"round"``: the round of decompositions in
        flight under ``AsyncConfig`` (None: none; see ``docs/api.md``). Never a collective, as
        ``state_dict()``: this rank's factors (global as of the last reduction plus this rank's
        statistics since; ``kfac_optim.checkpoint``)."""
        return checkpoint.kfac_state_dict(self.estimator)

    def load_kfac_state_dict(self, kfac_state: dict[str, Any]) -> None:
        """Restore :meth:`kfac_state_dict` (the same one on every rank), checked as in
        :meth:`load_state_dict`; layers match by name."""
        checkpoint.load_kfac_state_dict(self.estimator, kfac_state)

    def kfac_state(self) -> checkpoint.KFACState:
        """K-FAC's state for ``torch.distributed.checkpoint`` (DCP), next to the model's and the
        optimizer's (``get_state_dict``, which keep only SGD's part): ``dcp.save({..., "kfac":
        optimizer.kfac_state()})``, and the same dict to ``dcp.load``; see ``kfac_optim.checkpoint``."""
        return checkpoint.KFACState(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a KFAC optimizer cannot be pickled, deep-copied or torch.save()d: it holds hooks on the model "
            "and (when distributed) process groups. Save optimizer.state_dict() instead and load it with "
            "load_state_dict() into a KFAC built on the model."
        )

    def synchronize_factors(self) -> None:
        """Make every rank's running factors the global ones now: a collective, call it on every rank.

        ``step()`` does this lazily, right before decomposition steps; calling it after every step
        gives eager reduction (the same factors). ``state_dict()`` never communicates: call this on
        every rank before it when a checkpoint taken between decomposition steps must hold every
        rank's statistics (``kfac_optim.checkpoint``). A no-op on one process and when no factor
        step happened since the last reduction.
        """
        self.estimator.synchronize_factors("KFAC.synchronize_factors()")

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """``Joinable``: the hook with which a rank that ran out of inputs takes part in the other
        ranks' K-FAC collectives; use ``Join([ddp_model, optimizer])`` (``kfac_optim.distributed.join``).

        Raises:
            ValueError: ``grad_worker_fraction < 1`` (a joined rank cannot precondition), or layers
                sharded by FSDP2 (a joined rank cannot take part in their row collectives).
        """
        return self._join.hook()

    @property
    def join_device(self) -> torch.device:
        return self._join.device

    @property
    def join_process_group(self) -> Any:
        return self._join.process_group
