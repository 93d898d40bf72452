"""K-FAC on a small transformer: a character-level language model of Python's own source.

    python -m examples.recipes.transformer
    python -m examples.recipes.transformer --steps 200 --width 128 --device cuda

Token and position embeddings (``nn.Embedding``), pre-norm ``nn.TransformerEncoderLayer``s
(``batch_first=True``, a causal mask), a final ``nn.LayerNorm`` and a ``nn.Linear`` head, trained
to predict the next character of the standard library's ``argparse`` source (shipped with
Python: no download). K-FAC preconditions the embeddings, the attention projections
(``in_proj``, ``out_proj``), the MLPs and the head; the LayerNorms take the SGD path.

Prints ``KFAC.describe()`` and the held-out loss before and after training, and checks that the
loss went down and that K-FAC preconditions at least 95% of the weight-matrix elements (exit
status 1 when either does not hold).
"""

from __future__ import annotations

import argparse
import inspect

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kfac_optim

MIN_SHARE = 0.95


def corpus() -> Tensor:
    """The ``argparse`` module's source as byte values (a 1-D ``int64`` tensor; vocabulary 256)."""
    return torch.tensor(list(inspect.getsource(argparse).encode()), dtype=torch.int64)


class CharTransformer(nn.Module):
    """Tokens ``(N, L)`` → next-token logits ``(N, L, 256)``."""

    def __init__(self, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.token = nn.Embedding(256, width)
        self.position = nn.Embedding(context, width)
        self.encoder = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        x = self.token(tokens) + self.position(torch.arange(length, device=tokens.device))
        for layer in self.encoder:
            x = layer(x, src_mask=self.mask[:length, :length], is_causal=True)
        return self.head(self.norm(x))


def batches(text: Tensor, steps: int, batch_size: int, context: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """``steps`` random windows ``(inputs, next characters)``, each ``(batch_size, context)``."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(text) - context - 1, (batch_size,), generator=generator)
        windows = torch.stack([text[s : s + context + 1] for s in starts.tolist()])
        out.append((windows[:, :-1], windows[:, 1:]))
    return out


def loss_of(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.recipes.transformer",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    parser.add_argument("--context", type=int, default=64, help="characters per sequence")
    parser.add_argument("--width", type=int, default=64, help="embedding width")
    parser.add_argument("--layers", type=int, default=2, help="encoder layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate")
    parser.add_argument("--damping", type=float, default=0.1, help="K-FAC's damping λ")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to train")
    parser.add_argument("--seed", type=int, default=0, help="seed for the weights and the data")
    args = parser.parse_args(argv)

    text = corpus()
    split = int(0.9 * len(text))  # the last 10% is held out
    train = batches(text[:split], args.steps, args.batch_size, args.context, args.seed)
    held_out = batches(text[split:], 1, 4 * args.batch_size, args.context, args.seed)[0]
    torch.manual_seed(args.seed)
    model = CharTransformer(args.context, args.width, args.layers, args.heads).to(args.device)
    optimizer = kfac_optim.KFAC(
        model, lr=args.lr, momentum=0.9, damping=args.damping,
        kl_clip=0.1, update=kfac_optim.UpdateConfig(trust_region="lr_squared"),  # tuned under this trust region
        method="inverse", factor_update_steps=5, decomposition_update_steps=20,
    )
    print(optimizer.describe())

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            loss = loss_of(model, *(t.to(args.device) for t in held_out)).item()
        model.train()
        return loss

    before = evaluate()
    for step, (x, y) in enumerate(train, 1):
        optimizer.zero_grad()
        loss = loss_of(model, x.to(args.device), y.to(args.device))
        loss.backward()
        optimizer.step()
        if step % max(1, args.steps // 10) == 0 or step == args.steps:
            print(f"step {step}/{args.steps}: train loss {loss.item():.4f}", flush=True)
    after = evaluate()

    preconditioned = {id(p) for block in optimizer.blocks for p in block.parameters()}
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    share = sum(p.numel() for p in matrices if id(p) in preconditioned) / sum(p.numel() for p in matrices)
    decreased = after < before
    print(f"held-out loss: {before:.4f} before, {after:.4f} after {args.steps} steps (decreased: {decreased})")
    print(f"weight-matrix elements K-FAC preconditions: {share:.1%} (>= {MIN_SHARE:.0%}: {share >= MIN_SHARE})")
    return 0 if decreased and share >= MIN_SHARE else 1


if __name__ == "__main__":
    raise SystemExit(main())
