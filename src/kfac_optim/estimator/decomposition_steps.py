"""The decomposition steps, in line or with rounds on the background worker.

Owns: a decomposition step (make the factors global, decompose what this rank owns, share), the
decomposition step's one host sync (the factors' health flags and the non-finite directions' count,
handed to the ``Reporter``), and with ``AsyncConfig`` the rounds of ``BackgroundDecompositions``:
which factors go to the worker, the step a round is adopted at (``adopt_at``), adopting it, and
its part of a checkpoint (:meth:`InLineDecompositionSteps.saved_round`, :meth:`InLineDecompositionSteps.restore`).
Chosen once, at construction (:func:`decomposition_steps`). (How one factor is decomposed is the
method's business: ``methods.py``.)
Must not know: statistics (the caller settles them first), schedules (the caller says which steps
decompose), checkpoints' format (``checkpoint.py``), the optimizer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

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

    def __init__(self, blocks: Sequence[KroneckerBlock], method: Method, inv_dtype: torch.dtype, strategy: DistributionStrategy,
                 reporter: Reporter, nonfinite: Tensor) -> None:
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

    def saved_round(self) -> tuple[Round, int | None]:
        """The round in flight and :attr:`adopt_at`, for a checkpoint (none in line)."""
        return [], None

    def drop_round(self) -> None:
        """Before a restore replaces the factors: forget any round in flight (none in line)."""

    def restore(self, results: Round, adopt_at: int | None, round_saved: bool) -> None:
        """After a restore: a checkpoint's round in flight (``results`` of the factors of this model,
        ``adopt_at`` its step, ``round_saved`` whether the checkpoint held one), adopted at once in
        line: a synchronous run holds the newest decompositions it has, and refreshes them all at
        its next decomposition step anyway."""
        self.adopt(results)


class BackgroundDecompositionSteps(InLineDecompositionSteps):
    """``AsyncConfig``: a factor's first decomposition in line, the others in rounds on the
    background worker from snapshots; a round submitted at a decomposition step is adopted at the
    next one, or ``config.delay`` steps later (the same step on every rank), then shared."""

    remeasures = False

    def __init__(self, blocks: Sequence[KroneckerBlock], method: Method, inv_dtype: torch.dtype, strategy: DistributionStrategy,
                 reporter: Reporter, nonfinite: Tensor, config: AsyncConfig) -> None:
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

    def saved_round(self) -> tuple[Round, int | None]:
        """The round in flight (waiting for the worker; it stays in flight) and :attr:`adopt_at`."""
        return self.background.wait(), self.adopt_at

    def drop_round(self) -> None:
        """A round in flight decomposes the factors being replaced: stop it."""
        self.background.close()
        self.adopt_at = None

    def restore(self, results: Round, adopt_at: int | None, round_saved: bool) -> None:
        """Hold the saved round (the results of the factors this rank decomposes) and adopt it at its
        saved step, as in the run that saved it."""
        if round_saved:
            decomposes = self._strategy.decomposes
            self.background.hold([(job, r) for job, r in results if decomposes(job.owner[0].name, job.owner[1])])
            self.adopt_at = adopt_at  # on every rank alike, as it decides a collective


DecompositionSteps = InLineDecompositionSteps
"""The decomposition steps' interface (:class:`BackgroundDecompositionSteps` is one)."""


def decomposition_steps(blocks: Sequence[KroneckerBlock], method: Method, inv_dtype: torch.dtype, strategy: DistributionStrategy,
                        reporter: Reporter, nonfinite: Tensor, asynchronous: AsyncConfig | None) -> DecompositionSteps:
    """Rounds on the background worker with ``asynchronous`` (``KFACOptions.asynchronous``), in line otherwise."""
    if asynchronous is None:
        return InLineDecompositionSteps(blocks, method, inv_dtype, strategy, reporter, nonfinite)
    return BackgroundDecompositionSteps(blocks, method, inv_dtype, strategy, reporter, nonfinite, asynchronous)
