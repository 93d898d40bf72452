"""One command for a lent GPU: the CUDA tests, then step-time ratios and the cost constants, in five minutes.

Usage: ``python -m benchmarks.gpu_check [--out DIR] [--device cuda|cpu] [--quick] [--dry-run] [--phases ...]``
(``--help`` lists every flag). Installs nothing: run it after the README's install.

Phases, each in its own subprocess with its own time budget (a failure or a timeout is recorded
and the next phase runs; the budgets add up to under five minutes on one H100):

- ``tests``: ``pytest -m cuda -v -rA tests/cuda`` (the CUDA tests; pass/fail counts, and the
  printed eigh times in the log);
- ``resnet50``: torchvision ResNet-50 at 224 px, batch 64, bf16 autocast, channels_last: the step
  of ``torch.optim.SGD``, of the drop-in ``KFAC(model)`` and of ``KFAC`` with
  ``CurvatureConfig(conv_positions=Reduce())``, as ratios to SGD's (CUDA events, warm-up steps
  first, medians and means of the timed steps; the first step, which decomposes, apart);
- ``gpt``: the peers' ``CharGPT`` (benchmarks/peers/tasks.py) at width 512, 2 blocks, context
  256, batch 32, bf16 autocast: SGD, AdamW and ``KFAC(model)``, the same way;
- ``costs``: the rates behind ``kfac_optim.schedule.costs``'s constants on the device
  (``benchmarks.cost_constants.measure``).

Writes ``DIR/gpu_check.json`` (every phase's result), ``DIR/gpu_check.md`` (the table it prints),
``DIR/tests.log`` and one JSON per measuring phase. Without CUDA (``--device cuda``, the default)
it says so, prints what it would run, and exits 0 (a dry run); ``--device cpu --quick`` runs every
phase on the CPU with tiny models, to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PHASES = ("tests", "resnet50", "gpt", "costs")
BUDGETS_S = {"tests": 150.0, "resnet50": 60.0, "gpt": 30.0, "costs": 25.0}
"""Each phase's wall-clock budget (seconds), the start of its subprocess included."""
STARTUP_S = 15.0
"""Of a measuring phase's budget, what its subprocess may take to start (import torch, initialize
CUDA) before it measures; it stops timing steps once the rest is spent."""
GRACE_S = 20.0
"""How long past its budget a phase's subprocess may run before it is killed (it stops itself first)."""
REPO = Path(__file__).resolve().parents[1]


def say(message: str) -> None:
    """A progress line, flushed at once (a partial log of a killed run stays useful)."""
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", flush=True)  # noqa: T201 (a command-line report)


# -- the orchestrating process ---------------------------------------------------------------------


def device_report(device: str) -> dict[str, Any]:
    """What this process sees: torch's version and build, and the device."""
    report: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
                              "cuda_available": torch.cuda.is_available(), "requested_device": device}
    if torch.cuda.is_available():
        report.update(device_count=torch.cuda.device_count(), name=torch.cuda.get_device_name(0),
                      capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                      memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    return report


def pytest_counts(summary: str) -> dict[str, int]:
    """``{"passed": 3, "failed": 1, ...}`` from pytest's last line (``1 failed, 3 passed in 4.0s``)."""
    counts: dict[str, int] = {}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", summary):
        counts["error" if word.startswith("error") else word] = int(number)
    return counts


def stream(command: list[str], timeout_s: float, env: dict[str, str], log: Path) -> tuple[int | None, list[str]]:
    """Run ``command`` in the repository root, echoing and saving its output line by line; kill its
    process group after ``timeout_s``. Its exit code (None: killed) and its lines."""
    lines: list[str] = []
    with log.open("w") as saved:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, bufsize=1, start_new_session=True)

        def echo() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                lines.append(line.rstrip("\n"))
                saved.write(line)
                saved.flush()
                print(f"    {line}", end="", flush=True)  # noqa: T201

        reader = threading.Thread(target=echo, daemon=True)
        reader.start()
        try:
            code: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the phase and everything it spawned (rank processes)
            process.wait()
            code = None
        reader.join(timeout=5)
    return code, lines


