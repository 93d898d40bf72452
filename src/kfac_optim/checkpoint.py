"""K-FAC's checkpoints: the ``"kfac"`` entry of ``KFAC.state_dict()``, and its DCP view.

Owns: the entry's framing (``"format"``, :data:`FORMAT`, refused naming it when unknown; the error
prefix ``"K-FAC checkpoint"``) around the estimator's tree of owners (``kfac_optim.state``: each
saves, checks and loads its own part), the hooks through which the entry travels with
``Optimizer.state_dict`` / ``load_state_dict`` (:class:`Checkpointing`), and the ``Stateful`` view
for ``torch.distributed.checkpoint`` (:class:`KFACState`).
Must not know: what an owner saves (factors, rounds, schedules), factor math, ranks, the plan.

``state_dict()``: K-FAC's post hook is registered first, so every post hook a user registers sees
(and may replace) the ``"kfac"`` entry. ``load_state_dict()``: K-FAC's pre hook runs after every
pre hook a user registered (it is registered for the call only), so those see the whole state
and may repair it before K-FAC checks it (the whole tree, before anything changes); the checked
entry is restored after the SGD part loaded, by a post hook that runs before the user's.
``state_dict()`` never communicates: one rank's entry holds the global factors as of the last
reduction plus that rank's statistics since, and the decompositions this rank holds (docs/design.md
§5 "Checkpoints"; docs/api.md ``state_dict()``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from torch.optim import Optimizer

from kfac_optim.state import within

if TYPE_CHECKING:
    from kfac_optim.estimator.estimator import KroneckerEstimator

_NOT_SAVED = ("decomposition", "decomposed_key")

FORMAT = 2
"""The ``"kfac"`` entry's format: dense running factors and inverses packed (their upper triangle,
``Factor.packed``). An entry of another format (or without one: earlier releases) is refused."""


def kfac_state_dict(estimator: KroneckerEstimator) -> dict[str, Any]:
    """The ``"kfac"`` entry: ``{"format": FORMAT, **estimator.state_dict()}``, this rank's state read
    without communicating (see the module docstring)."""
    return {"format": FORMAT, **estimator.state_dict()}


def check(estimator: KroneckerEstimator, kfac_state: Any) -> None:
    """Check a checkpoint's ``"kfac"`` entry: its format, then the estimator's tree against this model.

    Raises:
        ValueError: ``"K-FAC checkpoint, <the keys down to the misfit>: <why>"`` (nothing is changed).
    """
    with within("K-FAC checkpoint"):
        if not isinstance(kfac_state, dict):
            raise ValueError(f"the 'kfac' entry must be a dict, got {type(kfac_state).__name__}")
        version = kfac_state.get("format")
        if version is None:
            raise ValueError("the 'kfac' entry has no 'format': saved by an earlier release of kfac_optim, "
                             "which this release does not read")
        if isinstance(version, bool) or version != FORMAT:
            raise ValueError(f"'format' {version!r} is not one this release reads ({FORMAT}: packed factors); "
                             "was it saved by another release of kfac_optim?")
        estimator.check_state(kfac_state)


def load_kfac_state_dict(estimator: KroneckerEstimator, kfac_state: Any) -> None:
    """Check ``kfac_state`` against the estimator, then restore it."""
    check(estimator, kfac_state)
    estimator.load_state_dict(kfac_state)


class Checkpointing:
    """K-FAC's part of one optimizer's ``state_dict`` / ``load_state_dict``, through the optimizer's hooks."""

    def __init__(self, optimizer: Optimizer, estimator: KroneckerEstimator) -> None:
        self._estimator = estimator
        self._checked: dict[str, Any] | None = None  # between the pre and the post hook
        optimizer.register_state_dict_post_hook(self._add_entry)  # first: the user's hooks see "kfac"
        optimizer.register_load_state_dict_post_hook(self._restore_entry)

    def _add_entry(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        state_dict["kfac"] = kfac_state_dict(self._estimator)  # local: never a collective

    @contextmanager
    def loading(self, optimizer: Optimizer) -> Iterator[None]:
        """Around ``Optimizer.load_state_dict``: check and take the ``"kfac"`` entry after the user's
        pre hooks (the hook is registered last, for this call only)."""
        handle = optimizer.register_load_state_dict_pre_hook(self._take_entry)
        try:
            yield
        finally:
            handle.remove()
            self._checked = None  # the SGD part failed to load: K-FAC is left as it was

    def _take_entry(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict = dict(state_dict)
        kfac_state = state_dict.pop("kfac", None)
        if kfac_state is not None:
            check(self._estimator, kfac_state)
            self._checked = kfac_state
        return state_dict

    def _restore_entry(self, optimizer: Optimizer) -> None:
        if self._checked is not None:
            kfac_state, self._checked = self._checked, None
            self._estimator.load_state_dict(kfac_state)


class HasKFACState(Protocol):
    """What :class:`KFACState` needs of the optimizer (``KFAC``'s public checkpoint methods)."""

    def synchronize_factors(self) -> None: ...

    def kfac_state_dict(self) -> dict[str, Any]: ...

    def load_kfac_state_dict(self, kfac_state: dict[str, Any]) -> None: ...


class KFACState:
    """``torch.distributed.checkpoint.stateful.Stateful`` over one ``KFAC`` optimizer's own state.

    Resharding checkpoints, any world size.

    ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` keys the model and
    the optimizer's per-parameter state (momentum buffers: ``DTensor`` shards under FSDP2) by
    parameter name, and keeps only ``"state"`` and ``"param_groups"``; K-FAC's part travels as its
    own entry::

        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "kfac": optimizer.kfac_state()}
        dcp.save(state, checkpoint_id=path)                     # on every rank

        model_sd, optim_sd = get_state_dict(model, optimizer)   # a fresh model/optimizer, any world size
        state = {"model": model_sd, "optim": optim_sd, "kfac": optimizer.kfac_state()}
        dcp.load(state, checkpoint_id=path)                     # K-FAC's part is restored here
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    The factors saved are the global ones (``KFACState.state_dict`` reduces them first, a collective
    as ``dcp.save`` is; ``KFAC.state_dict()`` itself never communicates), the same on every rank, so
    DCP writes them once and every rank of any world size (one process included) reads them whole.
    Decompositions are not saved: under ``grad_worker_fraction < 1`` each rank holds different
    ones; they are recomputed from the factors at the first step after loading (identical to the
    saved run's when the checkpoint follows a decomposition step, as the factors then are those
    decomposed). The health counters (``discarded``, ``failures``) are one rank's. For the same
    reason the round of decompositions in flight under ``AsyncConfig`` (which
    ``KFAC.state_dict()`` saves) is left out: a run resumed from DCP holds no round, decomposes its
    factors in line at its first step, and so does not continue bit-identically with the saved run.
    The stagger phases' costs are left out too (DCP loads only the keys the destination holds, and a
    fresh optimizer has none before its phases are fixed): a staggered run resumed from DCP fixes
    them again at its next all-block factor step. The automatic intervals' entry (None until chosen,
    then a dict) travels wrapped in a 1-tuple, which DCP stores as one leaf, so a fresh optimizer
    (whose entry is None) holds the key the saved one wrote and loads the chosen intervals.

    ``get_state_dict`` initializes an optimizer that has no per-parameter state by calling
    ``step()`` once with zero gradients and lr 0 (DCP's ``_init_optim_state``). On the fresh optimizer
    one loads into, that step is undone by the loaded step count; on a live optimizer it happens only
    with ``momentum=0`` and cleared gradients, and would count one K-FAC step: save before
    ``zero_grad()`` then.
    """

    def __init__(self, optimizer: HasKFACState) -> None:
        self._optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        """``KFAC.kfac_state_dict()`` of the global factors, without decompositions (the round in
        flight's included; the optimizer still adopts that round as before) and stagger phases. A
        collective under ``torch.distributed`` (``KFAC.synchronize_factors()`` first), as ``dcp.save`` and ``dcp.load``,
        which call it, are: every rank then holds the same entry, which DCP writes once."""
        self._optimizer.synchronize_factors()
        state = self._optimizer.kfac_state_dict()
        del state["round"], state["stagger"]  # see the class docstring
        state["intervals"] = (state["intervals"],)  # one leaf to DCP (the class docstring)
        for block in state["blocks"].values():
            for factor in block["factors"].values():
                for key in _NOT_SAVED:
                    del factor[key]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; decompositions follow at the next step."""
        blocks = {
            name: {
                **block,
                "factors": {
                    factor_name: {**factor, **dict.fromkeys(_NOT_SAVED)}
                    for factor_name, factor in block["factors"].items()
                },
            }
            for name, block in state_dict["blocks"].items()
        }
        self._optimizer.load_kfac_state_dict({**state_dict, "blocks": blocks, "intervals": state_dict["intervals"][0]})
