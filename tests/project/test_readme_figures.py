"""The README's "When K-FAC pays" table quotes what its result files say.

Each row of the table quotes figures (time ratios, step ratios, counts such as ``7/9``) and links the
result file or folder they came from under benchmarks/results/. Each test here reads one row (found by
its first cell and its link), recomputes its figures from that link's data (the JSON or metrics files
next to the linked Markdown) the way the row states them, and checks that the row prints exactly those
figures, rounded as it prints them. A re-run that moves a figure fails here, naming the row and the
figure, until the README follows.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class PaysRow:
    """One row of the table: its task (a continuation row's is the row above's), cells and link."""

    task: str
    goal: str
    time: str
    step: str
    link: str


def pays_rows() -> list[PaysRow]:
    """The rows of the README's "When K-FAC pays" table, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## When K-FAC pays", 1)[1].split("\n## ", 1)[0]
    rows: list[PaysRow] = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        link = re.search(r"\]\(([^)]+)\)", cells[-1]) if line.startswith("|") and len(cells) == 5 else None
        if link is None:  # not a row, the header or the rule under it
            continue
        task = cells[0] or rows[-1].task
        rows.append(PaysRow(task, cells[1], cells[2], cells[3], link[1]))
    return rows


def pays_row(task_start: str, link: str) -> PaysRow:
    """The one row whose task starts with ``task_start`` and whose link is ``link``."""
    found = [r for r in pays_rows() if r.task.startswith(task_start) and r.link == link]
    assert len(found) == 1, f"README 'When K-FAC pays': {len(found)} rows start with {task_start!r} and link {link}"
    return found[0]


def assert_row_quotes(row: PaysRow, cell: str, pattern: str, want: tuple[str, ...], figure: str) -> None:
    """That ``row``'s ``cell`` (``"time"``, ``"step"``, ...) matches ``pattern`` and its groups are ``want``."""
    text = getattr(row, cell)
    match = re.search(pattern, text)
    assert match is not None, f"README row {row.task!r}: {figure}: the {cell} cell {text!r} no longer reads {pattern!r}"
    assert match.groups() == want, (f"README row {row.task!r}: {figure}: the README says {match.groups()}, "
                                    f"the data behind {row.link} gives {want}")


def read_result(path: str) -> Any:
    """The JSON at ``path`` under benchmarks/results/."""
    return json.loads((RESULTS / path).read_text(encoding="utf-8"))


# -- the 1-D CNN at three batches (benchmarks.large_batch) ---------------------------------------------

def test_the_large_batch_row_quotes_large_batch_json() -> None:
    row = pays_row("1-D CNN", "benchmarks/results/large_batch_3seeds/large_batch.md")
    data = read_result("large_batch_3seeds/large_batch.json")
    rows = {(r["optimizer"], r["batch"]): r for r in data["tasks"]["cnn"]["rows"]}
    batches, seeds = data["settings"]["batches"], data["settings"]["seeds"]
    assert_row_quotes(row, "task", r"^1-D CNN, batch (\d+) / (\d+) / (\d+) .*, (\d+) seeds",
                      (*map(str, batches), str(seeds)), "the batches and seeds")
    assert_row_quotes(row, "goal", r"^(\d+%) test accuracy$", (f"{data['tasks']['cnn']['target']:.0%}",), "the target")

    def time_ratios(name: str, base: str) -> tuple[str, ...]:  # median CPU seconds to the target over the seeds
        return tuple(f"{statistics.median(rows[name, b]['seconds']) / statistics.median(rows[base, b]['seconds']):.2f}"
                     for b in batches)

    def step_ratios(name: str, base: str) -> tuple[str, ...]:
        return tuple(f"{rows[name, b]['step_ms'] / rows[base, b]['step_ms']:.1f}" for b in batches)

    three = r"([\d.]+)× / ([\d.]+)× / ([\d.]+)×"
    assert_row_quotes(row, "time", rf"drop-in {three} SGD's", time_ratios("kfac_dropin", "sgd"),
                      "drop-in's time to the target over SGD's")
    assert_row_quotes(row, "time", rf"EigenAdam {three} AdamW's", time_ratios("kfac", "adamw"),
                      "EigenAdam's time to the target over AdamW's")
    assert_row_quotes(row, "step", rf"^{three}; {three}$",
                      step_ratios("kfac_dropin", "sgd") + step_ratios("kfac", "adamw"),
                      "drop-in's step over SGD's; EigenAdam's over AdamW's")
    soap_fewer = all(statistics.median(rows["soap", b]["steps"]) < statistics.median(rows["kfac", b]["steps"])
                     for b in batches)
    assert ("SOAP needs fewer steps" in row.time) == soap_fewer, \
        f"README row {row.task!r}: 'SOAP needs fewer steps' (than EigenAdam at every batch) is {soap_fewer} in the file"


