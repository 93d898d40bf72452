"""The peer benchmark's tasks: a model, its data (train / validation / test), its loss and its metric.

- ``cnn``: the digits CNN of the main job (`examples.training.models.DigitsCNN`), accuracy.
- ``autoencoder``: the deep autoencoder (`DeepAutoencoder`) on digits pixels in [0, 1], test MSE.
- ``mlp``: a 64-256-256-10 ReLU MLP classifier on digits, accuracy.
- ``gpt``: a character-level GPT (`CharGPT`: learned position embedding, tied embedding/head,
  causal SDPA attention, LayerNorm, 2 layers, d=64) on Python standard-library sources, held-out
  loss in nats/char.
- ``nanogpt``: Karpathy's nanoGPT at a CPU size (`NanoGPT`: the same pre-LayerNorm blocks with a fused
  qkv Linear, output projection and 4x GELU MLP, biases on (nanoGPT's default ``bias=True``), dropout
  0, learned position embedding, tied embedding/head, nanoGPT's initialisation; 4 layers, 4 heads,
  d=128) on the same text, context and splits as ``gpt``; its AdamW has nanoGPT's betas (0.9, 0.95).

Digits come from `examples.training.data.load_datasets` (its fixed train/test split); the
validation split is a further stratified 20% of its training set, held out from training.
Every task trains on the same examples for the lr grid (scored on validation) and the seeds
(scored on test).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.training.config import DataConfig
from examples.training.data import load_datasets
from examples.training.models import DeepAutoencoder, DigitsCNN

VALIDATION_FRACTION = 0.2
SPLIT_SEED = 0
# Standard-library modules whose source is the GPT's text (shipped with Python: no download).
GPT_SOURCES = ("argparse", "dataclasses", "textwrap", "functools", "inspect")
GPT_CONTEXT = 64
GPT_EVAL_WINDOWS = 64


@dataclass(frozen=True)
class Splits:
    """Inputs and targets of train, validation and test; for the GPT, ``x`` is the text and ``y`` unused."""

    train: tuple[Tensor, Tensor]
    val: tuple[Tensor, Tensor]
    test: tuple[Tensor, Tensor]


@dataclass(frozen=True)
class Task:
    """One benchmark problem. ``metric`` is evaluated on a split; ``heads`` names the output modules
    (the layers Muon leaves to AdamW besides embeddings, norms and biases)."""

    name: str
    description: str
    metric: str
    higher_is_better: bool
    batch_size: int
    budget_s: float
    weight_decay: float
    build: Callable[[], nn.Module]
    heads: tuple[str, ...]
    kind: str  # "classify" | "reconstruct" | "language"
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's betas (the ``adamw`` peer's and Muon's AdamW part's): torch's default but where the
    model's own recipe sets them."""

    def splits(self) -> Splits:
        return _splits(self.kind)

    def loss(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        out = model(x)
        if self.kind == "reconstruct":
            return F.mse_loss(out, x.flatten(1))
        return F.cross_entropy(out.flatten(0, -2), y.flatten())

    def batches(self, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
        """Training batches forever, in an order fixed by ``seed`` (the same for every optimizer)."""
        generator = torch.Generator().manual_seed(seed)
        x, y = self.splits().train
        if self.kind == "language":
            while True:
                yield _windows(x, torch.randint(0, len(x) - GPT_CONTEXT - 1, (self.batch_size,), generator=generator))
        while True:
            order = torch.randperm(len(x), generator=generator)
            for start in range(0, len(x) - self.batch_size + 1, self.batch_size):
                index = order[start:start + self.batch_size]
                yield x[index], y[index]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str) -> float:
        """The metric on ``split`` ("val" or "test"), in eval mode, as one batch."""
        x, y = getattr(self.splits(), split)
        model.eval()
        try:
            out = model(x)
            if self.kind == "classify":
                return (out.argmax(1) == y).float().mean().item()
            if self.kind == "reconstruct":
                return F.mse_loss(out, x.flatten(1)).item()
            return F.cross_entropy(out.flatten(0, -2), y.flatten()).item()
        finally:
            model.train()


class DigitsMLP(nn.Sequential):
    """64-256-256-10 with ReLU: flattened 8x8 digits to class logits."""

    def __init__(self) -> None:
        super().__init__(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


class _Block(nn.Module):
    """Pre-norm transformer block: causal SDPA self-attention and a 4x GELU MLP, each residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        n, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, length, 3, self.heads, width // self.heads).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(n, length, width))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class CharGPT(nn.Module):
    """Byte tokens ``(N, L)`` -> next-byte logits ``(N, L, 256)``; the head's weight is the token embedding's."""

    def __init__(self, context: int = GPT_CONTEXT, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.token = nn.Embedding(256, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(_Block(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)
        self.head.weight = self.token.weight
        nn.init.normal_(self.token.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.token(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        return self.head(self.norm(self.blocks(x)))


class NanoGPT(CharGPT):
    """`CharGPT` initialised as Karpathy's nanoGPT (``model.py``): every Linear and Embedding weight
    N(0, 0.02²), biases 0, and each residual branch's output projection (attention's ``proj``, the
    MLP's ``out``) N(0, (0.02 / sqrt(2·layers))²). Shapes as `CharGPT`'s."""

    def __init__(self, context: int = GPT_CONTEXT, width: int = 128, layers: int = 4, heads: int = 4) -> None:
        super().__init__(context, width, layers, heads)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for projection in (block.proj, block.out):
                nn.init.normal_(projection.weight, std=0.02 / (2 * layers) ** 0.5)


def _windows(text: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
    windows = torch.stack([text[s:s + GPT_CONTEXT + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


@functools.cache
def _splits(kind: str) -> Splits:
    """The data of a task kind, loaded once per process."""
    if kind == "language":
        return _text_splits()
    from sklearn.model_selection import train_test_split

    data = load_datasets(DataConfig(name="digits", normalize=kind == "classify"))
    x, y = data.train.tensors
    x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=VALIDATION_FRACTION, stratify=y,
                                                      random_state=SPLIT_SEED)
    return Splits((x_train, y_train), (x_val, y_val), tuple(data.test.tensors))


def _text_splits() -> Splits:
    """The sources' bytes, split 80/10/10 in order; validation and test are fixed evenly spaced windows."""
    text = torch.tensor(list("".join(inspect.getsource(importlib.import_module(m)) for m in GPT_SOURCES).encode()),
                        dtype=torch.int64)
    a, b = int(0.8 * len(text)), int(0.9 * len(text))

    def held_out(part: Tensor) -> tuple[Tensor, Tensor]:
        return _windows(part, torch.linspace(0, len(part) - GPT_CONTEXT - 1, GPT_EVAL_WINDOWS).long())

    return Splits((text[:a], text[:0]), held_out(text[a:b]), held_out(text[b:]))


TASKS: dict[str, Task] = {task.name: task for task in (  # the GPTs, the costliest, last
    Task("cnn", "digits CNN (conv16-conv16-1024x128-10), batch 128", "accuracy", True, 128, 4.0, 0.0,
         DigitsCNN, heads=("7",), kind="classify"),
    Task("autoencoder", "digits deep autoencoder 64-512-256-128-16-...-64 (tanh), batch 256", "mse", False, 256,
         6.0, 0.0, DeepAutoencoder, heads=("15",), kind="reconstruct"),
    Task("mlp", "digits MLP 64-256-256-10 (ReLU), batch 128", "accuracy", True, 128, 2.5, 0.0,
         DigitsMLP, heads=("5",), kind="classify"),
    Task("gpt", "char GPT on stdlib sources: 2 layers, d=64, context 64, tied head, SDPA, batch 32",
         "loss (nats/char)", False, 32, 12.0, 0.0, CharGPT, heads=("head",), kind="language"),
    Task("nanogpt", "nanoGPT-shaped char model on the same text: 4 layers, 4 heads, d=128, context 64, "
         "tied head, nanoGPT's init and AdamW betas (0.9, 0.95), batch 16", "loss (nats/char)", False, 16, 30.0, 0.0,
         NanoGPT, heads=("head",), kind="language", adam_betas=(0.9, 0.95)),
)}
