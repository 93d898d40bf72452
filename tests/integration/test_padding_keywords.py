"""Padding with no user code: a model called with Hugging Face's ``attention_mask=`` keyword (1 =
real token, 0 = pad, ``(B, T)``) gives K-FAC the real positions as ``KFAC.mask`` would
(docs/numerics.md, "Padding"), in a plain loop, under reentrant activation checkpointing, inside
``transformers.Trainer`` and inside an ``accelerate`` loop.

Each test pads the same three sequences (5, 2 and 4 real tokens) to two lengths, 8 and 16 (right
padding, and left padding where the model's positions are relative: Llama's RoPE), and compares
the two runs: every block's running factors and the parameters after one step, in float64, to
1e-9 of each tensor's largest entry (a different padding changes only the order of float sums;
1e-6 for left padding, see the test). The real
transformers models are tiny random-init configs; the tests skip when transformers is missing.
GPT-2's attention and MLP are ``transformers.pytorch_utils.Conv1D`` (no K-FAC block here): its
covered blocks are the tied ``wte``/``lm_head``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kfac_optim import KFAC, CurvatureConfig
from tests.helpers import running_factors

LENGTHS = (5, 2, 4)
VOCABULARY = 64


def tiny_transformer(kind: str) -> nn.Module:
    """A tiny random-init transformers model of ``kind`` ("gpt2", "llama", "bert"), float64, eval
    mode (no dropout), PyTorch SDPA attention, seeded."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCABULARY, n_positions=64)
        model = transformers.GPT2LMHeadModel(config)
    elif kind == "llama":
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCABULARY,
                                          max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, vocab_size=VOCABULARY, max_position_embeddings=64)
        model = transformers.BertForMaskedLM(config)
    model.config._attn_implementation = "sdpa"  # eager attention gives nan at fully padded queries (left padding)
    return model.double().eval()


