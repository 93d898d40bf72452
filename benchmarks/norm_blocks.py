"""Normalization layers under K-FAC: SGD path (the default) or the opt-in per-unit 2x2 blocks.

    python -m benchmarks.norm_blocks [--steps 300] [--seeds 0 1] [--out DIR]

A small character-level language model on text every machine has (the source of Python's
``argparse`` module): an embedding, a causal depthwise ``Conv1d`` mixer, a causal
``nn.TransformerEncoderLayer``, a ``LayerNorm`` and a linear head, predicting the next character.
Each seed trains three times from the same weights on the same batches: AdamW, K-FAC with the
LayerNorm parameters on the SGD path, and K-FAC with ``LayerNormBlock`` registered. The same
untuned hyperparameters for both K-FAC runs. Reports the mean training loss of the last 20 steps,
the loss on (at most 256 windows of) held-out text, and the median step time; writes ``DIR/norm_blocks.json`` and
``DIR/norm_blocks.png`` (training loss against the step).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import nn
from tqdm import tqdm

from benchmarks.output import write_json_and_plot
from kfac_optim import KFAC, CurvatureConfig
from kfac_optim.layers import LayerNormBlock

KFAC_OPTIONS = dict(lr=0.1, momentum=0.9, damping=0.03, kl_clip=1e-3, factor_update_steps=1,
                    decomposition_update_steps=10)


class CharModel(nn.Module):
    """Embedding → causal depthwise Conv1d mixer → causal TransformerEncoderLayer → LayerNorm → head."""

    def __init__(self, vocabulary: int, dim: int = 64, kernel: int = 5) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, dim)
        self.mixer = nn.Conv1d(dim, dim, kernel, padding=kernel - 1, groups=dim)
        self.encoder = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        h = self.embedding(tokens)
        h = h + self.mixer(h.transpose(1, 2))[..., :length].transpose(1, 2)  # causal: trim the right
        mask = nn.Transformer.generate_square_subsequent_mask(length)
        return self.head(self.norm(self.encoder(h, src_mask=mask, is_causal=True)))


def corpus() -> tuple[torch.Tensor, int]:
    """The characters of ``argparse``'s source as token ids, and the vocabulary size."""
    text = inspect.getsource(argparse)
    alphabet = sorted(set(text))
    index = {c: i for i, c in enumerate(alphabet)}
    return torch.tensor([index[c] for c in text]), len(alphabet)


def batches(data: torch.Tensor, steps: int, batch: int, length: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - length - 1, (steps, batch), generator=generator)
    return [torch.stack([data[s : s + length + 1] for s in row.tolist()]) for row in starts]


def run(variant: str, seed: int, train: torch.Tensor, held_out: torch.Tensor, vocabulary: int, args) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = CharModel(vocabulary, args.dim)
    if variant == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.adamw_lr, weight_decay=0.0)
    elif variant == "kfac":
        optimizer = KFAC(model, **KFAC_OPTIONS)
    else:  # LayerNorm is not registered by default: precondition it for this optimizer only
        optimizer = KFAC(model, curvature=CurvatureConfig(blocks={nn.LayerNorm: LayerNormBlock}), **KFAC_OPTIONS)
    losses, times = [], []
    for chunk in tqdm(batches(train, args.steps, args.batch, args.length, seed),
                      desc=f"{variant} seed {seed}", leave=False):
        start = time.perf_counter()
        optimizer.zero_grad()
        logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocabulary), chunk[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    with torch.no_grad():
        model.eval()
        starts = range(0, len(held_out) - args.length - 1, args.length)
        test = torch.stack([held_out[s : s + args.length + 1] for s in starts][:256])  # at most 256 windows
        logits = model(test[:, :-1])
        held_out_loss = F.cross_entropy(logits.reshape(-1, vocabulary), test[:, 1:].reshape(-1)).item()
    return {
        "variant": variant, "seed": seed, "final_train_loss": statistics.fmean(losses[-20:]),
        "held_out_loss": held_out_loss, "median_step_s": statistics.median(times), "losses": losses,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--adamw-lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("results/norm_blocks"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data, vocabulary = corpus()
    split = int(0.9 * len(data))
    train, held_out = data[:split], data[split:]
    runs = []
    for seed in args.seeds:
        for variant in ("adamw", "kfac", "kfac+norm"):
            result = run(variant, seed, train, held_out, vocabulary, args)
            runs.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "losses"}))
    figure = Figure(figsize=(7, 4))
    axes = figure.subplots()
    colors = {"adamw": "tab:gray", "kfac": "tab:blue", "kfac+norm": "tab:orange"}
    for result in runs:
        axes.plot(result["losses"], color=colors[result["variant"]], alpha=0.7,
                  label=result["variant"] if result["seed"] == args.seeds[0] else None)
    axes.set(xlabel="step", ylabel="training loss", title="char LM (argparse source): LayerNorm on SGD vs 2x2 blocks")
    axes.legend()
    write_json_and_plot(args.out, "norm_blocks",
                        {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, figure)
    return runs


if __name__ == "__main__":
    main()
