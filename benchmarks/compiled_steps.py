"""Train steps of a ``torch.compile``d model with and without K-FAC's capture.

Usage: ``python -m benchmarks.compiled_steps [--model gpt|resnet18] [--backend inductor] [--threads 1] ...``
(``--help`` lists every flag). Prints a table and writes JSON (``--json``).

Each run builds the model afresh (same seed, one fixed random batch per step), compiles it
(``torch.compile(model, backend=...)``; ``--fullgraph`` passes ``fullgraph=True``) and times
``zero_grad`` + forward + backward, then ``step()``, wall-clock, step by step:

  sgd    ``torch.optim.SGD``: the compiled model without any capture (the floor)
  kfac   ``KFAC`` with ``--factor-interval`` / ``--inverse-interval``: the capture is armed on factor
         steps only (``KFAC.capturing``; Dynamo keeps one graph per arming state), so its forward +
         backward on factor steps is the compiled step *with* the capture, on the other steps the
         same model with the capture's hooks unarmed
  sgd-uncompiled, kfac-uncompiled  the same without ``torch.compile`` (for reference; not by default)

Each run's first ``--warmup`` steps (compiles, the first decomposition) are left out of the means.
The runs alternate ``--rounds`` times, each from ``torch.compiler.reset()`` and a fresh model (so
that a shared machine's load changes hit every run alike, and no model runs graphs traced for
another instance: Dynamo does not guard on module hooks). Graphs: how many graphs Dynamo hands the
backend for one forward of the model with the capture armed and without K-FAC (they must be equal:
docs/design.md §4, "Compiled models"). Models: ``gpt``, the peers' ``CharGPT`` (2 layers,
d=64, context 64, tied head, learned positions; ``benchmarks.peers.tasks``) on random bytes;
``resnet18``, torchvision's ResNet-18 (10 classes) on random ``--image-size`` images.

Uses only public names of the library; the package knows nothing of it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_optim import KFAC

MODELS = ("gpt", "resnet18")
RUNS = ("sgd", "kfac", "sgd-uncompiled", "kfac-uncompiled")


def build(model_name: str) -> nn.Module:
    """The model, seeded."""
    torch.manual_seed(0)
    if model_name == "gpt":
        from benchmarks.peers.tasks import CharGPT

        return CharGPT()
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def batches(args: argparse.Namespace) -> list[tuple[Tensor, Tensor]]:
    """One fixed random batch per step: byte windows ``(N, 64)`` for the GPT, images for ResNet-18."""
    generator = torch.Generator().manual_seed(1)
    if args.model == "gpt":
        tokens = [torch.randint(0, 256, (args.batch_size, 65), generator=generator) for _ in range(args.steps)]
        return [(t[:, :-1], t[:, 1:]) for t in tokens]
    size = args.image_size
    return [(torch.randn(args.batch_size, 3, size, size, generator=generator),
             torch.randint(0, 10, (args.batch_size,), generator=generator)) for _ in range(args.steps)]


def loss_of(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def make_optimizer(run: str, model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    if run.startswith("sgd"):
        return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    return KFAC(model, lr=args.lr, momentum=0.9, damping=args.damping,
                factor_update_steps=args.factor_interval, decomposition_update_steps=args.inverse_interval)


def graph_counts(args: argparse.Namespace, x: Tensor) -> dict[str, int]:
    """How many graphs Dynamo hands the backend for one forward, without K-FAC and with its capture armed."""
    counts = {}
    for run in ("sgd", "kfac"):
        torch.compiler.reset()
        model = build(args.model)
        optimizer = make_optimizer(run, model, args)  # KFAC arms its capture for step 0 (a factor step)
        graphs = []

        def count(graph: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., Any]:
            graphs.append(graph)
            return graph.forward

        torch.compile(model, backend=count)(x)
        counts[run] = len(graphs)
        del optimizer
    return counts


class Run:
    """One run's model, optimizer and compiled model, and its per-step times."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name = name
        self.model = build(args.model)
        self.model.train()
        self.optimizer = make_optimizer(name, self.model, args)
        self.compiled: Callable[[Tensor], Tensor] = self.model if name.endswith("-uncompiled") else torch.compile(
            self.model, backend=args.backend, fullgraph=args.fullgraph)
        self.times: dict[str, list[Any]] = {"forward_backward_s": [], "step_s": [], "factor_step": []}

    def step(self, x: Tensor, y: Tensor) -> None:
        """One timed train step: ``zero_grad`` + forward + backward, then ``step()``."""
        optimizer = self.optimizer
        self.times["factor_step"].append(isinstance(optimizer, KFAC) and optimizer.capturing)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss_of(self.compiled(x), y).backward()
        middle = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        self.times["forward_backward_s"].append(middle - start)
        self.times["step_s"].append(end - middle)


