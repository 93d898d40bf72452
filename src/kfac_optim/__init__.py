"""kfac_optim: K-FAC natural-gradient descent for PyTorch as one ``torch.optim.Optimizer``."""

from kfac_optim import schedules
from kfac_optim.optimizer import KFAC
from kfac_optim.schedules import MilestoneSchedule

__all__ = ["KFAC", "MilestoneSchedule", "__version__", "schedules"]

__version__ = "0.1.0"
