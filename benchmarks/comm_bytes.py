"""Bytes distributed K-FAC communicates on a torchvision model's layers (no data, no ranks needed).

At every decomposition step each rank all-reduces every running factor once (lazy reduction,
docs/design.md §5). Factors travel as packed upper triangles, ``n(n+1)/2`` fp32 entries of an ``(n, n)``
factor, in buckets of at most ``comm.DEFAULT_BUCKET_BYTES``, plus one fp32 count per factor. This
compares that payload with whole ``(n, n)`` factors, and adds what the strategies broadcast:
decompositions at ``f = 1`` (eigen: ``Q (n, n)`` and ``d (n,)``, not symmetric; inverse: a packed
triangle) per decomposition step, and preconditioned ``(out, in [+1])`` gradients at
``f = 1/world`` per step. Bytes are payloads per collective (what one rank contributes or
receives), not link traffic, which depends on the backend's algorithm.

    python -m benchmarks.comm_bytes [--model resnet50] [--out comm_bytes.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.plan_report import MIB, torchvision_block_dims
from kfac_optim.distributed.comm import DEFAULT_BUCKET_BYTES
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", help="torchvision.models builder name")
    parser.add_argument("--out", type=Path, help="also write the numbers as JSON here")
    args = parser.parse_args()
    numbers = comm_bytes(torchvision_block_dims(args.model))
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
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, **numbers}, indent=2))


if __name__ == "__main__":
    main()
