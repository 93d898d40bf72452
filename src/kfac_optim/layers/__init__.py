"""Kronecker blocks, one per supported module kind, and the registry that picks them."""

from __future__ import annotations

from torch import nn

from kfac_optim.layers.base import Factor, KroneckerBlock
from kfac_optim.layers.conv import Conv2dBlock
from kfac_optim.layers.linear import LinearBlock

__all__ = ["Conv2dBlock", "Factor", "KroneckerBlock", "LinearBlock", "block_kind"]


def block_kind(module: nn.Module) -> type[KroneckerBlock] | None:
    """The block class for a supported module, or None (the module's parameters take the SGD path)."""
    if isinstance(module, nn.Linear):
        return LinearBlock
    if isinstance(module, nn.Conv2d):
        return Conv2dBlock
    return None
