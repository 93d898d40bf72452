"""The capture hooks' lifetime: which live capture owns a module, and removing a capture's hooks.

Owns: the module -> capture registry (weak both ways: neither keeps the other alive), the
take-over of a module by a new capture (the old one's hooks removed, with a warning), and the
removal of a capture's hooks and of the inert placeholders on deep copies of its modules.
Must not know: blocks, statistics, arming, the backward pass (``capture.py`` installs the hooks
and registers this removal as its finalizer).
"""

from __future__ import annotations

import weakref
from typing import Protocol

from torch import nn
from torch.utils.hooks import RemovableHandle

from kfac_optim.diagnostics import warn_user
from kfac_optim.layers.hooks import InertHook


class Owner(Protocol):
    """What the registry asks of a capture (``capture.StatisticsCapture``)."""

    @property
    def active(self) -> bool: ...

    def remove(self) -> None: ...


_owners: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Owner]] = weakref.WeakKeyDictionary()


def take_over(capture: Owner, modules: list[nn.Module]) -> None:
    """``capture`` owns ``modules``, removing the hooks of any live capture that owned one of them."""
    previous: dict[int, Owner] = {}
    for module in modules:
        owner_ref = _owners.get(module)
        owner = owner_ref() if owner_ref is not None else None
        if owner is not None and owner is not capture and owner.active:  # a module may carry several blocks
            previous[id(owner)] = owner
        _owners[module] = weakref.ref(capture)
    for owner in previous.values():
        owner.remove()
    if previous:
        warn_user(
            "the model already has a live KFAC optimizer: the new one takes its layers over and the old "
            "one's hooks are removed (it no longer updates its factors). Call remove_hooks() on the old "
            "optimizer, or drop it, before creating a new one to silence this warning.",
        )


def remove_hooks(
    handles: list[RemovableHandle],
    copies: list[tuple[weakref.ref[nn.Module], InertHook]],
) -> None:
    """Remove the hooks of a capture and the placeholders on deep copies of its modules."""
    for handle in handles:
        handle.remove()
    handles.clear()
    for module_ref, inert in copies:
        module = module_ref()
        hooks = getattr(module, "_forward_hooks", None)  # None: gone, or a copy deepcopy abandoned
        if hooks is None:
            continue
        for hook_id in [key for key, hook in hooks.items() if hook is inert]:
            del hooks[hook_id]
            module._forward_hooks_with_kwargs.pop(hook_id, None)
            module._forward_hooks_always_called.pop(hook_id, None)
    copies.clear()
