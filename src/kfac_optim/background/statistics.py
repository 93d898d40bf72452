"""Statistics off the critical path: ``KFAC(runtime=RuntimeConfig(async_statistics=True))``.

Owns: one worker thread that runs statistics work (a captured pair's Gram products, a factor
step's fold) in submission order, waiting for it, and surfacing its errors on the caller's thread.
Must not know: layers, factors, schedules (the capture and the optimizer decide what to submit and
when to wait; see docs/design.md §4, "Statistics off the critical path").

The contract that keeps the result exact: work is submitted in the order the synchronous mode
would run it, runs in that order on one thread, with the submitter's intra-op thread count, and
whatever it writes (pending sums, running factors) is read by the optimizer's thread only after
:meth:`StatisticsWorker.wait`. The factors are then the synchronous mode's, bit for bit: the same
operations on the same tensors in the same order, only later.

On CUDA a piece of work runs on the stream that was current where it was submitted, so it is
ordered after the kernels that produced its inputs and, once waited for, before anything the
optimizer enqueues next on that stream: the host work leaves the critical path, the device work
stays on its stream (no cross-stream synchronization is needed).

A failure in the worker stops it: later work is dropped (the statistics it would have built
could be partial) and the error is raised on the optimizer's thread at the next submit or wait.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kfac_optim.background.decompositions import on_worker_stream

logger = logging.getLogger(__name__)


class StatisticsWorker:
    """A FIFO of statistics work on one background thread (started at the first :meth:`submit`)."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._last: Future[None] | None = None
        self._error: BaseException | None = None
        self._finalizer: weakref.finalize | None = None

    def submit(self, work: Callable[..., None], *args: Any) -> Future[None]:
        """Queue ``work(*args)`` after everything submitted before; its future completes when it ran.

        Raises:
            RuntimeError: an earlier piece of work failed (chained to its error).
        """
        self._raise_error()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kfac-statistics")
            self._finalizer = weakref.finalize(self, self._executor.shutdown, wait=False, cancel_futures=True)
        stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self._last = self._executor.submit(self._run, work, args, torch.get_num_threads(), stream)
        return self._last

    def wait(self, until: Future[None] | None = None) -> None:
        """Block until ``until`` (default: everything submitted so far) has run.

        Raises:
            RuntimeError: a piece of work failed (chained to its error).
        """
        target = self._last if until is None else until
        if target is not None:
            target.result()
        if until is None:
            self._last = None
        self._raise_error()

    def _run(self, work: Callable[..., None], args: tuple[Any, ...], threads: int, stream: Any) -> None:
        if self._error is not None:
            return
        if torch.get_num_threads() != threads:  # the submitter's count: the same kernels, the same sums
            torch.set_num_threads(threads)
        try:
            with torch.no_grad(), on_worker_stream(stream):
                work(*args)
        except BaseException as error:  # noqa: BLE001 (re-raised on the optimizer's thread)
            logger.debug("statistics worker failed; later statistics work is dropped", exc_info=True)
            self._error = error

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                "K-FAC's statistics worker (RuntimeConfig(async_statistics=True)) failed; the statistics since then "
                "were dropped and no more are computed"
            ) from self._error
