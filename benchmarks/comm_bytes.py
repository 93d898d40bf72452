"""Bytes distributed K-FAC communicates on a torchvision model's layers (no data, no ranks needed).

At every decomposition step each rank all-reduces every running factor once (lazy reduction,
docs/design.md §5). Factors travel as packed upper triangles, ``n(n+1)/2`` fp32 entries of an ``(n, n)``
factor, in buckets of at most ``comm.DEFAULT_BUCKET_BYTES``, plus one fp32 count per factor. This
compares that payload with whole ``(n, n)`` factors, and adds what the strategies broadcast:
decompositions at ``f = 1`` (eigen: ``Q (n, n)`` and ``d (n,)``, not symmetric; inverse: a packed
triangle) per decomposition step, and preconditioned ``(out, in [+1])`` gradients at
``f = 1/world`` per step. Bytes are payloads per collective (what one rank contributes or
receives), not link traffic, which depends on the backend's algorithm.

Under FSDP2 (``fully_shard``, ``--fsdp-world``), factors and decompositions move as above, and
every step each sharded layer's gradient rows go to the rank that preconditions it and its
direction's rows come back (``distributed.fsdp``: a gather over the shard group, a scatter over
the service group). That is counted per rank as bytes received from other ranks, with the same
routes the optimizer computes, next to FSDP's own traffic per step: the parameter all-gathers
(forward, and again in backward with ``reshard_after_forward``) and the gradient reduce-scatter,
each ``(world − 1)/world`` of the parameters' bytes received per rank.

    python -m benchmarks.comm_bytes [--model resnet50] [--fsdp-world 8] [--out comm_bytes.json]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from benchmarks.plan_report import MIB, torchvision_block_dims, torchvision_model
from kfac_optim.distributed.comm import DEFAULT_BUCKET_BYTES
from kfac_optim.distributed.fsdp import MeshLayout, assign_routes
from kfac_optim.distributed.plan import make_plan
from kfac_optim.distributed.work import work_items
from kfac_optim.linalg import triu_size

FP32 = 4


def bucket_count(sizes: list[int], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Buckets the communicator fills with payloads of ``sizes`` bytes, in order."""
    count, used = 0, 0
    for size in sizes:
        if count == 0 or used + size > bucket_bytes:
            count, used = count + 1, 0
        used += size
    return count


def comm_bytes(dims: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Payload bytes for blocks with factor sizes ``{name: (dim_A, dim_G)}``."""
    factor_dims = [n for pair in dims.values() for n in pair]
    packed = [FP32 * triu_size(n) for n in factor_dims]
    return {
        "blocks": len(dims),
        "factor_allreduce_unpacked": FP32 * sum(n * n for n in factor_dims) + FP32 * len(factor_dims),
        "factor_allreduce_packed": sum(packed) + FP32 * len(factor_dims),
        "factor_allreduce_buckets": bucket_count(packed),
        "eigen_broadcast_f1": FP32 * sum(n * n + n for n in factor_dims),
        "inverse_broadcast_f1": sum(packed),
        "gradient_broadcast_per_step_mem_opt": FP32 * sum(a * g for a, g in dims.values()),
    }


def fsdp_bytes(dims: dict[str, tuple[int, int]], param_bytes: int, world: int, fraction: float) -> dict[str, float]:
    """Bytes per step received per rank under FSDP2 on a 1-D mesh of ``world`` ranks.

    ``dims``: ``{name: (dim_A, dim_G)}`` of the K-FAC layers (every one sharded; ungrouped, so that
    ``dim_G x dim_A`` is the rows x columns of its parameters, as for torchvision's ResNets); ``param_bytes``:
    all of the model's parameters. K-FAC's rows travel in fp32 (``inv_dtype``), padded to
    ``ceil(out / world)`` rows per shard, as the optimizer moves them.
    """
    layout = MeshLayout((tuple(range(world)),), 0)
    plan = make_plan(work_items(dims), world, fraction)
    shapes = {name: (g, a) for name, (a, g) in dims.items()}
    routes = assign_routes(shapes, {name: plan.block(name).grad_workers for name in dims}, plan.receiver_groups, layout)
    received = [0] * world
    for name, block_routes in routes.items():
        out, cols = shapes[name]
        rows = FP32 * math.ceil(out / world) * cols
        for route in block_routes:
            received[route.preconditioner] += (len(route.gather_group) - 1) * rows
            for rank in route.service_group:
                if rank != route.preconditioner:
                    received[rank] += rows
    fsdp_share = (world - 1) / world * param_bytes
    return {
        "world": world,
        "grad_worker_fraction": fraction,
        "kfac_rows_per_step_mean": sum(received) / world,
        "kfac_rows_per_step_max": max(received),
        "fsdp_all_gather_per_step": 2 * fsdp_share,  # forward, and backward with reshard_after_forward
        "fsdp_reduce_scatter_per_step": fsdp_share,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", help="torchvision.models builder name")
    parser.add_argument("--fsdp-world", type=int, default=8, help="ranks of the FSDP2 mesh to count for")
    parser.add_argument("--out", type=Path, help="also write the numbers as JSON here")
    args = parser.parse_args()
    dims = torchvision_block_dims(args.model)
    numbers = comm_bytes(dims)
    ratio = numbers["factor_allreduce_packed"] / numbers["factor_allreduce_unpacked"]
    numbers["packed_over_unpacked"] = ratio
    print(f"{args.model}: {numbers['blocks']} K-FAC blocks")
    print(f"  factor all-reduce per decomposition step: packed {numbers['factor_allreduce_packed'] / MIB:.1f} MiB "
          f"in {numbers['factor_allreduce_buckets']} buckets vs unpacked "
          f"{numbers['factor_allreduce_unpacked'] / MIB:.1f} MiB: {ratio:.4f}x")
    print(f"  decomposition broadcasts at f=1 per decomposition step: eigen "
          f"{numbers['eigen_broadcast_f1'] / MIB:.1f} MiB, inverse {numbers['inverse_broadcast_f1'] / MIB:.1f} MiB")
    print(f"  preconditioned-gradient broadcasts at f=1/world per step: "
          f"{numbers['gradient_broadcast_per_step_mem_opt'] / MIB:.1f} MiB")
    with torch.device("meta"):
        param_bytes = FP32 * sum(p.numel() for p in torchvision_model(args.model).parameters())
    fsdp = [fsdp_bytes(dims, param_bytes, args.fsdp_world, f) for f in (1.0, 1 / args.fsdp_world)]
    print(f"  FSDP2 at {args.fsdp_world} ranks, per step and rank (received): FSDP all-gathers "
          f"{fsdp[0]['fsdp_all_gather_per_step'] / MIB:.1f} MiB + reduce-scatter "
          f"{fsdp[0]['fsdp_reduce_scatter_per_step'] / MIB:.1f} MiB; K-FAC's gradient/direction rows")
    for row in fsdp:
        extra = row["kfac_rows_per_step_mean"] / (row["fsdp_all_gather_per_step"] + row["fsdp_reduce_scatter_per_step"])
        print(f"    f={row['grad_worker_fraction']:.3g}: mean {row['kfac_rows_per_step_mean'] / MIB:.1f} MiB, "
              f"max {row['kfac_rows_per_step_max'] / MIB:.1f} MiB ({extra:.1%} of FSDP's own, mean)")
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, **numbers, "fsdp": fsdp}, indent=2))


if __name__ == "__main__":
    main()
