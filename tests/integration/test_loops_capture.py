"""Training loops, capture side: chunked forwards, padding masks, batch-free inputs of
every block kind, eval-mode training, torch.func loops, lazy modules and nested jagged inputs.

Each test compares K-FAC's factors with a dense reference from first principles (per-layer input
rows and output-gradients of the mean loss, ``A = (1/R) Σ [a 1][a 1]ᵀ``, ``G = N Σ g gᵀ``) or
with a control run.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC, CurvatureConfig
from tests.helpers import running_factors


def loop_kfac(model: nn.Module, weight_sharing: str = "expand") -> KFAC:
    """K-FAC folding and decomposing every step, in float64, without the KL clip."""
    curvature = CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64, factor_decay=0.5,
                                weight_sharing=weight_sharing)
    return KFAC(model, lr=0.1, damping=0.1, kl_clip=None, factor_update_steps=1, decomposition_update_steps=1,
                curvature=curvature)


def dense_linear_factors(inputs: list[torch.Tensor], grads: list[torch.Tensor],
                         samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``A = (1/R) Σ [a 1][a 1]ᵀ`` over every row of ``inputs`` and ``G = N Σ g gᵀ`` over every row of
    ``grads`` (output-gradients of a mean loss over N = ``samples``): the expand convention."""
    a = torch.cat([x.reshape(-1, x.shape[-1]) for x in inputs])
    a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
    g = torch.cat([t.reshape(-1, t.shape[-1]) for t in grads])
    return a.T @ a / a.shape[0], samples * g.T @ g


class TwoLinear(nn.Module):
    """``l2(tanh(l1(x)))``, float64."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.l1 = nn.Linear(5, width).double()
        self.l2 = nn.Linear(width, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


def two_linear_reference(model: TwoLinear, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The dense expand factors of ``model`` on one batch ``(x, y)`` under the mean cross-entropy,
    from the layers' inputs and output-gradients (call it before a KFAC hooks the model)."""
    h1 = model.l1(x)
    z = torch.tanh(h1)
    h2 = model.l2(z)
    g1, g2 = torch.autograd.grad(F.cross_entropy(h2, y), [h1, h2])
    reference = {}
    for name, a, g in (("l1", x, g1), ("l2", z.detach(), g2)):
        reference[f"{name}.A"], reference[f"{name}.G"] = dense_linear_factors([a], [g], x.shape[0])
    return reference


# -- 1. chunked forwards --------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [(16, 16), (24, 8)])
def test_a_batch_run_through_the_model_in_chunks_counts_every_chunks_samples(sizes: tuple[int, int]) -> None:
    torch.manual_seed(0)
    model = TwoLinear()
    x, y = torch.randn(32, 5, dtype=torch.float64), torch.randint(0, 3, (32,))
    reference = two_linear_reference(model, x, y)
    optimizer = loop_kfac(model)
    F.cross_entropy(torch.cat([model(c) for c in x.split(list(sizes))]), y).backward()
    assert [b.pending_samples for b in optimizer.blocks] == [32, 32]
    optimizer.step()
    for name, factor in running_factors(optimizer).items():
        torch.testing.assert_close(factor, reference[name], rtol=1e-10, atol=1e-12, msg=name)


