"""Checkpoint size of K-FAC against the model's and SGD's, for torchvision models.

Usage: ``python -m benchmarks.checkpoint_size [--models resnet18 resnet50] [--image 224] [--batch 2]
[--out benchmarks/results]`` (``--help`` lists every flag). Prints a table, writes
``checkpoint_size.json`` and ``checkpoint_size.png`` into ``--out``.

For each model (random weights, 1000 classes), one ``KFAC(model)`` step with the defaults (step 0
folds the factors and decomposes them: the eigenbasis cap, ``Eigen(max_rank=128)``) and one
``SGD(momentum=0.9)`` step on a batch of random images, then ``torch.save`` sizes (bytes):

  model             ``model.state_dict()``
  kfac_entry        ``optimizer.state_dict()["kfac"]``: packed running factors, decompositions, counters
  packed_factors    the running factors' tensors in that entry (upper triangles; diagonal factors whole)
  decompositions    the decompositions' tensors in that entry (``Q`` at most ``n × 128``, ``d``, ``σ``)
  whole_factors     what the factors took saved whole (the unpacked layout): ``Σ n²`` per factor
  kfac_checkpoint   ``{"model", "optimizer"}`` with KFAC (momentum buffers included)
  sgd_checkpoint    the same with SGD

and ``recompute_seconds``: what a checkpoint without decompositions costs when resumed (as under
``grad_worker_fraction < 1``, where the saving rank lacks the other ranks' decompositions and the
loading ranks recompute them from the saved factors at their first step): the first step after
loading such a checkpoint minus the first step after loading the full one (fixed intervals of 10,
so that step neither folds nor decomposes otherwise); ``factors_of_last_round`` is what the
alternative, saving the factors of the last decomposition round too, would add (the packed
factors again).

Image size matters only through the decompositions' ranks (a factor of few rows is held thin):
224 px gives every capped factor its full 128 columns, as in training.
"""

from __future__ import annotations

import argparse
import io
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import nn
from tqdm import tqdm

from benchmarks.output import write_json_and_plot
from benchmarks.plan_report import MIB
from kfac_optim import KFAC


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50"],
                        help="torchvision.models builder names")
    parser.add_argument("--image", type=int, default=224, help="input height and width")
    parser.add_argument("--batch", type=int, default=2, help="images in the one step")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON and PNG")
    return parser.parse_args(argv)


def serialized_bytes(value: Any) -> int:
    """Bytes ``torch.save`` writes for ``value``."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getbuffer().nbytes


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (nested dicts, lists, tuples; None for none)."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: int, image: int) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, image, image, generator=generator)
    y = torch.randint(0, 1000, (batch,), generator=generator)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def measure(name: str, batch: int, image: int) -> dict[str, Any]:
    """The sizes of the module docstring for torchvision model ``name``."""
    import torchvision  # here: importing this module must not need a working torchvision

    def build() -> nn.Module:
        torch.manual_seed(0)
        return getattr(torchvision.models, name)(weights=None)

    model = build()
    optimizer = KFAC(model)
    one_step(model, optimizer, batch, image)
    state = optimizer.state_dict()
    entry = state["kfac"]
    factors = [factor for block in entry["blocks"].values() for factor in block["factors"].values()]
    held = [factor for block in optimizer.blocks for factor in block.factors.values()]
    sgd_model = build()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    one_step(sgd_model, sgd, batch, image)
    sizes = {
        "model": serialized_bytes(model.state_dict()),
        "kfac_entry": serialized_bytes(entry),
        "packed_factors": sum(tensor_bytes(f["running"]) for f in factors),
        "decompositions": sum(tensor_bytes(f["decomposition"]) for f in factors),
        "whole_factors": sum(f.running.nbytes for f in held),
        "kfac_checkpoint": serialized_bytes({"model": model.state_dict(), "optimizer": state}),
        "sgd_checkpoint": serialized_bytes({"model": sgd_model.state_dict(), "optimizer": sgd.state_dict()}),
    }
    sizes["factors_of_last_round"] = sizes["packed_factors"]
    return {
        "model_name": name,
        "image": image,
        "batch": batch,
        "bytes": sizes,
        "kfac_entry_over_model": sizes["kfac_entry"] / sizes["model"],
        "kfac_entry_unpacked_over_model": (sizes["kfac_entry"] - sizes["packed_factors"] + sizes["whole_factors"])
        / sizes["model"],
        "kfac_checkpoint_over_sgd_checkpoint": sizes["kfac_checkpoint"] / sizes["sgd_checkpoint"],
        "recompute_seconds": recompute_seconds(build, batch, image),
    }


def recompute_seconds(build: Any, batch: int, image: int) -> float:
    """The first step after loading a checkpoint whose decompositions are dropped, minus the first
    step after loading it whole (see the module docstring)."""
    settings = dict(factor_update_steps=10, decomposition_update_steps=10)
    model = build()
    optimizer = KFAC(model, **settings)
    one_step(model, optimizer, batch, image)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    kfac = state["optimizer"]["kfac"]
    lacking = {**kfac, "blocks": {
        name: {**block, "factors": {kind: {**factor, "decomposition": None, "decomposed_key": None}
                                    for kind, factor in block["factors"].items()}}
        for name, block in kfac["blocks"].items()
    }}
    seconds = []
    for entry in (kfac, lacking):
        resumed = build()
        resumed.load_state_dict(state["model"])
        resumed_optimizer = KFAC(resumed, **settings)
        resumed_optimizer.load_state_dict({**state["optimizer"], "kfac": entry})
        start = time.perf_counter()
        one_step(resumed, resumed_optimizer, batch, image)
        seconds.append(time.perf_counter() - start)
    return seconds[1] - seconds[0]


def plot(results: list[dict[str, Any]]) -> Figure:
    figure = Figure(figsize=(7, 4))
    axes = figure.subplots()
    width = 0.2
    bars = (("model", "model state_dict"), ("packed_factors", "K-FAC: packed factors"),
            ("decompositions", "K-FAC: decompositions"), ("whole_factors", "factors whole (unpacked)"))
    for index, (key, label) in enumerate(bars):
        positions = [i + (index - 1.5) * width for i in range(len(results))]
        axes.bar(positions, [r["bytes"][key] / MIB for r in results], width, label=label)
    axes.set_xticks(range(len(results)), [r["model_name"] for r in results])
    axes.set_ylabel("MiB (torch.save)")
    axes.set_title("K-FAC checkpoint entry against the model's weights")
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    results = [measure(name, args.batch, args.image) for name in tqdm(args.models, desc="models")]
    for r in results:
        b = r["bytes"]
        print(  # noqa: T201 (a command-line report)
            f"{r['model_name']}: model {b['model'] / MIB:.1f} MiB, K-FAC entry {b['kfac_entry'] / MIB:.1f} MiB "
            f"({r['kfac_entry_over_model']:.2f}x; packed factors {b['packed_factors'] / MIB:.1f}, decompositions "
            f"{b['decompositions'] / MIB:.1f}; factors whole would be {b['whole_factors'] / MIB:.1f}), "
            f"checkpoint {b['kfac_checkpoint'] / MIB:.1f} MiB = {r['kfac_checkpoint_over_sgd_checkpoint']:.2f}x SGD's; "
            f"recomputing every decomposition on resume: {r['recompute_seconds']:.1f} s"
        )
    write_json_and_plot(args.out, "checkpoint_size", results, plot(results))
    return results


if __name__ == "__main__":
    main()
