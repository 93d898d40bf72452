"""How K-FAC's per-rank work shrinks with the number of ranks, measured and planned.

Usage: ``python -m benchmarks.scaling [--model resnet18|resnet50|mlp] [--worlds 1 2] ...``
(``--help`` lists every flag). Prints two tables, writes JSON and a PNG (``--out``).

**Measured** (gloo ranks on this machine, one thread each, file:// rendezvous): for every world
size, ``world`` fresh processes train the model under DDP on their shards of the same global batch,
once for each grad-worker fraction in turn (a new model and optimizer each time), with factor and
decomposition updates on every step so that each timed step holds every phase. Each rank times,
per step (median over ``--steps`` after ``--warmup``):

  decompose              ``kfac.decompose``: the decompositions this rank owns
  precondition           ``kfac.precondition``: preconditioning this rank computes (its
                         gradient-worker blocks), less the nested share gradients
  factor all-reduce      ``kfac.reduce_factors``: the packed, bucketed running-factor sum
  share decompositions   ``kfac.share_decompositions``: agreeing on what exists, owner broadcasts
  share gradients        ``kfac.share_directions``: preconditioned-gradient broadcasts (f < 1)

(the ``torch.profiler`` ranges of ``KFAC.step``; step times are taken under the profiler) and
counts the bytes it hands to collectives in each phase (``KFAC.bytes_communicated()``: flat
buffers, packed triangles, payloads as in ``comm_bytes.py``). The communication phases include waiting for slower ranks;
the compute phases do not. The headline is the slowest rank's decompose + precondition over
the one-process figure (KAISA's memory-optimal f = 1/world should approach 1/world).

**Planned** (no ranks, no data): the plan's load balance and per-rank memory for ``--plan-model``
(ResNet-50) at ``--plan-worlds`` (8 to 1024), as ``plan_report.py`` prints them.

Uses only the optimizer's public surface; the package knows nothing of it. On a 2-core machine
more than 2 ranks share cores and their times stop meaning much.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from benchmarks.plan_report import model_plan_report
from benchmarks.step_time import add_workload_arguments, build_model, workload_shape
from kfac_optim import KFAC, RuntimeConfig

PHASES = ("decompose", "precondition", "factor all-reduce", "share decompositions", "share gradients")
COMPUTE = ("decompose", "precondition")
RANGES = {  # the profiler ranges of KFAC.step (docs/design.md §4) -> phases
    "kfac.decompose": "decompose", "kfac.precondition": "precondition", "kfac.reduce_factors": "factor all-reduce",
    "kfac.share_decompositions": "share decompositions", "kfac.share_directions": "share gradients",
}
BYTE_KINDS = {"factors": "factor all-reduce", "decompositions": "share decompositions", "directions": "share gradients"}
DEADLINE_S = 1800.0


class PhaseMeter:
    """Per-step wall time and collective bytes of each phase, on one rank.

    Reads the optimizer's public instrumentation (docs/design.md §4): the ``torch.profiler``
    ranges ``step()`` marks its phases with, and ``KFAC.bytes_communicated()``. Time spent in a
    nested phase (share gradients inside preconditioning) is counted for the inner one only.
    """

    def __init__(self, optimizer: KFAC) -> None:
        self.optimizer = optimizer
        self.sent_before = optimizer.bytes_communicated()
        self.events: list[Any] = []

    @contextmanager
    def step(self) -> Iterator[None]:
        """Profile one training step (the CPU profiler adds a little to every op it records)."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            yield
        self.events = [e for e in profile.events() if e.name in RANGES]

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        """The last step's seconds and bytes per phase."""
        seconds = dict.fromkeys(PHASES, 0.0)
        for event in self.events:
            seconds[RANGES[event.name]] += event.cpu_time_total / 1e6
        seconds["precondition"] -= seconds["share gradients"]
        sent_now = self.optimizer.bytes_communicated()
        sent = dict.fromkeys(PHASES, 0)
        for kind, phase in BYTE_KINDS.items():
            sent[phase] = sent_now[kind] - self.sent_before[kind]
        self.sent_before = sent_now
        return seconds, sent