class TiedCellRNN(nn.Module):
    """An RNN over T steps of ``(N, T, 5)``: ``h ← tanh(inp(x_t) + rec(h))``, then ``out(h)``, float64."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 4).double()
        self.rec = nn.Linear(4, 4).double()
        self.out = nn.Linear(4, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 4, dtype=x.dtype)
        for t in range(x.shape[1]):
            h = torch.tanh(self.inp(x[:, t]) + self.rec(h))
        return self.out(h)


def test_an_rnn_cell_over_time_steps_counts_its_samples_once_per_forward() -> None:
    """The cell's T calls are uses of one weight by the same N samples (weight sharing, expand):
    ``A`` over all N·T rows, ``G = N Σ g gᵀ`` over them, N counted once; chunking the batch
    through the model still counts every chunk's samples."""
    torch.manual_seed(1)
    model = TiedCellRNN()
    x, y = torch.randn(6, 3, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    inputs: dict[str, list[torch.Tensor]] = {"inp": [], "rec": []}
    outputs: dict[str, list[torch.Tensor]] = {"inp": [], "rec": []}
    h = torch.zeros(6, 4, dtype=torch.float64)
    for t in range(3):
        inputs["inp"].append(x[:, t])
        inputs["rec"].append(h.detach())
        outputs["inp"].append(model.inp(x[:, t]))
        outputs["rec"].append(model.rec(h))
        h = torch.tanh(outputs["inp"][-1] + outputs["rec"][-1])
    logits = model.out(h)
    grads = torch.autograd.grad(F.cross_entropy(logits, y), [*outputs["inp"], *outputs["rec"], logits])
    reference = {}
    for name, a, g in (("inp", inputs["inp"], grads[:3]), ("rec", inputs["rec"], grads[3:6]),
                       ("out", [h.detach()], grads[6:])):
        reference[f"{name}.A"], reference[f"{name}.G"] = dense_linear_factors(a, list(g), 6)
    optimizer = loop_kfac(model)
    F.cross_entropy(torch.cat([model(c) for c in x.split(3)]), y).backward()  # chunks of the batch
    assert [b.pending_samples for b in optimizer.blocks] == [6, 6, 6]
    optimizer.step()
    for name, factor in running_factors(optimizer).items():
        torch.testing.assert_close(factor, reference[name], rtol=1e-10, atol=1e-12, msg=name)


def test_a_model_run_step_by_step_on_its_own_output_counts_its_samples_once() -> None:
    """A recurrence run call by call on the model KFAC was given (``h ← cell(h)``): each call's
    input is computed from the previous call's output, so the calls hold the same samples."""
    torch.manual_seed(2)
    cell = nn.Linear(4, 4).double()
    optimizer = loop_kfac(cell)
    h = torch.randn(5, 4, dtype=torch.float64)
    for _ in range(3):
        h = torch.tanh(cell(h))
    h.square().mean().backward()
    assert optimizer.blocks[0].pending_samples == 5


# -- 2. padding ------------------------------------------------------------------------------------


class TokenTagger(nn.Module):
    """Embedding → Linear → tanh → Linear per position: ``(N, T)`` tokens to ``(N, T, 3)`` logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(11, 4).double()
        self.hidden = nn.Linear(4, 6).double()
        self.head = nn.Linear(6, 3).double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embedding(tokens))))


def padded_tokens(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three sequences of lengths 5, 2 and 4, padded with token 0 to ``length``: ``(tokens, labels
    (-100 at padding), mask (True at real positions))``."""
    generator = torch.Generator().manual_seed(3)
    lengths = (5, 2, 4)
    tokens = torch.zeros(3, length, dtype=torch.long)
    labels = torch.full((3, length), -100)
    for n, real in enumerate(lengths):
        tokens[n, :real] = torch.randint(1, 11, (real,), generator=generator)
        labels[n, :real] = torch.randint(0, 3, (real,), generator=generator)
    return tokens, labels, labels != -100


def tagger_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean over sequences of each sequence's mean token cross-entropy over its real positions."""
    per_token = F.cross_entropy(model(tokens).transpose(1, 2), labels, ignore_index=-100, reduction="none")
    real = (labels != -100).sum(1)
    return (per_token.sum(1) / real).mean()


def tagger_reference(model: TokenTagger, weight_sharing: str) -> dict[str, torch.Tensor]:
    """The dense factors over the real positions only (the sequences unpadded, one by one)."""
    tokens, labels, mask = padded_tokens(5)
    rows: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"hidden": [], "head": []}
    embedding_rows: list[tuple[torch.Tensor, torch.Tensor]] = []
    for n in range(3):
        real = int(mask[n].sum())
        e = model.embedding(tokens[n : n + 1, :real])
        h = model.hidden(e)
        z = torch.tanh(h)
        logits = model.head(z)
        loss = F.cross_entropy(logits[0], labels[n, :real]) / 3  # this sequence's share of the mean
        ge, gh, gl = torch.autograd.grad(loss, [e, h, logits])
        embedding_rows.append((tokens[n, :real], ge[0]))
        rows["hidden"].append((e[0].detach(), gh[0]))
        rows["head"].append((z[0].detach(), gl[0]))
    reference = {}
    for name, pairs in rows.items():
        if weight_sharing == "expand":
            reference[f"{name}.A"], reference[f"{name}.G"] = dense_linear_factors(
                [a for a, _ in pairs], [g for _, g in pairs], 3)
        else:  # one row per sequence: the mean input over its real positions, the summed gradient
            a = torch.stack([a.mean(0) for a, _ in pairs])
            g = torch.stack([g.sum(0) for _, g in pairs])
            reference[f"{name}.A"], reference[f"{name}.G"] = dense_linear_factors([a], [g], 3)
    tokens_real = torch.cat([t for t, _ in embedding_rows])
    reference["embedding.A"] = torch.bincount(tokens_real, minlength=11).double() / tokens_real.numel()
    g = torch.cat([g for _, g in embedding_rows])
    reference["embedding.G"] = 3 * g.T @ g
    return reference