def phase_command(name: str, args: argparse.Namespace) -> list[str]:
    if name == "tests":
        selection = ["tests/cuda/test_cuda_step.py"] if args.quick else ["tests/cuda"]
        # -v: one line per test as it ends (a killed phase's log still says how far it got); -rA: the
        # captured output of passing tests too (the eigh times); -n 0: one process, not a worker per core
        # sharing the GPU
        return [sys.executable, "-m", "pytest", "-m", "cuda", "-n", "0", "-v", "-rA", "-p", "no:cacheprovider",
                *selection]
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--phase", name, "--out", str(args.out),
               "--device", args.device, "--budget", str(args.budgets[name])]
    return [*command, "--quick"] if args.quick else command


def run_phase(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One phase in its subprocess: what it measured or counted, or why it has nothing."""
    budget = args.budgets[name]
    say(f"phase {name}: budget {budget:.0f} s: {' '.join(phase_command(name, args))}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KFAC_TEST_DEVICE": args.device}
    start = time.perf_counter()
    code, lines = stream(phase_command(name, args), budget + GRACE_S, env, args.out / f"{name}.log")
    result: dict[str, Any] = {"phase_seconds": round(time.perf_counter() - start, 1), "exit_code": code}
    if name == "tests":
        summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", line)), "")
        result.update(counts=pytest_counts(summary), summary=summary.strip("= "))
        result["status"] = "timed out" if code is None else ("passed" if code == 0 else "failed")
    else:
        saved = args.out / f"{name}.json"
        if saved.exists():
            result.update(json.loads(saved.read_text()))
        result.setdefault("status", "timed out" if code is None else "failed")
    if result["status"] != "passed" and result["status"] != "measured":
        result["log_tail"] = lines[-15:]
    say(f"phase {name}: {result['status']} in {result['phase_seconds']} s")
    return result


def table(results: dict[str, Any]) -> str:
    """The Markdown summary: one row per phase, one per measured run."""
    rows = ["| phase | run | status / result |", "|---|---|---|"]
    for name, result in results["phases"].items():
        if name == "tests":
            counts = ", ".join(f"{n} {word}" for word, n in result.get("counts", {}).items()) or "no summary"
            rows.append(f"| tests | `pytest -m cuda` | {result['status']}: {counts} ({result['phase_seconds']} s) |")
        elif name == "costs" and result.get("status") == "measured":
            for kind, by_size in result["constants"].items():
                measured = ", ".join(f"n={n}: {value:.1f}" for n, value in by_size.items())
                rows.append(f"| costs | {kind} | library {result['library'][kind]:g}; measured {measured} |")
            rows.append(f"| costs | matmul rate | {result['rate_flop_per_s'] / 1e12:.1f} TFLOP/s (fp32) |")
        elif result.get("status") == "measured":
            for run, timing in result["runs"].items():
                rows.append(f"| {name} | {run} | median {timing['median_ms']:.1f} ms "
                            f"({timing['median_ratio']:.2f}x SGD), "
                            f"mean {timing['mean_ms']:.1f} ms ({timing['mean_ratio']:.2f}x), first step "
                            f"{timing['first_ms']:.0f} ms, {timing['steps']} steps, peak {timing['peak_mib']:.0f} MiB"
                            + (f", intervals {tuple(timing['intervals'])}" if "intervals" in timing else "") + " |")
        else:
            rows.append(f"| {name} | | {result.get('status', 'not run')} ({result.get('phase_seconds', 0)} s) |")
    return "\n".join(rows)


def default_out() -> Path:
    """benchmarks/results/gpu_check when writable, else a new temporary folder."""
    out = REPO / "benchmarks" / "results" / "gpu_check"
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".writable").touch()
        (out / ".writable").unlink()
        return out
    except OSError:
        return Path(tempfile.mkdtemp(prefix="gpu_check-"))


def orchestrate(args: argparse.Namespace) -> int:
    device = device_report(args.device)
    say(f"torch {device['torch']} (CUDA build {device['cuda_build']}); device: "
        + (f"{device['name']} x{device['device_count']}, {device['memory_gib']} GiB, sm {device['capability']}"
           if device["cuda_available"] else "no CUDA device"))
    dry = args.dry_run or (args.device == "cuda" and not torch.cuda.is_available())
    args.out.mkdir(parents=True, exist_ok=True)
    if dry:
        say("dry run: " + ("--dry-run given" if args.dry_run else "torch.cuda.is_available() is False")
            + f"; on a GPU it would run, writing into {args.out}:")
        for name in args.phases:
            say(f"  {name} (budget {args.budgets[name]:.0f} s): {' '.join(phase_command(name, args))}")
        (args.out / "gpu_check.json").write_text(json.dumps({"device": device, "dry_run": True,
                                                             "phases": list(args.phases)}, indent=1))
        return 0
    results: dict[str, Any] = {"device": device, "quick": args.quick, "phases": {}}
    for name in args.phases:
        try:
            results["phases"][name] = run_phase(name, args)
        except Exception:  # noqa: BLE001 (recorded; the next phase runs)
            results["phases"][name] = {"status": "error", "error": traceback.format_exc()}
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    summary = table(results)
    (args.out / "gpu_check.md").write_text(summary + "\n")
    print(summary, flush=True)  # noqa: T201
    say(f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}")
    return 0


# -- a measuring phase (its own process) ----------------------------------------------------------


class Clock:
    """Step times on ``device``: CUDA events (read after one synchronization at the end), or the CPU clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[Any, Any]] = []

    def time(self, work: Callable[[], None]) -> None:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            self.marks.append((start, end))
        else:
            start_s = time.perf_counter()
            work()
            self.marks.append((start_s, time.perf_counter()))

    def milliseconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) for start, end in self.marks]
        return [(end - start) * 1e3 for start, end in self.marks]


