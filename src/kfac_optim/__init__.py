"""kfac_optim: K-FAC natural-gradient descent for PyTorch as one ``torch.optim.Optimizer``."""

from kfac_optim.config import AsyncConfig, CurvatureConfig, RuntimeConfig, UpdateConfig
from kfac_optim.layers import KroneckerBlock, discover_blocks, register_block
from kfac_optim.methods import DampedInverse, Eigen, EigenAdam, Method
from kfac_optim.methods.root import RootKronecker  # registers method="root"
from kfac_optim.optimizer import KFAC
from kfac_optim.schedule.milestones import MilestoneSchedule
from kfac_optim.update.damping import AdaptiveDamping

__all__ = [
    "KFAC",
    "AdaptiveDamping",
    "AsyncConfig",
    "CurvatureConfig",
    "DampedInverse",
    "Eigen",
    "EigenAdam",
    "KroneckerBlock",
    "Method",
    "MilestoneSchedule",
    "RootKronecker",
    "RuntimeConfig",
    "UpdateConfig",
    "__version__",
    "discover_blocks",
    "register_block",
]

__version__ = "0.1.0"
