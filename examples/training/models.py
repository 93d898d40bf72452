"""The networks the training application trains, and the task (loss and metrics) each one is trained for.

- `digits_cnn`: two 3x3 convs (16 channels, same padding) and a 1024->128->10 MLP, for 8x8 digits.
- `digits_gapcnn`: three 3x3 convs (32, 32, 64 channels, the last with stride 2), global average
  pooling and a 64->10 Linear head, for 8x8 digits: the conv-heavy design of modern small CNNs.
- `digits_autoencoder`: the deep autoencoder of Hinton & Salakhutdinov / Martens & Grosse,
  64-512-256-128-16-128-256-512-64 with tanh, trained on reconstruction MSE.
- `resnet20`, `resnet32`: He et al. (2016) CIFAR ResNets, option A (parameter-free) shortcuts.
- `resnet18`, `resnet50`: torchvision's, randomly initialized (`weights=None`).

Knows nothing of data loading or optimizers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.training.config import ModelConfig, SetupError

RECONSTRUCTION_MODELS = frozenset({"digits_autoencoder"})


def is_reconstruction(model: ModelConfig) -> bool:
    """True when the model learns to reproduce its input (MSE) rather than to classify."""
    return model.name in RECONSTRUCTION_MODELS


def build_network(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The network `cfg` names, shaped for inputs of `input_shape` (C, H, W) and `num_classes`."""
    if cfg.name in ("digits_cnn", "digits_gapcnn", "digits_autoencoder") and input_shape != (1, 8, 8):
        raise SetupError(f"model.name={cfg.name} needs 1x8x8 inputs (data.name=digits); got {input_shape}")
    if cfg.name == "digits_cnn":
        return DigitsCNN(num_classes)
    if cfg.name == "digits_gapcnn":
        return DigitsGapCNN(num_classes)
    if cfg.name == "digits_autoencoder":
        return DeepAutoencoder()
    if cfg.name in ("resnet20", "resnet32"):
        return CifarResNet(depth=int(cfg.name[len("resnet"):]), num_classes=num_classes)
    from torchvision import models

    return getattr(models, cfg.name)(weights=None, num_classes=num_classes)


class DigitsCNN(nn.Sequential):
    """conv3x3(1->16) ReLU conv3x3(16->16) ReLU, flatten (16*8*8 = 1024), Linear 1024->128 ReLU, 128->classes."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
            nn.Flatten(),
            nn.Linear(16 * 8 * 8, 128), nn.ReLU(),
            nn.Linear(128, num_classes),
        )


class DigitsGapCNN(nn.Sequential):
    """conv3x3(1->32) ReLU conv3x3(32->32) ReLU conv3x3(32->64, stride 2) ReLU, global average pool, Linear 64->classes.

    Most of the compute is in the convs, while every K-FAC factor is small (input factors of at
    most 32*3*3 + 1 = 289 dims), unlike DigitsCNN's 1025-dim factor of its flattened Linear.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(64, num_classes),
        )


class DeepAutoencoder(nn.Sequential):
    """64-512-256-128-16-128-256-512-64 MLP, tanh after every layer but the last (a linear output).

    Takes (N, 1, 8, 8) or (N, 64) images and returns (N, 64) reconstructions.
    """

    WIDTHS = (64, 512, 256, 128, 16, 128, 256, 512, 64)

    def __init__(self) -> None:
        layers: list[nn.Module] = [nn.Flatten()]
        for i, (fan_in, fan_out) in enumerate(zip(self.WIDTHS, self.WIDTHS[1:])):
            layers.append(nn.Linear(fan_in, fan_out))
            if i < len(self.WIDTHS) - 2:
                layers.append(nn.Tanh())
        super().__init__(*layers)


class _BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers; the shortcut subsamples and zero-pads channels when the shape changes."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.stride = stride
        self.extra_channels = planes - in_planes

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x
        if self.stride != 1 or self.extra_channels:
            half = self.extra_channels // 2
            shortcut = F.pad(x[:, :, ::self.stride, ::self.stride],
                             (0, 0, 0, 0, half, self.extra_channels - half))
        return F.relu(out + shortcut)


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for 32x32 images: 16/32/64-channel stages of n basic blocks, option A shortcuts."""

    def __init__(self, depth: int, num_classes: int = 10) -> None:
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2 (20, 32, 44, 56, ...); got {depth}")
        blocks = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        stages: list[nn.Module] = []
        in_planes = 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(blocks):
                stages.append(_BasicBlock(in_planes, planes, stride if i == 0 else 1))
                in_planes = planes
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(64, num_classes)
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(module.weight)

    def forward(self, x: Tensor) -> Tensor:
        out = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))
