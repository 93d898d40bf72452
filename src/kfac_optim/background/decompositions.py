"""Decompositions off the critical path: ``KFAC(asynchronous=AsyncConfig())``.

Owns: one worker thread that decomposes a round of factor snapshots, and handing the results
back when the optimizer collects them; a round whose results were fetched early (to save them in a
checkpoint, :meth:`BackgroundDecompositions.wait`) or restored from one (:meth:`~BackgroundDecompositions.hold`)
is held until collected, so saving does not change when it is adopted.
Must not know: layers, ranks, schedules (``decomposition_steps.py`` decides what to snapshot and when to
collect, and at which step results are adopted: docs/design.md §4, step 3).

The worker only reads its snapshots (copies taken on the optimizer's thread), so the optimizer
keeps folding into the running factors meanwhile. On CUDA the worker runs on its own stream,
after the snapshots are written (an event recorded on the submitting stream), and collecting
makes the collecting stream wait for the worker's. Memory: one snapshot per factor in the round
until it is collected.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kfac_optim import linalg

if TYPE_CHECKING:
    from kfac_optim.layers.factor import Factor
    from kfac_optim.methods import Method

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """Decompose ``factor`` (a :meth:`Factor.snapshot` taken at ``version``) by ``method`` with
    ``shift``, ``dtype`` and ``drop_below`` (see ``Method.decompose``). ``owner`` is the caller's tag
    (e.g. its block and factor name)."""

    owner: Any
    factor: Factor
    version: int
    method: Method
    shift: float
    dtype: torch.dtype
    drop_below: float | None


Result = linalg.Eigen | Tensor | None


class BackgroundDecompositions:
    """At most one round in flight: :meth:`submit` a list of jobs, :meth:`collect` their results.

    A round is in flight from :meth:`submit` until :meth:`collect`, whether the worker still runs it
    or its results are held (:meth:`wait`, :meth:`hold`).
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._jobs: list[Job] = []
        self._round: Future[tuple[list[Result], torch.cuda.Event | None]] | None = None
        self._held: list[tuple[Job, Result]] | None = None

    @property
    def in_flight(self) -> bool:
        return self._round is not None or self._held is not None

    def submit(self, jobs: list[Job]) -> None:
        """Start decomposing ``jobs`` on the worker (a no-op for none). A round must not be in flight."""
        if not jobs:
            return
        if self.in_flight:
            raise RuntimeError("a round of decompositions is already in flight; collect it first")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kfac-decompositions")
        device = jobs[0].factor.running.device
        stream = ready = None
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            ready = torch.cuda.current_stream(device).record_event()
        self._jobs = jobs
        self._round = self._executor.submit(_run, jobs, stream, ready)
        logger.debug("submitted %d decompositions to the worker", len(jobs))

    def wait(self) -> list[tuple[Job, Result]]:
        """The in-flight round's jobs with their results, as :meth:`collect`, but the round stays in
        flight (held) until collected; ``[]`` when none is in flight."""
        if self._held is None and self._round is not None:
            self._held = self._collect_worker()
        return list(self._held or [])

    def hold(self, results: list[tuple[Job, Result]]) -> None:
        """Make ``results`` (e.g. a saved :meth:`wait`) the round in flight, replacing any (a no-op for none)."""
        self.close()
        if results:
            self._held = list(results)

    def collect(self) -> list[tuple[Job, Result]]:
        """The in-flight round's jobs with their results (None: failed), waiting for the worker if
        it has not finished; ``[]`` when no round is in flight. Re-raises a worker's exception."""
        if self._held is not None:
            held, self._held = self._held, None
            return held
        if self._round is None:
            return []
        return self._collect_worker()

    def _collect_worker(self) -> list[tuple[Job, Result]]:
        assert self._round is not None
        future, jobs = self._round, self._jobs
        self._round, self._jobs = None, []
        results, done = future.result()
        if done is not None:
            torch.cuda.current_stream(jobs[0].factor.running.device).wait_event(done)
        return list(zip(jobs, results, strict=True))

    def close(self) -> None:
        """Wait for the worker and stop it (results of a round in flight, held ones included, are dropped)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._round, self._jobs, self._held = None, [], None


def on_worker_stream(stream: torch.cuda.Stream | None) -> AbstractContextManager[Any]:
    """Enter ``stream`` on a worker thread (a no-op context for None).

    A new thread has no current CUDA context, and ``torch.cuda.stream`` does not make one current
    when the stream's device is already the thread's current device index; cuBLAS and cuSOLVER then
    find no context (torch warns once and sets the primary context itself). Setting the device
    first makes the device's primary context current on this thread.
    """
    if stream is None:
        return nullcontext()
    torch.cuda.set_device(stream.device)
    return torch.cuda.stream(stream)


def _run(
    jobs: list[Job], stream: torch.cuda.Stream | None, ready: torch.cuda.Event | None
) -> tuple[list[Result], torch.cuda.Event | None]:
    """The worker's round: every job's decomposition, and on CUDA an event recorded after them."""
    with torch.no_grad(), on_worker_stream(stream):
        if stream is not None and ready is not None:
            stream.wait_event(ready)
        results = [job.method.decompose(job.factor, job.shift, job.dtype, job.drop_below) for job in jobs]
        done = stream.record_event() if stream is not None else None
    return results, done
