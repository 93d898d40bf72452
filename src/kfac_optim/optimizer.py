"""``KFAC``: a ``torch.optim.Optimizer`` whose ``step()`` is the whole K-FAC update.

Owns: argument checks, param groups, the order of work inside ``step()``, ``state_dict``.
Delegates: capture (hooks), layers (factor math), linalg (decompositions), schedules,
precision (GradScaler and Apex loss scaling), distributed (sharding).

One step, for every K-FAC layer with joint weight ``W = [W | b]`` and gradient ``∇W``
(docs/design.md §4; ``k`` is the step counter, ``λ`` the damping at ``k``)::

    if GradScaler found inf/nan:         drop this backward's statistics, return   (see precision)
    ∇ ← ∇ / s under GradScaler;          batch G ← batch G / s²                    (loss scale s)
    if k % factor_update_steps(k) == 0:  A, G ← decay·(A, G) + (1 − decay)·(batch A, batch G)
                                         (stagger_factor_updates: per block, k % I == its phase)
                                         (batch G from the training loss, or from sample_fisher)
    if k % inv_update_steps(k) == 0:     refresh eig(A), eig(G)   (or the π-damped inverses;
                                         async_decompositions: adopt the worker's last round, start one)
    V   = (G ⊗ A + λI)⁻¹ ∇W                               (per layer)
    ν   = min(1, sqrt(kl_clip / |Σ_layers lr² ⟨V, ∇W⟩|))
    d   = ν·V  for K-FAC parameters,  ∇p  for every other parameter
    then exactly torch.optim.SGD on d: weight decay, momentum/dampening/nesterov, p ← p − lr·d
"""

from __future__ import annotations

import logging
import math
import numbers
import re
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.join import Joinable, JoinHook
from torch.optim.optimizer import Optimizer, ParamsT
from torch.optim.sgd import sgd
from torch.profiler import record_function

from kfac_optim import fisher as fisher_lib
from kfac_optim import linalg
from kfac_optim import layers
from kfac_optim.background import BackgroundDecompositions, Job, Result
from kfac_optim.capture import StatisticsCapture
from kfac_optim.checkpoint import KFACState
from kfac_optim.diagnostics import warn_user
from kfac_optim.distributed import fsdp
from kfac_optim.distributed.join import JoinSupport
from kfac_optim.distributed.sharding import Sharding
from kfac_optim.layers import ModuleReport, discover, discover_blocks
from kfac_optim.layers.attention import sequence_first_note
from kfac_optim.layers.registry import SkipLayers
from kfac_optim.methods import Method, method_named
from kfac_optim.precision import MixedPrecision
from kfac_optim.schedules import resolve
from kfac_optim.stagger import FactorStagger
from kfac_optim.statistics_worker import StatisticsWorker

logger = logging.getLogger(__name__)

IntSchedule = int | Callable[[int], int]
FloatSchedule = float | Callable[[int], float]

LARGE_FACTOR_DIM = 4096
"""Factors at least this wide take seconds to decompose on a CPU at full rank (``eigh`` is ``O(n³)``;
a rank-``r`` factor is decomposed in ``O(n²r)``, see ``linalg.symmetric_eigen``): noted once."""


