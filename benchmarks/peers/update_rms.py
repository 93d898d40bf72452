"""Update RMS per parameter kind on the peers' GPT: AdamW against K-FAC's EigenAdam at equal lr.

``python -m benchmarks.peers.update_rms --steps 150 --lr 3e-3`` trains `CharGPT` (the peers' GPT
task, seed 0) with each configuration and reports, per parameter kind (K-FAC-preconditioned
matrices, the tied embedding/head, LayerNorms, position embedding, biases), the RMS of the
update ``Δp / lr`` averaged over the last half of the steps, and the final training loss. It owns
only this measurement (docs/tuning.md "Replacing AdamW"); it must not know the peers' protocol.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from torch import nn
from tqdm import tqdm

import kfac_optim
from benchmarks.peers.optimizers import KFAC_SETTINGS
from benchmarks.peers.tasks import TASKS

logger = logging.getLogger(__name__)

CONFIGS = {
    "adamw": None,
    "eigen_adam (peers: SGD momentum 0.9)": KFAC_SETTINGS,
    "eigen_adam + dampening 0.9 (Adam's EMA)": {**KFAC_SETTINGS, "dampening": 0.9},
}


def kind(name: str, parameter: nn.Parameter) -> str:
    """The parameter's kind, by its name in `CharGPT`."""
    if "norm" in name:
        return "layernorm"
    if "position" in name or "pos" in name.split(".")[-1]:
        return "position"
    if "embed" in name or "token" in name:
        return "embedding/head"
    if name.endswith("bias"):
        return "bias"
    return "matrix"


def measure(settings: dict | None, lr: float, steps: int) -> dict[str, float]:
    task = TASKS["gpt"]
    torch.manual_seed(0)
    model = task.build()
    optimizer = (torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0) if settings is None
                 else kfac_optim.KFAC(model, lr=lr, weight_decay=0.0, **settings))
    names = {id(p): (n, kind(n, p)) for n, p in model.named_parameters()}
    sums: dict[str, list[float]] = {}
    batches = task.batches(0)
    loss = torch.tensor(0.0)
    for step in tqdm(range(steps), leave=False):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        loss = task.loss(model, *next(batches))
        loss.backward()
        optimizer.step()
        if step >= steps // 2:
            by_kind: dict[str, list[torch.Tensor]] = {}
            for p, old in zip(model.parameters(), before, strict=True):
                by_kind.setdefault(names[id(p)][1], []).append(((p.detach() - old) / lr).flatten())
            for k, parts in by_kind.items():
                sums.setdefault(k, []).append(torch.cat(parts).pow(2).mean().sqrt().item())
    result = {k: sum(v) / len(v) for k, v in sums.items()}
    result["train_loss"] = loss.item()
    result["val_loss"] = task.evaluate(model, "val")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="training steps (RMS over the last half)")
    parser.add_argument("--lr", type=float, nargs="+", default=[3e-3], help="learning rates")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for lr in args.lr:
        for label, settings in CONFIGS.items():
            results[f"{label} @ lr {lr:g}"] = measure(settings, lr, args.steps)
            logger.warning("%s @ %g: %s", label, lr,
                           {k: round(v, 4) for k, v in results[f"{label} @ lr {lr:g}"].items()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