# -- EigenAdam's transformer recipe (benchmarks.peers' transformer goal, validation split) --------------

def transformer_recipe_runs(task: str) -> list[dict]:
    """The recipe's (``kfac_ema``: EigenAdam with ``dampening=0.9``) entries for ``task`` in the
    validation-goal files: the first run's goal_val.json, then the task's repeat."""
    return [entry for name in ("goal_val.json", f"goal_val_{task}_repeat.json")
            for entry in read_result(f"transformers_goal/{name}")
            if entry["task"] == task and entry["optimizer"] == "kfac_ema"]


def test_the_transformer_recipe_row_quotes_goal_val_json() -> None:
    row = pays_row("char GPT / nanoGPT-shaped", "benchmarks/results/transformers_goal/goal_val.md")
    gpt, nanogpt = transformer_recipe_runs("gpt"), transformer_recipe_runs("nanogpt")
    assert len(gpt) == len(nanogpt) == 2

    def step_range(runs: list[dict]) -> tuple[str, str]:  # K-FAC's step time over AdamW's, lowest and highest
        ratios = sorted(r["step_ms"]["kfac_ema"] / r["step_ms"]["adamw"] for r in runs)
        return f"{ratios[0]:.1f}", f"{ratios[-1]:.1f}"

    assert_row_quotes(row, "time", r"^([\d.]+)×, ([\d.]+)× \(two runs\) / not reached in the budget$",
                      tuple(f"{r['to_adamw_s'] / r['adamw_s']:.2f}" for r in gpt),
                      "the char GPT's time to AdamW's final validation loss over AdamW's, per run")
    assert all(r["to_adamw_s"] == float("inf") for r in nanogpt), \
        f"README row {row.task!r}: the nanoGPT-shaped model now reaches AdamW's final loss in a run"
    assert_row_quotes(row, "step", r"^([\d.]+)-([\d.]+)× / ([\d.]+)-([\d.]+)×$", step_range(gpt) + step_range(nanogpt),
                      "K-FAC's step over AdamW's, lowest-highest over the runs")


# -- the model zoo (benchmarks.zoo), four rows by family ---------------------------------------------------

ZOO_ROWS = {  # the row's first cell starts with: (its families in zoo.md, its own count of models)
    "zoo, 20 steps, batch 16": (("decoder", "encoder", "encoder-decoder", "ssm", "lora"), 9),
    "zoo: 5 ViTs": (("vit",), 5),
    "zoo: 7 convnets": (("convnet",), 7),
    "zoo: 2 diffusion models": (("unet", "dit"), 2),
}


@pytest.mark.parametrize("task_start", list(ZOO_ROWS))
def test_a_zoo_row_quotes_zoo_json(task_start: str) -> None:
    row = pays_row(task_start, "benchmarks/results/zoo_full/zoo.md")
    data = read_result("zoo_full/zoo.json")
    results, (families, count) = data["results"], ZOO_ROWS[task_start]
    family_of = {cells[0]: cells[1] for line in data["table"].splitlines()[2:]
                 if len(cells := [c.strip() for c in line.strip("|").split("|")]) > 1}
    models = [m for m in results if family_of[m] in families]
    assert len(models) == count, f"README row {row.task!r}: zoo.json has {len(models)} such models, the row {count}"

    def wins(name: str, base: str, key: str) -> str:  # models where ``name``'s loss is at or below ``base``'s
        return f"{sum(results[m][name][key] <= results[m][base][key] for m in models)}/{len(models)}"

    def step_ratio(name: str, base: str) -> str:  # the median over the models of the mean step's CPU time
        return f"{statistics.median(results[m][name]['step_s'] / results[m][base]['step_s'] for m in models):.2f}"

    assert_row_quotes(row, "time", r"drop-in (?:on )?(\d+/\d+), (\d+/\d+); EigenAdam (?:on )?(\d+/\d+), (\d+/\d+)$",
                      (wins("kfac", "sgd", "final"), wins("kfac", "sgd", "equal_time"),
                       wins("eigen_adam", "adamw", "final"), wins("eigen_adam", "adamw", "equal_time")),
                      "models at or below the peer's loss after equal steps, at equal CPU time")
    assert_row_quotes(row, "step", r"^([\d.]+)×(?: SGD's)?; ([\d.]+)×(?: AdamW's)?$",
                      (step_ratio("kfac", "sgd"), step_ratio("eigen_adam", "adamw")),
                      "median step time over the peer's")
    if task_start.startswith("zoo,"):
        assert_row_quotes(row, "task", r"^zoo, (\d+) steps, batch (\d+) ",
                          (data["settings"]["steps"], data["settings"]["batch"]), "the steps and the batch")


