"""Checks, at construction, that every rank built K-FAC with the same settings and layers.

Owns: a readable description of each setting (what ranks compare and what error messages show),
its 64-bit digest, and the one collective that compares the digests of every rank.

Must not know: what the settings mean, the optimizer, layers' math. It compares strings.

Why: K-FAC's collectives are only matched when every rank takes the same factor and
decomposition steps over the same layers with the same plan. Ranks built differently either
drift apart silently (another ``damping``) or abort in the backend with a message that does not
say why (another ``decomposition_update_steps``, ``method`` or layer list). One ``all_gather`` of one int64
per setting at construction turns that into a ``ValueError`` naming the setting and the ranks.

How values are described (ranks compare these strings):
- numbers, strings, dtypes, ``None``: ``repr``;
- a callable (a schedule): its qualified name (``module.qualname`` of a function; the ``repr``
  of a callable object with its own ``repr``, such as ``MilestoneSchedule(...)``; else its
  class's qualified name) plus its value at step 0. Two lambdas on the same source line with
  different closures that agree at step 0 are not told apart;
- sequences: the description of each element, in order (the layer list).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from kfac_optim.distributed.comm import collective

Description = str | tuple[str, ...]


def describe(value: object) -> str:
    """The string ranks compare for one setting's value (see the module docstring)."""
    if callable(value) and not isinstance(value, type):
        return f"{_callable_name(value)} (at step 0: {_value_at_zero(value)})"
    return repr(value)


def _callable_name(function: Callable[..., object]) -> str:
    qualname = getattr(function, "__qualname__", None)
    if qualname is not None:
        return f"{getattr(function, '__module__', '?')}.{qualname}"
    text = repr(function)
    if type(function).__repr__ is not object.__repr__ and " at 0x" not in text:
        return text
    cls = type(function)
    return f"{cls.__module__}.{cls.__qualname__}"


def _value_at_zero(function: Callable[[int], object]) -> str:
    try:
        return repr(function(0))
    except Exception as error:  # noqa: BLE001 (the rank raises when it uses it; here ranks must not part ways)
        return f"raises {type(error).__name__}"


def _digest(name: str, description: Description) -> int:
    text = name + "=" + (description if isinstance(description, str) else "\n".join(description))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def check_same_on_every_rank(
    settings: Mapping[str, Description],
    process_group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """Raise on every rank if any rank's ``settings`` differ from another's (a collective).

    ``settings``: ``{name: description}`` in the same order on every rank; a description is a
    string or, for a list (the layers), a tuple of strings. ``device``: where the collective's
    tensor lives (the model's device: CUDA under NCCL). One ``all_gather`` of ``len(settings)``
    int64 digests; only when they differ, a second one exchanges the readable values of the first
    differing setting for the message.

    Raises:
        ValueError: the first setting (in ``settings`` order) whose value differs across ranks,
            with each rank's value (for a list, its first differing entry), on every rank.
        RuntimeError: the collective failed (a rank raised before reaching it, died, or did not
            construct ``KFAC``), as :func:`~kfac_optim.distributed.comm.collective` says.
    """
    world = dist.get_world_size(process_group)
    names = list(settings)
    what = "KFAC(...): the construction-time check that every rank has the same settings"
    local = torch.tensor([_digest(n, settings[n]) for n in names], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    with collective(what, process_group):
        dist.all_gather(gathered, local, group=process_group)
    table = torch.stack(gathered).cpu()
    differing = (table != table[0]).any(dim=0).nonzero().flatten().tolist()
    if not differing:
        return
    name = names[differing[0]]
    values: list[Description | None] = [None] * world
    with collective(what, process_group):
        dist.all_gather_object(values, settings[name], group=process_group)
    raise ValueError(_mismatch_message(name, values, dist.get_rank(process_group)))


def _mismatch_message(name: str, values: Sequence[Description | None], rank: int) -> str:
    """``name`` differs across ranks: which ranks have which value (a list: its first difference)."""
    if all(isinstance(v, tuple) for v in values):
        lists = [v for v in values if isinstance(v, tuple)]
        index = next(i for i in range(max(map(len, lists)) + 1) if len({v[i:i + 1] for v in lists}) > 1)
        shown = [v[index] if index < len(v) else f"(none: {len(v)} entries)" for v in lists]
        subject = f"{name} (entry {index}; {', '.join(f'rank {r}: {len(v)} entries' for r, v in enumerate(lists))})"
    else:
        shown = [str(v) for v in values]
        subject = name
    by_value: dict[str, list[int]] = {}
    for r, value in enumerate(shown):
        by_value.setdefault(value, []).append(r)
    ranks = "; ".join(f"ranks {members}: {value}" for value, members in by_value.items())
    return (
        f"KFAC settings differ across ranks: {subject} differs ({ranks}; this is rank {rank}). "
        "Construct KFAC with the same arguments and the same model on every rank."
    )

