"""Load balance and per-rank memory of the distributed work plan on a torchvision model's layers.

For each world size and grad-worker fraction, prints one table row and writes all rows as JSON:
max/mean load (each factor's decomposition cost as the method counts it,
``Method.decomposition_cost``), the lower bound on any assignment over the mean, the plan's max load
over that bound (1.0 is optimal), the same for plain LPT without the refinement, the number of
process groups, and per-rank memory of factors and decompositions. No data and no training: the
factors (sizes and kinds: dense, batched per group, diagonal) are those of the blocks KFAC builds
for the model (``kfac_optim.discover_blocks``, on the meta device).

    python -m benchmarks.plan_report --out plan_report.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from kfac_optim.distributed.balance import imbalance
from kfac_optim.distributed.grid import STRATEGIES
from kfac_optim.distributed.plan import make_plan
from kfac_optim.distributed.plan_memory import memory_per_rank
from kfac_optim.distributed.strategy import block_work_items
from kfac_optim.distributed.work import WorkItem, item_costs
from kfac_optim.layers import discover_blocks
from kfac_optim.optimizer import block_dims

MIB = 2**20


def torchvision_model(model: str, **kwargs: object) -> torch.nn.Module:
    """``torchvision.models.<model>(weights=None, **kwargs)``, randomly initialized (on the current
    default device: under ``torch.device("meta")`` nothing is allocated). torchvision is imported
    here, not with this module, so that importing the benchmarks never needs it."""
    import torchvision

    return getattr(torchvision.models, model)(weights=None, **kwargs)


def torchvision_block_dims(model: str) -> dict[str, tuple[int, int]]:
    """``{name: (dim_A, dim_G)}`` of the K-FAC blocks of a torchvision model, built on the meta device."""
    with torch.device("meta"):
        network = torchvision_model(model)
    return block_dims(network)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", help="torchvision.models builder name")
    parser.add_argument(
        "--worlds",
        type=int,
        nargs="+",
        default=[8, 16, 32, 64, 128, 256, 512, 1024],
        help="world sizes to plan for",
    )
    parser.add_argument(
        "--fractions",
        nargs="+",
        default=["comm-opt", "mem-opt"],
        help=f"grad_worker_fraction values: numbers in (0, 1] or names {STRATEGIES}",
    )
    parser.add_argument(
        "--method", choices=["eigen", "inverse"], default="eigen", help="decomposition kind"
    )
    parser.add_argument("--out", type=Path, default=Path("plan_report.json"), help="JSON path")
    return parser.parse_args()


def fraction_arg(text: str) -> float | str:
    return text if text in STRATEGIES else float(text)


def plan_rows(
    items: tuple[WorkItem, ...], worlds: list[int], fractions: list[str], method: str
) -> list[dict[str, float | int | str]]:
    """One row per (world size, fraction): balance of the plan and per-rank memory, printed as a table."""
    header = (
        f"{'world':>5} {'f':>10} {'gw':>4} {'max/mean':>9} {'bound/mean':>10} {'max/bound':>9} "
        f"{'LPT max/bound':>13} {'groups':>6} {'factors MiB':>11} {'decomp MiB min..max':>19}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for world in worlds:
        for text in fractions:
            plan = make_plan(items, world, fraction_arg(text), method=method)
            loads = plan.loads()
            mean = math.fsum(loads) / world
            bound = plan.lower_bound()
            lpt_max = max(make_plan(items, world, fraction_arg(text), method=method, refine=False).loads())
            memory = memory_per_rank(plan, method)
            decomp = [m.decompositions / MIB for m in memory]
            row = {
                "world_size": world,
                "grad_worker_fraction": text,
                "grad_workers": plan.grad_workers,
                "max_over_mean": imbalance(loads),
                "bound_over_mean": bound / mean,
                "max_over_bound": max(loads) / bound,
                "lpt_max_over_bound": lpt_max / bound,
                "groups": len(plan.groups),
                "factors_mib": memory[0].factors / MIB,
                "decompositions_mib_min": min(decomp),
                "decompositions_mib_max": max(decomp),
                "total_mib_max": max(m.total for m in memory) / MIB,
            }
            rows.append(row)
            print(
                f"{world:>5} {text:>10} {plan.grad_workers:>4} {row['max_over_mean']:>9.3f} "
                f"{row['bound_over_mean']:>10.3f} {row['max_over_bound']:>9.4f} "
                f"{row['lpt_max_over_bound']:>13.4f} {row['groups']:>6} "
                f"{row['factors_mib']:>11.1f} {min(decomp):>9.1f}..{max(decomp):<9.1f}"
            )
    return rows


def torchvision_work_items(model: str) -> tuple[int, tuple[WorkItem, ...]]:
    """The number of K-FAC blocks of a torchvision model and their work items (meta device)."""
    with torch.device("meta"):
        network = torchvision_model(model)
    blocks = discover_blocks(network)
    return len(blocks), tuple(block_work_items(blocks))


def model_plan_report(model: str, worlds: list[int], fractions: list[str], method: str) -> dict[str, object]:
    """Print the largest factors' cost shares and :func:`plan_rows` for a torchvision model; return both."""
    blocks, items = torchvision_work_items(model)
    costs = sorted(((c, f"{it.block}.{it.factor}") for it, c in item_costs(items, method).items()), reverse=True)
    total = math.fsum(c for c, _ in costs)
    largest = ", ".join(f"{name} ({c / total:.1%})" for c, name in costs[:3])
    print(f"{model}: {blocks} blocks, {len(items)} factors; largest cost shares: {largest}")
    rows = plan_rows(items, worlds, fractions, method)
    return {"model": model, "method": method, "blocks": blocks, "rows": rows}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    report = model_plan_report(args.model, args.worlds, args.fractions, args.method)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
