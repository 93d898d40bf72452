"""What the seed runs say: time to a metric, metric at a time, the per-task table and plot.

Histories are lists of evaluations ``{"time_s", "test", ...}`` (training CPU time, test metric).
Between two evaluations the metric is taken as linear in time, for both the time at which a run
reaches a target and the metric a run has at a given time.

- The goal is the **best peer's final metric**: the best median-over-seeds final test metric among
  the optimizers other than K-FAC (the median, so that at least half of that optimizer's seeds
  end at or beyond it and its own median time to it is finite). Each run's time to it is reported per
  seed ("never" when the run does not reach it), then the median over seeds (never counted as infinite) and the mean
  (only when every seed reaches it), and the median's ratio to AdamW's median.
- The benchmark's own goal, **AdamW's final metric** (AdamW's median final), the same way.
- **Metric at equal time**: each run's metric at the shortest total training time among all the
  task's runs (all runs have a history up to it), mean over seeds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure

from benchmarks.peers.protocol import Run, final
from benchmarks.peers.tasks import Task

NEVER = math.inf
KFAC = "kfac"


def reached(value: float, target: float, higher_is_better: bool) -> bool:
    return value >= target if higher_is_better else value <= target


def time_to(history: Sequence[dict[str, float]], target: float, higher_is_better: bool, split: str = "test",
            clock: str = "time_s") -> float:
    """Training time (``clock="step"``: steps) at which the metric first reaches ``target``
    (interpolated); inf if never."""
    previous = None
    for row in history:
        if reached(row[split], target, higher_is_better):
            if previous is None or row[split] == previous[split]:
                return row[clock]
            share = (target - previous[split]) / (row[split] - previous[split])
            return previous[clock] + share * (row[clock] - previous[clock])
        previous = row
    return NEVER


def metric_at(history: Sequence[dict[str, float]], seconds: float, split: str = "test") -> float:
    """The metric at training time ``seconds`` (interpolated; the last value after the history ends)."""
    previous = history[0]
    for row in history[1:]:
        if row["time_s"] >= seconds:
            span = row["time_s"] - previous["time_s"]
            share = 0.0 if span == 0 else (seconds - previous["time_s"]) / span
            return previous[split] + share * (row[split] - previous[split])
        previous = row
    return previous[split]


def median(times: Sequence[float]) -> float:
    return statistics.median(times)


def median_final(runs: Sequence[Run], higher_is_better: bool, split: str = "test") -> float:
    """The median final ``split`` metric over seeds; a diverged seed counts as the worst value."""
    worst = -math.inf if higher_is_better else math.inf
    return statistics.median(worst if math.isnan(v) else v for v in (final(r, split) for r in runs))


def best_of(values: dict[str, float], higher_is_better: bool) -> tuple[str, float]:
    finite = {k: v for k, v in values.items() if math.isfinite(v)}
    if not finite:
        name = next(iter(values))
        return name, values[name]
    name = (max if higher_is_better else min)(finite, key=finite.__getitem__)
    return name, finite[name]


def summarize_task(task: Task, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The numbers of one task's table (see the module docstring)."""
    hib = task.higher_is_better
    finals = {name: median_final(r["seeds"], hib) for name, r in results.items()}
    peers = {name: v for name, v in finals.items() if not name.startswith(KFAC)} or finals  # K-FAC and its variants
    peer, goal = best_of(peers, hib)
    adamw_goal = finals.get("adamw")
    equal_time = min(r["history"][-1]["time_s"] for res in results.values() for r in res["seeds"])
    rows = {}
    for name, res in results.items():
        seeds = res["seeds"]
        to_goal = [time_to(r["history"], goal, hib) for r in seeds]
        to_adamw = [time_to(r["history"], adamw_goal, hib) for r in seeds] if adamw_goal is not None else []
        rows[name] = {
            "lr": res["best_lr"], "grid": [r["lr"] for r in res["grid"]],
            "grid_val": [final(r, "val") for r in res["grid"]],
            "lr_at_grid_edge": len(res["grid"]) > 1 and res["best_lr"] in (res["grid"][0]["lr"], res["grid"][-1]["lr"]),
            "finals": [final(r, "test") for r in seeds], "final_median": finals[name],
            "final_mean": statistics.fmean(final(r, "test") for r in seeds),
            "to_goal_s": to_goal, "to_goal_median_s": median(to_goal),
            "to_goal_median_steps": median([time_to(r["history"], goal, hib, clock="step") for r in seeds]),
            "to_goal_mean_s": statistics.fmean(to_goal),
            "to_adamw_s": to_adamw, "to_adamw_median_s": median(to_adamw) if to_adamw else None,
            "at_equal_time": statistics.fmean(metric_at(r["history"], equal_time) for r in seeds),
            "step_ms": 1e3 * statistics.fmean(r["step_s"] for r in seeds),
            "steps": [r["steps"] for r in seeds], "diverged": sum(r["diverged"] for r in seeds),
        }
    for key, ratio in (("to_goal_median_s", "goal_vs_adamw"), ("to_adamw_median_s", "adamw_goal_vs_adamw")):
        base = rows.get("adamw", {}).get(key)
        for row in rows.values():
            row[ratio] = (row[key] / base if base and math.isfinite(base) and row[key] is not None
                          and math.isfinite(row[key]) else None)
    return {"task": task.name, "description": task.description, "metric": task.metric, "higher_is_better": hib,
            "goal": goal, "goal_from": peer, "adamw_goal": adamw_goal, "equal_time_s": equal_time, "rows": rows}


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return "never" if math.isinf(value) else f"{value:.2f}"


