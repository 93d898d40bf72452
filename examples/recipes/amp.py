"""K-FAC with mixed precision: bf16 autocast, or fp16 autocast with a GradScaler.

    python -m examples.recipes.amp --dtype bf16
    python -m examples.recipes.amp --dtype fp16 --device cuda

Factors and decompositions stay in fp32 whatever the autocast dtype (docs/design.md §6). Under
fp16 the scaler hands ``step()`` the loss scale and the inf flag; a step with inf/nan gradients
is skipped whole. Prints the first and last loss of each run next to an fp32 run from the same start,
and checks what the recipe demonstrates: the mixed-precision run's loss went down and its last loss
is finite and within ``TOLERANCE`` (relative) of the fp32 run's (exit status 1 when either does not hold).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

import kfac_optim
from examples.recipes.toy import toy_batches, toy_model

TOLERANCE = 0.02
"""How far (relative) the mixed-precision run's last loss may be from the fp32 run's."""


def train(dtype: str, device: str, steps: int) -> tuple[float, float]:
    """Train from the same start under ``dtype`` ("fp32", "bf16", "fp16"); the first and the last batch's loss."""
    model, loss_fn = toy_model().to(device), F.cross_entropy
    loader = [(x.to(device), y.to(device)) for x, y in toy_batches(steps, 64)]
    # explicit intervals: the runs compared must fold and decompose on the same steps, whatever the
    # default intervals' cost model makes of each precision
    optimizer = kfac_optim.KFAC(model, lr=0.1, momentum=0.9, factor_update_steps=1, decomposition_update_steps=10)
    losses = []
    if dtype == "fp16":
        scaler = torch.amp.GradScaler(device)
        for x, y in loader:
            optimizer.zero_grad()
            with torch.autocast(device, dtype=torch.float16):
                loss = loss_fn(model(x), y)
            losses.append(loss.item())
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # KFAC unscales and checks for inf itself
            scaler.update()
    else:
        autocast_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        for x, y in loader:
            optimizer.zero_grad()
            with torch.autocast(device, dtype=autocast_dtype, enabled=dtype == "bf16"):
                loss = loss_fn(model(x), y)
            losses.append(loss.item())
            loss.backward()
            optimizer.step()
    return losses[0], losses[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.recipes.amp", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16",
                        help="autocast dtype (fp16: with a GradScaler)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to train")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    args = parser.parse_args(argv)
    (first, mixed), (_, full) = train(args.dtype, args.device, args.steps), train("fp32", args.device, args.steps)
    decreased = mixed < first
    close = math.isfinite(mixed) and abs(mixed - full) <= TOLERANCE * abs(full)
    print(f"{args.dtype} loss {first:.4f} -> {mixed:.4f} after {args.steps} steps (decreased: {decreased})")
    print(f"fp32 last loss {full:.4f}; {args.dtype} within {TOLERANCE:.0%} of it: {close}")
    return 0 if decreased and close else 1


if __name__ == "__main__":
    raise SystemExit(main())