@pytest.mark.parametrize("weight_sharing", ["expand", "reduce"])
def test_padding_under_a_mask_gives_the_factors_and_steps_of_the_real_positions(weight_sharing: str) -> None:
    torch.manual_seed(4)
    base = TokenTagger()
    reference = tagger_reference(base, weight_sharing)
    runs = []
    for length in (6, 12):
        model = copy.deepcopy(base)
        optimizer = loop_kfac(model, weight_sharing)
        tokens, labels, mask = padded_tokens(length)
        with optimizer.mask(mask):
            loss = tagger_loss(model, tokens, labels)
        loss.backward()
        optimizer.step()
        for name, factor in running_factors(optimizer).items():
            torch.testing.assert_close(factor, reference[name], rtol=1e-10, atol=1e-12, msg=f"{length}: {name}")
        runs.append([p.detach().clone() for p in model.parameters()])
    for short, long in zip(*runs, strict=True):
        torch.testing.assert_close(short, long, rtol=1e-10, atol=1e-12)


def test_a_mask_is_validated_and_layers_that_cannot_take_it_say_so() -> None:
    model = nn.Sequential(nn.Conv1d(4, 4, 3, padding=1).double())
    optimizer = loop_kfac(model)
    with pytest.raises(TypeError, match="mask"):
        with optimizer.mask(torch.ones(2, 5)):
            pass
    with pytest.raises(ValueError, match="mask"):
        with optimizer.mask(torch.ones(5, dtype=torch.bool)):
            pass
    with pytest.warns(RuntimeWarning, match="'0' .*KFAC.mask.*does not implement masks"):
        with optimizer.mask(torch.ones(2, 4, dtype=torch.bool)):
            model(torch.randn(2, 4, 5, dtype=torch.float64)).sum().backward()


# -- 3. inputs without a batch dimension, every block kind -----------------------------------------


class PositionBiasMLP(nn.Module):
    """Swin-V2's continuous position bias: an MLP on a ``(1, T, T, 2)`` table of relative
    coordinates, broadcast over the batch and added to per-pair scores from a Linear."""

    def __init__(self, T: int = 4) -> None:
        super().__init__()
        coords = torch.arange(T, dtype=torch.float64)
        self.register_buffer("table", torch.stack(torch.meshgrid(coords, coords, indexing="ij"), -1)[None] / T)
        self.bias_mlp = nn.Linear(2, 1).double()
        self.proj = nn.Linear(3, T).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (N, T, 3) -> (N, T, T) scores
        return self.proj(x) + self.bias_mlp(self.table)[..., 0]


