"""K-FAC's checkpoints: the ``"kfac"`` entry of ``KFAC.state_dict()``, and its DCP view.

Owns: the format of K-FAC's own state (its step, every layer's factors and decompositions keyed
by module name, and the round of decompositions in flight), its checks against a model, and
the hooks through which it travels with ``Optimizer.state_dict`` / ``load_state_dict``
(:class:`Checkpointing`); the ``Stateful`` view for ``torch.distributed.checkpoint`` (:class:`KFACState`).
Must not know: factor math, ranks, the plan (the estimator restores; blocks check their own state).

``state_dict()``: K-FAC's post hook is registered first, so every post hook a user registers sees
(and may replace) the ``"kfac"`` entry. ``load_state_dict()``: K-FAC's pre hook runs after every
pre hook a user registered (it is registered for the call only), so those see the whole state
and may repair it before K-FAC checks it; the checked entry is restored after the SGD part
loaded, by a post hook that runs before the user's.

What one rank's entry holds, why it never communicates, and why it holds nothing redundant
(packed factors, decompositions as held): docs/design.md §5, "Checkpoints". The entry carries
``"format"`` (:data:`FORMAT`). DCP (``KFAC.kfac_state()``; docs/guide.md, docs/api.md): the
global factors (``KFACState.state_dict`` reduces them first, a collective as ``dcp.save`` is), no
decompositions, no round in flight and no stagger costs; the automatic intervals' entry travels
wrapped in a 1-tuple so that a fresh optimizer holds the key. ``get_state_dict`` initializes an
optimizer without per-parameter state by one ``step()`` at lr 0 (DCP's ``_init_optim_state``): on
a fresh optimizer the loaded step count undoes it; on a live one it counts a K-FAC step, so save
before ``zero_grad()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from torch.optim import Optimizer

from kfac_optim.background.decompositions import Job, Result
from kfac_optim.update.damping import check_state as check_damping_state
from kfac_optim.diagnostics import warn_user
from kfac_optim.estimator.folds import check_state as check_stagger_state
from kfac_optim.schedule.intervals import check_state as check_intervals

if TYPE_CHECKING:
    from kfac_optim.estimator.estimator import KroneckerEstimator

_NOT_SAVED = ("decomposition", "decomposed_key")

FORMAT = 2
"""The ``"kfac"`` entry's format: 2 packs dense running factors and inverses (their upper triangle,
``Factor.packed``). 1 (earlier releases, no ``"format"`` key) saved them whole; still read."""


def kfac_state_dict(estimator: KroneckerEstimator) -> dict[str, Any]:
    """The ``"kfac"`` entry: ``{"format": FORMAT, "steps", "blocks": {name: block state}, "round": round_state(...),
    "intervals": the automatic intervals once chosen (``IntervalSchedule.state_dict``; None: not chosen),
    "damping": ``AdaptiveDamping``'s λ and last ρ (``DampingRule.state_dict``; None: a constant or scheduled λ),
    "stagger": the costs the stagger phases come from (``StaggeredFolds.state_dict``; None: no phases)}``.

    This rank's state, read without communicating (the statistics worker and a round in flight
    are waited for: both are local): the running factors are this rank's, global as of the last
    reduction plus its own statistics since (see the module docstring)."""
    estimator.settle_statistics()
    return {
        "format": FORMAT,
        "steps": estimator.steps,
        "blocks": {block.name: block.state_dict(estimator.method) for block in estimator.blocks},
        "round": round_state(estimator),
        "intervals": estimator.intervals.state_dict(),
        "damping": estimator.damping.state_dict(),
        "stagger": estimator.folds.state_dict(),
    }


def round_state(estimator: KroneckerEstimator) -> dict[str, Any] | None:
    """The round of decompositions in flight (``AsyncConfig``), None when there is none.

    Waits for the worker; its results stay held and are adopted at the same step as if nothing
    had been saved. ``{"adopt_at": the step that adopts it (None: the next decomposition step),
    "factors": {block: {factor: {"decomposition": as in the block's state (None: it failed),
    "version": the factor version it decomposes, "shift": the shift it was given}}}}``: the
    factors this rank decomposes.
    """
    results, adopt_at = estimator.decomposition_steps.saved_round()
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


def load_kfac_state_dict(estimator: KroneckerEstimator, kfac_state: Any) -> None:
    """Check ``kfac_state`` against the estimator's blocks, then restore it."""
    restore_checked(estimator, kfac_state, check(estimator, kfac_state))


def restore_checked(estimator: KroneckerEstimator, kfac_state: dict[str, Any], saved: dict[str, Any]) -> None:
    """Restore a checked entry (``saved``: its blocks by name, from :func:`check`)."""
    saved_round = kfac_state.get("round")
    estimator.restore(kfac_state["steps"], saved, _saved_round(estimator, saved_round),
                      None if saved_round is None else saved_round["adopt_at"], saved_round is not None,
                      kfac_state.get("intervals"), kfac_state.get("damping"), kfac_state.get("stagger"))