def _steps(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:.0f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_table(summary: dict[str, Any]) -> str:
    """One Markdown table for a task, one row per optimizer."""
    metric, hib = summary["metric"], summary["higher_is_better"]
    head = ["optimizer", "lr (grid)", f"final test {metric}: median (seeds)", f"time to {summary['goal_from']}'s "
            f"{summary['goal']:.4g}: per seed (s)", "median (s)", "vs AdamW", "median steps",
            f"time to AdamW's {summary['adamw_goal']:.4g}: median (s)" if summary["adamw_goal"] is not None else
            "time to AdamW's final", "vs AdamW", f"{metric} at {summary['equal_time_s']:.1f} s", "step (ms)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in summary["rows"].items():
        grid = "/".join(f"{lr:g}" for lr in row["grid"])
        lr = f"**{row['lr']:g}** ({grid}){' edge' if row['lr_at_grid_edge'] else ''}"
        finals = f"{row['final_median']:.4f} ({', '.join(f'{v:.4f}' for v in row['finals'])})"
        if row["diverged"]:
            finals += f", {row['diverged']} diverged"
        cells = [name, lr, finals, ", ".join(map(_seconds, row["to_goal_s"])), _seconds(row["to_goal_median_s"]),
                 _ratio(row["goal_vs_adamw"]), _steps(row["to_goal_median_steps"]), _seconds(row["to_adamw_median_s"]),
                 _ratio(row["adamw_goal_vs_adamw"]),
                 f"{row['at_equal_time']:.4f}", f"{row['step_ms']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    direction = "higher" if hib else "lower"
    return (f"### {summary['task']}: {summary['description']} ({metric}, {direction} is better)\n\n"
            + "\n".join(lines))


def kfac_verdicts(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """The benchmark's goals for K-FAC, one line per task and goal, as measured (no judgement beyond the numbers)."""
    lines = []
    for s in summaries:
        rows = s["rows"]
        if KFAC not in rows:
            continue
        kfac = rows[KFAC]
        if "adamw" in rows:
            ratio = kfac["adamw_goal_vs_adamw"]
            lines.append(f"{s['task']}: K-FAC to AdamW's final {s['adamw_goal']:.4g}: "
                         + ("never (median)" if ratio is None else f"{ratio:.2f}x AdamW's time")
                         + f" (goal <= 0.8x: {'met' if ratio is not None and ratio <= 0.8 else 'NOT met'})")
        for peer in ("muon", "sgd") if s["task"] == "cnn" else ("muon",):
            if peer not in rows:
                continue
            k, m = kfac["to_goal_median_s"], rows[peer]["to_goal_median_s"]
            both_never = math.isinf(k) and math.isinf(m)
            ahead = (reached(kfac["at_equal_time"], rows[peer]["at_equal_time"], s["higher_is_better"])
                     if both_never else k <= m)
            goal = "never worse than SGD" if peer == "sgd" else "ahead"
            lines.append(f"{s['task']}: K-FAC vs {peer} to the best peer's final: {_seconds(k)} s vs {_seconds(m)} s; "
                         f"at equal time {kfac['at_equal_time']:.4f} vs {rows[peer]['at_equal_time']:.4f} "
                         f"({goal}{' (both never: decided at equal time)' if both_never else ''}: "
                         f"{'yes' if ahead else 'NO'})")
    return lines


def plot_task(summary: dict[str, Any], results: dict[str, dict[str, Any]]) -> Figure:
    """Test metric vs training CPU time, mean over seeds (band: min to max), up to the equal time."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    end = summary["equal_time_s"]
    times = [end * i / 100 for i in range(101)]
    for name, res in results.items():
        curves = [[metric_at(r["history"], t) for t in times] for r in res["seeds"]]
        mean = [statistics.fmean(values) for values in zip(*curves)]
        line, = ax.plot(times, mean, label=f"{name} (lr {res['best_lr']:g})")
        ax.fill_between(times, [min(v) for v in zip(*curves)], [max(v) for v in zip(*curves)],
                        color=line.get_color(), alpha=0.15)
    ax.axhline(summary["goal"], color="grey", linestyle="--", linewidth=1,
               label=f"best peer's final ({summary['goal_from']})")
    if not summary["higher_is_better"]:
        ax.set_yscale("log")
    else:
        ax.set_ylim(max(0.0, summary["goal"] - 0.15), 1.0)
    ax.set_xlabel("training CPU time (s, one thread)")
    ax.set_ylabel(f"test {summary['metric']}")
    ax.set_title(f"{summary['task']}: mean over {len(next(iter(results.values()))['seeds'])} seeds")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig
