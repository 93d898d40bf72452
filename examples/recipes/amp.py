"""K-FAC with mixed precision: bf16 autocast, or fp16 autocast with a GradScaler.

    python -m examples.recipes.amp --dtype bf16
    python -m examples.recipes.amp --dtype fp16 --device cuda

Factors and decompositions stay in fp32 whatever the autocast dtype (docs/design.md §6). Under
fp16 the scaler hands ``step()`` the loss scale and the inf flag; a step with inf/nan gradients
is skipped whole. Prints the loss of each run next to an fp32 run from the same start.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import kfac_optim
from examples.recipes.toy import toy_batches, toy_model


def train(dtype: str, device: str, steps: int) -> float:
    """Train from the same start under ``dtype`` ("fp32", "bf16", "fp16"); the last batch's loss."""
    model, loss_fn = toy_model().to(device), F.cross_entropy
    loader = [(x.to(device), y.to(device)) for x, y in toy_batches(steps, 64)]
    optimizer = kfac_optim.KFAC(model, lr=0.1, momentum=0.9)
    if dtype == "fp16":
        scaler = torch.amp.GradScaler(device)
        for x, y in loader:
            optimizer.zero_grad()
            with torch.autocast(device, dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # KFAC unscales and checks for inf itself
            scaler.update()
    else:
        autocast_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        for x, y in loader:
            optimizer.zero_grad()
            with torch.autocast(device, dtype=autocast_dtype, enabled=dtype == "bf16"):
                loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
    return loss.item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.recipes.amp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    mixed, full = train(args.dtype, args.device, args.steps), train("fp32", args.device, args.steps)
    print(f"last loss after {args.steps} steps: {args.dtype} {mixed:.4f}, fp32 {full:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