def test_a_linear_layer_on_a_table_broadcast_over_the_batch_takes_the_sgd_path_with_one_warning() -> None:
    """Its output-gradient is summed over the batch before K-FAC sees it: no per-sample statistics,
    so its factors would depend on the batch size; it takes the SGD path (as batch-free embeddings),
    its update is SGD's, and the batched layer beside it is preconditioned as without it."""
    torch.manual_seed(5)
    model = PositionBiasMLP()
    optimizer = loop_kfac(model)
    with pytest.warns(RuntimeWarning,
                      match="'bias_mlp' takes the SGD path: its input has no batch dimension") as caught:
        for batch in (8, 128):
            x, target = torch.randn(batch, 4, 3, dtype=torch.float64), torch.randn(batch, 4, 4, dtype=torch.float64)
            optimizer.zero_grad()
            F.mse_loss(model(x), target).backward()
            grad = model.bias_mlp.weight.grad.clone()
            before = model.bias_mlp.weight.detach().clone()
            optimizer.step()
            torch.testing.assert_close(before - model.bias_mlp.weight.detach(), 0.1 * grad, rtol=1e-12, atol=1e-15)
    assert sum("no batch dimension" in str(w.message) for w in caught) == 1
    bias_block, proj_block = optimizer.blocks
    assert not bias_block.A.initialized and proj_block.A.initialized
    assert "no batch dimension" in optimizer.describe()


# -- 4. eval mode ----------------------------------------------------------------------------------


def test_training_in_eval_mode_records_the_factors_of_training_mode() -> None:
    """RL loops train with dropout off (``model.eval()``): the factors and steps are train mode's
    on a model that computes the same in both; a validation pass under no_grad records nothing."""
    torch.manual_seed(6)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    runs = []
    for mode in ("train", "eval"):
        torch.manual_seed(7)
        model = TwoLinear()
        optimizer = loop_kfac(model)
        for _ in range(2):
            model.train(mode == "train")
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            model.eval()
            with torch.no_grad():
                model(x)  # a validation pass
        runs.append((running_factors(optimizer), [p.detach().clone() for p in model.parameters()]))
    (train_factors, train_params), (eval_factors, eval_params) = runs
    assert all(f.abs().sum() > 0 for f in eval_factors.values())
    for name in train_factors:
        torch.testing.assert_close(eval_factors[name], train_factors[name], rtol=0, atol=0, msg=name)
    for trained, evaluated in zip(train_params, eval_params, strict=True):
        torch.testing.assert_close(evaluated, trained, rtol=0, atol=0)


# -- 5. torch.func loops ---------------------------------------------------------------------------


def test_a_torch_func_grad_loop_steps_as_sgd_and_says_why_once() -> None:
    torch.manual_seed(8)
    model = TwoLinear()
    control = copy.deepcopy(model)
    optimizer = loop_kfac(model)
    sgd = torch.optim.SGD(control.parameters(), lr=0.1)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))

    def loss_of(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            grads = torch.func.grad(loss_of)(dict(model.named_parameters()))
            for name, param in model.named_parameters():
                param.grad = grads[name]
            optimizer.step()
            sgd.zero_grad()
            F.cross_entropy(control(x), y).backward()
            sgd.step()
    messages = [str(w.message) for w in caught]
    assert sum("torch.func transform" in m for m in messages) == 1, messages
    assert not any("create_graph" in m for m in messages), messages
    for param, reference in zip(model.parameters(), control.parameters(), strict=True):
        torch.testing.assert_close(param, reference, rtol=1e-12, atol=1e-14)


# -- 6. lazy modules and nested jagged inputs -----------------------------------------------------


def test_a_lazy_layer_before_its_first_forward_is_refused_naming_kfac_and_the_layer() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.LazyLinear(2))
    with pytest.raises(ValueError, match=r"K-FAC layer '1' \(LazyLinear\) has uninitialized \(lazy\) parameters"):
        KFAC(model, lr=0.1)
    model(torch.randn(2, 3))  # materialized: K-FAC takes it
    assert [b.name for b in KFAC(model, lr=0.1).blocks] == ["0", "1"]


