"""Where the milliseconds of a K-FAC step go, each part next to its floor.

Usage: ``python -m benchmarks.step_time [--model resnet18|resnet50|mlp] [--threads 1] ...``
(``--help`` lists every flag). Prints a table and writes JSON (``--json``).

Method: each part of the K-FAC step is timed **in isolation**, on one captured batch, by calling
the library's own public parts (the blocks and capture hooks ``KFAC`` builds, through
``discover_blocks`` and ``StatisticsCapture``) or by reading the ``torch.profiler`` ranges of
whole ``KFAC.step()`` calls (docs/design.md §4) (median over repeats), then **amortized analytically** over the
factor / inverse intervals (``--factor-interval``, ``--inverse-interval``):

    step = fwd+bwd (plain) + hooks·(1 − 1/f) + (statistics + fold)/f + decompositions/i
           + preconditioning + KL clip & update

Parts and their floors (the bare torch calls of the same shapes, timed in the same process):
  hooks (non-factor steps)  fwd+bwd with the capture hooks registered but unarmed, minus plain
                            fwd+bwd (interleaved A/B); floor 0, reported as % of an SGD step
  statistics (factor steps) ``block.accumulate`` on the captured (input, output-grad) of every
                            block (unfold, row copies, bias column, Gram products); floor:
                            ``torch.matmul(rowsᵀ, rows, out=)`` on contiguous rows of the same
                            shapes (a full product: the blocked symmetric one can beat it)
  fold                      ``block.fold`` after recording one sample (``block.accumulate``) minus
                            that recording alone; floor: ``running.lerp_(pending)`` + ``pending.zero_()``
  decompositions            ``factor.decompose`` (after ``factor.adopt(None, ...)``, rank thresholds as the optimizer
                            passes them); floor ``torch.linalg.eigh``
                            (eigen) or ``cholesky`` + ``cholesky_inverse`` (inverse) of the same
                            factor. Timed once per distinct factor size (eigh of a 4608² factor
                            takes seconds), multiplied by how many factors have that size.
  preconditioning           the ``kfac.precondition`` range of non-factor steps of a ``KFAC`` loaded
                            (``load_state_dict``) with these decompositions; floor: the 4 (eigen)
                            or 2 (inverse) bare ``torch.matmul`` calls per block
  KL clip + update          the ``kfac.kl_clip`` + ``kfac.sgd`` ranges (inverse method); floor: a
                            ``torch.optim.SGD`` step on the same parameters + one dot per block

Sampled Fisher (``CurvatureConfig(fisher="sampled")``, not in the amortized step above): ``sample_fisher`` on
factor steps (sampling, one more backward, and the statistics it records, which the training
backward then no longer records), timed as forward + ``sample_fisher`` minus a forward; floor:
one plain backward (fwd+bwd minus forward) plus the statistics part. Its net extra cost per step
is ``(sample_fisher − statistics)/f``.

Decomposition steps: the amortized step hides them; the table also gives the length of the one
step that folds and decomposes (``decomposition step, whole``), against SGD's step: the spike a
training loop sees every ``--inverse-interval`` steps.

Check: a whole non-factor step (``zero_grad``, fwd+bwd, ``step()``, inverse method) timed through
the public API next to the sum of its parts (unarmed fwd+bwd + preconditioning + clip & update):
a ratio well above 1 means work outside the parts above.

Uses only public names of the library (no private attribute); the package knows nothing of it.
The profiled parts carry the CPU profiler's small per-op overhead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from kfac_optim import KFAC, CurvatureConfig
from kfac_optim.capture.hooks import StatisticsCapture
from kfac_optim.layers import KroneckerBlock, LinearBlock, discover_blocks
from kfac_optim.methods import method_named

MODELS = {
    # name: (image size, batch size)
    "resnet18": (32, 64),
    "resnet50": (64, 32),
    "mlp": (16, 64),
}


def build_model(name: str, image_size: int, num_classes: int = 10) -> nn.Module:
    if name == "mlp":
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(3 * image_size * image_size, 1024),
            nn.ReLU(),
            nn.Linear(1024, 512),
            nn.ReLU(),
            nn.Linear(512, num_classes),
        )
    from torchvision import models

    return getattr(models, name)(weights=None, num_classes=num_classes)


@dataclasses.dataclass
class Timing:
    """Median seconds over ``n`` repeats; ``spread`` = (max − min) / median."""

    median: float
    spread: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> Timing:
        median = statistics.median(samples)
        return cls(median, (max(samples) - min(samples)) / median if median > 0 else 0.0, len(samples))


def timeit(fn: Callable[[], Any], repeats: int, budget_s: float, warmup: int = 1) -> Timing:
    """Median of up to ``repeats`` calls, fewer (at least one) once ``budget_s`` is spent."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < repeats and (not samples or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return Timing.of(samples)


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int, budget_s: float) -> dict[str, Timing]:
    """Time several functions alternately (A B A B ...) so load changes hit them alike."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    for r in range(repeats):
        if r and time.perf_counter() - start > budget_s:
            break
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: Timing.of(s) for name, s in samples.items()}


def capture_batch(
    blocks: list[KroneckerBlock], forward_backward: Callable[[], None]
) -> dict[str, tuple[Tensor, Tensor]]:
    """(input, output-grad) of every block's module from one forward/backward."""
    captured: dict[str, list[Tensor]] = {}
    handles = []
    for block in blocks:
        def hook(module, inputs, output, name=block.name):
            captured[name] = [inputs[0].detach()]
            output.register_hook(lambda grad: captured[name].append(grad.detach()))

        handles.append(block.module.register_forward_hook(hook))
    forward_backward()
    for handle in handles:
        handle.remove()
    return {name: (pair[0], pair[1]) for name, pair in captured.items()}


