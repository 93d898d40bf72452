"""What ``describe()`` and the warnings say about coverage is what the step does.

- a block that never receives statistics (its module bypassed: the weight used through the
  parameter) takes the SGD step, and ``describe()`` lists it so ("silent"), not as K-FAC;
- a weight matrix of more than 1% of the trainable elements that takes SGD's path is named in a
  warning even when a large covered matrix (a tied embedding) keeps the coverage high;
- a weight that the graph uses outside its module's calls (``h @ emb.weight.T``) is warned about
  once, at the first forward; calling the modules (a tied ``nn.Linear`` head included) gives no warning;
- a class-embedding table called twice per forward with the labels ``(N,)`` (a diffusion
  transformer's conditioning) is a batched use, not a batch-free one;
- a wide *diagonal* factor (an embedding's ``A``) is not named as slow to decompose (it costs O(n)).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC, Eigen

SETTINGS = dict(lr=0.1, momentum=0.0, kl_clip=None, factor_update_steps=1, decomposition_update_steps=1)


class BypassedHead(nn.Module):
    """``body`` called as a module, ``head``'s weight used through ``F.linear``: its hooks never fire."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.body(x)), self.head.weight, self.head.bias)


def test_a_block_that_never_received_statistics_is_described_as_taking_the_sgd_path() -> None:
    torch.manual_seed(0)
    model, x = BypassedHead(), torch.randn(16, 4)
    optimizer = KFAC(model, **SETTINGS)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*produced no statistics")
        for _ in range(2):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            grad, before = model.head.weight.grad.clone(), model.head.weight.detach().clone()
            optimizer.step()
    torch.testing.assert_close(before - model.head.weight.detach(), 0.1 * grad)  # the SGD step, as described
    reports = {r.name: r for r in optimizer.module_reports}
    assert (reports["head"].status, reports["head"].block) == ("silent", None)
    assert (reports["body"].status, reports["body"].block) == ("kfac", "body")
    first = optimizer.describe().splitlines()[0]
    assert "1 blocks precondition 32/48 weight-matrix elements" in first, first
    assert "head (Linear; weight 2x8, bias 2): SGD: " in optimizer.describe()


class WideEmbeddingAndBilinear(nn.Module):
    """A covered embedding of 4000 elements; an ``nn.Bilinear`` (no block) of 2·6·6 = 72 elements
    (1.8% of the 4082); a Linear ``(1, 10)`` under 1% (covered)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(400, 10)
        self.mix = nn.Bilinear(6, 6, 2, bias=False)
        self.out = nn.Linear(10, 1, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.out(self.embedding(tokens))
        return self.mix(h.expand(-1, 6), h.expand(-1, 6))


def test_a_weight_matrix_over_one_percent_on_the_sgd_path_is_warned_at_high_coverage() -> None:
    model = WideEmbeddingAndBilinear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        optimizer = KFAC(model, **SETTINGS)
    first = optimizer.describe().splitlines()[0]
    assert "4010/4082 weight-matrix elements (98.2%)" in first, first  # over the 50% of the coverage warning
    named = [str(w.message) for w in record if "takes SGD's update" in str(w.message)]
    assert len(named) == 1 and named[0].startswith("'mix.weight' (Bilinear, 72 elements, 1.8%"), named


class TiedByMatmul(nn.Module):
    """A language model whose head multiplies by the embedding's weight directly."""

    def __init__(self, functional_head: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8)
        self.ff = nn.Linear(8, 8)
        self.head = None if functional_head else nn.Linear(8, 20, bias=False)
        if self.head is not None:
            self.head.weight = self.embedding.weight  # the supported tie: a module

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.ff(self.embedding(tokens)))
        return h @ self.embedding.weight.T if self.head is None else self.head(h)


@pytest.mark.parametrize("functional_head", [True, False])
def test_a_weight_used_outside_its_module_is_warned_once(functional_head: bool) -> None:
    torch.manual_seed(0)
    model, tokens = TiedByMatmul(functional_head), torch.randint(20, (4, 5))
    optimizer = KFAC(model, **SETTINGS)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            optimizer.zero_grad()
            F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            optimizer.step()
    outside = [str(w.message) for w in record if "outside their module's calls" in str(w.message)]
    if functional_head:
        assert len(outside) == 1 and "'embedding' (Embedding: 2 uses in the graph, 1 module call(s))" in outside[0]
    else:
        assert outside == []


class TwiceConditioned(nn.Module):
    """A class-embedding table called twice per forward with the labels ``(N,)``, as a diffusion
    transformer conditions its blocks and its output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.classes = nn.Embedding(5, 6)
        self.body = nn.Linear(6, 6)
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x + self.classes(labels)))
        return self.out(h * self.classes(labels))


def test_a_class_embedding_called_twice_per_forward_is_batched_not_batch_free() -> None:
    torch.manual_seed(0)
    model = TwiceConditioned()
    x, labels = torch.randn(8, 6), torch.arange(8) % 5
    optimizer = KFAC(model, **SETTINGS)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no batch dimension")
        model(x, labels).square().mean().backward()
        optimizer.step()
    block = {b.name: b for b in optimizer.blocks}["classes"]
    assert block.sgd_reason is None
    counts = torch.bincount(labels, minlength=5).double()  # A: the labels' frequencies over both calls' rows
    torch.testing.assert_close(block.A.running.double(), 2 * counts / 16)


def test_a_wide_diagonal_factor_is_not_named_as_slow_to_decompose(caplog: pytest.LogCaptureFixture) -> None:
    """An embedding over a 50257-token vocabulary: A is its diagonal (O(n)); a Linear of 4096 inputs
    beside it keeps the note (full eigenbases: no cap)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(50257, 8), nn.Linear(8, 4096, bias=False))
    with caplog.at_level(logging.WARNING):
        KFAC(model, lr=0.1, method=Eigen(max_rank=None), factor_update_steps=1, decomposition_update_steps=10)
    (record,) = [r for r in caplog.records if "seconds" in r.getMessage()]
    assert "1.G (4096)" in record.getMessage() and "0.A" not in record.getMessage(), record.getMessage()
