"""EigenAdam's training step against AdamW's on the zoo's models: full bases against the thin basis.

Usage: ``python -m benchmarks.eigen_adam_cost [--models tv_resnet18 tv_vit ...] [--steps 20] [--rounds 3]``
or ``--kernels`` (the two designs for a wide pair, alone: below).

Per model and round, each optimizer in turn (alternated, so load changes hit all alike) trains
``--steps`` whole steps (``zero_grad``, loss, backward, ``step``) after ``--warmup`` steps from the
same initialization and batches, one thread; K-FAC as users get it (``method=EigenAdam(...)``,
default intervals) with docs/tuning.md's recipe. Reported: the median step and the mean step
(the mean carries the decomposition steps that fall in the window), each over rounds' medians, and
their ratio to AdamW's. Prints one line per model and writes JSON (``--json``).

``--kernels``: one pair of ResNet-18's layer4 (``∇ (512, 4608)``, random full-rank factors), the
two designs for a wide factor timed alone (median of ``--rounds``·5 calls): the thin basis
(``EigenAdam.precondition`` on held ``Q (n, 128)``, and the randomized decomposition) against
block-diagonal factors (``A`` as 9 blocks of 512: ``eigh`` per block and the blocked rotation
with the same Adam update), and full bases (``EigenAdam(max_rank=None)``, one ``eigh`` of 4608).
The entry ``beta1``: the thin basis with SOAP's first moment (``EigenAdam(beta1=0.9)``, momentum 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.zoo import ZOO, available
from kfac_optim import KFAC, EigenAdam

LR = 3e-3
BATCH = 32


def optimizers() -> dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer]]:
    def kfac(max_rank: int | None) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
        return lambda model: KFAC(model, lr=LR, momentum=0.9, dampening=0.9, kl_clip=None,
                                  method=EigenAdam(max_rank=max_rank))
    return {"adamw": lambda model: torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95)),
            "eigen_adam full": kfac(None), f"eigen_adam thin {EigenAdam().max_rank}": kfac(EigenAdam().max_rank),
            "eigen_adam thin 256": kfac(256),
            f"eigen_adam thin {EigenAdam().max_rank} beta1": lambda model: KFAC(
                model, lr=LR, momentum=0.0, kl_clip=None, method=EigenAdam(beta1=0.9))}


def step_times(name: str, make: Callable[[torch.nn.Module], torch.optim.Optimizer], warmup: int,
               steps: int) -> list[float]:
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.build()
    optimizer = make(model)
    generator = torch.Generator().manual_seed(0)
    batches = [entry.batch(BATCH, generator) for _ in range(4)]
    times = []
    for step in range(warmup + steps):
        batch = batches[step % len(batches)]
        start = time.perf_counter()
        optimizer.zero_grad()
        entry.loss(model, batch).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times[warmup:]


def kernel_times(rounds: int) -> dict[str, float]:
    """Milliseconds per call of each design's preconditioning and decomposition (see ``--kernels``)."""
    from types import SimpleNamespace

    from kfac_optim import linalg

    out, n, block = 512, 4608, 512
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(out, n, generator=generator)
    a = torch.randn(n, 2 * n, generator=generator)
    a = a @ a.T / (2 * n)
    g = torch.randn(out, 2 * out, generator=generator)
    g = g @ g.T / (2 * out)

    def timed(call: Callable[[], object]) -> float:
        call()
        times = []
        for _ in range(rounds * 5):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    def view(decomposition: linalg.Eigen, dim: int) -> SimpleNamespace:
        return SimpleNamespace(diagonal=False, groups=1, dim=dim, decomposition=decomposition)

    eig_g = linalg.symmetric_eigen(g, torch.float32)
    thin = EigenAdam()
    eig_a = linalg.symmetric_eigen(a, torch.float32, 0.0, None, thin.max_rank)
    eig_g_thin = linalg.symmetric_eigen(g, torch.float32, 0.0, None, thin.max_rank)
    result = {"decomposition thin (A 4608 + G 512)": timed(lambda: (
        linalg.symmetric_eigen(a, torch.float32, 0.0, None, thin.max_rank),
        linalg.symmetric_eigen(g, torch.float32, 0.0, None, thin.max_rank)))}
    state: dict[str, torch.Tensor] = {}
    result["precondition thin"] = timed(
        lambda: thin.precondition(grad, view(eig_a, n), view(eig_g_thin, out), 0.0, state))
    blocks = a.reshape(n // block, block, n // block, block).diagonal(dim1=0, dim2=2).permute(2, 0, 1).contiguous()
    result["decomposition block-diagonal (9 x 512 + G 512)"] = timed(
        lambda: (torch.linalg.eigh(blocks), torch.linalg.eigh(g)))
    q_blocks = torch.linalg.eigh(blocks)[1]
    v = torch.zeros(out, n)
    t = torch.zeros(())

    def block_precondition() -> torch.Tensor:
        rotated = (eig_g.Q.T @ grad).reshape(out, n // block, block).transpose(0, 1) @ q_blocks  # (9, out, b)
        v.mul_(0.95).addcmul_(rotated.transpose(0, 1).reshape(out, n), rotated.transpose(0, 1).reshape(out, n),
                              value=0.05)
        t.add_(1)
        scale = v.div(1 - 0.95 ** t).sqrt_().add_(1e-8).reshape(out, n // block, block).transpose(0, 1)
        back = (rotated / scale) @ q_blocks.transpose(1, 2)
        return eig_g.Q @ back.transpose(0, 1).reshape(out, n)

    result["precondition block-diagonal"] = timed(block_precondition)
    full = EigenAdam(max_rank=None)
    full_state: dict[str, torch.Tensor] = {}
    eig_a_full = linalg.symmetric_eigen(a, torch.float32)
    result["precondition full"] = timed(lambda: full.precondition(grad, view(eig_a_full, n), view(eig_g, out), 0.0,
                                                                   full_state))
    start = time.perf_counter()
    linalg.symmetric_eigen(a, torch.float32)
    result["decomposition full (A 4608 only, once)"] = (time.perf_counter() - start) * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=available())
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--kernels", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.kernels:
        for part, ms in kernel_times(args.rounds).items():
            print(f"{part}: {ms:.1f} ms", flush=True)
        return
    result = {}
    for name in args.models:
        medians: dict[str, list[float]] = {}
        means: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for label, make in optimizers().items():
                times = step_times(name, make, args.warmup, args.steps)
                medians.setdefault(label, []).append(statistics.median(times))
                means.setdefault(label, []).append(statistics.fmean(times))
        median = {label: statistics.median(v) * 1e3 for label, v in medians.items()}
        mean = {label: statistics.median(v) * 1e3 for label, v in means.items()}
        result[name] = {"median_ms": median, "mean_ms": mean}
        line = ", ".join(f"{label} {median[label]:.1f} ms ({median[label] / median['adamw']:.2f}×; mean "
                         f"{mean[label] / mean['adamw']:.2f}×)" for label in median)
        print(f"{name}: {line}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
