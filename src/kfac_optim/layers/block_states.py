"""The blocks' checkpoint state: every block's under its module name, one owner of ``kfac_optim.state``.

Owns: the ``"blocks"`` entry, ``{module name: KroneckerBlock.state_dict(method)}``; checking each
saved layer this model has (an error names the layer); the warning that layers missing from the
checkpoint start fresh and saved layers the model lacks are ignored. Layers match by name, so a
checkpoint moves between world sizes, fractions and compiled or plain models.
Must not know: what a block saves (each block does, with its factors), the estimator, the
checkpoint's framing (``checkpoint.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kfac_optim.diagnostics import warn_user
from kfac_optim.layers.base import KroneckerBlock
from kfac_optim.methods import Method
from kfac_optim.state import within


class BlockStates:
    """``blocks``' checkpoint state, their decompositions in ``method``'s layout (``Stateful``)."""

    def __init__(self, blocks: Sequence[KroneckerBlock], method: Method) -> None:
        self._blocks = blocks
        self._method = method

    def state_dict(self) -> dict[str, Any]:
        return {block.name: block.state_dict(self._method) for block in self._blocks}

    def check_state(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"expected a dict of layers by module name, got {type(state).__name__}")
        for block in self._blocks:
            if block.name in state:
                with within(f"layer '{block.name}'"):
                    block.check_state(state[block.name], self._method)
        missing = [block.name for block in self._blocks if block.name not in state]
        unknown = sorted(set(state) - {block.name for block in self._blocks})
        if missing or unknown:
            warn_user(
                f"K-FAC checkpoint does not match the model: layers without saved factors {missing} "
                f"start fresh; saved layers not in the model {unknown} are ignored",
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for block in self._blocks:
            if block.name in state:
                block.load_state_dict(state[block.name], self._method)
