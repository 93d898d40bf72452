"""The large-batch study's tasks on the MNIST-1D-style data (``data.py``): a model, its target.

Owns: the models, the targets and each task as a ``benchmarks.peers.tasks.Task`` (so that the peers'
optimizer builders, which read ``weight_decay`` and the output ``heads``, build every optimizer).
Must not know: optimizers, the protocol.

- ``cnn``: three 1-D convolutions (1→16 k5, 16→32 k3 s2, 32→32 k3 s2, ReLU) then 320→64→10; target
  92% test accuracy.
- ``mlp``: 40→256→256→10 ReLU MLP; target 88%.
(The targets: about 200-300 AdamW steps at batch 128, lr 3e-3, in a calibration run.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from benchmarks.large_batch.data import LENGTH, splits
from benchmarks.peers.tasks import Task


class CNN1D(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Conv1d(1, 16, 5, padding=2), nn.ReLU(), nn.Conv1d(16, 32, 3, stride=2, padding=1),
                         nn.ReLU(), nn.Conv1d(32, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(32 * LENGTH // 4, 64), nn.ReLU(), nn.Linear(64, 10))


class MLP1D(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Flatten(), nn.Linear(LENGTH, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


@dataclass(frozen=True)
class Study:
    """A task of the study: the peers' ``Task`` (model, heads, weight decay) and the accuracy to reach."""

    task: Task
    target: float

    @torch.no_grad()
    def accuracy(self, model: nn.Module, split: str) -> float:
        x, y = getattr(splits(), split)
        model.eval()
        try:
            return (model(x).argmax(1) == y).float().mean().item()
        finally:
            model.train()

    @staticmethod
    def loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return nn.functional.cross_entropy(model(x), y)


STUDIES: dict[str, Study] = {
    "cnn": Study(Task("cnn", "1-D CNN conv16-conv32-conv32-320x64-10 on MNIST-1D-style data", "accuracy", True,
                      0, 0.0, 0.0, CNN1D, heads=("9",), kind="classify"), target=0.92),
    "mlp": Study(Task("mlp", "MLP 40-256-256-10 on MNIST-1D-style data", "accuracy", True, 0, 0.0, 0.0, MLP1D,
                      heads=("5",), kind="classify"), target=0.88),
}