@pytest.mark.parametrize("weight_sharing", ["expand", "reduce"])
def test_nested_jagged_inputs_through_linear_layers_give_the_factors_of_the_real_rows(weight_sharing: str) -> None:
    """A jagged batch has no padding: its rows are the sequences' positions, N the sequences."""
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    reference_model = copy.deepcopy(model)
    sequences = [torch.randn(length, 4, dtype=torch.float64) for length in (3, 1, 4)]
    optimizer = loop_kfac(model, weight_sharing)
    batch = torch.nested.nested_tensor(sequences, layout=torch.jagged)
    (model(batch).values().square().sum() / 3).backward()  # mean over sequences of each one's sum
    optimizer.step()
    rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {0: [], 2: []}
    for sequence in sequences:
        h = reference_model[0](sequence)
        z = torch.tanh(h)
        out = reference_model[2](z)
        gh, go = torch.autograd.grad(out.square().sum() / 3, [h, out])
        rows[0].append((sequence, gh))
        rows[2].append((z.detach(), go))
    for index, pairs in rows.items():
        if weight_sharing == "expand":
            a, g = [a for a, _ in pairs], [g for _, g in pairs]
        else:
            a, g = [torch.stack([a.mean(0) for a, _ in pairs])], [torch.stack([g.sum(0) for _, g in pairs])]
        A, G = dense_linear_factors(a, g, 3)
        block = optimizer.blocks[index // 2]
        torch.testing.assert_close(block.A.running, A, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(block.G.running, G, rtol=1e-10, atol=1e-12)


def test_a_nested_input_to_a_block_without_nested_support_is_refused_naming_the_layer() -> None:
    model = nn.Sequential(nn.Embedding(7, 3))
    optimizer = loop_kfac(model)  # kept: the hooks live as long as the optimizer
    batch = torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3])], layout=torch.jagged)
    with pytest.raises(TypeError, match=r"K-FAC layer '0' \(EmbeddingBlock\) cannot record a nested tensor"):
        model(batch)
    del optimizer


def test_a_sequence_first_model_with_one_sequence_is_not_taken_for_batch_free() -> None:
    """Its attention blocks count the one sequence, its Linear blocks the length: no layer is batch-free."""
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)  # batch_first=False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sequence-first note
        optimizer = KFAC(layer, lr=0.1, factor_update_steps=1, decomposition_update_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(torch.randn(5, 1, 8)).square().mean().backward()
        optimizer.step()
    assert not any("no batch dimension" in str(w.message) for w in caught)
    assert all(block.A.initialized for block in optimizer.blocks)


def test_a_backbone_in_eval_mode_while_it_trains_records_without_a_warning() -> None:
    torch.manual_seed(10)
    model = TwoLinear()
    optimizer = loop_kfac(model)
    model.l1.eval()  # a frozen-statistics backbone that still trains
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert not [str(w.message) for w in caught]
    assert all(block.A.initialized for block in optimizer.blocks)


class TiedTagger(nn.Module):
    """Embedding → tanh → a Linear head sharing the embedding's weight: ``(N, T)`` to ``(N, T, 11)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(11, 4).double()
        self.head = nn.Linear(4, 11, bias=False).double()
        self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embedding(tokens)))


@pytest.mark.parametrize("weight_sharing", ["expand", "reduce"])
def test_a_tied_head_under_a_mask_gives_the_same_factors_at_any_padding(weight_sharing: str) -> None:
    torch.manual_seed(11)
    base = TiedTagger()
    factors = {}
    for length, masked in ((6, True), (12, True), (12, False)):
        model = copy.deepcopy(base)
        optimizer = loop_kfac(model, weight_sharing)
        tokens, labels, mask = padded_tokens(length)
        labels = torch.where(mask, tokens, -100)  # predict the token itself at the real positions
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the mask applies to both uses: no warning
            with optimizer.mask(mask) if masked else contextlib.nullcontext():
                loss = tagger_loss(model, tokens, labels)
            loss.backward()
            optimizer.step()
        factors[length, masked] = running_factors(optimizer)
    for name, factor in factors[6, True].items():
        torch.testing.assert_close(factors[12, True][name], factor, rtol=1e-10, atol=1e-12, msg=name)
    assert not torch.allclose(factors[12, False]["embedding.G"], factors[6, True]["embedding.G"])


class PaddedEncoder(nn.Module):
    """Embedding → TransformerEncoderLayer (padding masked in attention) → Linear head per position."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embedding = nn.Embedding(11, 8).double()
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first).double()
        self.head = nn.Linear(8, 3).double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens)
        padding = tokens == 0
        if self.batch_first:
            return self.head(self.encoder(h, src_key_padding_mask=padding))
        return self.head(self.encoder(h.transpose(0, 1), src_key_padding_mask=padding).transpose(0, 1))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("weight_sharing", ["expand", "reduce"])
