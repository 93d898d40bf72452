"""On paper: time per iteration of SGD and K-FAC on ResNet-50 (224 px) over P data-parallel GPUs.

Owns: the cost model and its stated assumptions. Must not know: the CPU study (the report sets the
two side by side). Uses the bytes of ``benchmarks.comm_bytes`` and the decomposition plan of
``kfac_optim.distributed.plan`` (as ``benchmarks.plan_report``) for torchvision's ResNet-50.

Per iteration at per-GPU batch ``b`` (global ``B = P·b``), ``F`` the effective FLOP rate, ``β`` the
per-GPU bus bandwidth, a ring all-reduce of ``n`` bytes taking ``2(P−1)/P·n/β`` and an all-gather
``(P−1)/P·n/β``::

    SGD    = b·C/F + allreduce(gradients)
    K-FAC  = SGD + precondition/F                         (every step, every layer on every rank, f = 1)
                 + statistics(b)/F / factor_every          (A and G over every output position)
                 + [max-rank eigh/F_eigh + allreduce(factors) + allgather(decompositions)] / inv_every

``C``: 3 × forward FLOPs per sample (forward + backward). ``precondition``: the eigen method's four
products per layer, ``4·out·in·(out + in)`` FLOPs (full bases; the default eigenbasis cap makes
capped layers cheaper, not counted). ``statistics``: ``2·rows·(in² + out²)`` per layer, rows = b × the
layer's output positions. ``max-rank eigh``: the plan's largest per-rank load (``dim³`` per factor)
× ``EIGH_FLOPS_PER_DIM3``. Time to a target = steps × time per iteration, so K-FAC pays exactly
when its steps are below SGD's times ``SGD / K-FAC`` per iteration: the **break-even steps ratio**.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from benchmarks.comm_bytes import comm_bytes
from benchmarks.plan_report import torchvision_model
from kfac_optim.distributed.plan import make_plan
from kfac_optim.distributed.work import eigh_cost, work_items
from kfac_optim.methods import Eigen


@dataclass(frozen=True)
class Assumptions:
    """Every number the projection assumes (none is measured here)."""

    flops: float = 100e12
    """Effective training FLOP rate per GPU (A100-class bf16, ~1/3 of its 312 TFLOP/s peak)."""
    eigh_flops: float = 0.5e12
    """Effective rate of fp32 eigendecompositions (cuSOLVER syevd runs far below peak)."""
    bandwidth: float = 25e9
    """Bus bandwidth per GPU, bytes/s (200 Gb/s InfiniBand)."""
    per_gpu_batch: int = 32
    factor_every: int = 10
    inv_every: int = 100
    """K-FAC's intervals (KAISA's ResNet-50 ImageNet settings)."""
    kfac_epochs_ratio: float = 55 / 90
    """K-FAC's epochs to 75.9% over SGD's on ResNet-50/ImageNet, as recalled from the seeds (KAISA, SC20);
    not checked against the paper (docs/large_batch.md)."""


EIGH_FLOPS_PER_DIM3 = 9.0
"""A symmetric eigendecomposition with eigenvectors: about 9·n³ FLOPs (tridiagonalization and back-transform)."""
WORLDS = (8, 16, 32, 64, 128, 256)


def resnet50_layers() -> list[dict[str, int]]:
    """Per conv / linear layer of ResNet-50 at 224 px: in (with bias / kernel), out, output positions."""
    with torch.device("meta"):
        model = torchvision_model("resnet50")
        layers: list[dict[str, int]] = []

        def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            kernel = math.prod(module.weight.shape[1:])
            positions = math.prod(output.shape[2:]) if output.dim() > 2 else 1
            layers.append({"in": kernel + (module.bias is not None), "out": module.weight.shape[0],
                           "positions": positions, "macs": kernel * module.weight.shape[0] * positions})

        for module in model.modules():
            if isinstance(module, nn.Conv2d | nn.Linear):
                module.register_forward_hook(hook)
        model(torch.empty(1, 3, 224, 224))
    return layers


def _allreduce(nbytes: float, world: int, bandwidth: float) -> float:
    return 2 * (world - 1) / world * nbytes / bandwidth


def project(assumptions: Assumptions = Assumptions()) -> dict[str, Any]:
    """Per-iteration seconds of SGD and K-FAC at every world size in ``WORLDS``, and their parts."""
    a = assumptions
    layers = resnet50_layers()
    dims = {str(i): (layer["in"], layer["out"]) for i, layer in enumerate(layers)}
    bytes_ = comm_bytes(dims)
    forward = 2 * sum(layer["macs"] for layer in layers)  # FLOPs per sample
    precondition = sum(4 * layer["out"] * layer["in"] * (layer["in"] + layer["out"]) for layer in layers)
    statistics = sum(2 * layer["positions"] * (layer["in"] ** 2 + layer["out"] ** 2) for layer in layers)
    gradient_bytes = bytes_["gradient_broadcast_per_step_mem_opt"]  # every weight and bias, fp32
    rows = []
    for world in WORLDS:
        b = a.per_gpu_batch
        compute = 3 * forward * b / a.flops
        sgd = compute + _allreduce(gradient_bytes, world, a.bandwidth)
        # full eigenbases (the assumption stated in docs/large_batch.md): the plan's loads are then n³ per factor
        plan = make_plan(work_items(dims), world, 1.0, method=Eigen(max_rank=None))
        eigh = max(plan.loads()) * EIGH_FLOPS_PER_DIM3 / a.eigh_flops
        decomposition_comm = (_allreduce(bytes_["factor_allreduce_packed"], world, a.bandwidth)
                              + (world - 1) / world * bytes_["eigen_broadcast_f1"] / a.bandwidth)
        parts = {"precondition": precondition / a.flops, "statistics": statistics * b / a.flops / a.factor_every,
                 "decompositions": eigh / a.inv_every, "kfac_communication": decomposition_comm / a.inv_every}
        kfac = sgd + sum(parts.values())
        rows.append({"gpus": world, "global_batch": world * b, "sgd_s": sgd, "compute_s": compute, "kfac_s": kfac,
                     **{f"{k}_s": v for k, v in parts.items()}, "per_iteration_ratio": kfac / sgd,
                     "break_even_steps_ratio": sgd / kfac,
                     "time_ratio_at_seeds_epochs": a.kfac_epochs_ratio * kfac / sgd})
    return {"assumptions": asdict(a), "forward_gflops_per_sample": forward / 1e9, "layers": len(layers),
            "bytes": bytes_, "eigh_cost_largest_factor": max(eigh_cost(n) for pair in dims.values() for n in pair),
            "rows": rows}


def render(projection: dict[str, Any]) -> list[str]:
    """The projection as Markdown lines: the assumptions, then one row per world size."""
    a = projection["assumptions"]
    b = projection["bytes"]
    lines = ["### Projection: ResNet-50 at 224 px on P data-parallel GPUs (on paper, docs/large_batch.md)", "",
             f"Assumed: {a['flops'] / 1e12:.0f} TFLOP/s effective training rate, {a['eigh_flops'] / 1e12:.1f} TFLOP/s "
             f"for eigendecompositions (9·n³ FLOPs each), {a['bandwidth'] / 1e9:.0f} GB/s per GPU, ring collectives, "
             f"{a['per_gpu_batch']} images per GPU, K-FAC intervals {a['factor_every']}/{a['inv_every']}, full "
             f"eigenbases, grad_worker_fraction 1. Forward {projection['forward_gflops_per_sample']:.1f} GFLOP "
             "per image; "
             f"gradients {b['gradient_broadcast_per_step_mem_opt'] / 1e6:.0f} MB, factors (packed) "
             f"{b['factor_allreduce_packed'] / 1e6:.0f} MB, "
             f"eigen decompositions {b['eigen_broadcast_f1'] / 1e6:.0f} MB "
             "(benchmarks.comm_bytes). Time ratio at the seeds' epochs: K-FAC's "
             f"{a['kfac_epochs_ratio']:.2f}x SGD's epochs (as the seeds report) times the per-iteration ratio.", "",
             "| GPUs | global batch | SGD ms/iter | K-FAC ms/iter | precondition | statistics | decompositions | "
             "K-FAC comm | K-FAC / SGD per iter | break-even steps ratio | time ratio at the seeds' epochs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in projection["rows"]:
        lines.append(f"| {r['gpus']} | {r['global_batch']} | {1e3 * r['sgd_s']:.0f} | {1e3 * r['kfac_s']:.0f} | "
                     f"{1e3 * r['precondition_s']:.1f} | {1e3 * r['statistics_s']:.1f} | "
                     f"{1e3 * r['decompositions_s']:.1f} | "
                     f"{1e3 * r['kfac_communication_s']:.1f} | {r['per_iteration_ratio']:.2f}x | "
                     f"{r['break_even_steps_ratio']:.2f} | {r['time_ratio_at_seeds_epochs']:.2f}x |")
    return lines + [""]
