"""K-FAC in fp16 (autocast + ``torch.amp.GradScaler``) against fp32: skipped steps and loss after N steps.

    python -m benchmarks.amp_steps [--steps 200] [--batch 64] [--init-scale 65536] [--device cpu]

Trains the digits CNN (``benchmarks.models.DigitsCNN``, scikit-learn digits scaled to [0, 1]) from
the same initial weights on the same batches, once in fp32 and once in fp16 with a GradScaler, and
prints one JSON line per run: steps taken and skipped (GradScaler overflows, and at which
iterations), the loss scale at the end, the mean training loss of the last 10 steps, and the test
loss and accuracy.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor

from benchmarks.models import DigitsCNN
from kfac_optim import KFAC

KFAC_OPTIONS = dict(lr=0.1, momentum=0.9, weight_decay=5e-4, damping=0.03, kl_clip=1e-3,
                    factor_update_steps=5, inv_update_steps=50, method="inverse")


def digits(device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Train/test split of digits as (N, 1, 8, 8) float tensors in [0, 1] and labels."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)

    def images(a: object) -> Tensor:
        return torch.tensor(a, dtype=torch.float32, device=device).view(-1, 1, 8, 8)

    def labels(a: object) -> Tensor:
        return torch.tensor(a, dtype=torch.long, device=device)

    return images(x_train), labels(y_train), images(x_test), labels(y_test)


def train(fp16: bool, args: argparse.Namespace) -> dict[str, object]:
    """One run of ``args.steps`` steps; returns its summary."""
    device = torch.device(args.device)
    x_train, y_train, x_test, y_test = digits(device)
    torch.manual_seed(0)
    model = DigitsCNN().to(device)
    optimizer = KFAC(model, **KFAC_OPTIONS)
    scaler = torch.amp.GradScaler(device.type, init_scale=args.init_scale, enabled=fp16)
    generator = torch.Generator().manual_seed(1)
    losses: list[float] = []
    skipped_at: list[int] = []
    start = time.perf_counter()
    for iteration in range(args.steps):
        index = torch.randint(0, len(x_train), (args.batch,), generator=generator).to(device)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
            loss = F.cross_entropy(model(x_train[index]), y_train[index])
        scaler.scale(loss).backward()
        taken = optimizer.steps
        scaler.step(optimizer)
        scaler.update()
        if optimizer.steps == taken:
            skipped_at.append(iteration)
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
        logits = model(x_test).float()
    return {
        "run": "fp16+GradScaler" if fp16 else "fp32",
        "steps": args.steps,
        "optimizer_steps": optimizer.steps,
        "skipped": len(skipped_at),
        "skipped_at": skipped_at,
        "final_scale": scaler.get_scale() if fp16 else None,
        "train_loss_last10": round(sum(losses[-10:]) / len(losses[-10:]), 4),
        "test_loss": round(F.cross_entropy(logits, y_test).item(), 4),
        "test_acc": round((logits.argmax(1) == y_test).float().mean().item(), 4),
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--init-scale", type=float, default=2.0**16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for fp16 in (False, True):
        print(json.dumps(train(fp16, args)))  # noqa: T201 (a command-line report)


if __name__ == "__main__":
    main()
