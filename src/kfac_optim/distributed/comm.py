"""Collectives of distributed K-FAC: bucketed asynchronous all-reduce and broadcasts of tensors.

Owns: the process groups a :class:`~kfac_optim.distributed.plan.Plan` asks for (created once, at
construction, in the plan's order, on every rank), packing tensors into flat buffers of bounded
size ("buckets"), launching the collectives asynchronously and unpacking their results.

Must not know: layers, what a factor means, the optimizer. It knows tensors and ranks.

Conventions:
- Ranks are ranks *within* the communicator's group, ``0 .. world_size - 1`` (the plan's ranks).
- A symmetric ``(n, n)`` matrix travels as its upper triangle (``linalg.pack_symmetric``,
  ``n(n+1)/2`` entries), about half the bytes, and is unpacked whole on arrival.
- Sums are ``SUM`` all-reduces; callers divide (gloo's ``AVG`` is not safe to rely on).
- Buffers keep the tensors' dtype and device: fp32 factors travel as fp32, CUDA tensors over
  NCCL, CPU tensors over gloo; nothing here assumes a backend.
- Every operation is a no-op with one rank (no process group, or a group of one): ``wait()``
  hands back the tensors it was given.
- Every operation is labelled (``what``: the user's call and the collective's job); a failure at
  launch or at ``wait()`` is re-raised by :func:`collective` naming K-FAC, the call and the usual
  causes, instead of the backend's bare "size mismatch" or "connection closed".
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from kfac_optim import linalg

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Upper bound on one flat buffer (a tensor larger than this travels alone in its own)."""

_communicators_per_group: dict[str, int] = {}
"""How many active communicators this process made per process group (their store keys' prefix)."""


def group_rank_and_size(process_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, world_size)`` of this process in ``process_group`` (default: the whole job).

    ``(0, 1)`` when ``torch.distributed`` is not initialized.

    Raises:
        ValueError: ``process_group`` given while ``torch.distributed`` is not initialized, or
            this process is not a member of it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("process_group given but torch.distributed is not initialized")
        return 0, 1
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError("process_group: this process is not a member of the group")
    return rank, dist.get_world_size(process_group)


CAUSES = (
    "K-FAC's collectives run inside KFAC(...), step(), synchronize_factors() and kfac_state() under DCP: call "
    "them on every rank, in the same order, with KFAC constructed alike on every rank. A rank that "
    "died or hangs makes the others fail here once the process group's timeout "
    "(init_process_group(timeout=...)) has passed."
)
"""The usual causes of a failed K-FAC collective, appended to its error message."""


@contextmanager
def collective(what: str, process_group: dist.ProcessGroup | None) -> Iterator[None]:
    """Re-raise a failure of the collectives launched or awaited inside as one naming ``what``.

    ``what``: the user's call and the collective's job, e.g. "KFAC.synchronize_factors(): the all-reduce
    of the running factors". A ``torch.distributed.DistError`` keeps its type (DistBackendError,
    DistNetworkError, ...), any other ``RuntimeError`` becomes a ``RuntimeError``; the backend's
    error is chained as the cause. Wrap only collective calls: any ``RuntimeError`` is taken for
    one.
    """
    try:
        yield
    except RuntimeError as error:
        rank, world = group_rank_and_size(process_group)
        message = f"{what} failed on rank {rank} of {world}: {error}\n{CAUSES}"
        raise (type(error)(message) if isinstance(error, dist.DistError) else RuntimeError(message)) from error


