"""Distributed K-FAC: who computes which decomposition (plan) and the collectives that share them.

A new distribution strategy is one module with a class that implements
``strategy.DistributionStrategy`` and one ``strategies.register_strategy`` call (docs/design.md
§5, "Strategies"). This face gathers the public names of that seam.
"""

from kfac_optim.distributed.strategies import StrategySetting, register_strategy, strategy_for, unregister_strategy
from kfac_optim.distributed.strategy import (
    DistributionStrategy,
    Precondition,
    WholeTensors,
    block_work_items,
    whole_gradient_directions,
)

__all__ = ["DistributionStrategy", "Precondition", "StrategySetting", "WholeTensors", "block_work_items",
           "register_strategy", "strategy_for", "unregister_strategy", "whole_gradient_directions"]