def time_steps(step: Callable[[], None], device: torch.device, warmup: int, steps: int,
               deadline: float) -> dict[str, Any]:
    """The first step (K-FAC decomposes in it), ``warmup - 1`` more untimed, then up to ``steps`` timed
    ones, fewer when ``deadline`` (``time.perf_counter()``) passes; milliseconds."""
    first = Clock(device)
    first.time(step)
    for _ in range(warmup - 1):
        step()
    clock = Clock(device)
    while len(clock.marks) < steps and (time.perf_counter() < deadline or len(clock.marks) < 2):
        clock.time(step)
        if device.type == "cuda" and len(clock.marks) % 5 == 0:
            torch.cuda.synchronize()  # the deadline is checked on the host: keep it near the device
    times = clock.milliseconds()
    return {"first_ms": first.milliseconds()[0], "median_ms": statistics.median(times),
            "mean_ms": statistics.fmean(times), "steps": len(times), "times_ms": [round(t, 3) for t in times]}


def measure_runs(build_model: Callable[[], nn.Module], batch: tuple[Tensor, Tensor],
                 loss_of: Callable[[Tensor, Tensor], Tensor],
                 optimizers: dict[str, Callable[[nn.Module], torch.optim.Optimizer]], device: torch.device,
                 warmup: int, steps: int, deadline: float) -> dict[str, Any]:
    """Each optimizer's step on a fresh model (bf16 autocast on CUDA; fp32 on the CPU, whose bf16 is
    slow without AMX), the runs sharing the time left before ``deadline``; ratios to the first
    run's (SGD's) median and mean."""
    runs: dict[str, Any] = {}
    x, y = batch
    for index, (name, make) in enumerate(optimizers.items()):
        model = build_model()
        optimizer = make(model)

        def step(model: nn.Module = model, optimizer: torch.optim.Optimizer = optimizer) -> None:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = loss_of(model(x), y)
            loss.backward()
            optimizer.step()

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        share = time.perf_counter() + (deadline - time.perf_counter()) / (len(optimizers) - index)
        say(f"  {name}: timing")
        timing = time_steps(step, device, warmup, steps, share)
        timing["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else 0.0
        intervals = getattr(getattr(getattr(optimizer, "estimator", None), "intervals", None), "chosen", None)
        if intervals is not None:  # K-FAC's (factor, decomposition) intervals: which steps the timed ones were
            timing["intervals"] = list(intervals)
        runs[name] = timing
        say(f"  {name}: median {timing['median_ms']:.1f} ms, mean {timing['mean_ms']:.1f} ms over "
            f"{timing['steps']} steps, "
            f"first {timing['first_ms']:.0f} ms")
        del step, model, optimizer
    baseline = next(iter(runs.values()))
    for timing in runs.values():
        timing["median_ratio"] = timing["median_ms"] / baseline["median_ms"]
        timing["mean_ratio"] = timing["mean_ms"] / baseline["mean_ms"]
    return {"status": "measured", "runs": runs}


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)