def time_runs(names: list[str], args: argparse.Namespace,
              data: list[tuple[Tensor, Tensor]]) -> dict[str, dict[str, list[Any]]]:
    """Every run's steps after its warmup, ``--rounds`` times, the runs alternating round by round
    (so that load changes on a shared machine hit all runs alike). Each run starts from
    ``torch.compiler.reset()`` with a fresh model: Dynamo does not guard on module hooks, so a model
    must not run graphs traced for another instance of its class."""
    times: dict[str, dict[str, list[Any]]] = {name: {"forward_backward_s": [], "step_s": [], "factor_step": []}
                                              for name in names}
    for _ in range(args.rounds):
        for name in names:
            torch.compiler.reset()
            run = Run(name, args)
            for x, y in data:
                run.step(x, y)
            for key, values in run.times.items():
                times[name][key] += values[args.warmup :]
    return times


def mean_over(values: list[float], keep: list[bool]) -> float | None:
    chosen = [v for v, k in zip(values, keep, strict=True) if k]
    return statistics.mean(chosen) if chosen else None


def summary(result: dict[str, Any]) -> dict[str, float | None]:
    """Means of the timed steps: forward + backward on factor / other steps, ``step()``, whole step."""
    fb, st, factor = result["forward_backward_s"], result["step_s"], result["factor_step"]
    kept = [True] * len(fb)
    whole = [a + b for a, b in zip(fb, st, strict=True)]
    return {
        "forward_backward_factor_steps_s": mean_over(fb, [k and f for k, f in zip(kept, factor, strict=True)]),
        "forward_backward_other_steps_s": mean_over(fb, [k and not f for k, f in zip(kept, factor, strict=True)]),
        "step_s": mean_over(st, kept),
        "whole_step_s": mean_over(whole, kept),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="gpt")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager, eager)")
    parser.add_argument("--fullgraph", action="store_true", help="compile with fullgraph=True")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32, help="resnet18 only")
    parser.add_argument("--steps", type=int, default=42)
    parser.add_argument("--warmup", type=int, default=12,
                        help="steps left out of the means (compiles, first decomposition)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all runs, alternating")
    parser.add_argument("--factor-interval", type=int, default=2)
    parser.add_argument("--inverse-interval", type=int, default=1000,
                        help="past --steps: the only decomposition is in the warmup")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--damping", type=float, default=0.01)
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=["sgd", "kfac"])
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data = batches(args)
    counts = graph_counts(args, data[0][0])
    times = time_runs(args.runs, args, data)
    results = {name: {**summary(run_times), "per_step": run_times} for name, run_times in times.items()}
    print(f"{args.model}, batch {args.batch_size}, backend {args.backend}{' fullgraph' if args.fullgraph else ''}, "  # noqa: T201
          f"{args.rounds} rounds of {args.steps} steps ({args.warmup} warmup), factor interval {args.factor_interval}, "
          f"{args.threads} "
          f"thread(s), torch {torch.__version__}, load {os.getloadavg()[0]:.1f}; graphs: {counts}")
    print("| run | fwd+bwd factor steps ms | fwd+bwd other steps ms | step() ms | whole step ms |")  # noqa: T201
    print("|---|---|---|---|---|")  # noqa: T201

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.1f}"

    for run, r in results.items():
        print(f"| {run} | {ms(r['forward_backward_factor_steps_s'])} | {ms(r['forward_backward_other_steps_s'])} "  # noqa: T201
              f"| {ms(r['step_s'])} | {ms(r['whole_step_s'])} |")
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "graphs": counts, "runs": results,
               "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
               "load": os.getloadavg()}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1))
    return payload


if __name__ == "__main__":
    main()