# -- the main job (benchmarks.digits): each run's metrics.jsonl ----------------------------------------------

def main_job_records(task: str, run: str) -> list[dict]:
    path = RESULTS / "main_job" / task / run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def main_job_reach(records: list[dict], metric: str, goal: float) -> tuple[float, int]:
    """The training time and epoch of the first epoch at the goal (accuracy at or above, a loss at or below)."""
    higher = metric.endswith("_acc")
    hit = next(r for r in records if (r[metric] >= goal if higher else r[metric] <= goal))
    return hit["time_s"], hit["epoch"]


def main_job_step_ratio(task: str, run: str, base: str) -> str:
    """``run``'s mean step (its training time over its steps) over ``base``'s, as the rows print it."""
    mean_step = {name: (r := main_job_records(task, name)[-1])["time_s"] / r["step"] for name in (run, base)}
    return f"{mean_step[run] / mean_step[base]:.2f}"


def test_the_digits_cnn_row_quotes_its_metrics() -> None:
    row = pays_row("digits CNN", "benchmarks/results/main_job/digits/summary.md")
    assert "metric: test_acc\n" in (RESULTS / "main_job/digits/kfac/config.yaml").read_text(encoding="utf-8")
    (kfac_s, kfac_epoch), (sgd_s, sgd_epoch) = (main_job_reach(main_job_records("digits", run), "test_acc", 0.97)
                                                for run in ("kfac", "sgd"))
    assert_row_quotes(row, "goal", r"^(\d+)% test accuracy$", ("97",), "the target")
    assert_row_quotes(row, "time", r"^([\d.]+)× SGD's \((\d+) epochs to (\d+)\)$",
                      (f"{kfac_s / sgd_s:.2f}", str(kfac_epoch), str(sgd_epoch)),
                      "K-FAC's time to the target over SGD's, and the epochs")
    assert_row_quotes(row, "step", r"^([\d.]+)×$", (main_job_step_ratio("digits", "kfac", "sgd"),),
                      "K-FAC's mean step over SGD's")


@pytest.mark.parametrize(("peer", "link"), [("sgd", "digits_autoencoder/summary.md"), ("adamw", "summary.md")])
def test_an_autoencoder_row_quotes_its_metrics(peer: str, link: str) -> None:
    row = pays_row("digits autoencoder", f"benchmarks/results/main_job/{link}")
    runs = {name: main_job_records("digits_autoencoder", name) for name in {peer, "adamw", "kfac"}}
    goal = runs[peer][-1]["train_mse"]  # the peer's final training MSE (SGD, which never gets to AdamW's, is left out)
    seconds = {name: main_job_reach(records, "train_mse", goal)[0] for name, records in runs.items()}
    name = {"sgd": "SGD", "adamw": "AdamW"}[peer]
    assert row.goal == f"{name}'s final MSE", f"README row {row.task!r}: the goal is {row.goal!r}"
    if peer == "sgd":  # the row also says how AdamW did against the same goal
        assert_row_quotes(row, "time", rf"^([\d.]+)× {name}'s \(\*\*AdamW took ([\d.]+)× too\*\*\)$",
                          (f"{seconds['kfac'] / seconds['sgd']:.2f}", f"{seconds['adamw'] / seconds['sgd']:.2f}"),
                          "K-FAC's and AdamW's time to SGD's final MSE over SGD's")
    else:
        assert_row_quotes(row, "time", rf"^([\d.]+)× {name}'s$", (f"{seconds['kfac'] / seconds[peer]:.2f}",),
                          f"K-FAC's time to {name}'s final MSE over {name}'s")
    assert_row_quotes(row, "step", r"^([\d.]+)×$", (main_job_step_ratio("digits_autoencoder", "kfac", peer),),
                      f"K-FAC's mean step over {name}'s")


# -- EigenAdam against tuned AdamW on four small tasks (benchmarks.peers, round 4) ---------------------------

