"""One N per backward, taken from the model's call (docs/numerics.md, "What N is"): N is what the
loss averages over, the same for every layer, not each layer's dim 0.

Each test lays the same data out two ways, the plain one (a batch of sequences ``(N, T)``, one
forward) and the one under test (tokens flattened to ``(N·T, D)`` inside the model, a submodule run
on chunks, sequences packed into one row with ``position_ids`` restarts or cumulative lengths, a
recurrence carried in a dataclass or a Hugging Face cache across calls), and checks that both
give K-FAC the factors of a dense reference built here from per-sample gradients:
``A = (1/R) Σ [a 1][a 1]ᵀ`` over the real rows, ``G = (1/N) Σ_n Σ_rows ĝ ĝᵀ`` with ``ĝ`` the
gradient of sample n's share ``N·ℓ_n`` of the loss (float64, rtol 1e-10).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC, CurvatureConfig
from tests.helpers import running_factors

CLASSES = 3


def sample_kfac(model: nn.Module) -> KFAC:
    """K-FAC folding every step, float64 factors (the first fold is the batch's factors)."""
    curvature = CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64)
    return KFAC(model, lr=0.1, damping=0.1, kl_clip=None, factor_update_steps=1, decomposition_update_steps=1,
                curvature=curvature)


def per_sample_reference(layers: dict[str, nn.Linear], run: callable, samples: int) -> dict[str, torch.Tensor]:
    """The dense expand factors of the Linear ``layers`` from per-sample gradients: ``run(n)`` runs
    sample n alone and returns its share of the loss, ``N·ℓ_n`` (the loss is ``(1/N) Σ_n N·ℓ_n``);
    the layers' inputs and outputs are caught with forward hooks."""
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in layers}
    grads: dict[str, list[torch.Tensor]] = {name: [] for name in layers}
    for n in range(samples):
        seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {name: [] for name in layers}
        handles = [layer.register_forward_hook(
                       lambda m, i, o, name=name, seen=seen: seen[name].append((i[0].detach(), o)))
                   for name, layer in layers.items()]
        share = run(n)
        for handle in handles:
            handle.remove()
        outputs = [o for name in layers for _, o in seen[name]]
        sample_grads = iter(torch.autograd.grad(share, outputs))
        for name in layers:
            for a, _ in seen[name]:
                rows[name].append(a.reshape(-1, a.shape[-1]))
                grads[name].append(next(sample_grads).reshape(-1, layers[name].out_features))
    reference = {}
    for name in layers:
        a = torch.cat(rows[name])
        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
        g = torch.cat(grads[name])
        reference[f"{name}.A"], reference[f"{name}.G"] = a.T @ a / a.shape[0], g.T @ g / samples
    return reference


def assert_factors(optimizer: KFAC, reference: dict[str, torch.Tensor]) -> None:
    factors = running_factors(optimizer)
    for name, expected in reference.items():
        torch.testing.assert_close(factors[name], expected, rtol=1e-10, atol=1e-13, msg=name)


# -- tokens flattened inside the model -----------------------------------------------------------


