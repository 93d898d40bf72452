"""Checkpoint and resume with K-FAC: the resumed run continues bit-identically.

    python -m examples.recipes.resume --steps 20 --checkpoint /tmp/kfac.pt

``optimizer.state_dict()`` holds SGD's state plus ``"kfac"``: the step counter and every layer's
factors (packed) and decompositions by module name. It never communicates: distributed, call it
where you save (rank 0 alone is fine; docs/api.md, ``state_dict()``, says what such a checkpoint
holds). Trains ``--steps`` straight, then half, saves, restores into a fresh model and optimizer,
trains the other half, and compares.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import kfac_optim
from examples.recipes.toy import toy_batches, toy_model


def train(model: nn.Module, optimizer: kfac_optim.KFAC, batches: list) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def fresh() -> tuple[nn.Module, kfac_optim.KFAC]:
    model = toy_model()
    return model, kfac_optim.KFAC(model, lr=0.1, momentum=0.9, factor_update_steps=1, decomposition_update_steps=5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.recipes.resume", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--checkpoint", type=Path, help="where to save; when not given, a temporary file")
    args = parser.parse_args(argv)
    batches = toy_batches(args.steps, 64)
    half = args.steps // 2

    straight, straight_optimizer = fresh()
    train(straight, straight_optimizer, batches)

    model, optimizer = fresh()
    train(model, optimizer, batches[:half])
    with tempfile.TemporaryDirectory() as directory:
        path = args.checkpoint or Path(directory) / "checkpoint.pt"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        optimizer.remove_hooks()  # done with this one: a new optimizer takes over the model below

        model, optimizer = fresh()
        checkpoint = torch.load(path)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    train(model, optimizer, batches[half:])

    identical = all(torch.equal(a, b) for a, b in zip(model.parameters(), straight.parameters()))
    print(f"saved at step {half}, resumed to step {optimizer.steps}: identical to the straight run: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