PEERS_TASKS = {  # the row's name of a task: (its JSON under peers_gpt_round4/, the K-FAC run the row quotes)
    "GPT": ("with_ema/gpt.json", "kfac_ema"), "MLP": ("other_tasks/mlp.json", "kfac"),
    "autoencoder": ("other_tasks/autoencoder.json", "kfac"), "CNN": ("other_tasks/cnn.json", "kfac"),
}


def test_the_peers_row_quotes_round_4s_json() -> None:
    row = pays_row("four small tasks", "benchmarks/results/peers_gpt_round4/")
    time_ratios, step_ratios = [], []
    for path, kfac in PEERS_TASKS.values():
        data = read_result(f"peers_gpt_round4/{path}")
        rows, runs = data["summary"]["rows"], data["runs"]
        # median training time over the seeds to AdamW's median final test metric, over AdamW's
        to_adamw = {name: statistics.median(rows[name]["to_adamw_s"]) for name in (kfac, "adamw")}
        time_ratios.append(f"{to_adamw[kfac] / to_adamw['adamw']:.2f}")
        step_s = {name: statistics.fmean(seed["step_s"] for seed in runs[name]["seeds"]) for name in (kfac, "adamw")}
        step_ratios.append(f"{step_s[kfac] / step_s['adamw']:.1f}")
    names = list(PEERS_TASKS)
    assert_row_quotes(row, "time", rf"^{names[0]} ([\d.]+)× \(`dampening=0.9`\), {names[1]} ([\d.]+)×, "
                      rf"{names[2]} ([\d.]+)×, {names[3]} ([\d.]+)×$", tuple(time_ratios),
                      "K-FAC's time to AdamW's final over AdamW's, per task")
    assert_row_quotes(row, "step", r"^([\d.]+)× / ([\d.]+)× / ([\d.]+)× / ([\d.]+)×$", tuple(step_ratios),
                      "K-FAC's step over AdamW's, per task")


CHECKED_ROWS = [  # (first cell's start, link) of each row the tests above check
    ("digits autoencoder", "benchmarks/results/main_job/digits_autoencoder/summary.md"),
    ("digits autoencoder", "benchmarks/results/main_job/summary.md"),
    ("digits CNN", "benchmarks/results/main_job/digits/summary.md"),
    ("1-D CNN", "benchmarks/results/large_batch_3seeds/large_batch.md"),
    ("four small tasks", "benchmarks/results/peers_gpt_round4/"),
    ("char GPT / nanoGPT-shaped", "benchmarks/results/transformers_goal/goal_val.md"),
    *((task_start, "benchmarks/results/zoo_full/zoo.md") for task_start in ZOO_ROWS),
]


def test_every_row_of_the_table_is_checked_here() -> None:
    unchecked = [f"{r.task} ({r.link})" for r in pays_rows()
                 if not any(r.task.startswith(start) and r.link == link for start, link in CHECKED_ROWS)]
    assert len(pays_rows()) == len(CHECKED_ROWS) and unchecked == [], \
        f"README 'When K-FAC pays': rows whose figures no test here recomputes: {unchecked}"


def test_the_zoo_sentence_counts_each_optimizers_lowest_losses_in_zoo_all() -> None:
    """The sentence under the table: on how many zoo models each optimizer as users get it (not the
    ``eigen_adam_m`` variant) ends lowest after equal steps."""
    text = (ROOT / "README.md").read_text(encoding="utf-8").split("## When K-FAC pays", 1)[1]
    quoted = re.search(r"On all (\d+)\s+zoo models with Muon and SOAP, the drop-in or EigenAdam ends lowest after "
                       r"(\d+) steps on (\d+)\s+\(SOAP (\d+), Muon (\d+),\s+AdamW (\d+): \[zoo_all\]"
                       r"\(benchmarks/results/zoo_all/zoo\.md\)\)", text)
    assert quoted is not None, "README: the zoo_all sentence under 'When K-FAC pays' is gone or reworded"
    data = read_result("zoo_all/zoo.json")
    lowest = [min((o for o in r if o != "eigen_adam_m"), key=lambda o: r[o]["final"]) for r in data["results"].values()]
    assert all({"sgd", "kfac", "adamw", "eigen_adam", "muon", "soap"} <= set(r) for r in data["results"].values())
    found = (len(lowest), int(data["settings"]["steps"]), sum(o in ("kfac", "eigen_adam") for o in lowest),
             lowest.count("soap"), lowest.count("muon"), lowest.count("adamw"))
    assert tuple(int(g) for g in quoted.groups()) == found, f"README zoo_all sentence: the file says {found}"