def global_batch(step: int, batch_size: int, image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    return x, torch.randint(0, 10, (batch_size,), generator=generator)


def run_rank(rank: int, world: int, config: dict[str, Any], directory: str) -> None:
    """One rank of one world size: for each of ``config["fractions"]``, train, time every phase;
    write ``rank<r>.json`` (this rank's result by fraction)."""
    torch.set_num_threads(config["threads"])
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{Path(directory) / 'rendezvous'}", rank=rank, world_size=world
        )
    try:
        results = {fraction: measure_fraction(rank, world, config, fraction) for fraction in config["fractions"]}
        (Path(directory) / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        if dist.is_initialized():
            gc.collect()  # free DDP reducers and collectives' work objects while the group is alive
            dist.destroy_process_group()


def measure_fraction(rank: int, world: int, config: dict[str, Any], fraction: str) -> dict[str, Any]:
    """Train a fresh model with grad-worker fraction ``fraction`` ("-": one process); this rank's figures."""
    torch.manual_seed(0)
    model = build_model(config["model"], config["image_size"])
    net = DDP(model) if world > 1 else model
    optimizer = KFAC(
        net, lr=0.01, momentum=0.9, damping=config["damping"], method=config["method"],
        factor_update_steps=1, decomposition_update_steps=1,
        runtime=RuntimeConfig(grad_worker_fraction=fraction if world > 1 else 1.0),
    )
    meter = PhaseMeter(optimizer)
    shard = config["batch_size"] // world
    steps = []
    for step in range(config["warmup"] + config["steps"]):
        x, y = global_batch(step, config["batch_size"], config["image_size"])
        x, y = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
        with meter.step():
            start = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(net(x), y).backward()
            optimizer.step()
            total = time.perf_counter() - start
        seconds, sent = meter.take()
        if step >= config["warmup"]:
            steps.append({"step_s": total, "seconds": seconds, "bytes": sent})
    return {
        "rank": rank,
        "owned_factors": len(optimizer.owned_factors),
        "step_ms": 1e3 * statistics.median(s["step_s"] for s in steps),
        "ms": {p: 1e3 * statistics.median(s["seconds"][p] for s in steps) for p in PHASES},
        "bytes_per_step": steps[-1]["bytes"],
    }


RANK_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "kfac_optim", "benchmarks.scaling"]
"""What the ranks' fork server imports once: a spawned rank spent seconds of CPU importing these."""


def measure(world: int, config: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Run every fraction of ``config["fractions"]`` on ``world`` fresh processes (forked from a
    server that imported :data:`RANK_PRELOAD`); by fraction, every rank's result, by rank."""
    mp.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)
    with tempfile.TemporaryDirectory() as directory:
        context = mp.start_processes(
            run_rank, args=(world, config, directory), nprocs=world, join=False, start_method="forkserver"
        )
        deadline = time.monotonic() + DEADLINE_S
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{world} ranks did not finish in {DEADLINE_S:.0f} s")
        ranks = [json.loads((Path(directory) / f"rank{r}.json").read_text()) for r in range(world)]
        return {fraction: [rank[fraction] for rank in ranks] for fraction in config["fractions"]}


def summarize(world: int, fraction: str, ranks: list[dict[str, Any]], single: float | None) -> dict[str, Any]:
    """Slowest-rank figures of one configuration; ratios to the one-process compute figure."""
    compute = [sum(r["ms"][p] for p in COMPUTE) for r in ranks]
    with_comm = [sum(r["ms"].values()) for r in ranks]
    row = {
        "world_size": world,
        "grad_worker_fraction": fraction,
        "compute_ms_per_rank": compute,
        "compute_ms_max": max(compute),
        "with_comm_ms_max": max(with_comm),
        "step_ms_max": max(r["step_ms"] for r in ranks),
        "mib_sent_per_step_rank0": sum(ranks[0]["bytes_per_step"].values()) / 2**20,
        "ranks": ranks,
    }
    if single is not None:
        row["compute_vs_one"] = row["compute_ms_max"] / single
        row["with_comm_vs_one"] = row["with_comm_ms_max"] / single
    return row


