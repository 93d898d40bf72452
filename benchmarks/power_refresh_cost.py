"""EigenAdam's basis refresh: ``eigh`` (``refresh="eigh"``) against one warm-started power-iteration
step + QR (``refresh="power"``, ``kfac_optim.methods.power_refresh``), per factor size.

Usage: ``nice python -m benchmarks.power_refresh_cost [--sizes 16 64 128 256 512 1024] [--capped 257 321 1024]
[--repeats 7] [--out DIR]``.

One thread. Per size ``n``: a random PSD factor (a Gram of ``2n`` Gaussian rows, its spectrum
decaying as a K-FAC factor's), decomposed by each decomposer as ``EigenAdam`` holds it (full bases:
``EigenDecomposer``'s ``eigh``; ``--capped`` sizes: the cap's 128 leading eigenvectors, where
``eigh``'s side is the randomized range eigensolver) and refreshed from the basis held. The two are
timed alternately, ``--repeats`` times each, CPU time (``time.process_time``), and the median of
each and the median of the per-pair ratios are reported (the ratio within a pair is what counts on
a shared machine). Also: the refreshed basis's distance from the factor's eigenbasis after one
and after five refreshes from an eigenbasis of the factor before a fold (``‖QᵀFQ − diag‖/‖F‖``).
Writes ``DIR/power_refresh_cost.json`` (default ``runs/``) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kfac_optim import linalg
from kfac_optim.methods import EIGEN_ADAM_MAX_RANK, EIGEN_ADAM_THIN_WIDTH
from kfac_optim.methods.decompositions import EigenDecomposer
from kfac_optim.methods.power_refresh import PowerRefreshDecomposer


@dataclass
class FactorStandIn:
    """The ``FactorView`` fields the decomposers read, for one dense ungrouped factor."""

    running: Tensor
    decomposition: linalg.Eigen | None = None
    groups: int = 1
    diagonal: bool = False
    rank_bound: int | None = None

    @property
    def dim(self) -> int:
        return self.running.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.running.device

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return ()


def gram(n: int, seed: int) -> Tensor:
    """A PSD ``(n, n)`` float32 factor: the mean Gram of ``2n`` rows with decaying column scales."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(2 * n, n, generator=generator) * torch.logspace(0, -2, n)
    return rows.T @ rows / (2 * n)


def off_diagonal(factor: Tensor, q: Tensor) -> float:
    """``‖QᵀFQ − diag(QᵀFQ)‖ / ‖F‖``: how far ``Q``'s span is from an invariant subspace of ``F``."""
    rotated = q.T.double() @ factor.double() @ q.double()
    return float((rotated - torch.diag(rotated.diagonal())).norm() / factor.double().norm())


def measure(n: int, capped: bool, repeats: int) -> dict[str, float]:
    cap = (EIGEN_ADAM_MAX_RANK, EIGEN_ADAM_THIN_WIDTH) if capped else (None, None)
    eigh, power = EigenDecomposer(*cap), PowerRefreshDecomposer(*cap)
    drop_below = 0.0 if capped else None
    before, after = gram(n, 0), 0.95 * gram(n, 0) + 0.05 * gram(n, 1)  # one fold of a new batch
    held = eigh.decompose(FactorStandIn(before), 0.0, torch.float32, drop_below)
    times: dict[str, list[float]] = {"eigh": [], "power": []}
    for _ in range(repeats):
        for name, decomposer in (("eigh", eigh), ("power", power)):
            factor = FactorStandIn(after, held)
            start = time.process_time()
            decomposer.decompose(factor, 0.0, torch.float32, drop_below)
            times[name].append(time.process_time() - start)
    ratios = [p / e for p, e in zip(times["power"], times["eigh"], strict=True)]
    refreshed, distances = held, []
    for _ in range(5):
        refreshed = power.decompose(FactorStandIn(after, refreshed), 0.0, torch.float32, drop_below)
        distances.append(off_diagonal(after, refreshed.Q))
    exact = eigh.decompose(FactorStandIn(after), 0.0, torch.float32, drop_below)
    return {"n": n, "columns": held.Q.shape[1], "eigh_ms": 1e3 * statistics.median(times["eigh"]),
            "power_ms": 1e3 * statistics.median(times["power"]), "ratio": statistics.median(ratios),
            "off_diagonal_held": off_diagonal(after, held.Q), "off_diagonal_1": distances[0],
            "off_diagonal_5": distances[-1], "off_diagonal_eigh": off_diagonal(after, exact.Q)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.power_refresh_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[16, 64, 128, 256, 512, 1024])
    parser.add_argument("--capped", nargs="+", type=int, default=[257, 321, 1024])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("runs"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(n, False, args.repeats) for n in args.sizes]
    rows += [measure(n, True, args.repeats) for n in args.capped]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "power_refresh_cost.json").write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)},
                                                                  "rows": rows}, indent=1))
    print("| n | columns | eigh ms | power ms | power/eigh (median of pairs) "
          "| off-diagonal: held, 1 refresh, 5, eigh |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['columns']} | {r['eigh_ms']:.3f} | {r['power_ms']:.3f} | {r['ratio']:.3f} | "
              f"{r['off_diagonal_held']:.1e}, {r['off_diagonal_1']:.1e}, {r['off_diagonal_5']:.1e}, "
              f"{r['off_diagonal_eigh']:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