def resnet_phase(args: argparse.Namespace, device: torch.device, deadline: float) -> dict[str, Any]:
    from torchvision import models

    from kfac_optim import KFAC, CurvatureConfig
    from kfac_optim.layers import Reduce

    name, size, batch = ("resnet18", 32, 2) if args.quick else ("resnet50", 224, 64)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return getattr(models, name)(weights=None, num_classes=1000).to(device, memory_format=torch.channels_last)

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=generator).to(device, memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), generator=generator).to(device)
    optimizers = {
        "sgd": sgd,
        "kfac": lambda m: KFAC(m, lr=0.1, momentum=0.9, weight_decay=5e-4),
        "kfac_reduce": lambda m: KFAC(m, lr=0.1, momentum=0.9, weight_decay=5e-4,
                                      curvature=CurvatureConfig(conv_positions=Reduce())),
    }
    result = measure_runs(build, (x, y), F.cross_entropy, optimizers, device, args.warmup, args.steps, deadline)
    return {**result, "model": name, "image_px": size, "batch": batch, "channels_last": True,
            "autocast": "bf16" if device.type == "cuda" else "none"}


def gpt_phase(args: argparse.Namespace, device: torch.device, deadline: float) -> dict[str, Any]:
    from benchmarks.peers.tasks import CharGPT
    from kfac_optim import KFAC

    shape = (dict(context=16, width=32, layers=1, heads=2) if args.quick
             else dict(context=256, width=512, layers=2, heads=8))
    batch = 4 if args.quick else 32

    def build() -> nn.Module:
        torch.manual_seed(0)
        return CharGPT(**shape).to(device)

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (batch, shape["context"] + 1), generator=generator).to(device)

    def loss_of(logits: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))

    optimizers = {
        "sgd": sgd,
        "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01),
        "kfac": lambda m: KFAC(m, lr=0.1, momentum=0.9, weight_decay=5e-4),
    }
    result = measure_runs(build, (tokens[:, :-1], tokens[:, 1:]), loss_of, optimizers, device, args.warmup,
                          args.steps, deadline)
    return {**result, "model": "CharGPT", **shape, "batch": batch,
            "autocast": "bf16" if device.type == "cuda" else "none"}


def costs_phase(args: argparse.Namespace, device: torch.device, deadline: float) -> dict[str, Any]:
    from benchmarks.cost_constants import measure

    sizes = [64, 192] if args.quick else [512, 1024, 2048, 4096]
    result = measure(sizes, repeats=3, device=device)
    return {"status": "measured", **json.loads(json.dumps(result))}  # int keys become strings, as in the file


MEASURES = {"resnet50": resnet_phase, "gpt": gpt_phase, "costs": costs_phase}


def measure_phase(args: argparse.Namespace) -> int:
    """Run one measuring phase in this process and write ``<out>/<phase>.json`` (the error, if it fails)."""
    started = time.perf_counter()
    deadline = started + max(args.budget - STARTUP_S, 1.0)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    path = args.out / f"{args.phase}.json"
    try:
        result = MEASURES[args.phase](args, device, deadline)
    except Exception:  # noqa: BLE001 (recorded in the phase's JSON)
        say(f"phase {args.phase} failed:\n{traceback.format_exc()}")
        path.write_text(json.dumps({"status": "failed", "error": traceback.format_exc()}, indent=1))
        return 1
    result["measure_seconds"] = round(time.perf_counter() - started, 1)
    path.write_text(json.dumps(result, indent=1))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the results (default benchmarks/results/gpu_check, or a temporary one)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default; without one: a dry run) or cpu (with --quick: checks the script)")
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps, one test file")
    parser.add_argument("--dry-run", action="store_true", help="say what would run, run nothing")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    for name in PHASES:
        parser.add_argument(f"--budget-{name}", type=float, default=BUDGETS_S[name], help=f"seconds for {name}")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; 1 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps at most (default 30; 3 with --quick)")
    parser.add_argument("--phase", choices=tuple(MEASURES), help=argparse.SUPPRESS)  # a measuring subprocess
    parser.add_argument("--budget", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out = (args.out or default_out()).resolve()
    args.budgets = {name: getattr(args, f"budget_{name}") for name in PHASES}
    args.warmup = args.warmup or (1 if args.quick else 5)
    args.steps = args.steps or (3 if args.quick else 30)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return measure_phase(args) if args.phase else orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