def print_measured(rows: list[dict[str, Any]]) -> None:
    header = (f"{'world':>5} {'f':>9} {'rank':>4} {'owns':>4} " + " ".join(f"{p:>12.12}" for p in PHASES)
              + f" {'MiB sent':>8} {'step ms':>8}")
    print(header)
    print("-" * len(header))
    for row in rows:
        for r in row["ranks"]:
            phases = " ".join(f"{r['ms'][p]:>12.1f}" for p in PHASES)
            mib = sum(r["bytes_per_step"].values()) / 2**20
            print(f"{row['world_size']:>5} {row['grad_worker_fraction']:>9} {r['rank']:>4} {r['owned_factors']:>4} "
                  f"{phases} {mib:>8.2f} {r['step_ms']:>8.1f}")
    print("\nslowest rank, decompose + precondition (ms), and vs 1 process; with communication:")
    for row in rows:
        ratio = f"{row['compute_vs_one']:.2f}x" if "compute_vs_one" in row else "-"
        ratio_comm = f"{row['with_comm_vs_one']:.2f}x" if "with_comm_vs_one" in row else "-"
        print(f"  world {row['world_size']} f={row['grad_worker_fraction']:<9} {row['compute_ms_max']:9.1f} ms "
              f"{ratio:>6}   with communication {row['with_comm_ms_max']:9.1f} ms {ratio_comm:>6}")


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    """Stacked per-rank phase times, one bar per rank, grouped by configuration."""
    fig = Figure(figsize=(max(6, 1.2 * sum(len(r["ranks"]) for r in rows)), 4.5), layout="constrained")
    ax = fig.subplots()
    labels, x = [], 0
    for row in rows:
        for rank in row["ranks"]:
            bottom = 0.0
            for index, phase in enumerate(PHASES):
                value = rank["ms"][phase]
                ax.bar(x, value, bottom=bottom, color=f"C{index}", label=phase if x == 0 else None,
                       hatch="//" if phase not in COMPUTE else None)
                bottom += value
            labels.append(f"{row['world_size']}r {row['grad_worker_fraction']}\nrank {rank['rank']}")
            x += 1
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("ms per step (median)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_workload_arguments(parser)  # --batch-size is the global batch, split over the ranks
    parser.add_argument("--method", choices=["eigen", "inverse"], default="inverse")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="rank counts to run (1 = one process)")
    parser.add_argument("--fractions", nargs="+", default=["comm-opt", "mem-opt"],
                        help="grad_worker_fraction values for world sizes > 1")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    parser.add_argument("--plan-model", default="resnet50", help="torchvision model for the planned table")
    parser.add_argument("--plan-worlds", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--skip-measured", action="store_true", help="only the planned table")
    parser.add_argument("--out", type=Path, default=Path("runs/scaling"),
                        help="folder for scaling.json and scaling.png")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    image_size, batch_size = workload_shape(args)
    config = {
        "model": args.model, "method": args.method, "damping": args.damping, "threads": args.threads,
        "batch_size": batch_size, "image_size": image_size,
        "warmup": args.warmup, "steps": args.steps,
    }
    for world in args.worlds:
        if world < 1 or config["batch_size"] % world:
            raise SystemExit(f"--worlds: {world} must be >= 1 and divide the global batch {config['batch_size']}")
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"config": config, "torch": torch.__version__, "machine": platform.machine(),
                              "cpus": os.cpu_count(), "measured": []}
    if not args.skip_measured:
        single: float | None = None
        for world in tqdm(sorted(set(args.worlds)), desc="world sizes", unit="world"):
            fractions = ["-"] if world == 1 else args.fractions
            for fraction, ranks in measure(world, {**config, "fractions": fractions}).items():
                row = summarize(world, fraction, ranks, single)
                if world == 1:
                    single = row["compute_ms_max"]
                report["measured"].append(row)
        print(f"\n{args.model}, global batch {config['batch_size']}, {config['image_size']}px, {args.method}, "
              f"factor and decomposition updates every step, {args.threads} thread(s) per rank, "
              f"median of {args.steps} steps")
        print_measured(report["measured"])
        plot(report["measured"], f"K-FAC per-rank phases, {args.model} ({args.method})", args.out / "scaling.png")
    print()
    report["planned"] = model_plan_report(args.plan_model, args.plan_worlds, args.fractions, args.method)
    path = args.out / "scaling.json"
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}" + ("" if args.skip_measured else f" and {args.out / 'scaling.png'}"))
    return report


if __name__ == "__main__":
    main()
