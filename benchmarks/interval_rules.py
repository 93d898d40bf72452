"""The automatic intervals' rules against each other on the zoo's models (``python -m benchmarks.interval_rules``).

Usage: ``python -m benchmarks.interval_rules [--models tv_resnet18 ...] [--rules auto fixed_5_50 ...]
[--steps 20] [--seeds 3] [--batch 16] [--out runs/interval_rules]``.

Each rule is the drop-in ``KFAC(model, lr, momentum=0.9)`` with one interval setting (:data:`RULES`),
run with ``benchmarks.zoo``'s protocol (its lr grid on SGD's centre, extended while the choice sits
at an edge, 3 seeds, the same batches, the thread's CPU time of the training steps), beside SGD.
Reported per model: the intervals each rule chose, the test loss after equal steps and at equal CPU
time (the smallest total training time among SGD and the rules), and the mean step against SGD's.

``auto`` is the library's rule: the preconditioning ``P`` takes at most half the budget,
``share = (overhead·S − min(P, overhead·S/2)) / 2``. ``budget_with_preconditioning`` is the rule
before: ``(overhead·S − P) / 2``, so a model whose preconditioning alone exceeded ``overhead·S``
had both intervals at their caps. ``preconditioning_on_top`` leaves ``P`` out of the budget,
``overhead·S / 2``: shorter intervals wherever ``P`` is not negligible (transformers too).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.zoo import run as zoo
from benchmarks.zoo.models import ZOO
from kfac_optim import KFAC
from kfac_optim.schedule.intervals import MIN_AUTO_INVERSE, AutoIntervals, StepCosts


@dataclass(frozen=True)
class BudgetWithPreconditioning(AutoIntervals):
    """The earlier budget rule: the preconditioning came out of the budget first (module docstring)."""

    def choose(self, costs: StepCosts, factor: int | None, inverse: int | None) -> tuple[int, int]:
        share = (self.overhead * costs.step - costs.precondition) / 2

        def interval(cost: float, low: int, high: int) -> int:
            return high if share <= 0 else min(max(low, math.ceil(cost / share)), high)

        factor = interval(costs.factor, 1, self.max_factor) if factor is None else factor
        inverse = interval(costs.decomposition, MIN_AUTO_INVERSE, self.max_inverse) if inverse is None else inverse
        return factor, math.ceil(inverse / factor) * factor


@dataclass(frozen=True)
class PreconditioningOnTop(AutoIntervals):
    """The preconditioning outside the budget: each interval's work gets ``overhead·S / 2``."""

    def choose(self, costs: StepCosts, factor: int | None, inverse: int | None) -> tuple[int, int]:
        return super().choose(StepCosts(costs.step, costs.factor, costs.decomposition), factor, inverse)


RULES: dict[str, dict[str, Any]] = {
    "auto": {},
    "budget_with_preconditioning": {"factor_update_steps": BudgetWithPreconditioning(),
                                    "decomposition_update_steps": BudgetWithPreconditioning()},
    "preconditioning_on_top": {"factor_update_steps": PreconditioningOnTop(),
                               "decomposition_update_steps": PreconditioningOnTop()},
    "fixed_5_50": {"factor_update_steps": 5, "decomposition_update_steps": 50},
}
CONVNETS = ("tv_resnet18", "timm_convnext", "timm_mobilenetv3", "timm_resnet18")
"""The zoo's convnets whose intervals the rules set apart (the others choose 2-3/10-12 under every budget rule)."""


def chosen_intervals(model: str, rule: str, batch: int) -> str:
    """The intervals ``rule`` takes on ``model`` at ``batch`` (after one step)."""
    entry = ZOO[model]
    torch.manual_seed(0)
    net = entry.build()
    optimizer = KFAC(net, lr=0.1, momentum=0.9, **RULES[rule])
    optimizer.zero_grad()
    entry.loss(net, entry.batch(batch, torch.Generator().manual_seed(0))).backward()
    optimizer.step()
    return optimizer.describe().splitlines()[-1].split(" from ")[0].removeprefix("intervals: ")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(CONVNETS), choices=sorted(ZOO))
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("runs/interval_rules"))
    args = parser.parse_args(argv)
    with zoo.quiet_runs(1):
        return _compare(args)


def _compare(args: argparse.Namespace) -> dict[str, Any]:
    """The runs of ``main``'s arguments: the table and the JSON."""
    results: dict[str, Any] = {}
    bar = tqdm(total=len(args.models) * (1 + len(args.rules)) * 3 * args.seeds, unit="run")
    drop_in = dict(zoo.DROP_IN)
    for model in args.models:
        by_rule = {"sgd": zoo.choose(ZOO[model], "sgd", args, bar)[1]}
        for rule in args.rules:
            zoo.DROP_IN = {**drop_in, **RULES[rule]}
            try:
                by_rule[rule] = zoo.choose(ZOO[model], "kfac", args, bar)[1]
            finally:
                zoo.DROP_IN = drop_in
            by_rule[rule]["intervals"] = chosen_intervals(model, rule, args.batch)
        budget = min(s["step_s"] * args.steps for s in by_rule.values())
        for summary in by_rule.values():
            summary["equal_time"] = sum(zoo.loss_at(r, budget) for r in summary["runs"]) / len(summary["runs"])
            summary["step_ratio"] = summary["step_s"] / by_rule["sgd"]["step_s"]
            summary["runs"] = [r.__dict__ for r in summary["runs"]]
        results[model] = by_rule
        tqdm.write(table({model: by_rule}))
    bar.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "interval_rules.json").write_text(json.dumps(
        {"settings": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    (args.out / "interval_rules.md").write_text(table(results))
    print(table(results))  # noqa: T201 (a command-line report)
    return results


def table(results: dict[str, Any]) -> str:
    """Per model and rule: intervals, test loss after equal steps / at equal CPU time, step vs SGD's, lr."""
    lines = ["| model | rule | intervals | loss, equal steps | loss, equal CPU time | step / SGD's | lr |",
             "|---|---|---|---|---|---|---|"]
    for model, by_rule in results.items():
        for rule, s in by_rule.items():
            edge = "*" if s["at_edge"] else ""
            lines.append(f"| {model} | {rule} | {s.get('intervals', '')} | {s['final']:.4g} | {s['equal_time']:.4g} | "
                         f"{s['step_ratio']:.2f} | {s['lr']:g}{edge} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
