"""Per-rank memory of K-FAC under FSDP2 (``fully_shard``) against DDP, measured on real gloo ranks.

Usage: ``python -m benchmarks.fsdp_memory [--model resnet18] [--world 2] [--out fsdp_memory.json]``
(``--help`` lists every flag). Prints a table, writes JSON and a PNG next to it.

For DDP and for FSDP2 (``fully_shard`` on every Conv2d/Linear and on the root), at each
grad-worker fraction (1 and 1/world), ``--world`` CPU processes (gloo, one thread each) build the
model, take one K-FAC step with a factor and a decomposition update on their shard of a small
batch, and report, per rank:

  kfac          ``KFAC.memory_usage()["total"]``: running factors, pending statistics, the
                decompositions this rank holds and, under FSDP, ``sharded_preconditioning`` (the
                factors and pending statistics are the same on every rank and under both wrappers:
                every rank keeps the global factors)
  factors       ``memory_usage()["factors"] + ["pending"]``
  transient     ``memory_usage()["sharded_preconditioning"]``: the most K-FAC's FSDP path holds at
                once (a bucket's gathered gradient rows on its preconditioner, plus one layer's
                whole gradient and direction)
  params        bytes of the parameters this rank holds (whole under DDP, its shards under FSDP)

The headline check: FSDP's ``kfac + params`` per rank <= ``(DDP's kfac + params) / world +
factors`` (the replicated factor state), with DDP at f = 1, KAISA's default.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import nn
from tqdm import tqdm

from benchmarks.plan_report import MIB, torchvision_model
from kfac_optim import KFAC, RuntimeConfig

FRACTIONS = ("1", "1/world")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet18", help="torchvision.models builder name")
    parser.add_argument("--world", type=int, default=2, help="gloo ranks to run")
    parser.add_argument("--batch", type=int, default=2, help="samples per rank")
    parser.add_argument("--image", type=int, default=32, help="input height and width")
    parser.add_argument(
        "--method", default="eigen", choices=("eigen", "inverse"),
        help="K-FAC method (inverse: Cholesky, several times cheaper than eigh on a CPU; "
             "n² instead of n² + n per factor)",
    )
    parser.add_argument("--out", type=Path, default=Path("fsdp_memory.json"), help="JSON path (PNG beside it)")
    return parser.parse_args(argv)


def build(kind: str, model_name: str) -> nn.Module:
    torch.manual_seed(0)
    model = torchvision_model(model_name, num_classes=10)
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            fully_shard(module)
    return fully_shard(model)


def local_bytes(tensor: torch.Tensor) -> int:
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).nbytes


def measure(kind: str, fraction: str, rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    model = build(kind, args.model)
    grad_worker_fraction = 1.0 if fraction == "1" else 1 / world
    optimizer = KFAC(
        model, lr=0.1, momentum=0.9, factor_update_steps=1, decomposition_update_steps=1, method=args.method,
        runtime=RuntimeConfig(grad_worker_fraction=grad_worker_fraction),
    )
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, args.image, args.image, generator=generator)
    y = torch.randint(0, 10, (args.batch,), generator=generator)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    usage = optimizer.memory_usage()
    result = {
        "kfac": usage["total"],
        "factors": usage["factors"] + usage["pending"],
        "decompositions": usage["decompositions"],
        "transient": usage["sharded_preconditioning"],
        "params": sum(local_bytes(p) for p in model.parameters()),
    }
    del model, optimizer
    gc.collect()
    return result


def rank_main(rank: int, world: int, args: argparse.Namespace, directory: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world,
        timeout=timedelta(minutes=30),
    )
    try:
        runs = [(kind, fraction) for kind in ("ddp", "fsdp") for fraction in FRACTIONS]
        results = {}
        for kind, fraction in tqdm(runs, desc="runs", disable=rank != 0):
            results[f"{kind} f={fraction}"] = measure(kind, fraction, rank, world, args)
        torch.save(results, Path(directory) / f"rank{rank}.pt")
    finally:
        gc.collect()
        dist.destroy_process_group()


def summarize(per_rank: list[dict[str, dict[str, int]]], world: int) -> dict[str, Any]:
    """The largest rank's figures per run, and the FSDP-versus-DDP check per fraction."""
    runs = {run: {key: max(r[run][key] for r in per_rank) for key in per_rank[0][run]} for run in per_rank[0]}
    ddp = runs["ddp f=1"]
    budget = (ddp["kfac"] + ddp["params"]) / world + ddp["factors"]
    checks = {}
    for fraction in FRACTIONS:
        fsdp = runs[f"fsdp f={fraction}"]
        checks[f"fsdp f={fraction}"] = {
            "kfac_plus_params": fsdp["kfac"] + fsdp["params"],
            "budget": budget,
            "within_budget": fsdp["kfac"] + fsdp["params"] <= budget,
        }
    return {"world": world, "runs": runs, "checks": checks}


def plot(summary: dict[str, Any], title: str, path: Path) -> None:
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    runs = list(summary["runs"])
    bottoms = [0.0] * len(runs)
    for key in ("factors", "decompositions", "transient", "params"):
        values = [summary["runs"][run][key] / MIB for run in runs]
        ax.bar(runs, values, bottom=bottoms, label="factors + pending" if key == "factors" else key)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.axhline(summary["checks"]["fsdp f=1"]["budget"] / MIB, color="black", linestyle="--", label="budget")
    ax.set_ylabel("MiB per rank (largest rank)")
    ax.legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        mp.start_processes(rank_main, args=(args.world, args, directory), nprocs=args.world, start_method="spawn")
        per_rank = [torch.load(Path(directory) / f"rank{r}.pt") for r in range(args.world)]
    summary = {"model": args.model, "method": args.method, "batch_per_rank": args.batch,
               **summarize(per_rank, args.world)}
    print(f"{args.model} at {args.world} ranks, method {args.method}, MiB per rank (largest rank):")
    print(f"  {'run':14} {'kfac':>9} {'factors':>9} {'decomp':>9} {'transient':>9} {'params':>9}")
    for run, row in summary["runs"].items():
        print(f"  {run:14} " + " ".join(f"{row[k] / MIB:9.1f}"
                                        for k in ("kfac", "factors", "decompositions", "transient", "params")))
    for run, check in summary["checks"].items():
        print(f"  {run}: kfac + params {check['kfac_plus_params'] / MIB:.1f} MiB vs budget "
              f"{check['budget'] / MIB:.1f} MiB: {'within' if check['within_budget'] else 'OVER'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    plot(summary, f"K-FAC memory per rank, {args.model}, {args.world} ranks", args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