@dataclass(frozen=True)
class KFACOptions:
    """The K-FAC hyperparameters (the SGD ones live in ``param_groups``), validated on creation.

    ``damping``: λ, in Fisher units of a per-sample loss (docs/design.md §3), so it keeps its meaning at
    any batch size. ``kl_clip``: the trust-region size ν is computed from (None: no clipping).
    ``factor_decay``: weight of the old factor in the running average (0: no averaging).
    ``fisher``: where G's statistics come from: "empirical" (the training loss's backward) or
    "sampled" (:meth:`KFAC.sample_fisher`'s backward at targets drawn from the model).
    ``stagger_factor_updates``: spread the blocks' factor updates over the steps of an interval
    (``kfac_optim.stagger``). ``async_decompositions`` / ``async_delay``: decompositions on a
    background worker, adopted at the next decomposition step or this many steps later (they
    change which decompositions a step uses, so every rank must agree on them).
    """

    damping: FloatSchedule = 0.1
    kl_clip: float | None = 1e-3
    factor_decay: float = 0.95
    factor_update_steps: IntSchedule = 1
    inv_update_steps: IntSchedule = 10
    method: Literal["eigen", "inverse"] | Method = "eigen"
    loss_reduction: Literal["mean", "sum"] = "mean"
    fisher: Literal["empirical", "sampled"] = "empirical"
    weight_sharing: Literal["expand", "reduce"] = "expand"
    factor_dtype: torch.dtype = torch.float32
    inv_dtype: torch.dtype = torch.float32
    stagger_factor_updates: bool = False
    async_decompositions: bool = False
    async_delay: int | None = None

    def __post_init__(self) -> None:
        for name in ("stagger_factor_updates", "async_decompositions"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.async_delay is not None and (isinstance(self.async_delay, bool) or not isinstance(self.async_delay, int)):
            raise TypeError(f"async_delay must be an int or None, got {type(self.async_delay).__name__}")
        if self.async_delay is not None and self.async_delay < 1:
            raise ValueError(f"async_delay must be >= 1, got {self.async_delay}")
        if not callable(self.damping):
            check_damping(self.damping)
        if self.kl_clip is not None and not 0 < self.kl_clip < math.inf:
            raise ValueError(f"kl_clip must be a finite number > 0 or None, got {self.kl_clip}")
        if not 0 <= self.factor_decay < 1:
            raise ValueError(f"factor_decay must be in [0, 1), got {self.factor_decay}")
        for name in ("factor_update_steps", "inv_update_steps"):
            value = getattr(self, name)
            if not callable(value):
                check_interval(name, value)
        method_named(self.method)  # ValueError naming method
        if self.loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")
        if self.weight_sharing not in ("expand", "reduce"):
            raise ValueError(f"weight_sharing must be 'expand' or 'reduce', got {self.weight_sharing!r}")
        if self.fisher not in ("empirical", "sampled"):
            raise ValueError(f"fisher must be 'empirical' or 'sampled', got {self.fisher!r}")
        for name in ("factor_dtype", "inv_dtype"):
            if getattr(self, name) not in (torch.float32, torch.float64):
                raise ValueError(f"{name} must be torch.float32 or torch.float64, got {getattr(self, name)}")


def fold_statistics(
    blocks: Sequence[layers.KroneckerBlock],
    folding: Sequence[layers.KroneckerBlock],
    decay: float,
    reduction: str,
    statistics_scale: float | Tensor,
) -> None:
    """A factor step's statistics work after the capture: fold the pending statistics of
    ``folding`` (see ``KroneckerBlock.fold``), then forget whatever the other ``blocks`` hold."""
    for block in folding:
        block.fold(decay, reduction, statistics_scale)
    clear_pending(blocks)  # a no-op for blocks that folded or captured nothing


def clear_pending(blocks: Sequence[layers.KroneckerBlock]) -> None:
    """Forget the pending statistics of ``blocks``."""
    for block in blocks:
        block.clear_pending()


def check_damping(value: float) -> float:
    if not 0 < value < math.inf:
        raise ValueError(f"damping must be a finite number > 0, got {value}")
    return value


def check_hyperparameter(name: str, value: float | Tensor, minimum: float = 0.0) -> None:
    """A finite real number (or a 1-element tensor, for ``lr``) ``>= minimum``, else an error naming it."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a float or a 1-element tensor")
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not minimum <= float(value) < math.inf:
        raise ValueError(f"{name} must be a finite number >= {minimum}, got {value}")


def check_skip_layers(skip_layers: Any) -> tuple[str | type[nn.Module], ...]:
    """``skip_layers`` as a tuple of valid full-match regexes and module types, else an error naming it."""
    if isinstance(skip_layers, (str, type)) or not isinstance(skip_layers, Sequence | set | frozenset):
        raise TypeError(
            f"skip_layers must be a sequence of name patterns or module types, got {type(skip_layers).__name__}"
        )
    for rule in skip_layers:
        if isinstance(rule, str):
            try:
                re.compile(rule)
            except re.error as error:
                raise ValueError(f"skip_layers: {rule!r} is not a valid regular expression ({error})") from None
        elif not (isinstance(rule, type) and issubclass(rule, nn.Module)):
            raise TypeError(f"skip_layers entries must be str patterns or nn.Module subclasses, got {rule!r}")
    return tuple(skip_layers)


def check_interval(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


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
    """``{module name: (dim_A, dim_G)}`` of the blocks ``KFAC(model, skip_layers=...)`` builds.

    The same discovery as the optimizer's (trainable parameters, ``skip_layers``, grouped convs
    now preconditioned too). It builds the blocks, so their factors are allocated on the model's device:
    build the model under ``torch.device("meta")`` to get the sizes without allocating anything.
    """
    model = unwrap_model(model)
    trainable = {p for p in model.parameters() if p.requires_grad}
    blocks = discover_blocks(model, trainable, skip_layers, KFACOptions.factor_dtype)
    return {block.name: (block.A.dim, block.G.dim) for block in blocks}


class KFAC(Optimizer, Joinable):
    """K-FAC natural-gradient descent with SGD's update rule, as one optimizer.

    Replaces ``torch.optim.SGD(model.parameters(), lr, momentum, dampening, weight_decay,
    nesterov)`` by ``KFAC(model, lr, momentum, dampening, weight_decay, nesterov, ...)``. Layers
    of registered kinds (``nn.Linear``, ``nn.Conv1d/2d/3d``, ``nn.Embedding``,
    ``nn.MultiheadAttention``, and any added with ``kfac_optim.register_block``) are preconditioned
    by their Kronecker-factored Fisher; every other parameter follows SGD exactly
    (:meth:`describe` lists which is which).

    Args:
        model: the model being trained (plain or wrapped in DistributedDataParallel); hooks are
            registered on its supported layers.
        lr, momentum, dampening, weight_decay, nesterov, maximize, foreach: as torch.optim.SGD.
        damping: λ, a float > 0 or a callable ``step -> float``.
        kl_clip: bound on the KL-divergence estimate of the update (None disables clipping).
        factor_decay: running-average weight of the old factors, in [0, 1).
        factor_update_steps: fold statistics every this many steps (int ≥ 1 or callable).
        stagger_factor_updates: spread the factor updates over the steps of each interval ``I``
            instead of doing all on every ``I``-th step: after the first factor step (where every
            layer folds) each layer gets a fixed phase ``p`` in ``[0, I)`` and captures and folds
            only on the steps ``k`` with ``k % I == p``, so it still updates its factors every
            ``I`` steps. Phases balance the layers' statistics cost (rows × factor size), the
            same on every rank; a callable interval gets phases per value, against the interval
            in force at each step (``kfac_optim.stagger``). Decomposition steps are unchanged.
        inv_update_steps: refresh decompositions every this many steps (int ≥ 1 or callable).
        method: "eigen" (exact damping of ``G ⊗ A``) or "inverse" (π-factored damping), or a
            ``kfac_optim.Method`` instance.
        loss_reduction: "mean" or "sum", how the loss reduces over the batch.
        fisher: "empirical" (G from the training loss's gradients) or "sampled" (the true Fisher:
            G from a second backward pass at targets sampled from the model, which the training
            loop starts with :meth:`sample_fisher` on every batch; ``loss_reduction`` then does
            not apply).
        weight_sharing: how a weight applied at several positions of a sample (a Linear's leading
            dims, a conv's output positions, attention's sequence) enters the factors (Eschenhagen
            et al. 2023): "expand" (every position is a row) or "reduce" (one row per sample: the
            mean of the inputs and the sum of the output-gradients over its positions; for
            Linear blocks over every call of the module in one backward, e.g. an RNN cell).
            Embeddings and normalization blocks always expand (docs/design.md §3).
        skip_layers: module-name regexes (full match against the name or the class name) or
            module types whose layers take the SGD path.
        factor_dtype, inv_dtype: float32 or float64 for factors and decompositions.
        grad_worker_fraction: distributed strategy (docs/design.md §5), KAISA's ``f`` in (0, 1] or
            "comm-opt" (f = 1: every rank holds every decomposition), "mem-opt" (f = 1/world:
            one rank per layer holds them and broadcasts its preconditioned gradient) or
            "hybrid-opt"; ``f·world`` must divide the world size. Ignored on one process.
        process_group: the group to run on (default: the whole job when ``torch.distributed``
            is initialized with more than one rank; otherwise a single process).
        params: param groups (all parameters must belong to ``model``); default: every trainable
            parameter of ``model`` in one group.
        grad_scaler: the ``torch.amp.GradScaler`` of a loop that calls ``scaler.unscale_(optimizer)``
            before ``scaler.step(optimizer)`` (gradient clipping): its scale corrects the K-FAC
            statistics then. Not needed otherwise (``scaler.step`` passes the scale); see ``precision``.
        async_decompositions: compute decompositions on a background worker (a thread; on CUDA
            its own stream) while training goes on. A round starts at a decomposition step with
            snapshots of the factors and is adopted at the next decomposition step (waiting for
            the worker if it has not finished), the same step on every rank; meanwhile layers
            precondition with the decompositions they hold, so they are one refresh older than
            in the synchronous mode (Ba et al., 2017). A factor's first decomposition is computed
            in line. ``state_dict()`` saves a round in flight (waiting for the worker; the run
            still adopts it at the same step), so a run resumed from it continues bit-identically;
            loaded without ``async_decompositions`` the round is adopted at once. Distributed:
            each rank's round holds the factors it decomposes, so resuming is exact when every
            rank loads its own ``state_dict()``; a checkpoint of one rank gives the others none
            (they keep the older decompositions, identically on every rank).
        async_delay: with ``async_decompositions``, adopt a round this many steps after the
            decomposition step that started it (before that step's preconditioning, waiting for
            the worker if needed), or at the next decomposition step if that comes first. None
            (default): at the next decomposition step. 1 keeps layers one step stale and
            overlaps the decompositions with one step's forward and backward.
        async_statistics: compute the statistics on a background worker thread instead of in
            the backward pass and ``step()``: each captured pair's Gram products, and a factor
            step's fold. The factors are exactly those of the synchronous mode (the same work
            in the same order, with the same thread count), only ready later: the optimizer
            waits for the worker where it reads them (decomposition steps, ``state_dict()``,
            ``synchronize_factors()``), and a factor step first waits for the previous factor
            step's work (at most one factor step in flight). The model's inputs must not be
            modified in place before the worker reads them: a pair that changed is dropped with
            a warning (version counters). Under Apex amp the statistics are computed in line
            (one warning). It changes no result, so ranks may differ in it.

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
        damping: FloatSchedule = KFACOptions.damping,
        kl_clip: float | None = KFACOptions.kl_clip,
        factor_decay: float = KFACOptions.factor_decay,
        factor_update_steps: IntSchedule = KFACOptions.factor_update_steps,
        inv_update_steps: IntSchedule = KFACOptions.inv_update_steps,
        method: Literal["eigen", "inverse"] | Method = KFACOptions.method,
        loss_reduction: Literal["mean", "sum"] = KFACOptions.loss_reduction,
        fisher: Literal["empirical", "sampled"] = KFACOptions.fisher,
        weight_sharing: Literal["expand", "reduce"] = KFACOptions.weight_sharing,
        skip_layers: SkipLayers = (),
        factor_dtype: torch.dtype = KFACOptions.factor_dtype,
        inv_dtype: torch.dtype = KFACOptions.inv_dtype,
        grad_worker_fraction: float | str = 1.0,
        process_group: dist.ProcessGroup | None = None,
        params: ParamsT | None = None,
        maximize: bool = False,
        foreach: bool | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        async_decompositions: bool = KFACOptions.async_decompositions,
        async_delay: int | None = KFACOptions.async_delay,
        stagger_factor_updates: bool = KFACOptions.stagger_factor_updates,
        async_statistics: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        for name, value in (("lr", lr), ("momentum", momentum), ("dampening", dampening), ("weight_decay", weight_decay)):
            check_hyperparameter(name, value)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov requires momentum > 0 and dampening = 0")
        if not isinstance(async_statistics, bool):
            raise TypeError(f"async_statistics must be a bool, got {type(async_statistics).__name__}")
        skip_layers = check_skip_layers(skip_layers)
        self.options = KFACOptions(
            damping=damping,
            kl_clip=kl_clip,
            factor_decay=factor_decay,
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            method=method,
            loss_reduction=loss_reduction,
            fisher=fisher,
            weight_sharing=weight_sharing,
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            stagger_factor_updates=stagger_factor_updates,
            async_decompositions=async_decompositions,
            async_delay=async_delay,
        )
        self.model = unwrap_model(model)
        model_params = set(self.model.parameters())
        if params is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
            "foreach": foreach,
        }
        super().__init__(params, defaults)
        Joinable.__init__(self)
        trainable = {p for group in self.param_groups for p in group["params"]}
        if not trainable <= model_params:
            raise ValueError("params must all be parameters of model")

        self.method: Method = method_named(self.options.method)
        self.blocks, self._reports = discover(
            self.model, trainable, skip_layers, factor_dtype, weight_sharing=self.options.weight_sharing
        )
        note = sequence_first_note(self.blocks)
        if note is not None:
            warn_user(note)
        if not self.blocks:
            kinds = ", ".join(sorted({t.__name__ for t in layers.registered_blocks()}))
            warn_user(
                f"model has no supported layer to precondition (registered kinds: {kinds}; see KFAC.describe()): "
                "KFAC behaves as SGD",
            )
        unsupported = [r for r in self._reports if r.status == "unsupported"]
        if unsupported:
            warn_user(
                f"{len(unsupported)} layer(s) of registered kinds take the SGD path: "
                + "; ".join(f"{r.name}: {r.detail}" for r in unsupported)
            )
        empirical = self.options.fisher == "empirical"
        # First (before any hook exists): with several ranks it checks they all built K-FAC alike.
        self._sharding = Sharding(
            self.blocks, grad_worker_fraction, process_group, settings=vars(self.options)
        )
        self._precision = MixedPrecision(self, grad_scaler, statistics_loss_scaled=empirical)
        self._statistics = StatisticsWorker() if async_statistics else None
        self._capture = StatisticsCapture(
            self.blocks,
            self._precision.accumulate,
            every_backward=empirical,
            worker=self._statistics,
            in_line=self._precision.under_apex,  # Apex's loss scale is read during backward
        )
        self._last_fold: Future[None] | None = None  # async_statistics: the latest factor step's fold
        self._reported_overwritten: set[str] = set()
        self._warned_apex_in_line = False
        self._join = JoinSupport(self, model)
        self._background = BackgroundDecompositions() if async_decompositions else None
        self._async_delay = async_delay
        self._adopt_at: int | None = None  # the step at which the round in flight is adopted
        self._stagger = FactorStagger(self.blocks) if self.options.stagger_factor_updates else None
        self._steps = 0
        self._warned_nothing_sampled = False
        self._warned_graph_backward = False
        # Per K-FAC parameter (blocks in order): steps whose direction was non-finite (left out of
        # ν), on the device; and per block, how many of those steps were reported.
        device = self.blocks[0].weight.device if self.blocks else torch.device("cpu")
        parameter_count = sum(len(block.parameters()) for block in self.blocks)
        self._nonfinite_directions = torch.zeros(parameter_count, dtype=torch.int64, device=device)
        self._reported_nonfinite = [0] * len(self.blocks)
        self._arm_for(self._steps)
        self._checked_capture = False
        logger.info("%s", self.describe())
        factors = [(f"{block.name}.{name}", f.dim) for block in self.blocks for name, f in block.factors.items()]
        large = [f"{name} ({dim})" for name, dim in factors if dim >= LARGE_FACTOR_DIM]
        if large:
            logger.warning("K-FAC factors of dim >= %d take seconds each to decompose on a CPU at full rank "
                           "(rank-deficient ones, e.g. of convs on small feature maps, far less): %s; see "
                           "inv_update_steps, async_decompositions and skip_layers (docs/design.md §4)",
                           LARGE_FACTOR_DIM, ", ".join(large))

    # -- schedules ---------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """Optimizer steps taken (skipped overflow steps excluded)."""
        return self._steps

    @property
    def capturing(self) -> bool:
        """Whether the hooks record statistics now (the coming step is a factor step; with
        ``stagger_factor_updates``, for the layers that fold on it)."""
        return self._capture.armed

    @property
    def owned_factors(self) -> tuple[str, ...]:
        """The factors this rank decomposes, ``"<layer>.A"`` / ``"<layer>.G"`` (all on one process)."""
        return self._sharding.owned_factors()

    def bytes_communicated(self) -> dict[str, int]:
        """Payload bytes this rank handed to collectives so far, by kind: ``"factors"`` (the
        factor all-reduce), ``"decompositions"`` (agreement and broadcasts) and ``"directions"``
        (preconditioned gradients, ``f < 1``). Flat buffers as sent (packed triangles); zeros on
        one process."""
        return self._sharding.bytes_communicated()

    def damping_at(self, step: int) -> float:
        return check_damping(resolve(self.options.damping, step))

    def is_factor_step(self, step: int) -> bool:
        """Whether some layer folds its statistics at ``step`` (every layer, unless staggered)."""
        return bool(self._folding_blocks(step))

    def _folding_blocks(self, step: int) -> list[layers.KroneckerBlock]:
        """The blocks that capture for and fold at ``step``: all on factor steps, or their phase's."""
        interval = check_interval("factor_update_steps", resolve(self.options.factor_update_steps, step))
        if self._stagger is not None and self._stagger.ready:
            return self._stagger.blocks_at(step, interval)
        return self.blocks if step % interval == 0 else []

    def is_inverse_step(self, step: int) -> bool:
        interval = check_interval("inv_update_steps", resolve(self.options.inv_update_steps, step))
        return step % interval == 0

    def _arm_for(self, step: int) -> None:
        if self._stagger is not None and self._stagger.ready:
            interval = check_interval("factor_update_steps", resolve(self.options.factor_update_steps, step))
            only = self._stagger.modules_at(step, interval)
            self._capture.arm(bool(only), only)
        else:
            self._capture.arm(self.is_factor_step(step))

    # -- public helpers ----------------------------------------------------------------------

    def remove_hooks(self) -> None:
        """Detach the capture hooks from the model (the optimizer then never updates factors)."""
        self._capture.remove()

    def describe(self) -> str:
        """Every module with trainable parameters and what K-FAC does with them: the block that
        preconditions them (its kind and factor shapes) or why they take the SGD path, then the
        share of weight-matrix elements (parameters with 2+ dims) that K-FAC preconditions."""
        preconditioned = {id(p) for block in self.blocks for p in block.parameters()}
        matrices = {id(p): p.numel() for group in self.param_groups for p in group["params"] if p.dim() >= 2}
        covered = sum(n for key, n in matrices.items() if key in preconditioned)
        total = sum(matrices.values())
        share = covered / total if total else 1.0
        lines = [
            f"KFAC ({self.method.name}): {len(self.blocks)} blocks precondition {covered}/{total} "
            f"weight-matrix elements ({share:.1%})",
            *(f"  {report}" for report in self._reports),
        ]
        return "\n".join(lines)

    @property
    def module_reports(self) -> list[ModuleReport]:
        """:meth:`describe`'s rows as data, one per module with trainable parameters."""
        return list(self._reports)

    def discard_pending_statistics(self) -> None:
        """Forget statistics captured since the last step (e.g. of a step that will not happen)."""
        if self._statistics is None:
            clear_pending(self.blocks)
        elif self._capture.recorded:  # after the worker's work on them (in order)
            self._statistics.submit(clear_pending, self.blocks)
        self._capture.recorded = 0

    def _settle_statistics(self) -> None:
        """With ``async_statistics``: wait until the worker has run everything submitted, so that
        the factors and pending statistics may be read here (a no-op otherwise)."""
        if self._statistics is not None:
            self._statistics.wait()
            self._last_fold = None

    @record_function("kfac.sample_fisher")
    def sample_fisher(
        self,
        outputs: Tensor,
        likelihood: fisher_lib.Likelihood,
        generator: torch.Generator | None = None,
    ) -> None:
        """Capture this batch's statistics at targets sampled from the model (``fisher="sampled"``).

        Call it on every (micro-)batch between the forward pass and ``loss.backward()``, with the
        model's ``outputs`` and the ``likelihood`` its training loss assumes: "cross_entropy"
        (logits ``(N, C)``) or "mse" (see ``kfac_optim.fisher``). On a step that updates factors
        it back-propagates the loss at sampled targets with ``torch.autograd.grad`` with respect to
        the K-FAC layers' outputs of this forward (one more backward pass, down to the first
        K-FAC layer and without weight gradients, however the parameters reach the graph, e.g.
        FSDP2's unsharded copies; ``.grad`` is left alone and the graph is kept for the training
        loss; the outputs are held from the forward until then);
        on the other steps, in eval mode and under ``torch.no_grad()`` it returns at once.
        ``generator`` draws the targets (default: torch's global generator). Loss scaling
        (GradScaler, Apex) needs nothing more: the sampled loss is never scaled, as its
        output-gradients are per-sample and of order one.
        """
        if self.options.fisher != "sampled":
            raise RuntimeError("sample_fisher needs KFAC(..., fisher='sampled'); this optimizer uses fisher='empirical'")
        fisher_lib.check_likelihood(likelihood)
        if not torch.is_grad_enabled():
            return
        if not outputs.requires_grad:
            raise ValueError("outputs must be the model's output computed with grad enabled (it does not require grad)")
        if not self._capture.armed or not any(block.module.training for block in self.blocks):
            return  # not a factor step, or eval mode (the hooks capture nothing)
        loss = fisher_lib.sampled_loss(outputs, likelihood, generator)
        recorded_before = self._capture.recorded
        with self._capture.recording_outputs() as layer_outputs:
            if layer_outputs:  # back-propagate exactly as far as the hooked layer outputs
                torch.autograd.grad(loss, layer_outputs, retain_graph=True, allow_unused=True)
        if self._capture.recorded == recorded_before and not self._warned_nothing_sampled:
            warn_user(
                "sample_fisher recorded no statistics: no K-FAC layer's output on the path to `outputs` was "
                "captured (reentrant torch.utils.checkpoint hides its layers from this pass; use "
                "use_reentrant=False); the factors are not updated",
                RuntimeWarning,
            )
            self._warned_nothing_sampled = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``Optimizer.zero_grad``; also drops statistics of backward passes no step consumed."""
        self.discard_pending_statistics()
        super().zero_grad(set_to_none=set_to_none)

    # -- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    @record_function("kfac.step")
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one K-FAC step (see the module docstring for the order of work)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        if self._precision.skip_step():
            self.discard_pending_statistics()
            return loss
        statistics_scale = self._precision.unscale(p for group in self.param_groups for p in group["params"])
        if statistics_scale is None:  # captured under a loss scale nobody told us
            self.discard_pending_statistics()
            statistics_scale = 1.0
        self._precision.bind_master_params(self.blocks)

        self._join.check_step()
        step = self._steps
        damping = self.damping_at(step)
        self._update_factors_and_decompositions(step, damping, statistics_scale)

        directions = self._preconditioned_directions(damping)
        if self.options.kl_clip is not None and directions:
            self._clip_to_trust_region(directions)
        self._sgd_update(directions)

        self._steps += 1
        self._arm_for(self._steps)
        return loss

    def _update_factors_and_decompositions(self, step: int, damping: float, statistics_scale: float | Tensor) -> None:
        """Fold the statistics on factor steps, refresh the decompositions on decomposition steps.

        Every K-FAC collective of a step with ``grad_worker_fraction=1`` happens here, so a rank
        that ran out of inputs under ``Join`` runs it too (:meth:`_shadow_step`).
        """
        if self._sharding.decompositions_missing:  # a loaded checkpoint lacks some: from its factors
            self._decomposition_step(damping, only_missing=True)
        folding = self._folding_blocks(step)
        if folding:
            self._check_something_was_recorded()
            # sample_fisher's loss is a sum over samples, whatever the training loss's reduction.
            reduction = "sum" if self.options.fisher == "sampled" else self.options.loss_reduction
            if not self._checked_capture or (self._stagger is not None and not self._stagger.ready):
                self._settle_statistics()  # the one-time checks below read the pending statistics
            if not self._checked_capture:
                self._warn_about_silent_blocks()
            if self._stagger is not None and not self._stagger.ready:
                self._assign_stagger_phases()
            with record_function("kfac.fold"):
                fold = (self.blocks, folding, self.options.factor_decay, reduction, statistics_scale)
                if self._statistics is None or self._precision.under_apex():
                    self._settle_statistics()
                    fold_statistics(*fold)
                else:  # after the previous factor step's (at most one in flight), then this one's
                    if self._last_fold is not None:
                        self._statistics.wait(self._last_fold)
                    self._last_fold = self._statistics.submit(fold_statistics, *fold)
                self._capture.recorded = 0
            self._sharding.factors_folded()
        else:
            self.discard_pending_statistics()  # a no-op when nothing was captured
        if self.is_inverse_step(step):
            self._decomposition_step(damping)
        elif self._adopt_at == step:  # async_delay: adopt the round in flight, the same step on every rank
            self._adopt_background_round()
            self._sharding.share_decompositions(self.method, self.options.inv_dtype)
        if self._statistics is not None:  # after any wait for the worker above
            self._report_statistics_worker()

    def _report_statistics_worker(self) -> None:
        """With ``async_statistics``: warn once about pairs the worker dropped because their tensors
        were modified in place before it read them, and about Apex keeping the statistics in line."""
        overwritten = self._capture.overwritten.copy() - self._reported_overwritten
        if overwritten:
            self._reported_overwritten |= overwritten
            warn_user(
                f"K-FAC layer(s) {sorted(overwritten)}: an input or output-gradient was modified in place before "
                "the statistics worker (async_statistics=True) read it (e.g. an input buffer refilled in place); "
                "those statistics were dropped. Hand the model fresh tensors, or use async_statistics=False",
                RuntimeWarning,
            )
        if not self._warned_apex_in_line and self._precision.under_apex():
            self._warned_apex_in_line = True
            warn_user(
                "async_statistics=True does not apply under Apex amp (its loss scale is read during the backward "
                "pass): the statistics are computed in line"
            )

    def _assign_stagger_phases(self) -> None:
        """At an all-block factor step: fix the stagger phases from the statistics costs summed
        over ranks (a collective, also in Join's shadow step), once some rank recorded statistics."""
        assert self._stagger is not None
        costs = self._sharding.sum_over_ranks(self._stagger.unit_costs(), "the stagger phases' cost all-reduce")
        if sum(costs) > 0:
            self._stagger.set_costs(costs)
            logger.debug("stagger phases for interval %s: %s", self.options.factor_update_steps,
                         dict(zip(self._stagger.names, costs, strict=True)))

    def _warn_about_silent_blocks(self) -> None:
        """At the first factor step with any statistics: warn once about blocks whose hooks never
        fired (e.g. a layer called functionally, or whose output never reached the loss)."""
        silent = [block.name for block in self.blocks if block.pending_samples == 0]
        if len(silent) == len(self.blocks):
            return  # no statistics at all (eval mode, a skipped backward): ask again next time
        self._checked_capture = True
        if silent:
            warn_user(
                f"K-FAC layer(s) {silent} produced no statistics at the first factor step (their hooks never "
                "fired: a layer called through its parameters rather than its forward, or whose output does "
                "not reach the loss); they take the SGD path until they do",
                RuntimeWarning,
            )

    def _check_something_was_recorded(self) -> None:
        """Warn once when every backward of a factor step ran with ``create_graph=True`` (not recorded)."""
        skipped, self._capture.graph_backward_skipped = self._capture.graph_backward_skipped, False
        if skipped and not self._warned_graph_backward and not self._capture.recorded:
            warn_user(
                "every backward since the last step ran with create_graph=True: K-FAC records the "
                "output-gradients of the backward that produces .grad without create_graph (e.g. the "
                "final backward of a gradient penalty), so the factors were not updated on this step",
                RuntimeWarning,
            )
            self._warned_graph_backward = True

    def _decomposition_step(self, damping: float, only_missing: bool = False) -> None:
        """Make the factors global (lazy reduction), decompose what this rank owns, share them.

        With ``async_decompositions``: first adopt the round the worker was given at the previous
        decomposition step (waiting for it if needed), then decompose in line only the factors
        that have no decomposition yet, share, and hand the rest to the worker as snapshots.
        """
        self._settle_statistics()
        with record_function("kfac.reduce_factors"):
            self._sharding.synchronize_factors()
        if self._background is not None and not only_missing:
            self._adopt_background_round()
        self._update_decompositions(damping, only_missing)
        with record_function("kfac.share_decompositions"):
            self._sharding.share_decompositions(self.method, self.options.inv_dtype)

    def _adopt_background_round(self) -> None:
        """Hold the decompositions of the worker's round (reporting the ones that failed)."""
        assert self._background is not None
        self._adopt_at = None
        self._adopt(self._background.collect())

    def _adopt(self, results: list[tuple[Job, Result]]) -> None:
        """Hold each job's decomposition (None: report that it failed)."""
        for job, result in results:
            block, name = job.owner
            if result is None:
                self._report_failure(block, name)
            else:
                block.factors[name].adopt(result, job.method.keyed_shift(job.shift), job.version)

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
        With ``async_decompositions``, factors that hold a decomposition go to the worker."""
        method, inv_dtype = self.method, self.options.inv_dtype
        jobs: list[Job] = []
        factors = [(block, name, factor) for block in self.blocks for name, factor in block.factors.items()]
        if not factors:
            return
        # One host sync per decomposition step for the device-side health flags.
        flags = torch.cat(
            [torch.stack([f.initialized.long(), f.discarded]) for _, _, f in factors] + [self._nonfinite_directions]
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
            if not initialized or not self._sharding.decomposes(block.name, name):
                continue
            if only_missing and factor.decomposition is not None:
                continue
            shift = block.shifts(method, damping)[name]
            if not factor.needs_decomposition(method, shift):
                continue
            drop_below = block.rank_thresholds(method, damping)[name]
            if self._background is not None and factor.decomposition is not None and not only_missing:
                jobs.append(Job((block, name), factor.snapshot(), factor.version, method, shift, inv_dtype, drop_below))
            elif not factor.decompose(method, shift, inv_dtype, drop_below):
                self._report_failure(block, name)
        if self._background is not None:
            self._background.submit(jobs)
            # On every rank, jobs or not: the adopt step shares decompositions (a collective). When
            # no rank had a job (e.g. step 0, all in line) that exchange resends what receivers hold.
            if not only_missing and self._async_delay is not None:
                self._adopt_at = self._steps + self._async_delay

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

    @record_function("kfac.precondition")
    def _preconditioned_directions(self, damping: float) -> dict[Tensor, Tensor]:
        """Per-parameter update directions of the K-FAC layers that have a decomposition.

        Under FSDP2 a direction is a ``DTensor`` laid out as its parameter (this rank's rows).
        """
        joint: dict[str, Tensor] = {}
        sharded_rows: dict[str, Tensor] = {}
        for block in self.blocks:
            if self._sharding.is_row_sharded(block.name):
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
            joint = self._sharding.share_directions(joint, self.options.inv_dtype)
        directions: dict[Tensor, Tensor] = {}
        for block in self.blocks:
            if block.name in joint:
                directions.update(block.split(joint[block.name]))
        if sharded_rows:
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
                rows_of = self._sharding.precondition_sharded(sharded_rows, precondition, self.options.inv_dtype)
            for name, rows in rows_of.items():
                params = by_name[name].parameters()
                for param, direction in zip(params, fsdp.split_rows(rows, params), strict=True):
                    directions[param] = fsdp.like_param(param, direction.to(param.dtype).contiguous())
        return directions

    @record_function("kfac.kl_clip")
    def _clip_to_trust_region(self, directions: dict[Tensor, Tensor]) -> None:
        """Scale every direction by ``ν = min(1, sqrt(kl_clip / |Σ lr² ⟨d, ∇p⟩|))`` in place.

        The sum runs over the layers whose term is finite: a layer with a non-finite gradient has a
        non-finite direction (its preconditioner mixes all its entries) and is left out, so one bad
        entry cannot make every layer's update non-finite through ν. Such layers are counted on the
        device and reported at the next decomposition step (no host sync here). FSDP2-sharded
        parameters contribute their rows' terms, summed over the shards.
        """
        lr_of = {p: group["lr"] for group in self.param_groups for p in group["params"]}
        zero = self._nonfinite_directions.new_zeros((), dtype=next(iter(directions.values())).dtype)

        def term(param: Tensor) -> Tensor:
            if param not in directions or param.grad is None:
                return zero
            rows, grad = fsdp.local(directions[param]), fsdp.local(param.grad)
            return torch.vdot(rows.reshape(-1), grad.to(rows.dtype).reshape(-1)) * lr_of[param] ** 2

        # one per K-FAC parameter, in block order; 0 for those without a direction
        params = [param for block in self.blocks for param in block.parameters()]
        per_parameter = torch.stack([term(param) for param in params])
        if self._sharding.row_sharded is not None:  # one all-reduce of the terms over the shard group
            sharded = [fsdp.is_sharded(p) for p in params]
            summed = self._sharding.sum_over_shards(per_parameter.clone())
            per_parameter = torch.stack([summed[i] if s else per_parameter[i] for i, s in enumerate(sharded)])
        finite = torch.isfinite(per_parameter)
        self._nonfinite_directions += ~finite
        kl_estimate = per_parameter.where(finite, 0.0).sum().abs()
        nu = (self.options.kl_clip / kl_estimate).sqrt().clamp(max=1.0)
        torch._foreach_mul_([fsdp.local(d) for d in directions.values()], nu)

    @record_function("kfac.sgd")
    def _sgd_update(self, directions: dict[Tensor, Tensor]) -> None:
        """``torch.optim.SGD``'s update, per group, on the (possibly preconditioned) directions."""
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            momentum_buffers: list[Tensor | None] = []
            has_sparse_grad = False
            for p in group["params"]:
                if p.grad is None:
                    continue
                params.append(p)
                grads.append(directions.get(p, p.grad))
                has_sparse_grad |= p.grad.is_sparse
                if group["momentum"] != 0:
                    momentum_buffers.append(self.state[p].get("momentum_buffer"))
            sgd(
                params,
                grads,
                momentum_buffers,
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                lr=group["lr"],
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                maximize=group["maximize"],
                has_sparse_grad=has_sparse_grad,
                foreach=group["foreach"],
            )
            if group["momentum"] != 0:
                for p, buffer in zip(params, momentum_buffers, strict=True):
                    self.state[p]["momentum_buffer"] = buffer

    # -- NVIDIA Apex amp ---------------------------------------------------------------------

    @property
    def most_recent_scale(self) -> float:
        """Apex amp's hook into optimizers: 1.0 (``KFAC`` reads Apex's loss scale itself)."""
        return 1.0

    @most_recent_scale.setter
    def most_recent_scale(self, value: float) -> None:
        """Apex sets this exactly when it skips a step on overflow: drop that backward's statistics."""
        self.discard_pending_statistics()

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``Optimizer.state_dict()`` plus ``"kfac"``: :meth:`kfac_state_dict`.

        Distributed: the factors saved are the global ones, made so here by
        :meth:`synchronize_factors`, a collective when a factor step happened since the last
        decomposition step (or synchronization): call ``state_dict()`` on every rank, then save on
        one. Right after a decomposition step (``steps % inv_update_steps == 0`` before it) or a
        ``synchronize_factors()`` the factors are global already and it communicates nothing, so
        calling it on one rank only is then safe; otherwise that rank fails with an error naming
        this call once ``init_process_group``'s timeout has passed. Decompositions are those this
        rank holds; a checkpoint saved under ``grad_worker_fraction < 1`` lacks the others, and
        whoever loads it recomputes them from the saved factors at its first step.
        """
        self._settle_statistics()
        self._sharding.synchronize_factors("KFAC.state_dict()", confirm=True)
        state = super().state_dict()
        state["kfac"] = self._kfac_state()
        return state

    def kfac_state_dict(self) -> dict[str, Any]:
        """The ``"kfac"`` entry of :meth:`state_dict`: the step, every block's factors (and the
        decompositions held here) by module name, and ``"round"``: the round of decompositions in
        flight under ``async_decompositions`` (None: none; see ``docs/api.md``); a collective as
        :meth:`state_dict` is."""
        self._settle_statistics()
        self._sharding.synchronize_factors("KFAC.kfac_state_dict()", confirm=True)
        return self._kfac_state()

    def _kfac_state(self) -> dict[str, Any]:
        return {
            "steps": self._steps,
            "blocks": {block.name: block.state_dict() for block in self.blocks},
            "round": self._round_state(),
        }

    def _round_state(self) -> dict[str, Any] | None:
        """The round of decompositions in flight (``async_decompositions``), None when there is none.

        Waits for the worker; its results stay held and are adopted at the same step as if nothing
        had been saved. ``{"adopt_at": the step that adopts it (None: the next decomposition step),
        "factors": {block: {factor: {"decomposition": as in the block's state (None: it failed),
        "version": the factor version it decomposes, "shift": the shift it was given}}}}``: the
        factors this rank decomposes.
        """
        results = self._background.wait() if self._background is not None else []
        if not results:
            return None
        factors: dict[str, dict[str, Any]] = {}
        for job, result in results:
            block, name = job.owner
            factors.setdefault(block.name, {})[name] = {
                "decomposition": block.factors[name].decomposition_state(result),
                "version": job.version,
                "shift": job.shift,
            }
        return {"adopt_at": self._adopt_at, "factors": factors}

    def kfac_state(self) -> KFACState:
        """K-FAC's state for ``torch.distributed.checkpoint`` (DCP), next to the model's and the
        optimizer's (``get_state_dict``, which keep only SGD's part): ``dcp.save({..., "kfac":
        optimizer.kfac_state()})``, and the same dict to ``dcp.load``; see ``kfac_optim.checkpoint``."""
        return KFACState(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``Optimizer.load_state_dict`` plus the ``"kfac"`` entry of :meth:`state_dict`.

        The whole K-FAC entry is checked first (keys, shapes against this model, finiteness): a
        checkpoint that does not fit raises ``ValueError`` naming the layer and the field, and the
        optimizer is left exactly as it was. Layers of the model missing from the checkpoint start
        fresh and saved layers the model lacks are ignored, both with a warning.
        """
        state_dict = dict(state_dict)
        kfac_state = state_dict.pop("kfac", None)
        if kfac_state is not None:
            saved = self._validate_kfac_state(kfac_state)
        super().load_state_dict(state_dict)
        if kfac_state is not None:
            self._restore_kfac_state(kfac_state["steps"], saved, kfac_state.get("round"))

    def load_kfac_state_dict(self, kfac_state: dict[str, Any]) -> None:
        """Restore :meth:`kfac_state_dict` (the same one on every rank), checked as in
        :meth:`load_state_dict`; layers match by name."""
        saved = self._validate_kfac_state(kfac_state)
        self._restore_kfac_state(kfac_state["steps"], saved, kfac_state.get("round"))

    def _restore_kfac_state(self, steps: int, saved: dict[str, Any], saved_round: dict[str, Any] | None) -> None:
        """Load validated blocks and the saved round in flight (None: none, or saved before rounds were).

        With ``async_decompositions`` the round is held and adopted at its saved step, as in the run
        that saved it (the results of the factors this rank decomposes). Without, it is adopted at
        once: a synchronous run holds the newest decompositions it has, and refreshes them all at its
        next decomposition step anyway."""
        self._settle_statistics()  # work in flight writes into the factors being replaced
        if self._background is not None:  # a round in flight decomposes the factors being replaced
            self._background.close()
            self._adopt_at = None
        self._steps = int(steps)
        for block in self.blocks:
            if block.name in saved:
                block.load_state_dict(saved[block.name])
        results = self._saved_round(saved_round)
        if self._background is None:
            self._adopt(results)
        elif saved_round is not None:
            decomposes = self._sharding.decomposes
            self._background.hold([(job, r) for job, r in results if decomposes(job.owner[0].name, job.owner[1])])
            self._adopt_at = saved_round["adopt_at"]  # on every rank alike, as it decides a collective
        self._sharding.loaded()
        self._arm_for(self._steps)

    def _saved_round(self, saved_round: dict[str, Any] | None) -> list[tuple[Job, Result]]:
        """A validated round entry of a checkpoint as jobs with their results (layers of this model only)."""
        if saved_round is None:
            return []
        blocks = {block.name: block for block in self.blocks}
        return [
            (
                Job((blocks[block_name], name), blocks[block_name].factors[name], result["version"], self.method,
                    float(result["shift"]), self.options.inv_dtype, None),
                blocks[block_name].factors[name].load_decomposition(result["decomposition"]),
            )
            for block_name, factors in saved_round["factors"].items() if block_name in blocks
            for name, result in factors.items()
        ]

    def _validate_kfac_state(self, kfac_state: Any) -> dict[str, Any]:
        """Check a checkpoint's ``"kfac"`` entry against this model; return its blocks by name."""
        if not isinstance(kfac_state, dict) or not isinstance(kfac_state.get("blocks"), dict):
            raise ValueError("K-FAC checkpoint: the 'kfac' entry must be a dict with 'steps' and 'blocks'")
        steps = kfac_state.get("steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"K-FAC checkpoint: 'steps' must be an int >= 0, got {steps!r}")
        saved = kfac_state["blocks"]
        for block in self.blocks:
            if block.name in saved:
                block.validate_state(saved[block.name])
        self._validate_round(kfac_state.get("round"), steps)
        missing = [block.name for block in self.blocks if block.name not in saved]
        unknown = sorted(set(saved) - {block.name for block in self.blocks})
        if missing or unknown:
            warn_user(
                f"K-FAC checkpoint does not match the model: layers without saved factors {missing} "
                f"start fresh; saved layers not in the model {unknown} are ignored",
            )
        return saved

    def _validate_round(self, saved_round: Any, steps: int) -> None:
        """Check a checkpoint's round in flight (see :meth:`_round_state`) against this model."""
        if saved_round is None:
            return
        shaped = isinstance(saved_round, dict) and isinstance(saved_round.get("factors"), dict)
        if not shaped or "adopt_at" not in saved_round:
            raise ValueError("K-FAC checkpoint: 'round' must be None or a dict with 'adopt_at' and 'factors'")
        adopt_at = saved_round["adopt_at"]
        if adopt_at is not None and (isinstance(adopt_at, bool) or not isinstance(adopt_at, int) or adopt_at < steps):
            raise ValueError(
                f"K-FAC checkpoint: the round's 'adopt_at' must be None or an int >= 'steps' ({steps}), "
                f"got {adopt_at!r}"
            )
        blocks = {block.name: block for block in self.blocks}
        for block_name, factors in saved_round["factors"].items():
            if block_name not in blocks:
                continue  # a saved layer the model lacks: ignored, as its factors are
            where = f"K-FAC checkpoint, layer '{block_name}', the round in flight"
            if not isinstance(factors, dict):
                raise ValueError(f"{where}: expected a dict of factors, got {type(factors).__name__}")
            for name, result in factors.items():
                if name not in blocks[block_name].factors:
                    raise ValueError(f"{where}: this layer has no factor {name!r}")
                try:
                    blocks[block_name].factors[name].validate_result(result)
                except ValueError as error:
                    raise ValueError(f"{where}, factor {name}: {error}") from None

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a KFAC optimizer cannot be pickled, deep-copied or torch.save()d: it holds hooks on the model "
            "and (when distributed) process groups. Save optimizer.state_dict() instead and load it with "
            "load_state_dict() into a KFAC built on the model."
        )

    # -- distributed -------------------------------------------------------------------------

    def synchronize_factors(self) -> None:
        """Make every rank's running factors the global ones now: a collective, call it on every rank.

        ``step()`` does this lazily, right before decomposition steps, and ``state_dict()`` before
        saving; calling it after every step gives eager reduction (the same factors). A no-op on
        one process and when no factor step happened since the last reduction.
        """
        self._settle_statistics()
        self._sharding.synchronize_factors("KFAC.synchronize_factors()", confirm=True)

    # -- uneven inputs (torch.distributed.algorithms.Join) -----------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """``Joinable``: the hook with which a rank that ran out of inputs takes part in the other
        ranks' K-FAC collectives; use ``Join([ddp_model, optimizer])`` (``kfac_optim.distributed.join``).

        Raises:
            ValueError: ``grad_worker_fraction < 1`` (a joined rank cannot precondition).
        """
        return self._join.hook()

    @property
    def join_device(self) -> torch.device:
        return self._join.device

    @property
    def join_process_group(self) -> Any:
        return self._join.process_group

    def _shadow_step(self) -> None:
        """A joined rank's part in one ``step()`` of the others: count it, fold nothing, and run
        the decomposition step's collectives (and decompositions) when it is one."""
        step = self._steps
        self._update_factors_and_decompositions(step, self.damping_at(step), 1.0)
        self._steps += 1
        self._arm_for(self._steps)

    def memory_usage(self) -> dict[str, int]:
        """Bytes of K-FAC state on this rank, by category, and their ``"total"``.

        ``"factors"``: running A and G of every layer (every rank keeps all of them);
        ``"pending"``: statistics captured since the last fold; ``"decompositions"``: the
        eigendecompositions or inverses this rank holds (all layers with ``f = 1``, about
        ``f`` of them otherwise); ``"sharded_preconditioning"``: under FSDP2, the most this rank
        holds at once while preconditioning sharded layers (gathered gradient rows and one whole
        gradient and direction; 0 without sharded layers). Momentum buffers are SGD's and not counted.
        """
        factors = [factor for block in self.blocks for factor in block.factors.values()]
        row_sharded = self._sharding.row_sharded
        itemsize = torch.empty((), dtype=self.options.inv_dtype).element_size()
        usage = {
            "factors": sum(f.running.nbytes for f in factors),
            "pending": sum(f.pending.nbytes for f in factors),
            "decompositions": sum(linalg.nbytes(f.decomposition) for f in factors),
            "sharded_preconditioning": 0 if row_sharded is None else row_sharded.peak_bytes(itemsize),
        }
        usage["total"] = sum(usage.values())
        return usage

