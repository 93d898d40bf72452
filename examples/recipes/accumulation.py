"""Gradient accumulation with K-FAC: several micro-batches per optimizer step.

    python -m examples.recipes.accumulation --accum-steps 4

Statistics accumulate over every backward since the last ``step()``, weighted by sample counts,
so micro-batch losses scaled like the large batch's (``/ accum_steps`` for a mean loss) give the
factors, and the step, of one large batch (docs/design.md §4). Prints the largest parameter
difference between the two ways of training.
"""

from __future__ import annotations

import argparse

import torch.nn.functional as F
from torch import nn

import kfac_optim
from examples.recipes.toy import toy_batches, toy_model


def train(accum_steps: int, steps: int) -> nn.Module:
    """Train on the same batches of 64, each split into ``accum_steps`` micro-batches."""
    model, loss_fn = toy_model(), F.cross_entropy
    # explicit intervals: the two runs compared must fold and decompose on the same steps, whatever
    # the default intervals' cost model makes of each run
    optimizer = kfac_optim.KFAC(model, lr=0.1, momentum=0.9, factor_update_steps=1, decomposition_update_steps=10)
    for x, y in toy_batches(steps, 64):
        optimizer.zero_grad()
        for micro_x, micro_y in zip(x.chunk(accum_steps), y.chunk(accum_steps)):
            loss = loss_fn(model(micro_x), micro_y) / accum_steps
            loss.backward()
        optimizer.step()
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.recipes.accumulation",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--accum-steps", type=int, default=4, help="micro-batches per step (dividing 64)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    args = parser.parse_args(argv)
    accumulated, whole = train(args.accum_steps, args.steps), train(1, args.steps)
    difference = max((a - b).abs().max().item() for a, b in zip(accumulated.parameters(), whole.parameters()))
    print(f"{args.accum_steps} micro-batches vs one batch, {args.steps} steps: "
          f"max parameter difference {difference:.2e}")
    return 0 if difference < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
