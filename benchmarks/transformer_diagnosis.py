"""Why is K-FAC no better than SGD, step for step, on a small transformer?

A tiny character-level GPT (pre-LN blocks, SDPA causal attention, learned position embedding, tied
embedding/head) on Python sources of the standard library. Two parts:

``train``  the loss after N steps for SGD, AdamW, Muon and K-FAC ablations (one candidate cause
           each) and prototype fixes, each on a small lr grid, the same seeds and batches for all.
           K-FAC is used as a *direction oracle*: ``KFAC(lr=1, momentum=0, kl_clip=None)`` gives the
           preconditioned direction ``V`` of a step; this script then applies the update rule under
           test (the library's KL clip at the scheduled lr, the clip at the base lr, grafting, no
           clip) and SGD's momentum. ``--check-wrapper`` shows the rule "clip" reproduces
           ``KFAC(lr, momentum=0.9, kl_clip)`` itself.
``probe``  on a TINY model, the exact per-layer Fisher (empirical and true) formed densely from
           per-token gradients; the cosine between K-FAC's step and the exact natural-gradient step
           ``(F + λI)⁻¹∇``, step norms, KL-clip factors, and the spectra of the A and G factors.

Units (docs/numerics.md): with a loss that averages over B·T tokens, K-FAC counts N = B samples, so
its ``G ⊗ A`` is the per-token Fisher ``F_tok`` divided by T (empirical Fisher), and the damping λ
acts as ``λ·T`` in per-token units. ``sample_fisher`` rejects ``(B, T, V)`` logits, so this script
passes them reshaped to ``(B·T, V)``: the sampled loss then sums over tokens while N stays B, so the
sampled ``G ⊗ A`` is ``T·F_tok`` and λ acts as ``λ/T`` per token (T² apart from the empirical one).

    python -m benchmarks.transformer_diagnosis train --steps 200
    python -m benchmarks.transformer_diagnosis probe
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import kfac_optim

# -- data -------------------------------------------------------------------------------------


def load_corpus(max_chars: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Standard-library Python sources (sorted file names) as char ids; (train, val, vocab size).

    Printable ASCII, newline and tab get their own ids; every other character one "unknown" id.
    """
    root = Path(inspect.getfile(os)).parent
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(errors="ignore")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    text = "".join(parts)[:max_chars]
    alphabet = "\n\t" + "".join(chr(c) for c in range(32, 127))
    index = {c: i for i, c in enumerate(alphabet)}
    ids = torch.tensor([index.get(c, len(alphabet)) for c in text], dtype=torch.long)
    split = int(0.9 * len(ids))
    return ids[:split], ids[split:], len(alphabet) + 1


