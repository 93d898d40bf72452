"""K-FAC against its peers on the zoo's real architectures (``python -m benchmarks.zoo``).

Usage: ``python -m benchmarks.zoo [--models gpt2 tv_resnet18 ...] [--optimizers sgd kfac ...]
[--steps 20] [--seeds 3] [--batch 16] [--out runs/zoo]``; a run in pieces (say, one per family, or
the cheap optimizers first): each piece into its own ``--out`` (or the same, one after another), then
``python -m benchmarks.zoo --out ALL --merge PIECE1 PIECE2 ...`` joins their files into one table.

Per model of :data:`benchmarks.zoo.models.ZOO` (those whose library imports) and per optimizer:

- ``sgd``: ``torch.optim.SGD``, momentum 0.9; ``kfac``: the drop-in ``KFAC(model, lr, momentum=0.9)``
  with every default, on SGD's grid; ``adamw``: ``torch.optim.AdamW``, torch's defaults;
  ``eigen_adam``: the README's AdamW swap, ``KFAC(model, lr, momentum=0.9, dampening=0.9,
  method="eigen_adam", kl_clip=None)``, on AdamW's grid; ``muon``: ``torch.optim.Muon`` on the 2-D
  parameters that are not an embedding's (``adjust_lr_fn="match_rms_adamw"``), AdamW on the rest
  (as Muon's documentation says), on AdamW's grid; ``soap``: heavyball's SOAP (eager), skipped with a
  note when heavyball does not import. The builders are ``benchmarks.peers.optimizers``'.
- The lr grid rule, the same for all: 3 points ``centre·10^(k/2)``, k = -1, 0, 1 around the family's
  centre (:data:`CENTRES`), extended by one point (up to ``MAX_EXTENSIONS`` times) while the chosen
  lr sits at an edge (``benchmarks.peers.optimizers.extend_at_edge``, ``benchmarks.large_batch``'s
  rule). The lr is chosen by the mean over seeds of the loss on a validation batch set after
  ``--steps`` steps; the figures are on a separate test batch set.
- Every run trains ``--steps`` steps on the same batches per seed (``ZooModel.batch`` from a seeded
  generator), timing only the training steps (forward, backward, ``step()``: the thread's CPU time,
  one thread), and scores the test set after each step.
- Reported per model: the test loss after equal steps; the test loss at equal CPU time (the
  smallest total training time among the optimizers: each run's loss after its last step within
  it); the mean step's CPU time against SGD's; K-FAC's coverage (the share of weight-matrix elements
  it preconditions, from ``describe()``); whether the chosen lr sits at the grid's edge.

- The goals: on how many models the drop-in ends at or below SGD (equal steps, equal CPU time), EigenAdam
  at or below AdamW (equal steps), EigenAdam's step against AdamW's, and where a K-FAC optimizer ends above
  its starting loss while AdamW ends below its own (:func:`goals`).

Writes ``<out>/zoo.json`` (every run) after each (model, optimizer) search, so that an interrupted run
keeps what it finished; a rerun with the same ``--out`` (and the same ``--steps``, ``--seeds`` and
``--batch``) skips the searches already in it. ``<out>/zoo.md`` (the table and the goals) and
``<out>/zoo.png`` (the equal-step and equal-time losses against SGD's) are rewritten after each model.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import re
import statistics
import time
import warnings
from collections.abc import Iterator
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure
from torch import nn
from tqdm import tqdm

import kfac_optim
from benchmarks.output import join_searches, load_finished, write_json_whole
from benchmarks.peers.optimizers import (
    MAX_EXTENSIONS,
    OptimizerPair,
    build_kfac,
    extend_at_edge,
    grid_points,
    grid_rate,
)
from benchmarks.peers.optimizers import available as peer_available
from benchmarks.zoo.models import ZOO, ZooModel, available

OPTIMIZERS = ("sgd", "kfac", "adamw", "eigen_adam", "muon", "soap")
VALIDATION_SEED, TEST_SEED, BATCHES = 10_001, 20_002, 2
DROP_IN: dict[str, Any] = {"momentum": 0.9}
EIGEN_ADAM: dict[str, Any] = {"momentum": 0.9, "dampening": 0.9, "method": "eigen_adam", "kl_clip": None}


@dataclass(frozen=True)
class Variant:
    """A K-FAC optimizer run only when named: ``KFAC(model, lr, **settings)`` on ``grid``'s grid (an
    optimizer of :data:`OPTIMIZERS`); the parameters no K-FAC block covers take ``outside_lr`` times
    the lr (1: the drop-in's plain SGD step at its lr)."""

    settings: dict[str, Any]
    grid: str
    outside_lr: float = 1.0


def _drop_in(outside_lr: float = 1.0, **settings: Any) -> Variant:
    return Variant({**DROP_IN, **settings}, "kfac", outside_lr)


VARIANTS: dict[str, Variant] = {
    "eigen_adam_m": Variant({"momentum": 0.0, "method": kfac_optim.EigenAdam(beta1=0.9), "kl_clip": None}, "adamw"),
    "kfac_outside_0": _drop_in(0.0),
    "kfac_outside_0.3": _drop_in(0.3),
    "kfac_outside_3": _drop_in(3.0),
    "kfac_no_clip": _drop_in(kl_clip=None),
    "kfac_kl_1e-3": _drop_in(kl_clip=1e-3),
    "kfac_kl_0.1": _drop_in(kl_clip=0.1),
    "kfac_graft_sgd": _drop_in(kl_clip=None, update=kfac_optim.UpdateConfig(grafting="sgd")),
    "kfac_damping_0.01": _drop_in(damping=0.01),
    "kfac_damping_1": _drop_in(damping=1.0),
    "kfac_intervals_1": _drop_in(factor_update_steps=1, decomposition_update_steps=1),
    "kfac_factor_1": _drop_in(factor_update_steps=1),
    "kfac_decomposition_1": _drop_in(decomposition_update_steps=1),
    "kfac_no_cap": _drop_in(method=kfac_optim.Eigen(max_rank=None)),
    "kfac_reduce": _drop_in(curvature=kfac_optim.CurvatureConfig(weight_sharing="reduce")),
    "kfac_inverse": _drop_in(method="inverse"),
    "kfac_norms": _drop_in(curvature=kfac_optim.CurvatureConfig(
        blocks={nn.LayerNorm: kfac_optim.layers.LayerNormBlock})),
}
"""K-FAC variants run only when named. ``eigen_adam_m``: SOAP's placement of the first moment
(``EigenAdam(beta1=0.9)``, no SGD momentum), on AdamW's grid. ``kfac_*``: the drop-in with one
change, on its grid (the ablations of benchmarks/RESULTS.md "Why the drop-in trailed SGD on two
ViTs, ConvNeXt and EfficientNet"): ``outside_*`` the lr of the parameters outside K-FAC times 0, 0.3
or 3; ``no_clip`` K-FAC's directions as they are (``kl_clip=None``); ``kl_*`` the KL bound;
``graft_sgd`` each tensor's step at SGD's norm; ``damping_*``; ``intervals_1`` fresh factors and
decompositions every step, ``factor_1`` / ``decomposition_1`` only one of them every step (the other
automatic); ``no_cap`` no eigenbasis cap; ``reduce`` ``weight_sharing="reduce"``; ``inverse``
π-factored damping (``method="inverse"``); ``norms`` ``nn.LayerNorm``'s own blocks (``layers.norm``;
not its subclasses that override ``forward``, such as timm's ``LayerNorm2d`` and ``LayerNorm``)."""
_FAMILIES = {"sgd": 0.1, "kfac": 0.1, "adamw": 3e-3, "eigen_adam": 3e-3, "muon": 3e-3, "soap": 3e-3}
CENTRES = {**_FAMILIES, **{name: _FAMILIES[variant.grid] for name, variant in VARIANTS.items()}}
"""The centre of each family's grid: the drop-in shares SGD's, EigenAdam and Muon (at AdamW's RMS)
AdamW's, a variant its :attr:`Variant.grid`'s."""


def grid_lr(name: str, k: int) -> float:
    """Point ``k`` of optimizer ``name``'s grid, ``centre·10^(k/2)``."""
    return grid_rate(CENTRES[name], k)


def _muon(model: nn.Module, lr: float) -> OptimizerPair:
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    matrices = [p for p in trainable if p.dim() == 2 and id(p) not in embedded]
    chosen = {id(p) for p in matrices}
    rest = [p for p in trainable if id(p) not in chosen]
    parts = [torch.optim.Muon(matrices, lr=lr, adjust_lr_fn="match_rms_adamw")] if matrices else []
    if rest:  # none on a LoRA model, whose trainable parameters are all adapter matrices
        parts.append(torch.optim.AdamW(rest, lr=lr))
    return OptimizerPair(*parts)


def _soap(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    import heavyball
    import heavyball.utils

    heavyball.utils.compile_mode = None  # eager: torch.compile on CPU would charge its compile time
    return heavyball.SOAP([p for p in model.parameters() if p.requires_grad], lr=lr)


def build(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer | OptimizerPair:
    """Optimizer ``name`` over the trainable parameters of ``model`` at ``lr`` (module docstring)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(trainable, lr=lr, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(trainable, lr=lr)
    if name == "kfac":
        return build_kfac(model, lr, 0.0, {**DROP_IN, "params": trainable})
    if name == "eigen_adam":
        return build_kfac(model, lr, 0.0, {**EIGEN_ADAM, "params": trainable})
    if name in VARIANTS:
        return _variant(VARIANTS[name], model, lr, trainable)
    if name == "muon":
        return _muon(model, lr)
    if name == "soap":
        return _soap(model, lr)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}; got {name!r}")


def _covered(model: nn.Module, settings: dict[str, Any]) -> set[str]:
    """The names of ``model``'s parameters that K-FAC's blocks cover under ``settings`` (read off a copy)."""
    copy = deepcopy(model)
    names = {id(p): name for name, p in copy.named_parameters()}
    optimizer = build_kfac(copy, 1.0, 0.0, settings)
    return {names[id(p)] for block in optimizer.blocks for p in block.parameters()}


def _variant(variant: Variant, model: nn.Module, lr: float, trainable: list[nn.Parameter]) -> torch.optim.Optimizer:
    """``variant`` over ``trainable`` at ``lr``, the parameters outside K-FAC in a group of their own."""
    if variant.outside_lr == 1.0:
        return build_kfac(model, lr, 0.0, {**variant.settings, "params": trainable})
    covered = _covered(model, variant.settings)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for name, p in named if name in covered]},
              {"params": [p for name, p in named if name not in covered], "lr": lr * variant.outside_lr}]
    return build_kfac(model, lr, 0.0, {**variant.settings, "params": [g for g in groups if g["params"]]})


def coverage(optimizer: object) -> float | None:
    """The share of weight-matrix elements K-FAC preconditions (from ``describe()``), None for the peers."""
    if not isinstance(optimizer, kfac_optim.KFAC):
        return None
    match = re.search(r"precondition (\d+)/(\d+) weight-matrix", optimizer.describe())
    return int(match.group(1)) / int(match.group(2)) if match and int(match.group(2)) else None


@dataclass
class Run:
    """One training run: ``times[k]`` the CPU seconds of the first k+1 steps, ``test[k]`` the test
    loss after them (``test_start`` before any), ``validation`` the validation loss at the end."""

    optimizer: str
    lr: float
    seed: int
    times: list[float]
    test: list[float]
    test_start: float
    validation: float
    coverage: float | None


def _mean_loss(entry: ZooModel, model: nn.Module, batches: list[Any]) -> float:
    with torch.no_grad():
        return sum(float(entry.loss(model, batch)) for batch in batches) / len(batches)


def _batches(entry: ZooModel, batch_size: int, seed: int, count: int) -> list[Any]:
    generator = torch.Generator().manual_seed(seed)
    return [entry.batch(batch_size, generator) for _ in range(count)]


def train(entry: ZooModel, name: str, lr: float, seed: int, steps: int, batch_size: int) -> Run:
    """``steps`` steps of optimizer ``name`` at ``lr`` on ``entry`` from ``seed`` (module docstring)."""
    torch.manual_seed(seed)
    model = entry.build()
    optimizer = build(name, model, lr)
    train_batches = _batches(entry, batch_size, 1000 + seed, steps)
    validation = _batches(entry, batch_size, VALIDATION_SEED, BATCHES)
    test = _batches(entry, batch_size, TEST_SEED, BATCHES)
    times, losses, elapsed = [], [], 0.0
    start_loss = _mean_loss(entry, model, test)
    for batch in train_batches:
        began = time.thread_time()
        optimizer.zero_grad()
        entry.loss(model, batch).backward()
        optimizer.step()
        elapsed += time.thread_time() - began
        times.append(elapsed)
        loss = _mean_loss(entry, model, test)
        losses.append(loss if math.isfinite(loss) else math.inf)
        if not math.isfinite(loss):
            break  # diverged: the rest of the run stays at inf
    losses += [math.inf] * (steps - len(losses))
    times += [times[-1]] * (steps - len(times))
    val = _mean_loss(entry, model, validation)
    return Run(name, lr, seed, times, losses, start_loss, val if math.isfinite(val) else math.inf, coverage(optimizer))


def loss_at(run: Run, budget: float) -> float:
    """The test loss after the last step of ``run`` finished within ``budget`` CPU seconds."""
    done = [loss for t, loss in zip(run.times, run.test, strict=True) if t <= budget]
    return done[-1] if done else run.test_start


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def choose(entry: ZooModel, name: str, args: argparse.Namespace, bar: tqdm) -> tuple[list[Run], dict[str, Any]]:
    """The grid search of optimizer ``name`` on ``entry``: every run, and the chosen lr's summary."""
    runs: dict[int, list[Run]] = {}
    ks = grid_points(3)
    for extension in range(MAX_EXTENSIONS + 1):
        for k in ks:
            if k not in runs:
                runs[k] = []
                for seed in range(args.seeds):
                    runs[k].append(train(entry, name, grid_lr(name, k), seed, args.steps, args.batch))
                    bar.update(1)
        best = min(ks, key=lambda k: _mean([run.validation for run in runs[k]]))
        if extension == MAX_EXTENSIONS or not extend_at_edge(ks, best):
            break
        bar.total += args.seeds
    low, high = ks[0], ks[-1]
    chosen = runs[best]
    summary = {"lr": grid_lr(name, best), "at_edge": best in (low, high),
               "grid": [grid_lr(name, k) for k in range(low, high + 1)],
               "final": _mean([run.test[-1] for run in chosen]), "start": _mean([run.test_start for run in chosen]),
               "step_s": _mean([run.times[-1] / args.steps for run in chosen]), "coverage": chosen[0].coverage,
               "diverged_runs": sum(not math.isfinite(run.test[-1]) for group in runs.values() for run in group)}
    return [run for group in runs.values() for run in group], {**summary, "runs": chosen}


def _table(results: dict[str, dict[str, dict[str, Any]]], optimizers: list[str]) -> str:
    lines = ["| model | family | " + " | ".join(optimizers) + " |", "|---|---|" + "---|" * len(optimizers)]
    for model, by_optimizer in results.items():
        cells = []
        for name in optimizers:
            s = by_optimizer.get(name)
            if s is None:
                cells.append("n/a")
                continue
            edge = "*" if s["at_edge"] else ""
            cov = f"; cov {s['coverage']:.0%}" if s["coverage"] is not None else ""
            cells.append(f"{s['final']:.3g} / {s['equal_time']:.3g} "
                         f"({s['step_ratio']:.2g}×; lr {s['lr']:g}{edge}{cov})")
        lines.append(f"| {model} | {ZOO[model].family} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _figure(results: dict[str, dict[str, dict[str, Any]]], optimizers: list[str]) -> Figure:
    figure = Figure(figsize=(max(6.0, 0.45 * len(results)), 6))
    for row, key, title in ((0, "final", "loss after equal steps / SGD's"),
                            (1, "equal_time", "loss at equal CPU time / SGD's")):
        axes = figure.add_subplot(2, 1, row + 1)
        models = list(results)
        for i, name in enumerate(optimizers):
            ys = [results[m][name][key] / results[m]["sgd"][key] if name in results[m] and "sgd" in results[m]
                  and results[m]["sgd"][key] > 0 else math.nan for m in models]
            axes.scatter([j + 0.08 * (i - len(optimizers) / 2) for j in range(len(models))], ys, label=name, s=14)
        axes.axhline(1.0, color="grey", lw=0.8)
        axes.set_yscale("log")
        axes.set_title(title, fontsize=9)
        axes.set_xticks(range(len(models)), models if row else [""] * len(models), rotation=60, fontsize=7)
    figure.axes[0].legend(fontsize=7, ncol=len(optimizers))
    figure.tight_layout()
    return figure


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=None, help="zoo entries (default: every available one)")
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=[*OPTIMIZERS, *VARIANTS])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/zoo"))
    parser.add_argument("--merge", nargs="+", type=Path, default=None, metavar="FOLDER",
                        help="train nothing: join these folders' zoo.json (a run made in pieces) into --out's table")
    args = parser.parse_args(argv)
    with quiet_runs(args.threads):
        return _compare(args, parser)


@contextlib.contextmanager
def quiet_runs(threads: int) -> Iterator[None]:
    """Run inside: ``threads`` threads, warnings ignored and the library's notes at ERROR (the runs'
    one-time notes would bury the table); the caller's process (a test) gets its settings back."""
    library_logger = logging.getLogger("kfac_optim")
    saved_threads, level = torch.get_num_threads(), library_logger.level
    torch.set_num_threads(threads)
    library_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_num_threads(saved_threads)
        library_logger.setLevel(level)


RESUME_KEYS = ("steps", "seeds", "batch")
"""The settings a rerun into the same ``--out`` must share with the runs it resumes."""


def _load(path: Path, args: argparse.Namespace, parser: argparse.ArgumentParser,
          required: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The summaries and runs already in ``path`` (none if it does not exist and not ``required``); refuses
    other settings."""
    try:
        saved = load_finished(path, vars(args), RESUME_KEYS)
    except ValueError as error:
        parser.error(str(error))
    if saved is None:
        if required:
            parser.error(f"{path} does not exist")
        return {}, []
    return saved["results"], saved["runs"]


def settle(results: dict[str, dict[str, dict[str, Any]]], every_run: list[dict[str, Any]], steps: int) -> None:
    """Per model, the figures that compare its optimizers (in place): ``equal_time``, the mean test loss of
    the chosen lr's runs at the smallest mean training time among the optimizers searched so far, and
    ``step_ratio``, the mean step's CPU time against SGD's."""
    for model, by_optimizer in results.items():
        chosen = {name: [Run(**{k: v for k, v in r.items() if k != "model"}) for r in every_run
                         if r["model"] == model and r["optimizer"] == name and r["lr"] == s["lr"]]
                  for name, s in by_optimizer.items()}
        budget = min(s["step_s"] * steps for s in by_optimizer.values())
        sgd_step = by_optimizer["sgd"]["step_s"] if "sgd" in by_optimizer else None
        for name, summary in by_optimizer.items():
            summary["equal_time"] = _mean([loss_at(run, budget) for run in chosen[name]])
            summary["step_ratio"] = summary["step_s"] / sgd_step if sgd_step else math.nan


def _share(wins: int, total: int) -> str:
    return f"{wins}/{total} ({wins / total:.0%})" if total else "0/0"


def goals(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The issue's goals read off ``settle``d results, one line each (models that lack an optimizer a goal
    names are left out of that goal's count)."""
    def pairs(a: str, b: str) -> list[str]:
        return [m for m, r in results.items() if a in r and b in r]

    lines = []
    for key, clock, need in (("final", "equal steps", 0.9), ("equal_time", "equal CPU time", 0.75)):
        models = pairs("kfac", "sgd")
        wins = [m for m in models if results[m]["kfac"][key] <= results[m]["sgd"][key]]
        lines.append(f"- drop-in ≤ SGD after {clock}: {_share(len(wins), len(models))} (goal ≥ {need:.0%}); "
                     f"above on: {', '.join(m for m in models if m not in wins) or 'none'}")
    models = pairs("eigen_adam", "adamw")
    wins = [m for m in models if results[m]["eigen_adam"]["final"] <= results[m]["adamw"]["final"]]
    lines.append(f"- EigenAdam ≤ AdamW after equal steps: {_share(len(wins), len(models))} (goal ≥ 90%); "
                 f"above on: {', '.join(m for m in models if m not in wins) or 'none'}")
    ratios = {m: results[m]["eigen_adam"]["step_s"] / results[m]["adamw"]["step_s"] for m in models}
    over = [f"{m} {r:.2f}×" for m, r in ratios.items() if r > 2.5]
    if ratios:
        lines.append(f"- EigenAdam's step / AdamW's: median {statistics.median(ratios.values()):.2f}×, "
                     f"max {max(ratios.values()):.2f}× (goal ≤ 2.5× on every model); over: {', '.join(over) or 'none'}")
    trained = [m for m in pairs("adamw", "adamw") if results[m]["adamw"]["final"] < results[m]["adamw"]["start"]]
    failed = [f"{m} {name} {results[m][name]['start']:.3g} → {results[m][name]['final']:.3g}"
              for m in trained for name in ("kfac", "eigen_adam")
              if name in results[m] and not results[m][name]["final"] < results[m][name]["start"]]
    lines.append(f"- K-FAC (drop-in or EigenAdam) ends at or above its starting loss where AdamW trains "
                 f"({len(trained)} models): {', '.join(failed) or 'never'} (goal: never)")
    return lines


def by_family(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """A Markdown table per model family: on how many of its models the drop-in ends at or below SGD and
    EigenAdam at or below AdamW (after equal steps; at equal CPU time), and the median step ratios."""
    def count(models: list[str], a: str, b: str, key: str) -> str:
        both = [m for m in models if a in results[m] and b in results[m]]
        return f"{sum(results[m][a][key] <= results[m][b][key] for m in both)}/{len(both)}"

    def ratio(models: list[str], a: str, b: str) -> str:
        values = [results[m][a]["step_s"] / results[m][b]["step_s"]
                  for m in models if a in results[m] and b in results[m]]
        return f"{statistics.median(values):.2g}×" if values else "n/a"

    families: dict[str, list[str]] = {}
    for model in results:
        families.setdefault(ZOO[model].family, []).append(model)
    lines = ["| family | models | drop-in ≤ SGD (steps; time) | EigenAdam ≤ AdamW (steps; time) | "
             "drop-in step / SGD's | EigenAdam step / AdamW's |", "|---|---|---|---|---|---|"]
    for family, models in families.items():
        lines.append(f"| {family} | {', '.join(models)} | {count(models, 'kfac', 'sgd', 'final')}; "
                     f"{count(models, 'kfac', 'sgd', 'equal_time')} | {count(models, 'eigen_adam', 'adamw', 'final')}; "
                     f"{count(models, 'eigen_adam', 'adamw', 'equal_time')} | {ratio(models, 'kfac', 'sgd')} | "
                     f"{ratio(models, 'eigen_adam', 'adamw')} |")
    return "\n".join(lines) + "\n"


def _compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The runs of ``main``'s arguments: the table, the JSON and the plot (module docstring)."""
    here = available(args.models)
    models = args.models or here
    unknown = [m for m in models if m not in ZOO]
    if unknown:
        parser.error(f"unknown models {unknown}; the zoo has {sorted(ZOO)}")
    notes = [f"{m}: its library does not import here, skipped" for m in models if m not in here]
    models = [m for m in models if m in here]
    optimizers = [o for o in args.optimizers if o != "soap" or peer_available("soap")]
    if len(optimizers) < len(args.optimizers):
        notes.append("soap: heavyball does not import here, skipped")
    for note in notes:
        tqdm.write(note)
    path = args.out / "zoo.json"
    results, every_run = _load(path, args, parser)
    if args.merge:
        return _merge(args, parser, results, every_run)
    todo = [(m, o) for m in models for o in optimizers if o not in results.get(m, {})]
    settings = {k: str(v) for k, v in vars(args).items()}
    payload: dict[str, Any] = {"settings": settings, "notes": notes, "results": results, "runs": every_run}
    bar = tqdm(total=len(todo) * 3 * args.seeds, desc="zoo runs", unit="run")
    for model in models:
        bar.set_postfix_str(model)
        for name in optimizers:
            if (model, name) not in todo:
                continue
            runs, summary = choose(ZOO[model], name, args, bar)
            summary.pop("runs")
            every_run += [{"model": model, **run.__dict__} for run in runs]
            results.setdefault(model, {})[name] = summary
            settle(results, every_run, args.steps)
            write_json_whole(path, payload)
        if model in results:
            _report(args.out, payload)
    bar.close()
    _report(args.out, payload)
    print(payload["table"])  # noqa: T201 (a command-line report)
    return payload


def _merge(args: argparse.Namespace, parser: argparse.ArgumentParser, results: dict[str, Any],
           every_run: list[dict[str, Any]]) -> dict[str, Any]:
    """``--merge``: the searches of the named folders joined to those in ``--out`` (a search in two: an error)."""
    for folder in args.merge:
        more, runs = _load(folder / "zoo.json", args, parser, required=True)
        twice = join_searches(results, more)
        if twice:
            parser.error(f"{folder} repeats searches already joined: {twice}")
        every_run += runs
    settle(results, every_run, args.steps)
    payload = {"settings": {k: str(v) for k, v in vars(args).items()}, "notes": [], "results": results,
               "runs": every_run}
    _report(args.out, payload)
    print(payload["table"])  # noqa: T201 (a command-line report)
    return payload


def _report(out: Path, payload: dict[str, Any]) -> None:
    """The table, the goals and the plot of everything in ``payload`` so far (the JSON gets them too)."""
    results = {m: payload["results"][m] for m in ZOO if m in payload["results"]}  # the zoo's order
    optimizers = [o for o in (*OPTIMIZERS, *VARIANTS) if any(o in r for r in results.values())]
    payload["table"], payload["goals"] = _table(results, optimizers), goals(results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "zoo.md").write_text(
        "Cells: test loss after equal steps / at equal CPU time (the mean step's CPU time against SGD's; the "
        "chosen lr, * at the grid's edge; K-FAC's coverage)\n\n" + payload["table"] + "\nGoals:\n\n"
        + "\n".join(payload["goals"]) + "\n\nBy family (median step ratios):\n\n" + by_family(results))
    write_json_whole(out / "zoo.json", payload)
    _figure(results, optimizers).savefig(out / "zoo.png", dpi=120)
