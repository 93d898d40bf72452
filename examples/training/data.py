"""Datasets and batch loaders: digits, CIFAR-10, ImageNet folders, synthetic images.

Owns where examples come from, their transforms, the fixed digits split, and how batches are
sharded across ranks (a `DistributedSampler` for training, a strided shard for evaluation).
Knows nothing of models or optimizers. Nothing is ever downloaded.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from examples.training.config import DataConfig, SetupError

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
DIGITS_SPLIT_SEED = 0  # the digits train/test split never changes with the run's seed


@dataclass(frozen=True)
class Datasets:
    """A train and a test set, with what a model needs to know about them.

    `input_shape` is one example's shape (C, H, W); `in_memory` says both sets are
    `TensorDataset`s, batched by slicing instead of a worker-backed `DataLoader`.
    """

    train: Dataset
    test: Dataset
    input_shape: tuple[int, ...]
    num_classes: int
    in_memory: bool


def load_datasets(cfg: DataConfig) -> Datasets:
    """The train and test sets that `cfg` names."""
    loaders = {"digits": _digits, "cifar10": _cifar10, "imagenet": _imagenet, "synthetic": _synthetic}
    return loaders[cfg.name](cfg)


def _digits(cfg: DataConfig) -> Datasets:
    """scikit-learn's bundled 8x8 digits (1797 images, 0..16 grey levels), split once, stratified."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=cfg.test_fraction, stratify=labels, random_state=DIGITS_SPLIT_SEED
    )
    x_train, x_test = (torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0 for x in (x_train, x_test))
    if cfg.normalize:
        mean, std = x_train.mean(), x_train.std()
        x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    y_train, y_test = (torch.tensor(y, dtype=torch.int64) for y in (y_train, y_test))
    return Datasets(TensorDataset(x_train, y_train), TensorDataset(x_test, y_test), (1, 8, 8), 10, True)


def _cifar10(cfg: DataConfig) -> Datasets:
    """torchvision's CIFAR-10 from `root/cifar-10-batches-py`, with the usual crop+flip augmentation."""
    from torchvision import datasets, transforms

    folder = Path(cfg.root).expanduser() / "cifar-10-batches-py"
    if not folder.is_dir():
        raise SetupError(
            f"CIFAR-10 not found: expected the python version of the data set in {folder} "
            f"(e.g. made by torchvision.datasets.CIFAR10(root={str(Path(cfg.root).expanduser())!r}, download=True) "
            "on a machine with internet); set data.root to the folder that holds cifar-10-batches-py/"
        )
    normalize = transforms.Normalize(CIFAR_MEAN, CIFAR_STD)
    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), normalize])
    test_tf = transforms.Compose([transforms.ToTensor(), normalize])
    root = str(folder.parent)
    train = datasets.CIFAR10(root, train=True, transform=train_tf, download=False)
    test = datasets.CIFAR10(root, train=False, transform=test_tf, download=False)
    return Datasets(train, test, (3, 32, 32), 10, False)


def _imagenet(cfg: DataConfig) -> Datasets:
    """ImageFolder `root/train` and `root/val` with the standard ResNet transforms (224 crops)."""
    from torchvision import datasets, transforms

    root = Path(cfg.root).expanduser()
    missing = [str(root / split) for split in ("train", "val") if not (root / split).is_dir()]
    if missing:
        raise SetupError(
            f"ImageNet not found: missing {' and '.join(missing)}; data.root must hold train/ and val/, "
            "each with one sub-folder of images per class (torchvision ImageFolder layout)"
        )
    normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), normalize])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                  transforms.ToTensor(), normalize])
    train = datasets.ImageFolder(str(root / "train"), transform=train_tf)
    test = datasets.ImageFolder(str(root / "val"), transform=test_tf)
    return Datasets(train, test, (3, 224, 224), len(train.classes), False)


def _synthetic(cfg: DataConfig) -> Datasets:
    """Gaussian images with uniform random labels, ImageNet- or CIFAR-shaped, for smoke and speed runs.

    Both sets are generated once from a fixed seed and held in memory:
    (train_size + test_size) * 3 * side^2 * 4 bytes.
    """
    side, classes = {"imagenet": (224, 1000), "cifar": (32, 10)}[cfg.shape]
    side = cfg.image_size or side
    gen = torch.Generator().manual_seed(0)

    def make(n: int) -> TensorDataset:
        return TensorDataset(torch.randn(n, 3, side, side, generator=gen),
                             torch.randint(classes, (n,), generator=gen))

    return Datasets(make(cfg.train_size), make(cfg.test_size), (3, side, side), classes, True)


class ShardSampler(Sampler[int]):
    """Indices rank, rank + world, ...: every example on exactly one rank, no padding (evaluation)."""

    def __init__(self, length: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, length, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class TensorLoader:
    """Batches of in-memory tensors in a sampler's order: one gather per batch, no collation or workers."""

    def __init__(self, dataset: TensorDataset, batch_size: int, sampler: Sampler[int], drop_last: bool) -> None:
        self.tensors: Sequence[Tensor] = dataset.tensors
        self.batch_size = batch_size
        self.sampler = sampler
        self.drop_last = drop_last

    def __len__(self) -> int:
        full, rest = divmod(len(self.sampler), self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def __iter__(self) -> Iterator[list[Tensor]]:
        order = torch.as_tensor(list(self.sampler), dtype=torch.int64)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            index = order[start:start + self.batch_size]
            yield [t[index] for t in self.tensors]


Loader = DataLoader | TensorLoader


def train_loader(data: Datasets, micro_batch: int, rank: int, world_size: int, seed: int,
                 workers: int, pin_memory: bool) -> Loader:
    """Shuffled, rank-sharded micro-batches of the training set; call `set_epoch` before each epoch.

    Partial micro-batches are dropped; the trainer drops micro-batches that do not fill an
    accumulation group, so every optimizer step sees exactly the configured global batch.
    """
    sampler = DistributedSampler(data.train, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=seed, drop_last=True)
    if data.in_memory:
        return TensorLoader(data.train, micro_batch, sampler, drop_last=True)
    return DataLoader(data.train, batch_size=micro_batch, sampler=sampler, num_workers=workers,
                      pin_memory=pin_memory, drop_last=True, persistent_workers=workers > 0)


def eval_loader(dataset: Dataset, in_memory: bool, batch: int, rank: int, world_size: int,
                workers: int, pin_memory: bool) -> Loader:
    """This rank's shard of `dataset` in order, for evaluation (sums are all-reduced by the caller)."""
    sampler = ShardSampler(len(dataset), rank, world_size)
    if in_memory:
        return TensorLoader(dataset, batch, sampler, drop_last=False)
    return DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers, pin_memory=pin_memory)


def set_epoch(loader: Loader, epoch: int) -> None:
    """Reseed the loader's shuffling for `epoch` (same order on resume, different each epoch)."""
    loader.sampler.set_epoch(epoch)