def batch(ids: torch.Tensor, size: int, context: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` random windows: inputs (B, T) and next-char targets (B, T)."""
    start = torch.randint(0, len(ids) - context - 1, (size,), generator=generator)
    rows = start[:, None] + torch.arange(context + 1)
    window = ids[rows]
    return window[:, :-1], window[:, 1:]


# -- model ------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LN transformer block: causal SDPA attention and a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + learned position embedding, pre-LN blocks, final LayerNorm, head tied to the embedding."""

    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def hidden_matrices(model: GPT) -> list[nn.Linear]:
    """The 2-D hidden weights' layers (Muon's and EKFAC's domain): qkv, proj, fc, fc2 of every block."""
    return [m for b in model.blocks for m in (b.qkv, b.proj, b.fc, b.fc2)]


# -- update rules -----------------------------------------------------------------------------


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Runner:
    """One optimizer under test: ``step(x, y, factor)`` does forward, backward and update at lr·factor."""

    stats: dict[str, list[float]]

    def step(self, x: torch.Tensor, y: torch.Tensor, factor: float) -> float:
        raise NotImplementedError


class TorchRunner(Runner):
    """torch.optim optimizers, each with its own base lr scaled by the schedule factor."""

    def __init__(self, model: GPT, optimizers: list[torch.optim.Optimizer]) -> None:
        self.model, self.optimizers, self.stats = model, optimizers, {}
        self.base = [[g["lr"] for g in o.param_groups] for o in optimizers]

    def step(self, x, y, factor):
        loss = cross_entropy(self.model(x), y)
        loss.backward()
        for optimizer, base in zip(self.optimizers, self.base):
            for group, lr in zip(optimizer.param_groups, base):
                group["lr"] = lr * factor
            optimizer.step()
            optimizer.zero_grad()
        return loss.item()


class KFACRunner(Runner):
    """K-FAC's preconditioned direction V with a chosen update rule and SGD momentum 0.9.

    rule "clip": ν = min(1, sqrt(kl / (lr_t² |Σ⟨V,∇⟩|))), step lr_t·ν·V (the library's KL clip);
    "clip_base": ν from the base lr, step lr_t·ν·V (fix c: the step follows the schedule, the bound
    holds at the peak lr); "none": lr_t·V; "graft_adam"/"graft_sgd": per tensor, K-FAC's
    (momentum-averaged) direction with the norm of Adam's / SGD-momentum's step (fix b).
    Sums over K-FAC parameters only (the library clips preconditioned layers only).
    """

    def __init__(self, model: GPT, lr: float, rule: str, kl_clip: float, sampled: bool, **kfac: Any) -> None:
        self.model, self.lr, self.rule, self.kl, self.sampled = model, lr, rule, kl_clip, sampled
        sharing = kfac.pop("weight_sharing", "expand")
        self.opt = kfac_optim.KFAC(model, lr=1.0, momentum=0.0, kl_clip=None, factor_update_steps=1, **kfac,
                                   curvature=kfac_optim.CurvatureConfig(
                                       fisher="sampled" if sampled else "empirical", weight_sharing=sharing))
        self.params = [p for p in model.parameters() if p.requires_grad]
        kfac_ids = {id(p) for b in self.opt.blocks for p in b.module.parameters(recurse=False)}
        self.is_kfac = [id(p) in kfac_ids for p in self.params]
        self.state: list[dict[str, torch.Tensor]] = [{} for _ in self.params]
        self.t = 0
        self.stats = {"nu": [], "step_unclipped": [], "step_applied": []}

    def step(self, x, y, factor):
        logits = self.model(x)
        loss = cross_entropy(logits, y)
        if self.sampled:  # sample_fisher rejects (B, T, V): tokens as rows (see the module docstring)
            self.opt.sample_fisher(logits.reshape(-1, logits.shape[-1]), "cross_entropy")
        loss.backward()
        with torch.no_grad():
            grads = [p.grad.clone() for p in self.params]
            before = [p.detach().clone() for p in self.params]
            self.opt.step()
            directions = [b - p for b, p in zip(before, self.params)]
            for p, b in zip(self.params, before):
                p.copy_(b)
            self.opt.zero_grad()
            self._apply(directions, grads, self.lr * factor)
        self.t += 1
        return loss.item()

    def _apply(self, directions: list[torch.Tensor], grads: list[torch.Tensor], lr: float) -> None:
        kfac_dirs = [d for d, k in zip(directions, self.is_kfac) if k]
        inner = sum(float((d * g).sum()) for d, g, k in zip(directions, grads, self.is_kfac) if k)
        norm = math.sqrt(sum(float(d.square().sum()) for d in kfac_dirs))
        nu = 1.0
        if self.rule in ("clip", "clip_base"):
            reference = lr if self.rule == "clip" else self.lr
            nu = min(1.0, math.sqrt(self.kl / max(abs(reference**2 * inner), 1e-30)))
        self.stats["nu"].append(nu)
        self.stats["step_unclipped"].append(lr * norm)
        applied = 0.0
        for p, d, g, k, state in zip(self.params, directions, grads, self.is_kfac, self.state):
            update = self._update(d * nu if k else d, g, k, state)
            p.sub_(update, alpha=lr)
            applied += float(update.square().sum()) * lr**2 if k else 0.0
        self.stats["step_applied"].append(math.sqrt(applied))

    def _update(self, d: torch.Tensor, g: torch.Tensor, is_kfac: bool, state: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.rule in ("clip", "clip_base", "none"):  # torch.optim.SGD's momentum, dampening 0
            buf = state.setdefault("buf", torch.zeros_like(d))
            return buf.mul_(0.9).add_(d) if self.t > 0 else buf.copy_(d)
        kbuf = state.setdefault("kbuf", torch.zeros_like(d))
        kbuf.mul_(0.9).add_(d, alpha=0.1)
        if self.rule == "graft_adam":
            reference = adam_direction(state, g, self.t)
        else:
            sbuf = state.setdefault("sbuf", torch.zeros_like(d))
            reference = sbuf.mul_(0.9).add_(g) if self.t > 0 else sbuf.copy_(g)
        if not is_kfac:
            return reference
        return kbuf * (reference.norm() / kbuf.norm().clamp(min=1e-30))


class LibraryKFACRunner(Runner):
    """``kfac_optim.KFAC`` itself (no direction oracle) with an ``UpdateConfig``; the schedule sets each
    group's lr to ``base·factor`` before its step, as a torch LR scheduler would. ``decay``: decoupled
    weight decay on parameters with 2+ dims (matrices), none on the rest (AdamW's recipe)."""

    def __init__(self, model: GPT, lr: float, damping: float, update: kfac_optim.UpdateConfig,
                 decay: float = 0.0) -> None:
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        graft_adam = update.grafting == "adam"
        self.model, self.stats = model, {}
        self.opt = kfac_optim.KFAC(
            model, lr=lr, momentum=0.0 if graft_adam else 0.9, damping=damping, decomposition_update_steps=10,
            kl_clip=None if update.grafting else 1e-3, update=update,
            params=[{"params": matrices, "weight_decay": decay}, {"params": rest, "weight_decay": 0.0}],
        )
        self.base = lr

    def step(self, x, y, factor):
        loss = cross_entropy(self.model(x), y)
        loss.backward()
        for group in self.opt.param_groups:
            group["lr"] = self.base * factor
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


def _library(damping: float = 0.1, per_token: float = 0.0, decay: float = 0.0, **update: Any):
    """A LibraryKFACRunner factory; damping = damping · T**per_token (T the context)."""

    def build(model: GPT, lr: float, args) -> Runner:
        return LibraryKFACRunner(model, lr, damping * args.context**per_token, kfac_optim.UpdateConfig(**update), decay)

    return build


def adam_direction(state: dict[str, torch.Tensor], g: torch.Tensor, t: int, betas=(0.9, 0.95),
                   eps=1e-8) -> torch.Tensor:
    """Adam's bias-corrected m̂ / (√v̂ + ε) for gradient ``g`` at step index ``t`` (moments kept in ``state``)."""
    m = state.setdefault("m", torch.zeros_like(g)).mul_(betas[0]).add_(g, alpha=1 - betas[0])
    v = state.setdefault("v", torch.zeros_like(g)).mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
    return (m / (1 - betas[0] ** (t + 1))) / ((v / (1 - betas[1] ** (t + 1))).sqrt() + eps)


class EKFACAdamRunner(Runner):
    """Fix (a), standalone: Adam in the eigenbasis of K-FAC's factors (SOAP with K-FAC's A and G).

    For each hidden Linear (qkv, proj, fc, fc2): running A = E[a aᵀ] and G = E[ĝ ĝᵀ] over token rows
    (expand, decay 0.95, every step), eigenbases Q_A, Q_G refreshed every ``refresh`` steps;
    m = EMA of ∇W, v = EMA of (Q_Gᵀ ∇W Q_A)², step Q_G [(Q_Gᵀ m̂ Q_A) / (√v̂ + ε)] Q_Aᵀ (v is kept
    across refreshes, as SOAP keeps it). Embeddings, LayerNorms and biases: Adam. Betas (0.9, 0.95).
    """

    def __init__(self, model: GPT, lr: float, refresh: int = 10) -> None:
        self.model, self.lr, self.refresh, self.t, self.stats = model, lr, refresh, 0, {}
        self.layers = hidden_matrices(model)
        self.factors: dict[nn.Module, dict[str, torch.Tensor]] = {m: {} for m in self.layers}
        self.inputs: dict[nn.Module, torch.Tensor] = {}
        for m in self.layers:
            m.register_forward_hook(self._save_input)
            m.register_full_backward_hook(self._save_grad)
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def _save_input(self, module, args, output):
        self.inputs[module] = args[0].detach()

    def _save_grad(self, module, grad_input, grad_output):
        a = self.inputs.pop(module).reshape(-1, module.in_features)
        g = grad_output[0].detach().reshape(-1, module.out_features)
        f = self.factors[module]
        for name, rows in (("A", a), ("G", g)):
            gram = rows.T @ rows / rows.shape[0]
            f[name] = gram if name not in f else f[name].mul_(0.95).add_(gram, alpha=0.05)

    def step(self, x, y, factor):
        loss = cross_entropy(self.model(x), y)
        loss.backward()
        lr = self.lr * factor
        with torch.no_grad():
            rotated = {m.weight: m for m in self.layers}
            for p in self.model.parameters():
                state = self.state.setdefault(p, {})
                if p in rotated:
                    update = self._rotated_adam(rotated[p], p.grad, state)
                else:
                    update = adam_direction(state, p.grad, self.t)
                p.sub_(update, alpha=lr)
                p.grad = None
        self.t += 1
        return loss.item()

    def _rotated_adam(self, module: nn.Module, g: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        f = self.factors[module]
        if self.t % self.refresh == 0:
            f["QA"] = torch.linalg.eigh(f["A"].double())[1].float()
            f["QG"] = torch.linalg.eigh(f["G"].double())[1].float()
        qa, qg = f["QA"], f["QG"]
        m = state.setdefault("m", torch.zeros_like(g)).mul_(0.9).add_(g, alpha=0.1)
        gr = qg.T @ g @ qa
        v = state.setdefault("v", torch.zeros_like(g)).mul_(0.95).addcmul_(gr, gr, value=0.05)
        mr = qg.T @ m @ qa / (1 - 0.9 ** (self.t + 1))
        return qg @ (mr / ((v / (1 - 0.95 ** (self.t + 1))).sqrt() + 1e-8)) @ qa.T


# -- the optimizers under test ------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """An optimizer configuration: its lr grid and how to build its runner."""

    name: str
    group: str  # "baseline", "cause" or "fix"
    what: str
    lrs: tuple[float, ...]
    build: Callable[[GPT, float, argparse.Namespace], Runner] = field(repr=False)


SGD_LRS, ADAM_LRS, MUON_LRS, KFAC_LRS = (0.1, 0.3, 1.0), (1e-3, 3e-3, 1e-2), (0.01, 0.03, 0.1), (0.03, 0.1, 0.3)
SAMPLED_LRS = (120.0, 400.0, 1200.0)  # KFAC_LRS·T² (T=64): the reshaped sampled G is T² times the empirical one


def _muon(model: GPT, lr: float, args) -> Runner:
    hidden = [m.weight for m in hidden_matrices(model)]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    return TorchRunner(model, [torch.optim.Muon(hidden, lr=lr, weight_decay=0.0),
                               torch.optim.AdamW(rest, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)])


def _kfac(rule: str = "clip", damping: float = 0.1, per_token: float = 0.0, sampled: bool = False, **kw):
    """A KFACRunner factory; damping = damping · T**per_token (T the context)."""

    def build(model: GPT, lr: float, args) -> Runner:
        lam = damping * args.context**per_token
        return KFACRunner(model, lr, rule, 1e-3, sampled, damping=lam, decomposition_update_steps=10, **kw)

    return build


VARIANTS = [
    Variant("sgd", "baseline", "SGD momentum 0.9", SGD_LRS,
            lambda m, lr, a: TorchRunner(m, [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)])),
    Variant("adamw", "baseline", "AdamW betas (0.9, 0.95), wd 0", ADAM_LRS,
            lambda m, lr, a: TorchRunner(m, [torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95),
                                                               weight_decay=0.0)])),
    Variant("muon", "baseline", "torch.optim.Muon on hidden 2-D weights, AdamW 3e-3 on the rest", MUON_LRS, _muon),
    Variant("kfac", "cause",
            "K-FAC defaults: λ=0.1, kl_clip=1e-3 at the scheduled lr, empirical, expand", KFAC_LRS, _kfac()),
    Variant("kfac-noclip", "cause", "(1) no KL clip", (0.003, 0.01, 0.03), _kfac("none")),
    Variant("kfac-damp/T", "cause", "(2) λ = 0.1/T (per-token units)", KFAC_LRS, _kfac(per_token=-1)),
    Variant("kfac-damp/T-noclip", "cause", "(1)+(2) λ = 0.1/T, no clip", (0.0003, 0.001, 0.003),
            _kfac("none", per_token=-1)),
    Variant("kfac-sampled", "cause",
            "(3) sampled Fisher, λ=0.1·T² (same per-token damping as the default)", SAMPLED_LRS,
            _kfac(per_token=2, sampled=True)),
    Variant("kfac-sampled-damp/T", "cause", "(2)+(3) sampled Fisher, λ=0.1·T (0.1 per token)", SAMPLED_LRS,
            _kfac(per_token=1, sampled=True)),
    Variant("kfac-reduce", "cause", "(4) weight_sharing='reduce'", KFAC_LRS, _kfac(weight_sharing="reduce")),
    Variant("kfac-damp/T-reduce", "cause", "(2)+(4) λ = 0.1/T, reduce", KFAC_LRS,
            _kfac(per_token=-1, weight_sharing="reduce")),
    Variant("kfac-lrclip", "fix", "(c) clip at the base lr, step follows the schedule", KFAC_LRS, _kfac("clip_base")),
    Variant("kfac-damp/T-lrclip", "fix", "(2)+(c)", KFAC_LRS, _kfac("clip_base", per_token=-1)),
    Variant("graft-adam", "fix", "(b) K-FAC direction, per-tensor norm of Adam's step", ADAM_LRS, _kfac("graft_adam")),
    Variant("graft-adam-damp/T", "fix", "(2)+(b) λ = 0.1/T, Adam-grafted", ADAM_LRS, _kfac("graft_adam", per_token=-1)),
    Variant("kfac-damp/T²-lrclip", "fix", "(2)+(c) λ = 0.1/T² (1.6e-3 per token)", KFAC_LRS,
            _kfac("clip_base", per_token=-2)),
    Variant("graft-adam-damp/T²", "fix", "(2)+(b) λ = 0.1/T² (1.6e-3 per token), Adam-grafted", ADAM_LRS,
            _kfac("graft_adam", per_token=-2)),
    Variant("graft-sgd-damp/T", "fix", "(2)+(b) λ = 0.1/T, SGD-momentum-grafted", SGD_LRS,
            _kfac("graft_sgd", per_token=-1)),
    Variant("lib-kfac-scheduled", "library", "KFAC, UpdateConfig(trust_region='scheduled_lr'): the earlier rule",
            KFAC_LRS, _library(trust_region="scheduled_lr")),
    Variant("lib-kfac", "library", "KFAC defaults: the trust region at the base lr", KFAC_LRS, _library()),
    Variant("lib-kfac-wd", "library", "KFAC defaults + decoupled weight decay 0.1 on matrices", KFAC_LRS,
            _library(decay=0.1, decoupled_weight_decay=True)),
    Variant("lib-graft-adam", "library", "KFAC, UpdateConfig(grafting='adam', betas 0.9/0.95)", ADAM_LRS,
            _library(grafting="adam", adam_betas=(0.9, 0.95))),
    Variant("lib-graft-adam-damp/T", "library", "KFAC, Adam-grafted, λ = 0.1/T", ADAM_LRS,
            _library(per_token=-1, grafting="adam", adam_betas=(0.9, 0.95))),
    Variant("lib-graft-sgd", "library", "KFAC, UpdateConfig(grafting='sgd'), momentum 0.9", SGD_LRS,
            _library(grafting="sgd")),
    Variant("ekfac-adam", "fix", "(a) Adam in K-FAC's eigenbasis (standalone, SOAP-like), hidden Linears", ADAM_LRS,
            lambda m, lr, a: EKFACAdamRunner(m, lr)),
]


def schedule(t: int, steps: int) -> float:
    """Linear warmup over the first 5% of steps, then cosine decay to 0.1 of the peak."""
    warm = max(1, steps // 20)
    if t < warm:
        return (t + 1) / warm
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (t - warm) / max(1, steps - warm)))


def train_run(variant: Variant, lr: float, seed: int, data, args) -> dict[str, Any]:
    """One run: N steps on seed-determined init and batches; train curve, final val loss, CPU seconds."""
    train_ids, val_ids, vocab = data
    torch.manual_seed(seed)
    model = GPT(vocab, args.context, args.width, args.layers, args.heads)
    runner = variant.build(model, lr, args)
    generator = torch.Generator().manual_seed(1000 + seed)
    losses, cpu = [], []
    start = time.process_time()
    for t in range(args.steps):
        x, y = batch(train_ids, args.batch, args.context, generator)
        loss = runner.step(x, y, schedule(t, args.steps))
        losses.append(loss if math.isfinite(loss) else float("nan"))
        cpu.append(time.process_time() - start)
        if not math.isfinite(loss):
            break
    return {"variant": variant.name, "lr": lr, "seed": seed, "train": losses, "cpu": cpu,
            "val": evaluate(model, val_ids, args), "stats": summarize(runner.stats)}


@torch.no_grad()
def evaluate(model: GPT, val_ids: torch.Tensor, args) -> float:
    generator = torch.Generator().manual_seed(12345)
    model.eval()
    total = sum(cross_entropy(model(x), y).item() for x, y in
                (batch(val_ids, 64, args.context, generator) for _ in range(8)))
    model.train()
    return total / 8 if math.isfinite(total) else float("nan")


def summarize(stats: dict[str, list[float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    if stats.get("nu"):
        nu = torch.tensor(stats["nu"])
        out["clip_binds"] = float((nu < 1).float().mean())
        out["nu_median"] = float(nu.median())
        out["step_unclipped_median"] = float(torch.tensor(stats["step_unclipped"]).median())
        out["step_applied_median"] = float(torch.tensor(stats["step_applied"]).median())
        out["step_applied_last"] = float(stats["step_applied"][-1])
    return out


def train_part(args) -> dict[str, Any]:
    data = load_corpus(args.chars)
    chosen = [v for v in VARIANTS if not args.only or v.name in args.only]
    runs = []
    jobs = [(v, lr, s) for v in chosen for lr in (args.lrs or v.lrs) for s in args.seeds]
    for v, lr, s in tqdm(jobs, desc="train runs"):
        runs.append(train_run(v, lr, s, data, args))
        tqdm.write(f"{v.name:22s} lr={lr:<7g} seed={s} val={runs[-1]['val']:.3f} "
                   f"train@end={sum(runs[-1]['train'][-10:]) / 10:.3f} cpu={runs[-1]['cpu'][-1]:.1f}s "
                   f"{runs[-1]['stats']}")
    return {"runs": runs,
            "variants": {v.name: {"group": v.group, "what": v.what, "lrs": args.lrs or v.lrs} for v in chosen}}


def best_table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per variant: the lr with the lowest mean val loss over seeds; its mean val, train loss and CPU."""
    rows = []
    for name, info in result["variants"].items():
        best = None
        for lr in info["lrs"]:
            runs = [r for r in result["runs"] if r["variant"] == name and r["lr"] == lr]
            if not runs:
                continue
            vals = [r["val"] for r in runs]
            mean = sum(vals) / len(vals) if all(math.isfinite(v) for v in vals) else float("inf")
            if best is None or mean < best[0]:
                best = (mean, lr, runs)
        if best is None:
            continue
        mean, lr, runs = best
        stats = {k: sum(r["stats"].get(k, 0.0) for r in runs) / len(runs) for k in runs[0]["stats"]}
        rows.append({"variant": name, "group": info["group"], "what": info["what"], "lr": lr, "val": mean,
                     "vals": [r["val"] for r in runs],
                     "train_last20": sum(sum(r["train"][-20:]) / 20 for r in runs) / len(runs),
                     "cpu_s": sum(r["cpu"][-1] for r in runs) / len(runs), **stats})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'variant':22s} {'lr':>7s} {'val':>7s} {'train':>7s} {'cpu s':>6s} {'binds':>6s} {'ν med':>8s} "
          f"{'|lr V| med':>10s} {'|applied| med':>13s}")
    for r in rows:
        print(f"{r['variant']:22s} {r['lr']:7g} {r['val']:7.3f} {r['train_last20']:7.3f} {r['cpu_s']:6.1f} "
              f"{r.get('clip_binds', float('nan')):6.2f} {r.get('nu_median', float('nan')):8.3g} "
              f"{r.get('step_unclipped_median', float('nan')):10.3g} "
              f"{r.get('step_applied_median', float('nan')):13.3g}")


def plot_train(result: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax in axes:
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
    for r in rows:
        runs = [x for x in result["runs"] if x["variant"] == r["variant"] and x["lr"] == r["lr"]]
        n = min(len(x["train"]) for x in runs)
        curve = torch.tensor([x["train"][:n] for x in runs]).mean(0)
        smooth = torch.nn.functional.avg_pool1d(curve[None, None], 10, 1).flatten()
        cpu = torch.tensor([x["cpu"][:n] for x in runs]).mean(0)[9:]
        style = {"baseline": "-", "cause": ":", "fix": "--", "library": "-."}[r["group"]]
        for ax, xs in zip(axes, (torch.arange(9, n), cpu)):
            ax.plot(xs, smooth, style, label=f"{r['variant']} lr={r['lr']:g}")
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("CPU seconds (1 thread)")
    for ax in axes:
        ax.set_ylabel("train loss (10-step mean)")
        ax.set_ylim(2.0, 3.2)
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- probe: K-FAC against the exact natural gradient on a tiny model ----------------------------


def per_token_gradients(model: GPT, x, y, layers: list[nn.Linear], sampled: int,
                        generator) -> dict[nn.Linear, torch.Tensor]:
    """Per-token gradients of each layer's joint ``[W | b]`` (flattened row-major), shape (rows, out·(in+1)).

    ``sampled=0``: of ℓ_t at the data's targets (empirical Fisher); ``k > 0``: of ℓ_t at k targets
    drawn from the model's softmax per token (Monte-Carlo true Fisher).
    """
    logits = model(x)
    logp = torch.log_softmax(logits.reshape(-1, logits.shape[-1]), -1)
    if sampled:
        targets = torch.multinomial(logp.exp().detach(), sampled, replacement=True, generator=generator).T.reshape(-1)
        losses = -logp.repeat(sampled, 1).gather(1, targets[:, None]).squeeze(1)
    else:
        losses = -logp.gather(1, y.reshape(-1, 1)).squeeze(1)
    params = [p for m in layers for p in (m.weight, m.bias)]
    rows: dict[nn.Linear, list[torch.Tensor]] = {m: [] for m in layers}
    for i in range(len(losses)):
        grads = torch.autograd.grad(losses[i], params, retain_graph=i + 1 < len(losses))
        for j, m in enumerate(layers):
            rows[m].append(torch.cat([grads[2 * j], grads[2 * j + 1][:, None]], 1).flatten())
    return {m: torch.stack(r) for m, r in rows.items()}


def exact_natural(u: torch.Tensor, g: torch.Tensor, lams: list[float]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(F + λI)⁻¹ g for F = uᵀu / rows (u: (rows, P)), for each λ, via the eigenpairs of u uᵀ; and F's eigenvalues."""
    u = u.double()
    s, w = torch.linalg.eigh(u @ u.T / u.shape[0])
    s = s.clamp(min=0)
    q = (u.T @ w) / (s * u.shape[0]).clamp(min=1e-300).sqrt()  # F's eigenvectors (P, rows)
    keep = s > s.max() * 1e-12
    q, s = q[:, keep], s[keep]
    coef = q.T @ g.double()
    return [g.double() / lam + q @ (coef * (1 / (s + lam) - 1 / lam)) for lam in lams], s


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() @ b.double()) / (a.double().norm() * b.double().norm()))


def kfac_direction(model: GPT, x, y, damping: float, sampled: bool, sharing: str) -> tuple[dict, list]:
    """One K-FAC step's direction V per hidden Linear ([W | b] flattened) from this batch's own factors; and the
    blocks."""
    model = copy.deepcopy(model)
    opt = kfac_optim.KFAC(model, lr=1.0, momentum=0.0, kl_clip=None, damping=damping, factor_update_steps=1,
                          decomposition_update_steps=1, curvature=kfac_optim.CurvatureConfig(
                              factor_decay=0.0, fisher="sampled" if sampled else "empirical", weight_sharing=sharing))
    logits = model(x)
    if sampled:
        opt.sample_fisher(logits.reshape(-1, logits.shape[-1]), "cross_entropy",
                          generator=torch.Generator().manual_seed(7))
    cross_entropy(logits, y).backward()
    layers = hidden_matrices(model)
    before = {m: torch.cat([m.weight, m.bias[:, None]], 1).detach().clone() for m in layers}
    opt.step()
    out = {i: (before[m] - torch.cat([m.weight, m.bias[:, None]], 1).detach()).flatten() for i, m in enumerate(layers)}
    blocks = [b for b in opt.blocks if b.module in layers]
    factors = [(b.name, b.A.running.clone(), b.G.running.clone()) for b in blocks]
    opt.remove_hooks()
    return out, factors


def probe_part(args) -> dict[str, Any]:
    train_ids, _, vocab = load_corpus(args.chars)
    torch.manual_seed(0)
    t = args.probe_context
    model = GPT(vocab, t, args.probe_width, args.layers, args.heads)
    generator = torch.Generator().manual_seed(1)
    warm = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    for _ in tqdm(range(args.probe_warmup), desc="AdamW warm-up"):  # a realistic point, not the init
        x, y = batch(train_ids, args.batch, t, generator)
        cross_entropy(model(x), y).backward()
        warm.step()
        warm.zero_grad()
    x, y = batch(train_ids, args.probe_batch, t, generator)
    layers = hidden_matrices(model)
    names = [f"blocks.{i}.{n}" for i in range(len(model.blocks)) for n in ("qkv", "proj", "fc", "fc2")]
    model.zero_grad()
    cross_entropy(model(x), y).backward()
    grad = {i: torch.cat([m.weight.grad, m.bias.grad[:, None]], 1).flatten().clone() for i, m in enumerate(layers)}
    model.zero_grad()
    print("per-token gradients (empirical)...")
    emp = per_token_gradients(model, x, y, layers, 0, generator)
    print("per-token gradients (true Fisher, sampled targets)...")
    true = per_token_gradients(model, x, y, layers, args.probe_draws, generator)
    model.zero_grad()
    lam_tok = [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]  # damping in per-token Fisher units
    settings = {  # (K-FAC damping, sampled, sharing, the per-token damping that damping amounts to)
        "default (λ=0.1, emp, expand)": (0.1, False, "expand", 0.1 * t),
        "λ=0.1/T (emp, expand)": (0.1 / t, False, "expand", 0.1),
        "λ=1e-3/T (emp, expand)": (1e-3 / t, False, "expand", 1e-3),
        "reduce (λ=0.1)": (0.1, False, "reduce", 0.1 * t),
        "reduce, λ=0.1/T": (0.1 / t, False, "reduce", 0.1),
        "sampled, λ=0.1·T² (0.1·T/token)": (0.1 * t * t, True, "expand", 0.1 * t),
        "sampled, λ=0.1·T (0.1/token)": (0.1 * t, True, "expand", 0.1),
        "sampled, λ=1e-3·T (1e-3/token)": (1e-3 * t, True, "expand", 1e-3),
    }
    result: dict[str, Any] = {"T": t, "width": args.probe_width, "rows": args.probe_batch * t,
                              "layers": {}, "settings": {}}
    exact = {}
    for i, m in enumerate(layers):
        g = grad[i]
        exact[i] = {}
        for kind, u in (("empirical", emp[m]), ("true", true[m])):
            steps, eig = exact_natural(u, g, lam_tok + [0.1 * t])
            exact[i][kind] = dict(zip(lam_tok + [0.1 * t], steps))
            result["layers"].setdefault(names[i], {})[kind] = {
                "params": g.numel(), "rank": int(eig.numel()), "eig_max": float(eig.max()),
                "eig_mean_over_P": float(eig.sum() / g.numel()),
                "eig_quantiles": [float(q)
                                  for q in torch.quantile(eig, torch.tensor([0.5, 0.9, 0.99], dtype=eig.dtype))],
                "cos_exact_vs_grad": {f"{lam:g}": cosine(s, g) for lam, s in exact[i][kind].items()},
                "cos_true_vs_emp": None}
        result["layers"][names[i]]["cos_exact_true_vs_emp"] = {f"{lam:g}": cosine(exact[i]["true"][lam],
                                                                                  exact[i]["empirical"][lam])
                                                               for lam in lam_tok}
    for label, (damping, sampled, sharing, per_tok) in tqdm(settings.items(), desc="K-FAC settings"):
        directions, factors = kfac_direction(model, x, y, damping, sampled, sharing)
        entry: dict[str, Any] = {"damping": damping, "per_token_damping": per_tok, "layers": {}}
        for i, name in enumerate(names):
            v, g = directions[i], grad[i]
            fisher = "true" if sampled else "empirical"
            entry["layers"][name] = {
                "cos_grad": cosine(v, g),
                "cos_exact_matched": cosine(v, exact[i][fisher][per_tok]),
                "cos_exact_true_matched": cosine(v, exact[i]["true"][per_tok]),
                "cos_exact_true_by_lambda": {f"{lam:g}": cosine(v, exact[i]["true"][lam]) for lam in lam_tok},
                "step_norm": float(v.norm()),
                "exact_norm_matched": float(exact[i][fisher][per_tok].norm() * (1 / t if sampled else t)),
            }
        spectra = {}
        for name, a, gf in factors:
            ea, eg = torch.linalg.eigvalsh(a.double()).clamp(min=0), torch.linalg.eigvalsh(gf.double()).clamp(min=0)
            kron = (eg[:, None] * ea[None, :]).flatten()
            spectra[name] = {"A_eigs": ea.tolist(), "G_eigs": eg.tolist(),
                             # condition numbers: λmax/λmin (λmin clamped at 1e-12·λmax) and λmax/median
                             "A_cond": float(ea.max() / ea.min().clamp(min=1e-12 * ea.max())),
                             "G_cond": float(eg.max() / eg.min().clamp(min=1e-12 * eg.max())),
                             "A_max_over_median": float(ea.max() / ea.median()),
                             "G_max_over_median": float(eg.max() / eg.median()),
                             "A_top1_share": float(ea.max() / ea.sum()), "G_top1_share": float(eg.max() / eg.sum()),
                             "kron_frac_above_damping": float((kron > damping).double().mean()),
                             "kron_max_over_damping": float(kron.max() / damping)}
        entry["factors"] = spectra
        result["settings"][label] = entry
    return result


def print_probe(result: dict[str, Any]) -> None:
    lams = list(next(iter(result["layers"].values()))["true"]["cos_exact_vs_grad"])
    print(f"\nexact natural gradient vs the gradient, cosine per layer (true Fisher; per-token damping {lams})")
    for name, info in result["layers"].items():
        ti = info["true"]
        print(f"  {name:14s} P={ti['params']:5d} eig max {ti['eig_max']:.3g} mean {ti['eig_mean_over_P']:.3g}  "
              + " ".join(f"{c:.2f}" for c in ti["cos_exact_vs_grad"].values()))
    print("\nK-FAC step per layer: cos(V, ∇) | cos(V, exact NG at matched damping)"
          " | cos(V, exact true NG at λ_tok=1e-3)"
          " | frac Kronecker eigs > λ | A cond, G cond | A, G max/median")
    for label, entry in result["settings"].items():
        print(f" {label}  (λ={entry['damping']:g}, per-token {entry['per_token_damping']:g})")
        for name, row in entry["layers"].items():
            f = entry["factors"].get(name)
            extra = (f"{f['kron_frac_above_damping']:.3f} | {f['A_cond']:.1e}, {f['G_cond']:.1e} | "
                     f"{f['A_max_over_median']:.1e}, {f['G_max_over_median']:.1e}" if f else "")
            print(f"   {name:14s} {row['cos_grad']:6.3f} | {row['cos_exact_matched']:6.3f} | "
                  f"{row['cos_exact_true_by_lambda']['0.001']:6.3f} | {extra}")


# -- command line -----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["train", "probe", "check-wrapper", "table"], help="what to run")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    parser.add_argument("--context", type=int, default=64, help="characters per sequence T (default 64)")
    parser.add_argument("--width", type=int, default=64, help="model width d (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--chars", type=int, default=1_000_000, help="characters of stdlib source (default 1e6)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds (default 0 1)")
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run (default all)")
    parser.add_argument("--lrs", type=float, nargs="*", default=None, help="override every chosen variant's lr grid")
    parser.add_argument("--probe-width", type=int, default=32, help="probe model width (default 32)")
    parser.add_argument("--probe-context", type=int, default=32, help="probe T (default 32)")
    parser.add_argument("--probe-batch", type=int, default=8, help="probe sequences: rows = batch·T (default 8)")
    parser.add_argument("--probe-draws", type=int, default=4,
                        help="sampled targets per token for the true Fisher (default 4)")
    parser.add_argument("--probe-warmup", type=int, default=100, help="AdamW steps before probing (default 100)")
    parser.add_argument("--out", type=Path, default=Path("runs/transformer_diagnosis"), help="output folder")
    parser.add_argument("--tag", default="", help="suffix for the output file names")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "train":
        result = train_part(args)
        result["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        rows = best_table(result)
        result["table"] = rows
        path = args.out / f"train{args.tag}.json"
        path.write_text(json.dumps(result))
        print_table(rows)
        plot_train(result, rows, args.out / f"train{args.tag}.png")
        print(f"wrote {path}")
    elif args.part == "table":
        results = [json.loads(path.read_text()) for path in sorted(args.out.glob("train*.json"))]
        rows: dict[str, tuple[dict, dict]] = {}
        for res in results:  # a variant run in several files: the lowest val loss
            for r in res["table"]:
                if r["variant"] not in rows or r["val"] < rows[r["variant"]][0]["val"]:
                    rows[r["variant"]] = (r, res)
        budget = rows["adamw"][0]["cpu_s"] if "adamw" in rows else None
        print_table([r for r, _ in rows.values()])
        merged = {"runs": [x for name, (_, res) in rows.items() for x in res["runs"] if x["variant"] == name]}
        finite = [r for r, _ in rows.values() if r["val"] < 4]  # diverged runs stay in the table, not the plot
        plot_train(merged, finite, args.out / "train_all.png")
        print(f"wrote {args.out / 'train_all.png'}")
        if budget:
            print(f"\ntrain loss (20-step mean) at AdamW's CPU time ({budget:.1f} s) and step at which each reaches "
                  f"AdamW's final train loss ({rows['adamw'][0]['train_last20']:.3f})")
            target = rows["adamw"][0]["train_last20"]
            for name, (r, res) in rows.items():
                run = next(x for x in res["runs"] if x["variant"] == name and x["lr"] == r["lr"])
                k = next((i for i, c in enumerate(run["cpu"]) if c >= budget), len(run["cpu"]) - 1)
                at = sum(run["train"][max(0, k - 19): k + 1]) / len(run["train"][max(0, k - 19): k + 1])
                smooth = [sum(run["train"][max(0, i - 19): i + 1]) / len(run["train"][max(0, i - 19): i + 1])
                          for i in range(len(run["train"]))]
                hit = next((i for i, v in enumerate(smooth) if v <= target), None)
                when = "-" if hit is None else f"{run['cpu'][hit]:.1f} s"
                print(f"  {name:22s} {at:.3f} (step {k})   reaches it at step {hit}, {when}")
    elif args.part == "probe":
        result = probe_part(args)
        path = args.out / f"probe{args.tag}.json"
        path.write_text(json.dumps(result))
        print_probe(result)
        print(f"wrote {path}")
    else:  # check-wrapper: the direction-oracle rule "clip" against KFAC's own clip and momentum
        data = load_corpus(args.chars)
        losses = []
        for own in (True, False):
            torch.manual_seed(0)
            model = GPT(data[2], args.context, args.width, args.layers, args.heads)
            if own:
                opt = kfac_optim.KFAC(model, lr=0.1, momentum=0.9, damping=0.1, kl_clip=1e-3, factor_update_steps=1,
                                      decomposition_update_steps=10)
                sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: schedule(t, args.steps))

                def step(x, y, factor):
                    loss = cross_entropy(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    sched.step()
                    return loss.item()
            else:
                step = KFACRunner(model, 0.1, "clip", 1e-3, False, damping=0.1, decomposition_update_steps=10).step
            generator = torch.Generator().manual_seed(1000)
            losses.append([step(*batch(data[0], args.batch, args.context, generator), schedule(t, args.steps))
                           for t in range(args.steps)])
        diff = max(abs(a - b) for a, b in zip(*losses))
        print(f"KFAC itself: final {losses[0][-1]:.5f}; direction oracle + rule 'clip': {losses[1][-1]:.5f}; "
              f"max |Δ loss| over {args.steps} steps: {diff:.2e}")


if __name__ == "__main__":
    main()