class FlatTokens(nn.Module):
    """``(N, T, 4)`` → ``inp`` per token → ``ff`` on the tokens flattened to ``(N·T, 6)`` (as a
    mixture-of-experts block does) or per position → ``head`` per token, float64."""

    def __init__(self, flatten: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp, self.ff, self.head = (nn.Linear(4, 6).double(), nn.Linear(6, 6).double(),
                                        nn.Linear(6, CLASSES).double())
        self.flatten = flatten

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = self.ff(h.reshape(-1, h.shape[-1])).reshape(h.shape) if self.flatten else self.ff(h)
        return self.head(torch.tanh(h))


def flat_token_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    return torch.randn(5, 7, 4, generator=generator, dtype=torch.float64), torch.randint(0, CLASSES, (5, 7),
                                                                                         generator=generator)


@pytest.mark.parametrize("flatten", [False, True])
def test_a_linear_fed_flattened_tokens_counts_the_models_samples(flatten: bool) -> None:
    x, y = flat_token_batch()
    model = FlatTokens(flatten)
    layers = {"inp": model.inp, "ff": model.ff, "head": model.head}

    def share(n: int) -> torch.Tensor:  # the mean over all N·T tokens is (1/N) Σ_n (sample n's token mean)
        return F.cross_entropy(model(x[n : n + 1]).reshape(-1, CLASSES), y[n])

    reference = per_sample_reference(layers, share, x.shape[0])
    optimizer = sample_kfac(model)
    F.cross_entropy(model(x).reshape(-1, CLASSES), y.reshape(-1)).backward()
    optimizer.step()
    assert_factors(optimizer, reference)


# -- a submodule run on chunks ------------------------------------------------------------------


class ChunkedEncoder(nn.Module):
    """``head(encoder(x))`` with ``encoder = Linear → tanh`` run on the batch in ``chunks`` (None: whole)."""

    def __init__(self, chunks: list[int] | None) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.encoder = nn.Sequential(nn.Linear(4, 6).double(), nn.Tanh())
        self.head = nn.Linear(6, CLASSES).double()
        self.chunks = chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunks is None:
            return self.head(self.encoder(x))
        return self.head(torch.cat([self.encoder(c) for c in x.split(self.chunks)]))


@pytest.mark.parametrize("chunks", [None, [4, 4], [6, 2]])
def test_a_submodule_run_on_chunks_within_the_models_call_counts_the_models_samples(chunks: list[int] | None) -> None:
    generator = torch.Generator().manual_seed(6)
    x, y = torch.randn(8, 4, generator=generator, dtype=torch.float64), torch.randint(0, CLASSES, (8,),
                                                                                      generator=generator)
    model = ChunkedEncoder(None)  # the reference runs one sample at a time: no chunks
    layers = {"encoder.0": model.encoder[0], "head": model.head}
    reference = per_sample_reference(layers, lambda n: F.cross_entropy(model(x[n : n + 1]), y[n : n + 1]), 8)
    model.chunks = chunks
    optimizer = sample_kfac(model)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    assert_factors(optimizer, reference)


def test_submodules_called_outside_the_model_take_the_count_stated_with_samples() -> None:
    generator = torch.Generator().manual_seed(6)
    x, y = torch.randn(8, 4, generator=generator, dtype=torch.float64), torch.randint(0, CLASSES, (8,),
                                                                                      generator=generator)
    model = ChunkedEncoder(None)
    layers = {"encoder.0": model.encoder[0], "head": model.head}
    reference = per_sample_reference(layers, lambda n: F.cross_entropy(model(x[n : n + 1]), y[n : n + 1]), 8)
    optimizer = sample_kfac(model)
    with optimizer.samples(8):
        logits = model.head(torch.cat([model.encoder(c) for c in x.split([6, 2])]))
    F.cross_entropy(logits, y).backward()
    optimizer.step()
    assert_factors(optimizer, reference)
    with pytest.raises(ValueError, match="count"):
        with optimizer.samples(0):
            pass


# -- packed sequences ---------------------------------------------------------------------------

SEQUENCES = (5, 2, 4, 3)


class PositionTagger(nn.Module):
    """Token and position embeddings → Linear → tanh → Linear per token; a packing-aware model
    (no interaction between positions) called as Hugging Face models are."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.tokens, self.positions = nn.Embedding(11, 4).double(), nn.Embedding(8, 4).double()
        self.hidden, self.head = nn.Linear(4, 6).double(), nn.Linear(6, CLASSES).double()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, **packing: torch.Tensor) -> torch.Tensor:
        h = self.tokens(input_ids) + self.positions(position_ids)
        return self.head(torch.tanh(self.hidden(h)))


def sequences() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(8)
    return [(torch.randint(1, 11, (n,), generator=generator), torch.randint(0, CLASSES, (n,), generator=generator))
            for n in SEQUENCES]


def padded_layout() -> dict[str, torch.Tensor]:
    """The sequences as a padded batch ``(4, 5)`` with ``attention_mask`` (labels -100 at pads)."""
    ids, labels = torch.zeros(4, 5, dtype=torch.long), torch.full((4, 5), -100)
    for n, (tokens, tags) in enumerate(sequences()):
        ids[n, : len(tokens)], labels[n, : len(tokens)] = tokens, tags
    return {"input_ids": ids, "position_ids": torch.arange(5).expand(4, 5), "attention_mask": labels != -100,
            "labels": labels}


def packed_layout(cumulative: bool) -> dict[str, torch.Tensor]:
    """The sequences packed into one row ``(1, 14)`` with ``position_ids`` restarting at each (and
    ``cu_seq_lens_q`` when ``cumulative``), as ``DataCollatorWithFlattening`` gives them."""
    pairs = sequences()
    batch = {"input_ids": torch.cat([t for t, _ in pairs])[None],
             "position_ids": torch.cat([torch.arange(len(t)) for t, _ in pairs])[None],
             "labels": torch.cat([tags for _, tags in pairs])[None]}
    if cumulative:
        batch["cu_seq_lens_q"] = torch.tensor([0, *torch.tensor(SEQUENCES).cumsum(0).tolist()])
    return batch


def packed_tagger_reference(model: PositionTagger) -> dict[str, torch.Tensor]:
    """Per-sample factors: sample n's share of the mean over all R real tokens is ``(N/R) Σ_t ℓ_t``."""
    pairs, real = sequences(), sum(SEQUENCES)

    def share(n: int) -> torch.Tensor:
        tokens, tags = pairs[n]
        logits = model(tokens[None], torch.arange(len(tokens))[None])
        return F.cross_entropy(logits[0], tags, reduction="sum") * len(pairs) / real

    return per_sample_reference({"hidden": model.hidden, "head": model.head}, share, len(pairs))


@pytest.mark.parametrize("layout", ["padded", "packed", "packed_cumulative"])
def test_packed_sequences_count_their_sequences(layout: str) -> None:
    model = PositionTagger()
    reference = packed_tagger_reference(model)
    optimizer = sample_kfac(model)
    batch = padded_layout() if layout == "padded" else packed_layout(layout == "packed_cumulative")
    labels = batch.pop("labels")
    logits = model(**batch)
    F.cross_entropy(logits.reshape(-1, CLASSES), labels.reshape(-1), ignore_index=-100).backward()
    assert {b.pending_samples for b in optimizer.blocks} == {len(SEQUENCES)}
    optimizer.step()
    assert_factors(optimizer, reference)


# -- recurrences carried in a dataclass or a cache object --------------------------------------


@dataclasses.dataclass
class CellState:
    hidden: torch.Tensor


class StateCell(nn.Module):
    """One step of an RNN whose state travels in a dataclass: ``(x_t, state) → (logits, state)``;
    ``steps`` (the plain layout) runs every step inside one call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(9)
        self.inp, self.rec, self.out = (nn.Linear(4, 5).double(), nn.Linear(5, 5).double(),
                                        nn.Linear(5, CLASSES).double())

    def step(self, x: torch.Tensor, state: CellState) -> tuple[torch.Tensor, CellState]:
        hidden = torch.tanh(self.inp(x) + self.rec(state.hidden))
        return self.out(hidden), CellState(hidden)

    def forward(self, x: torch.Tensor, state: CellState | None = None) -> tuple[torch.Tensor, CellState]:
        if state is not None:
            return self.step(x, state)
        state, logits = CellState(torch.zeros(x.shape[0], 5, dtype=x.dtype)), []
        for t in range(x.shape[1]):
            out, state = self.step(x[:, t], state)
            logits.append(out)
        return torch.stack(logits, 1), state


@pytest.mark.parametrize("per_call", [False, True])
def test_a_recurrence_carried_in_a_dataclass_counts_its_samples_once(per_call: bool) -> None:
    x, y = flat_token_batch()
    model = StateCell()
    layers = {"inp": model.inp, "rec": model.rec, "out": model.out}

    def share(n: int) -> torch.Tensor:
        return F.cross_entropy(model(x[n : n + 1])[0][0], y[n])

    reference = per_sample_reference(layers, share, x.shape[0])
    optimizer = sample_kfac(model)
    if per_call:  # the model called step by step, the state handed back in a dataclass
        state, outputs = CellState(torch.zeros(x.shape[0], 5, dtype=x.dtype)), []
        for t in range(x.shape[1]):
            out, state = model(x[:, t], state)
            outputs.append(out)
        logits = torch.stack(outputs, 1)
    else:
        logits = model(x)[0]
    F.cross_entropy(logits.reshape(-1, CLASSES), y.reshape(-1)).backward()
    optimizer.step()
    assert_factors(optimizer, reference)


def test_a_llama_run_in_segments_through_its_cache_gives_the_factors_of_one_call() -> None:
    transformers = pytest.importorskip("transformers")

    def llama() -> nn.Module:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                                          max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(config).double().eval()
        model.config._attn_implementation = "sdpa"
        return model

    ids = torch.randint(1, 64, (3, 8), generator=torch.Generator().manual_seed(10))
    factors = []
    for segments in (1, 2):
        model = llama()
        optimizer = sample_kfac(model)
        if segments == 1:
            logits = model(input_ids=ids).logits
        else:  # the second half reads the first half's keys and values from the DynamicCache
            first = model(input_ids=ids[:, :4], use_cache=True)
            cache = {"cache": first["cache"]} if "cache" in first else {"past_key_values": first["past_key_values"]}
            second = model(input_ids=ids[:, 4:], use_cache=True, **cache)  # transformers >= 5.2x spells it "cache"
            logits = torch.cat([first.logits, second.logits], 1)
        F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
        assert {b.pending_samples for b in optimizer.blocks} == {3}
        optimizer.step()
        factors.append(running_factors(optimizer))
    for name, plain in factors[0].items():
        torch.testing.assert_close(factors[1][name], plain, rtol=1e-9, atol=1e-9 * float(plain.abs().max()), msg=name)


# -- the sampled Fisher under a mask ------------------------------------------------------------


def padded_to(length: int) -> dict[str, torch.Tensor]:
    """:func:`padded_layout`'s sequences padded to ``length`` (positions 0.. at every row)."""
    batch = padded_layout()
    extra = length - batch["input_ids"].shape[1]
    return {"input_ids": F.pad(batch["input_ids"], (0, extra)), "position_ids": torch.arange(length).expand(4, length),
            "attention_mask": F.pad(batch["attention_mask"], (0, extra))}


@pytest.mark.parametrize("masked_by", ["attention_mask", "KFAC.mask"])
def test_the_sampled_fisher_under_a_mask_draws_at_the_real_positions_in_the_units_of_the_real_tokens(
    masked_by: str,
) -> None:
    model = PositionTagger()
    pairs, real = sequences(), sum(SEQUENCES)
    with torch.no_grad():  # the draws, made by hand: one per real position, in row-major order
        logits = torch.cat([model(t[None], torch.arange(len(t))[None])[0] for t, _ in pairs])
        draws = torch.multinomial(torch.softmax(logits, 1), 1, generator=torch.Generator().manual_seed(11))[:, 0]
    drawn = draws.split(list(SEQUENCES))

    def share(n: int) -> torch.Tensor:  # sample n's loss at its draws, in the units of the mean over R real tokens
        tokens, _ = pairs[n]
        return F.cross_entropy(model(tokens[None], torch.arange(len(tokens))[None])[0], drawn[n],
                               reduction="sum") * len(pairs) / real

    reference = per_sample_reference({"hidden": model.hidden, "head": model.head}, share, len(pairs))
    for length in (5, 8):
        twin = copy.deepcopy(model)
        optimizer = KFAC(twin, lr=0.1, damping=0.1, kl_clip=None, factor_update_steps=1, decomposition_update_steps=1,
                         curvature=CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64,
                                                   fisher="sampled"))
        batch = padded_to(length)
        if masked_by == "attention_mask":
            out = twin(**batch)
        else:  # sample_fisher runs after the with: the model's call keeps the mask
            with optimizer.mask(batch.pop("attention_mask")):
                out = twin(**batch)
        optimizer.sample_fisher(out, "cross_entropy", generator=torch.Generator().manual_seed(11))
        out.sum().backward()  # any training loss: the sampled Fisher's statistics are recorded already
        optimizer.step()
        factors = running_factors(optimizer)
        for name, expected in reference.items():
            torch.testing.assert_close(factors[name], expected, rtol=1e-10, atol=1e-13, msg=f"{length}: {name}")


class ListInput(nn.Module):
    """A model called with a list of tensors (no tensor argument of its own), as detection models are."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3).double()

    def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
        return self.layer(torch.stack(images))


def test_a_call_that_does_not_tell_its_samples_counts_the_layers_dim_0_and_warns_once_naming_the_layer() -> None:
    model = ListInput()
    optimizer = sample_kfac(model)
    images = list(torch.randn(6, 4, dtype=torch.float64))
    with pytest.warns(RuntimeWarning, match="'layer' counts its samples N from dim 0 of its own input.*samples"):
        model(images).square().mean().backward()
    assert optimizer.blocks[0].pending_samples == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        model(images).square().mean().backward()


def test_position_ids_broadcast_over_the_batch_are_not_taken_for_packing() -> None:
    model = PositionTagger()
    optimizer = sample_kfac(model)
    batch = padded_layout()
    model(batch["input_ids"], position_ids=torch.arange(5)[None]).sum().backward()  # ids (1, T) for a batch of 4
    assert optimizer.blocks[2].name == "hidden" and optimizer.blocks[2].pending_samples == 4
