"""K-FAC state in ``torch.distributed.checkpoint`` (DCP): resharding checkpoints, any world size.

Owns: the DCP view of a ``KFAC`` optimizer's own state (its step and every layer's running
factors, keyed by module name), as a ``Stateful`` that DCP saves and loads next to the model and
the SGD part of the optimizer.
Must not know: factor math, ranks, the plan.

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

The factors saved are the global ones (``state_dict`` reduces them first, a collective), the same
on every rank, so DCP writes them once and every rank of any world size (one process included)
reads them whole. Decompositions are not saved: under ``grad_worker_fraction < 1`` each rank
holds different ones; they are recomputed from the factors at the first step after loading
(identical to the saved run's when the checkpoint follows a decomposition step, as the factors
then are those decomposed). The health counters (``discarded``, ``failures``) are one rank's.
For the same reason the round of decompositions in flight under ``async_decompositions`` (which
``KFAC.state_dict()`` saves) is left out: a run resumed from DCP holds no round, decomposes its
factors in line at its first step, and so does not continue bit-identically with the saved run.

``get_state_dict`` initializes an optimizer that has no per-parameter state by calling
``step()`` once with zero gradients and lr 0 (DCP's ``_init_optim_state``). On the fresh optimizer
one loads into, that step is undone by the loaded step count; on a live optimizer it happens only
with ``momentum=0`` and cleared gradients, and would count one K-FAC step: save before
``zero_grad()`` then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kfac_optim.optimizer import KFAC

_NOT_SAVED = ("decomposition", "decomposed_key")


class KFACState:
    """``torch.distributed.checkpoint.stateful.Stateful`` over one ``KFAC`` optimizer's own state."""

    def __init__(self, optimizer: KFAC) -> None:
        self._optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        """``KFAC.kfac_state_dict()`` without decompositions, the round in flight's included (a
        collective under ``torch.distributed``); the optimizer still adopts that round as before."""
        state = self._optimizer.kfac_state_dict()
        del state["round"]
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
        self._optimizer.load_kfac_state_dict({**state_dict, "blocks": blocks})