def padded_batch(length: int, side: str = "right") -> dict[str, torch.Tensor]:
    """The three sequences padded with token 0 to ``length`` on ``side``: ``input_ids``,
    ``attention_mask`` (1 at real tokens) and ``labels`` (the tokens, -100 at pads and at each
    sequence's first token, which a causal model would predict from a pad when left-padded)."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.zeros(len(LENGTHS), length, dtype=torch.long)
    mask = torch.zeros(len(LENGTHS), length, dtype=torch.long)
    labels = torch.full((len(LENGTHS), length), -100)
    for n, real in enumerate(LENGTHS):
        start = 0 if side == "right" else length - real
        ids[n, start : start + real] = torch.randint(1, VOCABULARY, (real,), generator=generator)
        mask[n, start : start + real] = 1
        labels[n, start + 1 : start + real] = ids[n, start + 1 : start + real]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def padding_kfac(model: nn.Module) -> KFAC:
    """K-FAC folding and decomposing every step, float64 factors, no KL clip."""
    curvature = CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64)
    return KFAC(model, lr=0.1, damping=0.1, kl_clip=None, factor_update_steps=1, decomposition_update_steps=1,
                curvature=curvature)


def hf_padded_step(kind: str, batch: dict[str, torch.Tensor], checkpointing: bool = False) -> dict[str, torch.Tensor]:
    """One K-FAC step on ``batch``: the running factors and the parameters after it, by name."""
    model = tiny_transformer(kind)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.train()  # transformers checkpoints in training mode only; the configs' dropout is made 0 below
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
    optimizer = padding_kfac(model)
    model(**batch).loss.backward()
    optimizer.step()
    return {**running_factors(optimizer), **{n: p.detach().clone() for n, p in model.named_parameters()}}


def assert_same_factors_and_step(short: dict[str, torch.Tensor], long: dict[str, torch.Tensor],
                                 rtol: float = 1e-9) -> None:
    """Every factor equal to ``rtol`` of its own largest entry, every parameter to ``rtol`` (a key
    bias, whose gradient is zero but for rounding, holds values of 1e-21)."""
    assert short.keys() == long.keys()
    for name in short:
        scale = float(long[name].abs().max()) if name.endswith((".A", ".G")) else 1.0
        torch.testing.assert_close(short[name], long[name], rtol=rtol, atol=rtol * scale, msg=name)


@pytest.mark.parametrize(("kind", "side"), [("gpt2", "right"), ("llama", "right"), ("llama", "left"),
                                            ("bert", "right")])
def test_an_attention_mask_keyword_gives_the_same_factors_and_step_at_any_padding(kind: str, side: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        short, long = (hf_padded_step(kind, padded_batch(length, side)) for length in (8, 16))
    # a position table broadcast over the batch (GPT-2's wpe, BERT's position embeddings) is batch-free, not unmasked
    assert not [w for w in caught if "padding mask" in str(w.message)]
    # Left padding moves the real tokens to other absolute positions, whose rotary angles transformers
    # computes in float32: the model's own logits and gradients differ by ~1e-8 relative between the
    # two paddings, 1.2e-7 of the largest entry in layer 1's q/k G (counting the pads changed A by 33-68%)
    assert_same_factors_and_step(short, long, rtol=1e-9 if side == "right" else 1e-6)


def test_the_attention_mask_travels_with_a_forward_recomputed_by_reentrant_checkpointing() -> None:
    short, long = (hf_padded_step("llama", padded_batch(length), checkpointing=True) for length in (8, 16))
    assert_same_factors_and_step(short, long)


class PaddedSequences(torch.utils.data.Dataset):
    """The three sequences unpadded, as a tokenizer gives them (the collator pads)."""

    def __init__(self) -> None:
        batch = padded_batch(max(LENGTHS))
        self.items = [batch["input_ids"][n, :real] for n, real in enumerate(LENGTHS)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[index]}


def pad_to(length: int) -> Any:
    """A collate function padding a list of ``{"input_ids": (T,)}`` on the right to ``length``."""
    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        ids = torch.zeros(len(items), length, dtype=torch.long)
        mask = torch.zeros(len(items), length, dtype=torch.long)
        for n, item in enumerate(items):
            ids[n, : len(item["input_ids"])] = item["input_ids"]
            mask[n, : len(item["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    return collate


def trainer_step(length: int, root: Path) -> dict[str, torch.Tensor]:
    """One step of ``transformers.Trainer`` with ``KFAC`` on Llama, batches padded to ``length``."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = tiny_transformer("llama")
    optimizer = padding_kfac(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    args = transformers.TrainingArguments(
        output_dir=str(root / str(length)), per_device_train_batch_size=len(LENGTHS), max_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0, logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=PaddedSequences(),
                                   data_collator=pad_to(length), optimizers=(optimizer, scheduler))
    trainer.train()
    assert optimizer.steps == 1
    return {**running_factors(optimizer), **{n: p.detach().clone() for n, p in model.named_parameters()}}


def test_inside_the_hf_trainer_padding_changes_neither_factors_nor_step(tmp_path: Path) -> None:
    assert_same_factors_and_step(trainer_step(8, tmp_path), trainer_step(16, tmp_path))


def accelerate_step(length: int) -> dict[str, torch.Tensor]:
    """One step of an ``accelerate`` loop (prepare, ``accelerator.backward``) with ``KFAC`` on BERT."""
    accelerate = pytest.importorskip("accelerate")
    model = tiny_transformer("bert")
    accelerator = accelerate.Accelerator(cpu=True)
    loader = torch.utils.data.DataLoader(PaddedSequences(), batch_size=len(LENGTHS), collate_fn=pad_to(length))
    optimizer = padding_kfac(model)
    model, prepared, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        prepared.zero_grad()
        accelerator.backward(model(**batch).loss)
        prepared.step()
    assert optimizer.steps == 1
    return {**running_factors(optimizer), **{n: p.detach().clone() for n, p in model.named_parameters()}}


def test_inside_an_accelerate_loop_padding_changes_neither_factors_nor_step() -> None:
    assert_same_factors_and_step(accelerate_step(8), accelerate_step(16))


class CheckpointedTagger(nn.Module):
    """Embedding → (Linear → tanh, under reentrant activation checkpointing) → Linear per token, float64."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embedding = nn.Embedding(VOCABULARY, 4).double()
        self.hidden, self.head = nn.Linear(4, 6).double(), nn.Linear(6, 3).double()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(lambda e: torch.tanh(self.hidden(e)), self.embedding(input_ids),
                                              use_reentrant=True)
        return self.head(h)


def test_a_kfac_mask_travels_with_a_forward_recomputed_after_the_with() -> None:
    runs = []
    for length in (8, 16):
        model = CheckpointedTagger()
        optimizer = padding_kfac(model)
        batch = padded_batch(length)
        with optimizer.mask(batch["attention_mask"]):
            logits = model(batch["input_ids"])
        labels = batch["labels"].clamp(max=2).masked_fill(batch["labels"] == -100, -100)
        torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100).backward()  # recomputes
        optimizer.step()
        runs.append({**running_factors(optimizer), **{n: p.detach().clone() for n, p in model.named_parameters()}})
    assert_same_factors_and_step(*runs)
