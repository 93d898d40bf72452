"""The decomposition steps, in line or with rounds on the background worker.

Owns: a decomposition step (make the factors global, decompose what this rank owns, share), the
decomposition step's one host sync (the factors' health flags and the non-finite directions' count,
handed to the ``Reporter``), and with ``AsyncConfig`` the rounds of ``BackgroundDecompositions``:
which factors go to the worker, the step a round is adopted at (``adopt_at``), adopting it, and
the round in flight's checkpoint state (the ``"round"`` entry, ``kfac_optim.state``'s protocol).
Chosen once, at construction (:func:`decomposition_steps`). (How one factor is decomposed is the
method's business: ``methods``.)
Must not know: statistics (the caller settles them first), schedules (the caller says which steps
decompose), the checkpoint's framing (``checkpoint.py``), the optimizer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from kfac_optim.background.decompositions import BackgroundDecompositions, Job, Result
from kfac_optim.config import AsyncConfig
from kfac_optim.distributed.strategy import DistributionStrategy
from kfac_optim.layers import KroneckerBlock
from kfac_optim.layers.factor import Factor
from kfac_optim.methods import Method
from kfac_optim.reporter import Reporter
from kfac_optim.state import within

logger = logging.getLogger(__name__)

Round = list[tuple[Job, Result]]
"""A round of decompositions: each job with its result (None: it failed)."""


class InLineDecompositionSteps:
    """Every decomposition computed in the decomposition step, by ``method`` in ``inv_dtype``.

    ``blocks``: all of them; ``strategy``: which factors this rank decomposes, and the collectives
    that make factors global and share decompositions; ``reporter``: told of discards, non-finite
    directions (``nonfinite``: the step length's count per parameter, on the device), failures and
    truncations.
    """

    remeasures = True
    """Whether the automatic intervals may re-measure the decompositions' time (not off the critical path)."""

    adopt_at: int | None = None
    """The step at which the round in flight is adopted (None: none, or at the next decomposition step)."""

    def __init__(self, blocks: Sequence[KroneckerBlock], method: Method, inv_dtype: torch.dtype,
                 strategy: DistributionStrategy, reporter: Reporter, nonfinite: Tensor) -> None:
        self._blocks = blocks
        self._method = method
        self._inv_dtype = inv_dtype
        self._strategy = strategy
        self._reporter = reporter
        self._nonfinite = nonfinite

    def step(self, damping: float, step: int) -> None:
        """A decomposition step at ``step``: make the factors global (lazy reduction), decompose what
        this rank owns at ``damping``, share the decompositions (collectives on every rank)."""
        self._synchronize()
        self._decompose(damping, only_missing=False)
        self._share()

    def complete(self, damping: float) -> None:
        """Decompose, in line, the factors that lack a decomposition (a loaded checkpoint's), and share."""
        self._synchronize()
        self._decompose(damping, only_missing=True)
        self._share()

    def between(self, step: int) -> None:
        """At a step that does not decompose (nothing to do in line)."""

    def _synchronize(self) -> None:
        with record_function("kfac.reduce_factors"):
            self._strategy.synchronize_factors()

    def _share(self) -> None:
        with record_function("kfac.share_decompositions"):
            self._strategy.share_decompositions(self._method, self._inv_dtype)

    @record_function("kfac.decompose")
    def _decompose(self, damping: float, only_missing: bool) -> list[Job]:
        """Refresh the decompositions of the initialized factors this rank owns (every factor on one
        process; with ``only_missing`` only those without one); report discards and failures.
        Returns the jobs :meth:`_job` left for later (none in line)."""
        factors = [(block, name, factor) for block in self._blocks for name, factor in block.factors.items()]
        if not factors:
            return []
        # One host sync per decomposition step for the device-side health flags.
        flags = torch.cat(
            [torch.stack([f.initialized.long(), f.discarded]) for _, _, f in factors] + [self._nonfinite]
        ).tolist()
        self._reporter.nonfinite_directions(flags[2 * len(factors):])
        jobs: list[Job] = []
        for index, (block, name, factor) in enumerate(factors):
            initialized, discarded = flags[2 * index : 2 * index + 2]
            self._reporter.discarded(block, name, factor, discarded)
            if not initialized or not self._strategy.decomposes(block.name, name):
                continue
            if only_missing and factor.decomposition is not None:
                continue
            shift = block.shifts(self._method, damping)[name]
            if not factor.needs_decomposition(self._method, shift):
                continue
            drop_below = block.rank_thresholds(self._method, damping)[name]
            job = None if only_missing else self._job(block, name, factor, shift, drop_below)
            if job is not None:
                jobs.append(job)
            elif not factor.decompose(self._method, shift, self._inv_dtype, drop_below):
                self._reporter.failed(block, name)
            else:
                self._reporter.decomposed(block, name)
        return jobs

    def _job(self, block: KroneckerBlock, name: str, factor: Factor, shift: float,
             drop_below: float | None) -> Job | None:
        """The job that decomposes ``factor`` later, or None to decompose it now (always, in line)."""
        return None

    def adopt(self, results: Round) -> None:
        """Hold each job's decomposition (None: report that it failed)."""
        for job, result in results:
            block, name = job.owner
            if result is None:
                self._reporter.failed(block, name)
            else:
                block.factors[name].adopt(result, job.method.keyed_shift(job.shift), job.version)
                self._reporter.decomposed(block, name)

    # -- checkpoints: the round in flight ----------------------------------------------------

    def state_dict(self) -> dict[str, Any] | None:
        """The round of decompositions in flight (``AsyncConfig``; None: none, always in line):
        ``{"adopt_at": the step that adopts it (None: the next decomposition step), "factors":
        {layer: {factor: {"decomposition": as the factor saves one (None: it failed), "version":
        the factor version it decomposes, "shift": the shift it was given}}}}``, the factors this
        rank decomposes. Waits for the worker; the round stays in flight, adopted as if not saved."""
        results, adopt_at = self._round_in_flight()
        if not results:
            return None
        factors: dict[str, dict[str, Any]] = {}
        for job, result in results:
            block, name = job.owner
            factors.setdefault(block.name, {})[name] = {
                "decomposition": block.factors[name].saved_decomposition(job.method, result),
                "version": job.version,
                "shift": job.shift,
            }
        return {"adopt_at": adopt_at, "factors": factors}

    def check_state(self, state: Any, steps: int) -> None:
        """Raise ``ValueError`` naming the key if ``state`` (a :meth:`state_dict`) does not fit these
        blocks, or is adopted before ``steps`` (the step the checkpoint resumes at); saved layers
        this model lacks are ignored, as their factors are."""
        if state is None:
            return
        if not isinstance(state, dict) or not isinstance(state.get("factors"), dict) or "adopt_at" not in state:
            raise ValueError("expected None or a dict with 'adopt_at' and 'factors'")
        adopt_at = state["adopt_at"]
        if adopt_at is not None and (isinstance(adopt_at, bool) or not isinstance(adopt_at, int) or adopt_at < steps):
            raise ValueError(f"'adopt_at' must be None or an int >= 'steps' ({steps}), got {adopt_at!r}")
        blocks = {block.name: block for block in self._blocks}
        for block_name, factors in state["factors"].items():
            if block_name not in blocks:
                continue
            with within(f"layer '{block_name}'"):
                if not isinstance(factors, dict):
                    raise ValueError(f"expected a dict of factors, got {type(factors).__name__}")
                for name, result in factors.items():
                    if name not in blocks[block_name].factors:
                        raise ValueError(f"this layer has no factor {name!r}")
                    with within(f"factor {name}"):
                        _check_result(blocks[block_name].factors[name], result, self._method)

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Replace the round in flight by a checked :meth:`state_dict` (None: none), after the blocks loaded."""
        self._drop_round()
        if state is None:
            return
        blocks = {block.name: block for block in self._blocks}
        results = [
            (Job((blocks[block_name], name), blocks[block_name].factors[name], saved["version"], self._method,
                 float(saved["shift"]), self._inv_dtype, None),
             blocks[block_name].factors[name].loaded_decomposition(self._method, saved["decomposition"]))
            for block_name, factors in state["factors"].items() if block_name in blocks
            for name, saved in factors.items()
        ]
        self._hold(results, state["adopt_at"])

    def _round_in_flight(self) -> tuple[Round, int | None]:
        """The round in flight and :attr:`adopt_at` (none in line)."""
        return [], None

    def _drop_round(self) -> None:
        """Forget any round in flight (none in line)."""

    def _hold(self, results: Round, adopt_at: int | None) -> None:
        """A checkpoint's round (``results`` of the factors of this model), adopted at once in line:
        a synchronous run holds the newest decompositions it has, and refreshes them all at its next
        decomposition step anyway."""
        self.adopt(results)


class BackgroundDecompositionSteps(InLineDecompositionSteps):
    """``AsyncConfig``: a factor's first decomposition in line, the others in rounds on the
    background worker from snapshots; a round submitted at a decomposition step is adopted at the
    next one, or ``config.delay`` steps later (the same step on every rank), then shared."""

    remeasures = False

    def __init__(self, blocks: Sequence[KroneckerBlock], method: Method, inv_dtype: torch.dtype,
                 strategy: DistributionStrategy, reporter: Reporter, nonfinite: Tensor, config: AsyncConfig) -> None:
        super().__init__(blocks, method, inv_dtype, strategy, reporter, nonfinite)
        self.background = BackgroundDecompositions()
        self._delay = config.delay
        self.adopt_at = None

    def step(self, damping: float, step: int) -> None:
        """Make the factors global, adopt the round the worker was given at the previous decomposition
        step (waiting for it if needed), decompose in line only the factors that have no decomposition
        yet, share, and hand the rest to the worker as snapshots."""
        self._synchronize()
        self._adopt_round()
        jobs = self._decompose(damping, only_missing=False)
        self.background.submit(jobs)
        # On every rank, jobs or not: the adopt step shares decompositions (a collective). When
        # no rank had a job (e.g. step 0, all in line) that exchange resends what receivers hold.
        if self._delay is not None and any(block.factors for block in self._blocks):
            self.adopt_at = step + self._delay
        self._share()

    def between(self, step: int) -> None:
        """``AsyncConfig.delay``: adopt the round in flight at its step (the same on every rank), and share."""
        if self.adopt_at == step:
            self._adopt_round()
            self._share()

    def _adopt_round(self) -> None:
        """Hold the decompositions of the worker's round (reporting the ones that failed)."""
        self.adopt_at = None
        self.adopt(self.background.collect())

    def _job(self, block: KroneckerBlock, name: str, factor: Factor, shift: float,
             drop_below: float | None) -> Job | None:
        if factor.decomposition is None:
            return None  # a first decomposition: in line
        return Job((block, name), factor.snapshot(), factor.version, self._method, shift, self._inv_dtype, drop_below)

    def _round_in_flight(self) -> tuple[Round, int | None]:
        """The round in flight (waiting for the worker; it stays in flight) and :attr:`adopt_at`."""
        return self.background.wait(), self.adopt_at

    def _drop_round(self) -> None:
        """A round in flight decomposes the factors being replaced: stop it."""
        self.background.close()
        self.adopt_at = None

    def _hold(self, results: Round, adopt_at: int | None) -> None:
        """Hold the saved round (the results of the factors this rank decomposes) and adopt it at its
        saved step, as in the run that saved it."""
        decomposes = self._strategy.decomposes
        self.background.hold([(job, r) for job, r in results if decomposes(job.owner[0].name, job.owner[1])])
        self.adopt_at = adopt_at  # on every rank alike, as it decides a collective


DecompositionSteps = InLineDecompositionSteps
"""The decomposition steps' interface (:class:`BackgroundDecompositionSteps` is one)."""


def decomposition_steps(blocks: Sequence[KroneckerBlock], method: Method, inv_dtype: torch.dtype,
                        strategy: DistributionStrategy, reporter: Reporter, nonfinite: Tensor,
                        asynchronous: AsyncConfig | None) -> DecompositionSteps:
    """Rounds on the background worker with ``asynchronous`` (``KFACOptions.asynchronous``), in line otherwise."""
    if asynchronous is None:
        return InLineDecompositionSteps(blocks, method, inv_dtype, strategy, reporter, nonfinite)
    return BackgroundDecompositionSteps(blocks, method, inv_dtype, strategy, reporter, nonfinite, asynchronous)


def _check_result(factor: Factor, state: Any, method: Method) -> None:
    """Raise ``ValueError`` naming the field if ``state`` is not one factor's entry of the round (see
    :meth:`InLineDecompositionSteps.state_dict`)."""
    if not isinstance(state, dict):
        raise ValueError(f"expected a dict, got {type(state).__name__}")
    for key in ("decomposition", "version", "shift"):
        if key not in state:
            raise ValueError(f"'{key}' is missing")
    factor.check_decomposition(method, state["decomposition"])
    version, shift = state["version"], state["shift"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"'version' must be an int >= 0, got {version!r}")
    if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not math.isfinite(shift):
        raise ValueError(f"'shift' must be a finite float, got {shift!r}")