class Pending:
    """Collectives in flight. :meth:`wait` completes them and returns the results once.

    ``what`` and ``process_group`` name them in a failure (see :func:`collective`).
    """

    def __init__(
        self,
        works: Sequence[dist.Work],
        finish: Callable[[], list[Tensor]],
        what: str = "a K-FAC collective",
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self._works = list(works)
        self._finish = finish
        self._what = what
        self._group = process_group

    @classmethod
    def done(cls, tensors: Sequence[Tensor]) -> Pending:
        """Nothing to wait for: ``wait()`` returns ``tensors``."""
        result = list(tensors)
        return cls((), lambda: result)

    def wait(self) -> list[Tensor]:
        """Block until the collectives finished (CUDA: until queued on the current stream)."""
        with collective(self._what, self._group):
            for work in self._works:
                work.wait()
        self._works = []  # the backend's work objects (and the buffers they hold) need not outlive the wait
        return self._finish()


@dataclass(frozen=True)
class _Bucket:
    """One flat buffer holding the flattened tensors ``indices`` back to back."""

    indices: tuple[int, ...]
    sizes: tuple[int, ...]
    buffer: Tensor


class Communicator:
    """Collectives over one process group and the sub-groups a plan needs.

    Args:
        process_group: the group K-FAC runs on (None: the whole job, when initialized).
        group_ranks: rank tuples (ranks of ``process_group``) that need a group of their own, in
            the order every rank must create them (``Plan.groups``). The tuple of every rank is
            always available and uses ``process_group`` itself; tuples of one rank need none.
        bucket_bytes: upper bound on one flat buffer.

    Raises:
        ValueError: as :func:`group_rank_and_size`; ``bucket_bytes < 1``; sub-groups asked for
            while ``process_group`` covers only part of the job (``dist.new_group`` must then be
            entered by processes outside it, which do not run this code).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        group_ranks: Sequence[tuple[int, ...]] = (),
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.rank, self.world_size = group_rank_and_size(process_group)
        self.group = process_group
        self.bucket_bytes = bucket_bytes
        self.bytes_sent: Counter[str] = Counter()
        """Payload bytes handed to collectives so far (flat buffers as sent), by the callers' ``tag``."""
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self._confirmed_calls = 0
        if self.active:
            name = self._process_group().group_name
            self._instance = _communicators_per_group.get(name, 0)
            _communicators_per_group[name] = self._instance + 1
            self._create_groups(group_ranks)

    @property
    def active(self) -> bool:
        """Whether there is anyone to talk to (more than one rank)."""
        return self.world_size > 1

    def _process_group(self) -> dist.ProcessGroup:
        return self.group if self.group is not None else dist.group.WORLD

    def confirm_every_rank_calls(self, call: str, why: str) -> None:
        """Before collectives that ``call`` runs only sometimes: make sure every rank made it.

        Each rank writes a key for this call to the process group's store and waits for the
        others' keys, up to the store's timeout (``init_process_group(timeout=...)``). The store
        is not the backend's transport, so a rank that went on to another collective cannot be
        matched against this one (gloo aborts the process on a size mismatch). ``why``: why
        ``call`` communicates now, for the message. Every communicator of a group is created on
        every rank in the same order and confirms the same calls, so the keys line up.

        Raises:
            RuntimeError: some rank did not make the call in time; the message names them.
        """
        if not self.active:
            return
        store = self._process_group().get_group_store()
        prefix = f"kfac_optim/{self._instance}/{self._confirmed_calls}"
        self._confirmed_calls += 1
        keys = [f"{prefix}/{rank}" for rank in range(self.world_size)]
        store.set(keys[self.rank], call)
        try:
            store.wait(keys)
        except RuntimeError as error:
            missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
            raise RuntimeError(
                f"{call} is a collective now ({why}), but rank(s) {missing} of the K-FAC process group did "
                f"not call it within the store's timeout of {store.timeout} ({error}). Call it on every "
                "rank (and save on one)."
            ) from error

    def _create_groups(self, group_ranks: Sequence[tuple[int, ...]]) -> None:
        everyone = tuple(range(self.world_size))
        subgroups = [ranks for ranks in group_ranks if len(ranks) > 1 and ranks != everyone]
        if subgroups and self.world_size != dist.get_world_size():
            raise ValueError(
                "process_group covers part of the job, but this grad_worker_fraction needs "
                "sub-groups, which every process of the job would have to create; use "
                "grad_worker_fraction 1 or 1/world_size with a partial process_group"
            )
        self._groups[everyone] = self.group
        for ranks in group_ranks:
            if len(ranks) > 1 and ranks != everyone:
                parent = self.group if self.group is not None else dist.group.WORLD
                global_ranks = [dist.get_global_rank(parent, r) for r in ranks]
                group = dist.new_group(global_ranks)  # entered by every rank, in the same order
                if self.rank in ranks:
                    self._groups[ranks] = group

    def subgroup(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The process group created for ``ranks`` (ascending; this rank among them; None: the
        default group, when ``ranks`` is every rank of it)."""
        return self._groups[ranks]

    # -- collectives -------------------------------------------------------------------------

    def all_reduce_sum(
        self,
        tensors: Sequence[Tensor],
        *,
        symmetric: bool | Sequence[bool] = False,
        in_place: bool = False,
        what: str = "a K-FAC all-reduce",
        tag: str = "other",
    ) -> Pending:
        """Sum ``tensors`` over all ranks, asynchronously; every rank must call with like shapes.

        ``wait()`` returns the sums: new tensors, or with ``in_place`` the inputs overwritten
        (they are copied into the buffers at the call, so they may change until ``wait()``,
        and no ``(n, n)`` result is allocated). With ``symmetric`` (for all tensors, or one flag per
        tensor) a tensor is a symmetric ``(n, n)`` matrix and only its upper triangle travels. One
        rank: ``wait()`` returns ``tensors`` themselves. ``what`` names the collective in a failure
        (see :func:`collective`); ``tag`` names what is sent in :attr:`bytes_sent`.
        """
        if not self.active or not tensors:
            return Pending.done(tensors)
        buckets = self._pack(tensors, symmetric, tag)
        with collective(what, self.group):
            works = [
                dist.all_reduce(b.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                for b in buckets
            ]
        shapes = [t.shape for t in tensors]
        outputs = tensors if in_place else None
        return Pending(works, partial(self._unpack, buckets, shapes, symmetric, outputs), what, self.group)

    def broadcast(
        self,
        tensors: Sequence[Tensor],
        src: int,
        ranks: tuple[int, ...],
        *,
        symmetric: bool | Sequence[bool] = False,
        what: str = "a K-FAC broadcast",
        tag: str = "other",
    ) -> Pending:
        """Send ``src``'s ``tensors`` to every rank of ``ranks``, asynchronously.

        Only the ranks in ``ranks`` (one of the ``group_ranks`` given at construction, or a
        single rank) call this, in the same order. On ``src``, ``tensors`` are the data; on the
        others, buffers of the same shapes and dtypes that ``wait()`` overwrites and returns.
        ``symmetric``, ``what``, ``tag``: as in :meth:`all_reduce_sum`.
        """
        if len(ranks) == 1 or not tensors:
            return Pending.done(tensors)
        if self.rank not in ranks or src not in ranks:
            raise ValueError(f"rank {self.rank} and src {src} must be among {ranks}")
        group = self._groups[ranks]
        group_src = ranks.index(src)  # groups list their members ascending
        buckets = self._pack(tensors, symmetric, tag)
        with collective(what, self.group):
            works = [
                dist.broadcast(b.buffer, group=group, group_src=group_src, async_op=True)
                for b in buckets
            ]
        if self.rank == src:
            return Pending(works, lambda: list(tensors), what, self.group)
        shapes = [t.shape for t in tensors]
        return Pending(works, partial(self._unpack, buckets, shapes, symmetric, tensors), what, self.group)

    # -- buckets -----------------------------------------------------------------------------

    def _pack(self, tensors: Sequence[Tensor], symmetric: bool | Sequence[bool], tag: str) -> list[_Bucket]:
        """Copy ``tensors`` (triangles where ``symmetric``) into buckets of one dtype and device;
        count their bytes under ``tag``."""
        symmetric = _per_tensor(symmetric, len(tensors))
        sizes = [linalg.triu_size(len(t)) if sym else t.numel() for t, sym in zip(tensors, symmetric, strict=True)]
        groups: list[list[int]] = []
        used = 0
        for index, (tensor, size) in enumerate(zip(tensors, sizes)):
            nbytes = size * tensor.element_size()
            first = tensors[groups[-1][0]] if groups else None
            if first is None or used + nbytes > self.bucket_bytes or (
                (tensor.dtype, tensor.device) != (first.dtype, first.device)
            ):
                groups.append([])
                used = 0
            groups[-1].append(index)
            used += nbytes
        buckets = []
        for members in groups:
            member_sizes = tuple(sizes[i] for i in members)
            first = tensors[members[0]]
            buffer = torch.empty(sum(member_sizes), dtype=first.dtype, device=first.device)
            for index, part in zip(members, buffer.split(member_sizes), strict=True):
                if symmetric[index]:
                    linalg.pack_symmetric(tensors[index], out=part)
                else:
                    part.copy_(tensors[index].reshape(-1))
            buckets.append(_Bucket(tuple(members), member_sizes, buffer))
            self.bytes_sent[tag] += buffer.numel() * buffer.element_size()
        return buckets

    @staticmethod
    def _unpack(
        buckets: Sequence[_Bucket],
        shapes: Sequence[torch.Size],
        symmetric: bool | Sequence[bool],
        outputs: Sequence[Tensor] | None,
    ) -> list[Tensor]:
        """The tensors in ``buckets``, written into ``outputs`` when given, else new tensors."""
        symmetric = _per_tensor(symmetric, len(shapes))
        results: list[Tensor | None] = [None] * len(shapes)
        for bucket in buckets:
            for index, part in zip(bucket.indices, bucket.buffer.split(bucket.sizes), strict=True):
                out = None if outputs is None else outputs[index]
                if symmetric[index]:
                    results[index] = linalg.unpack_symmetric(part, shapes[index][0], out=out)
                elif out is None:
                    results[index] = part.view(shapes[index])
                else:
                    results[index] = out.copy_(part.view(shapes[index]))
        return results  # type: ignore[return-value]  (every index lies in one bucket)


def _per_tensor(symmetric: bool | Sequence[bool], count: int) -> list[bool]:
    """One symmetric flag per tensor, from one flag for all or a flag each."""
    flags = [symmetric] * count if isinstance(symmetric, bool) else list(symmetric)
    if len(flags) != count:
        raise ValueError(f"symmetric needs one flag per tensor ({count}), got {len(flags)}")
    return flags