def test_attention_blocks_under_a_mask_give_the_same_factors_and_steps_at_any_padding(
    weight_sharing: str, batch_first: bool
) -> None:
    torch.manual_seed(12)
    base = PaddedEncoder(batch_first)
    runs = {}
    for length, masked in ((6, True), (12, True), (12, False)):
        model = copy.deepcopy(base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the sequence-first note
            optimizer = loop_kfac(model, weight_sharing)
        tokens, labels, mask = padded_tokens(length)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with optimizer.mask(mask) if masked else contextlib.nullcontext():
                loss = tagger_loss(model, tokens, labels)
            loss.backward()
            optimizer.step()
        unmasked_layers = {str(w.message).split("'")[1] for w in caught if "KFAC.mask()" in str(w.message)}
        # sequence-first: the feed-forward Linears see (T, N, ·), which they cannot tell from samples first
        assert unmasked_layers == (set() if batch_first or not masked else {"encoder.linear1", "encoder.linear2"})
        runs[length, masked] = (running_factors(optimizer), [p.detach().clone() for p in model.parameters()])
    (short, short_params), (long, long_params) = runs[6, True], runs[12, True]
    for name, factor in short.items():
        if batch_first or "linear" not in name:
            torch.testing.assert_close(long[name], factor, rtol=1e-9, atol=1e-12, msg=name)
    for a, b in zip(short_params, long_params, strict=True):
        if batch_first:
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)
    unmasked = runs[12, False][0]
    assert not torch.allclose(unmasked["encoder.self_attn.in_proj.A"], short["encoder.self_attn.in_proj.A"])


def test_a_batch_norm_block_in_eval_mode_records_the_fisher_of_its_running_statistics() -> None:
    """Eval mode normalizes with the running statistics: the opt-in norm block's factor is the
    per-unit Fisher ``(1/N) Σ ŝ ŝᵀ`` of that normalization, from per-sample gradients."""
    from kfac_optim.layers import ChannelNormBlock

    torch.manual_seed(13)
    layer = nn.BatchNorm2d(3).double()
    with torch.no_grad():
        layer.running_mean.normal_()
        layer.running_var.uniform_(0.5, 2.0)
        layer.weight.normal_()
        layer.bias.normal_()
    layer.eval()
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    target = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    out = layer(x)
    per_sample = []
    for n in range(4):
        grads = torch.autograd.grad(0.5 * ((out[n] - target[n]) ** 2).sum(), [layer.weight, layer.bias],
                                    retain_graph=True)
        per_sample.append(torch.stack(grads, -1))
    s_hat = torch.stack(per_sample)  # (N, units, 2)
    fisher = torch.einsum("nui,nuj->uij", s_hat, s_hat) / 4
    curvature = CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64,
                                blocks={nn.BatchNorm2d: ChannelNormBlock})
    optimizer = KFAC(layer, lr=0.1, curvature=curvature, factor_update_steps=1, decomposition_update_steps=1)
    (0.5 * ((layer(x) - target) ** 2).reshape(4, -1).sum(1).mean()).backward()
    optimizer.step()
    torch.testing.assert_close(optimizer.blocks[0].A.running, fisher, rtol=1e-10, atol=1e-12)
