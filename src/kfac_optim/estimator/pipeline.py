"""The statistics pipeline: captured statistics to running factors, in line or on the statistics worker.

Owns: the capture it builds (``StatisticsCapture``, hooks and all), where a factor step's fold runs
(in line; or on the ``StatisticsWorker`` of ``RuntimeConfig(async_statistics=True)``, at most one
factor step in flight, and in line under Apex amp, whose loss scale is read during the backward),
discarding a step's statistics, settling (waiting for the worker before the factors are read), and
the worker's one-time warnings. Chosen once, at construction (:func:`statistics_pipeline`).
Must not know: schedules (which blocks fold when: the fold schedule), decompositions, ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from torch import Tensor, nn
from torch.profiler import record_function

from kfac_optim.background.statistics import StatisticsWorker
from kfac_optim.capture.hooks import Recording, StatisticsCapture
from kfac_optim.diagnostics import warn_user
from kfac_optim.layers import KroneckerBlock
from kfac_optim.precision import MixedPrecision

logger = logging.getLogger(__name__)


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
    discard_pending(blocks)  # a no-op for blocks that folded or captured nothing


def discard_pending(blocks: Sequence[KroneckerBlock]) -> None:
    """Forget the pending statistics of ``blocks``."""
    for block in blocks:
        block.discard_pending()


class InLineStatistics:
    """Statistics computed where they are captured and folded in ``step()``: nothing to wait for.

    ``blocks``: all of them; ``capture``: their capture; ``decay``, ``reduction``: the fold's
    (``CurvatureConfig.factor_decay``, ``.reduction``).
    """

    worker: StatisticsWorker | None = None

    def __init__(self, blocks: Sequence[KroneckerBlock], capture: StatisticsCapture, decay: float,
                 reduction: str) -> None:
        self.blocks = blocks
        self.capture = capture
        self._decay = decay
        self._reduction = reduction

    def recording(self) -> Recording:
        """At a factor step, before its fold: what the capture saw since the last one (its per-step
        flags are reset; the recorded count is reset by the fold)."""
        capture = self.capture
        seen = Recording(capture.recorded, capture.arrivals, capture.transformed_skipped,
                         capture.graph_backward_skipped, capture.active)
        capture.transformed_skipped = capture.graph_backward_skipped = False
        capture.arrivals = 0
        return seen

    def settle(self) -> None:
        """Make the factors and pending statistics readable here (nothing is in flight in line)."""

    def discard_pending(self) -> None:
        """Forget the statistics captured since the last step (e.g. of a step that will not happen)."""
        discard_pending(self.blocks)
        self.capture.forget()

    @record_function("kfac.fold")
    def fold(self, folding: Sequence[KroneckerBlock], statistics_scale: float | Tensor) -> None:
        """Fold ``folding``'s pending statistics into their factors (``statistics_scale``: the loss
        scale's correction) and forget the others'."""
        self._fold_now(folding, statistics_scale)
        self.capture.forget()

    def _fold_now(self, folding: Sequence[KroneckerBlock], statistics_scale: float | Tensor) -> None:
        fold_statistics(self.blocks, folding, self._decay, self._reduction, statistics_scale)

    def report(self) -> None:
        """The pipeline's one-time warnings after a step's statistics work (none in line)."""


class WorkerStatistics(InLineStatistics):
    """Statistics on the ``worker`` thread (see ``statistics_worker``): the capture hands it each
    pair's Gram products and :meth:`fold` a factor step's fold, after the previous one's. Under Apex
    amp (``under_apex()``) both stay in line (one warning)."""

    def __init__(self, blocks: Sequence[KroneckerBlock], capture: StatisticsCapture, decay: float,
                 reduction: str, worker: StatisticsWorker, under_apex: Callable[[], bool]) -> None:
        super().__init__(blocks, capture, decay, reduction)
        self.worker = worker
        self._under_apex = under_apex
        self._last_fold: Future[None] | None = None  # the latest factor step's fold
        self._reported_overwritten: set[str] = set()
        self._warned_apex = False

    def settle(self) -> None:
        """Wait until the worker has run everything submitted, so that the factors and pending
        statistics may be read here."""
        self.worker.wait()
        self._last_fold = None

    def discard_pending(self) -> None:
        if self.capture.recorded:  # after the worker's work on them (in order)
            self.worker.submit(discard_pending, self.blocks)
        self.capture.forget()

    @record_function("kfac.fold")
    def fold(self, folding: Sequence[KroneckerBlock], statistics_scale: float | Tensor) -> None:
        if self._under_apex():
            self.settle()
            self._fold_now(folding, statistics_scale)
        else:  # after the previous factor step's (at most one in flight), then this one's
            if self._last_fold is not None:
                self.worker.wait(self._last_fold)
            self._last_fold = self.worker.submit(fold_statistics, self.blocks, folding, self._decay,
                                                 self._reduction, statistics_scale)
        self.capture.forget()

    def report(self) -> None:
        """Warn once about pairs the worker dropped because their tensors were modified in place
        before it read them, and about Apex keeping the statistics in line."""
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
        if not self._warned_apex and self._under_apex():
            self._warned_apex = True
            warn_user(
                "RuntimeConfig(async_statistics=True) does not apply under Apex amp (its loss scale is read during the "
                "backward pass): the statistics are computed in line"
            )


StatisticsPipeline = InLineStatistics
"""The pipeline's interface (:class:`WorkerStatistics` is one)."""


def statistics_pipeline(blocks: Sequence[KroneckerBlock], model: nn.Module, precision: MixedPrecision, *,
                        every_backward: bool, on_worker: bool, decay: float, reduction: str,
                        resharded: Callable[[Tensor], bool]) -> StatisticsPipeline:
    """The pipeline for ``blocks`` of ``model``, with its capture: hooks that accumulate through
    ``precision``, recording ``every_backward`` (the empirical Fisher) or only ``sample_fisher``'s
    pass; on the statistics worker when ``on_worker`` (``RuntimeConfig.async_statistics``); ``resharded``:
    as ``StatisticsCapture``'s."""
    worker = StatisticsWorker() if on_worker else None
    capture = StatisticsCapture(
        blocks,
        precision.accumulate,
        every_backward=every_backward,
        worker=worker,
        in_line=precision.under_apex,  # Apex's loss scale is read during backward
        model=model,  # its calls delimit samples (chunked forwards: capture.py)
        resharded=resharded,
    )
    if worker is None:
        return InLineStatistics(blocks, capture, decay, reduction)
    return WorkerStatistics(blocks, capture, decay, reduction, worker, precision.under_apex)