def check(estimator: KroneckerEstimator, kfac_state: Any) -> dict[str, Any]:
    """Check a checkpoint's ``"kfac"`` entry against the estimator's blocks; return its blocks by name.

    Raises:
        ValueError: naming the layer and the field that does not fit (nothing is changed).
    """
    if not isinstance(kfac_state, dict) or not isinstance(kfac_state.get("blocks"), dict):
        raise ValueError("K-FAC checkpoint: the 'kfac' entry must be a dict with 'steps' and 'blocks'")
    version = kfac_state.get("format", 1)
    if isinstance(version, bool) or version not in (1, FORMAT):
        raise ValueError(
            f"K-FAC checkpoint: 'format' {version!r} is not one this release reads (1: whole factors, "
            f"{FORMAT}: packed factors); was it saved by another release of kfac_optim?"
        )
    steps = kfac_state.get("steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"K-FAC checkpoint: 'steps' must be an int >= 0, got {steps!r}")
    saved = kfac_state["blocks"]
    for block in estimator.blocks:
        if block.name in saved:
            block.validate_state(saved[block.name], estimator.method)
    _check_round(estimator, kfac_state.get("round"), steps)
    check_intervals(kfac_state.get("intervals"))
    check_damping_state(kfac_state.get("damping"))
    check_stagger_state(kfac_state.get("stagger"))
    missing = [block.name for block in estimator.blocks if block.name not in saved]
    unknown = sorted(set(saved) - {block.name for block in estimator.blocks})
    if missing or unknown:
        warn_user(
            f"K-FAC checkpoint does not match the model: layers without saved factors {missing} "
            f"start fresh; saved layers not in the model {unknown} are ignored",
        )
    return saved


def _check_round(estimator: KroneckerEstimator, saved_round: Any, steps: int) -> None:
    """Check a checkpoint's round in flight (see :func:`round_state`) against the blocks."""
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
    blocks = {block.name: block for block in estimator.blocks}
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
                blocks[block_name].factors[name].validate_result(result, estimator.method)
            except ValueError as error:
                raise ValueError(f"{where}, factor {name}: {error}") from None


def _saved_round(estimator: KroneckerEstimator, saved_round: dict[str, Any] | None) -> list[tuple[Job, Result]]:
    """A checked round entry of a checkpoint as jobs with their results (layers of this model only)."""
    if saved_round is None:
        return []
    blocks = {block.name: block for block in estimator.blocks}
    inv_dtype = estimator.options.curvature.inv_dtype
    return [
        (
            Job((blocks[block_name], name), blocks[block_name].factors[name], result["version"], estimator.method,
                float(result["shift"]), inv_dtype, None),
            blocks[block_name].factors[name].loaded_decomposition(estimator.method, result["decomposition"]),
        )
        for block_name, factors in saved_round["factors"].items() if block_name in blocks
        for name, result in factors.items()
    ]


class Checkpointing:
    """K-FAC's part of one optimizer's ``state_dict`` / ``load_state_dict``, through the optimizer's hooks."""

    def __init__(self, optimizer: Optimizer, estimator: KroneckerEstimator) -> None:
        self._estimator = estimator
        self._checked: tuple[dict[str, Any], dict[str, Any]] | None = None  # between the pre and the post hook
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
            self._checked = (kfac_state, check(self._estimator, kfac_state))
        return state_dict

    def _restore_entry(self, optimizer: Optimizer) -> None:
        if self._checked is not None:
            kfac_state, saved = self._checked
            self._checked = None
            restore_checked(self._estimator, kfac_state, saved)


class HasKFACState(Protocol):
    """What :class:`KFACState` needs of the optimizer (``KFAC``'s public checkpoint methods)."""

    def synchronize_factors(self) -> None: ...

    def kfac_state_dict(self) -> dict[str, Any]: ...

    def load_kfac_state_dict(self, kfac_state: dict[str, Any]) -> None: ...


class KFACState:
    """``torch.distributed.checkpoint.stateful.Stateful`` over one ``KFAC`` optimizer's own state."""

    def __init__(self, optimizer: HasKFACState) -> None:
        self._optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        """``KFAC.kfac_state_dict()`` of the global factors, without decompositions (the round in
        flight's included; the optimizer still adopts that round as before) and stagger phases. A
        collective under ``torch.distributed`` (``KFAC.synchronize_factors()`` first), as ``dcp.save`` and ``dcp.load``,
        which call it, are: every rank then holds the same entry, which DCP writes once."""
        self._optimizer.synchronize_factors()
        state = self._optimizer.kfac_state_dict()
        del state["round"], state["stagger"]  # see the module docstring
        state["intervals"] = (state["intervals"],)  # one leaf to DCP (module docstring)
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