NEVER = 10**9
"""An update interval no timed step reaches: steps after the first are neither factor nor decomposition steps."""


def loaded_kfac(model: nn.Module, blocks: list[KroneckerBlock], method: str, damping: float) -> KFAC:
    """A ``KFAC`` on ``model`` holding ``blocks``' factors and decompositions, through its checkpoint API,
    at step 1: its steps precondition with them and never fold or decompose."""
    opt = KFAC(model, lr=1e-4, momentum=0.9, weight_decay=5e-4, damping=damping, method=method,
               factor_update_steps=NEVER, decomposition_update_steps=NEVER, kl_clip=1e-3)
    state = opt.state_dict()
    state["kfac"]["steps"] = 1
    state["kfac"]["blocks"] = {block.name: block.state_dict(opt.method) for block in blocks}
    opt.load_state_dict(state)
    return opt


def profiled_steps(
    opt: KFAC, forward_backward: Callable[[], None], floor: Callable[[], None], repeats: int, budget_s: float
) -> tuple[dict[str, Timing], Timing]:
    """Whole steps of ``opt`` under ``torch.profiler``, alternating with ``floor`` (A B A B ...): the
    per-step durations of the ``kfac.*`` ranges, and the floor's timing."""
    def step() -> None:
        forward_backward()
        opt.step()

    step()
    floor()
    samples: dict[str, list[float]] = {}
    floor_samples: list[float] = []
    start = time.perf_counter()
    for r in range(repeats):
        if r and time.perf_counter() - start > budget_s:
            break
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            step()
        for event in profile.events():
            if event.name.startswith("kfac."):
                samples.setdefault(event.name, []).append(event.cpu_time_total / 1e6)
        t0 = time.perf_counter()
        floor()
        floor_samples.append(time.perf_counter() - t0)
    return {name: Timing.of(values) for name, values in samples.items()}, Timing.of(floor_samples)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    image_size, batch = workload_shape(args)
    model = build_model(args.model, image_size)
    model.train()
    x = torch.randn(batch, 3, image_size, image_size)
    y = torch.randint(0, 10, (batch,))
    decay, reduction, damping = 0.95, "mean", args.damping
    budget = args.budget

    def forward_backward() -> None:
        model.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()

    progress = tqdm(total=12, desc=f"{args.model} b{batch} {image_size}px", file=sys.stderr, leave=False)
    out: dict[str, Any] = {}

    # The optimizer's own parts, assembled as KFAC assembles them: its blocks and capture hooks.
    blocks = discover_blocks(model, set(model.parameters()), (), torch.float32)
    capture = StatisticsCapture(blocks)
    capture.armed = False
    sgd = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, weight_decay=5e-4)

    def clear() -> None:
        for block in blocks:
            block.discard_pending()

    def without_hooks(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            nonlocal capture
            capture.remove()
            fn()
            capture = StatisticsCapture(blocks)
            capture.armed = False

        return run

    def sgd_step() -> None:
        forward_backward()
        sgd.step()

    def armed() -> None:
        capture.armed = True
        forward_backward()
        capture.armed = False
        clear()

    # SGD step, fwd+bwd without hooks, with unarmed hooks (non-factor steps), armed: interleaved.
    runs = interleaved({"sgd": without_hooks(sgd_step), "plain": without_hooks(forward_backward),
                        "unarmed": forward_backward, "armed": armed}, args.repeats, 4 * budget)
    out["sgd_step"], out["fwd_bwd_plain"] = runs["sgd"], runs["plain"]
    out["fwd_bwd_unarmed"], out["fwd_bwd_armed"] = runs["unarmed"], runs["armed"]
    progress.update()

    # The same hooks measured directly (the A/B difference above is below the noise): the cost of
    # an unarmed capture hook per module call, on a 1x1 Linear, times the number of blocks.
    tiny, tiny_input = nn.Linear(1, 1), torch.randn(1, 1)
    tiny_capture = StatisticsCapture([LinearBlock("tiny", tiny, True, torch.float32)])
    calls = 2000

    def tiny_calls() -> None:
        for _ in range(calls):
            tiny(tiny_input)

    def tiny_calls_plain() -> None:
        tiny_capture.remove()
        tiny_calls()

    hooked = timeit(tiny_calls, args.repeats, budget)
    plain = timeit(tiny_calls_plain, args.repeats, budget)
    out["hook_per_call"] = Timing((hooked.median - plain.median) / calls, max(hooked.spread, plain.spread), hooked.n)
    progress.update()

    # Statistics on factor steps, on one captured batch.
    capture.remove()
    pairs = capture_batch(blocks, forward_backward)
    blocks = [b for b in blocks if b.name in pairs]

    def statistics_part() -> None:
        for block in blocks:
            block.accumulate(*pairs[block.name])

    rows = {}
    for block in blocks:
        inputs, grads = pairs[block.name]
        a = block.input_rows(inputs)
        if block.bias is not None:
            a = torch.cat([a, torch.ones(len(a), 1)], 1)
        rows[block.name] = (a.contiguous(), block.output_grad_rows(grads).contiguous())

    grams = {name: (a.new_empty(a.shape[1], a.shape[1]), g.new_empty(g.shape[1], g.shape[1]))
             for name, (a, g) in rows.items()}

    def statistics_floor() -> None:
        for name, (a, g) in rows.items():
            torch.matmul(a.T, a, out=grams[name][0])
            torch.matmul(g.T, g, out=grams[name][1])

    stats = interleaved({"part": statistics_part, "floor": statistics_floor}, args.repeats, budget)
    out["statistics"], out["statistics_floor"] = stats["part"], stats["floor"]
    progress.update()

    # Fold: pending from the real batch, then fold repeatedly (content does not change the cost).
    # Each timed fold first gives every block pending statistics the public way, by recording the
    # first sample of the captured batch (``block.accumulate``); that recording is timed alone
    # in the same interleaved run and subtracted.
    clear()
    statistics_part()
    for block in blocks:
        block.fold(decay, reduction)
    factors = [f for b in blocks for f in b.factors.values()]
    pending_ones = {id(f): torch.ones_like(f.running) for f in factors}
    first_sample = {name: (inputs[:1], grads[:1]) for name, (inputs, grads) in pairs.items()}

    def record_one_sample() -> None:
        for block in blocks:
            block.accumulate(*first_sample[block.name])

    def fold_part() -> None:
        record_one_sample()
        for block in blocks:
            block.fold(decay, reduction)

    def fold_floor() -> None:
        for f in factors:
            f.running.lerp_(pending_ones[id(f)], 1 - decay)
            f.pending.zero_()

    folds = interleaved({"record": record_one_sample, "part": fold_part, "floor": fold_floor}, args.repeats, budget)
    recorded_and_folded, recorded = folds["part"], folds["record"]
    out["fold"] = Timing(recorded_and_folded.median - recorded.median,
                         max(recorded_and_folded.spread, recorded.spread), recorded_and_folded.n)
    out["fold_floor"] = folds["floor"]
    progress.update()

    # Decompositions, once per distinct factor size; the result is shared by same-size factors
    # (for the preconditioning timings below, content does not matter).
    by_dim: dict[int, list] = {}
    for block in blocks:
        for name, factor in block.factors.items():
            by_dim.setdefault(factor.dim, []).append((block, name, factor))
    torch.linalg.eigh(torch.eye(8))
    opts: dict[str, KFAC] = {}
    ranges: dict[str, dict[str, Timing]] = {}
    for method in ("eigen", "inverse"):
        part_total = floor_total = 0.0
        worst = 0.0
        for dim, members in sorted(by_dim.items()):
            block, name, factor = members[0]
            shift = block.shifts(method_named(method), damping)[name]
            drop_below = block.rank_thresholds(method_named(method), damping)[name]

            def part() -> None:
                factor.adopt(None, shift)  # hold none: decompose() computes it afresh
                factor.decompose(method_named(method), shift, torch.float32, drop_below)

            def floor() -> None:
                if method == "eigen":
                    torch.linalg.eigh(factor.running)
                else:
                    shifted = factor.running + shift * torch.eye(dim)
                    torch.cholesky_inverse(torch.linalg.cholesky(shifted))

            reps = args.repeats if dim <= 1024 else max(1, args.repeats // 4)
            timed = interleaved({"part": part, "floor": floor}, reps, budget)
            part_total += timed["part"].median * len(members)
            floor_total += timed["floor"].median * len(members)
            worst = max(worst, timed["part"].spread, timed["floor"].spread)
            for _, _, other in members[1:]:
                other.adopt(factor.decomposition, method_named(method).keyed_shift(shift))
        out[f"decomposition_{method}"] = Timing(part_total, worst, 0)
        out[f"decomposition_{method}_floor"] = Timing(floor_total, worst, 0)
        progress.update()

        # Preconditioning with this method's decompositions: a KFAC loaded with them takes whole
        # non-factor steps under the profiler; its ranges time the parts (docs/design.md §4).
        opts[method] = loaded_kfac(model, blocks, method, damping)
        shapes = [(b.G.dim, b.A.dim) for b in blocks]
        mats = [(torch.randn(o, o), torch.randn(o, i), torch.randn(i, i)) for o, i in shapes]

        def precondition_floor_matmuls() -> None:
            for q_g, grad, q_a in mats:
                if method == "eigen":
                    torch.matmul(torch.matmul(q_g, torch.matmul(torch.matmul(q_g.T, grad), q_a)), q_a.T)
                else:
                    torch.matmul(torch.matmul(q_g, grad), q_a)

        ranges[method], floor = profiled_steps(opts[method], forward_backward, precondition_floor_matmuls,
                                               args.repeats, budget)
        out[f"precondition_{method}"], out[f"precondition_{method}_floor"] = ranges[method]["kfac.precondition"], floor
        opts[method].remove_hooks()
        progress.update()

    # KL clip + update, from the inverse method's steps; floor: SGD's step and one dot per block.
    kfac_params = [p for b in blocks for p in (b.weight, b.bias) if p is not None]
    floor_sgd = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, weight_decay=5e-4)
    floor_sgd.step()

    def update_floor() -> None:
        with torch.no_grad():
            for p in kfac_params:
                torch.dot(p.grad.reshape(-1), p.grad.reshape(-1))
            floor_sgd.step()

    clip, sgd_part = ranges["inverse"]["kfac.kl_clip"], ranges["inverse"]["kfac.sgd"]
    out["clip_update"] = Timing(clip.median + sgd_part.median, max(clip.spread, sgd_part.spread), clip.n)
    out["clip_update_floor"] = timeit(update_floor, args.repeats, budget)
    progress.update()

    # A whole non-factor step through the public API (inverse method, decompositions in place),
    # unprofiled: what the parts above do not cover (zero_grad, bookkeeping in step()) shows up
    # as the difference to the sum of its parts.
    opt = loaded_kfac(model, blocks, "inverse", damping)

    def whole_step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    out["whole_non_factor_step"] = timeit(whole_step, args.repeats, budget)
    progress.update()

    # The sampled Fisher's extra pass on factor steps, by difference with a forward alone.
    opt.remove_hooks()
    sampled = KFAC(model, lr=1e-4, factor_update_steps=1, curvature=CurvatureConfig(fisher="sampled"))

    def forward() -> None:
        model(x)

    def forward_and_sample() -> None:
        sampled.sample_fisher(model(x), "cross_entropy")
        sampled.discard_pending_statistics()

    # fwd_bwd: the training backward, which the sampled optimizer's hooks let pass unrecorded.
    passes = interleaved({"forward": forward, "sampled": forward_and_sample, "fwd_bwd": forward_backward},
                         args.repeats, 2 * budget)
    sampled.remove_hooks()
    forward_ms = passes["forward"].median
    out["sample_fisher"] = Timing(passes["sampled"].median - forward_ms, passes["sampled"].spread, passes["sampled"].n)
    backward_ms = max(passes["fwd_bwd"].median - forward_ms, 0.0)  # a difference of noisy timings: never < 0
    out["sample_fisher_floor"] = Timing(backward_ms + out["statistics_floor"].median,
                                        passes["fwd_bwd"].spread, passes["fwd_bwd"].n)
    progress.update()
    progress.close()

    shape_counts = Counter((b.G.dim, b.A.dim) for b in blocks)
    return {
        "timings": {k: dataclasses.asdict(v) for k, v in out.items()},
        "blocks": len(blocks),
        "factor_dims": {str(d): len(m) for d, m in sorted(by_dim.items())},
        "repeated_block_shapes": {f"{o}x{i}": n for (o, i), n in shape_counts.items() if n > 1},
        "batch_size": batch,
        "image_size": image_size,
    }


def table(result: dict[str, Any], args: argparse.Namespace) -> tuple[list[list[str]], dict[str, float]]:
    t = {k: v["median"] * 1e3 for k, v in result["timings"].items()}
    spread = {k: v["spread"] for k, v in result["timings"].items()}
    f, i = args.factor_interval, args.inverse_interval
    hooks = t["fwd_bwd_unarmed"] - t["fwd_bwd_plain"]
    hooks_direct = t["hook_per_call"] * result["blocks"]
    rows = []

    def row(part: str, per_event: float, every: str, amortized: float, floor: float | None, key: str) -> None:
        ratio = f"{per_event / floor:.2f}" if floor else "-"
        rows.append([part, f"{per_event:.2f}", every, f"{amortized:.2f}",
                     f"{floor:.2f}" if floor is not None else "-", ratio, f"{100 * spread.get(key, 0):.0f}%"])

    row("SGD step (fwd+bwd+update)", t["sgd_step"], "1", t["sgd_step"], None, "sgd_step")
    row("fwd+bwd, no hooks", t["fwd_bwd_plain"], "1", t["fwd_bwd_plain"], None, "fwd_bwd_plain")
    row("hooks, non-factor steps (A/B)", hooks, f"{f - 1}/{f}", hooks * (f - 1) / f, 0.0, "fwd_bwd_unarmed")
    row("hooks, non-factor steps (direct)", hooks_direct, f"{f - 1}/{f}", hooks_direct * (f - 1) / f,
        0.0, "hook_per_call")
    row("armed fwd+bwd - plain (check)", t["fwd_bwd_armed"] - t["fwd_bwd_plain"], "-", 0.0, None, "fwd_bwd_armed")
    row("statistics (factor steps)", t["statistics"], f"1/{f}", t["statistics"] / f,
        t["statistics_floor"], "statistics")
    row("fold", t["fold"], f"1/{f}", t["fold"] / f, t["fold_floor"], "fold")
    totals = {}
    common = t["fwd_bwd_plain"] + hooks_direct * (f - 1) / f + (t["statistics"] + t["fold"]) / f + t["clip_update"]
    for method in ("eigen", "inverse"):
        d, p = t[f"decomposition_{method}"], t[f"precondition_{method}"]
        row(f"decompositions ({method})", d, f"1/{i}", d / i, t[f"decomposition_{method}_floor"],
            f"decomposition_{method}")
        row(f"preconditioning ({method})", p, "1", p, t[f"precondition_{method}_floor"], f"precondition_{method}")
        totals[method] = common + d / i + p
    row("KL clip + update", t["clip_update"], "1", t["clip_update"], t["clip_update_floor"], "clip_update")
    parts = t["fwd_bwd_unarmed"] + t["precondition_inverse"] + t["clip_update"]
    row("non-factor step (inverse), whole vs its parts", t["whole_non_factor_step"], "-", 0.0, parts,
        "whole_non_factor_step")
    sample_fisher_extra = (t["sample_fisher"] - t["statistics"]) / f  # the training backward no longer records
    row("sample_fisher (fisher='sampled', factor steps)", t["sample_fisher"], f"1/{f}", sample_fisher_extra,
        t["sample_fisher_floor"], "sample_fisher")
    for method, total in totals.items():
        rows.append([f"KFAC step ({method}), amortized", "-", "-", f"{total:.2f}", "-",
                     f"{total / t['sgd_step']:.2f}x SGD", "-"])
    spikes = {method: decomposition_step(t, method) for method in totals}
    for method, spike in spikes.items():  # what the amortized mean hides: the step that decomposes
        rows.append([f"decomposition step ({method}), whole", f"{spike:.2f}", f"1/{i}", "-", "-",
                     f"{spike / t['sgd_step']:.2f}x SGD", "-"])
    goals = {
        "hooks_pct_of_sgd_ab": 100 * hooks / t["sgd_step"],
        "hooks_pct_of_sgd_direct": 100 * hooks_direct / t["sgd_step"],
        "inverse_over_eigen_preconditioning": t["precondition_inverse"] / t["precondition_eigen"],
        "whole_non_factor_step_over_parts": t["whole_non_factor_step"] / parts,
        "sample_fisher_extra_pct_of_sgd": 100 * sample_fisher_extra / t["sgd_step"],
        **{f"kfac_{m}_over_sgd": v / t["sgd_step"] for m, v in totals.items()},
        **{f"decomposition_step_{m}_over_sgd": v / t["sgd_step"] for m, v in spikes.items()},
    }
    return rows, goals


def decomposition_step(t: dict[str, float], method: str) -> float:
    """Milliseconds of one step that folds and decomposes (every decomposition step is a factor step
    here): fwd+bwd, statistics, fold, every decomposition, preconditioning, KL clip and update.
    The amortized step divides the decompositions by the interval; a training loop waits for all of
    them on this step, unless they run under ``AsyncConfig`` (docs/api.md "Long decomposition steps")."""
    return (t["fwd_bwd_plain"] + t["statistics"] + t["fold"] + t[f"decomposition_{method}"]
            + t[f"precondition_{method}"] + t["clip_update"])


def render(rows: list[list[str]]) -> str:
    header = ["part", "ms/event", "events/step", "ms/step", "floor ms/event", "part/floor", "spread"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags naming what is timed (also used by ``scaling.py``): model, batch, image size,
    damping, threads."""
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 64 (resnet18, mlp), 32 (resnet50)")
    parser.add_argument("--image-size", type=int, default=None, help="default: 32 (resnet18), 64 (resnet50), 16 (mlp)")
    parser.add_argument("--damping", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (per process)")


def workload_shape(args: argparse.Namespace) -> tuple[int, int]:
    """``(image size, batch size)``: the flags, or the model's defaults in ``MODELS``."""
    image_size, batch_size = MODELS[args.model]
    return args.image_size or image_size, args.batch_size or batch_size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--factor-interval", type=int, default=10)
    parser.add_argument("--inverse-interval", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per part (median)")
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per part before fewer repeats are taken")
    parser.add_argument("--json", type=Path, default=None, help="default: runs/step_time_<model>.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    result = measure(args)
    rows, goals = table(result, args)
    print(f"{args.model}, batch {result['batch_size']}, {result['image_size']}px, {result['blocks']} K-FAC blocks, "
          f"factor/inverse interval {args.factor_interval}/{args.inverse_interval}, {args.threads} thread(s), "
          f"torch {torch.__version__}")
    print(render(rows))
    print("goals: " + ", ".join(f"{k}={v:.3g}" for k, v in goals.items()))
    result.update(args={k: str(v) for k, v in vars(args).items()}, goals=goals, table=rows,
                  torch=torch.__version__, machine=platform.machine(), cpus=os.cpu_count(),
                  wall_s=time.perf_counter() - start)
    path = args.json or Path("runs") / f"step_time_{args.model}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path} ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
