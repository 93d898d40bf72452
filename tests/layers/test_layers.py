"""Blocks beyond Linear/Conv2d against dense references from first principles (float64).

N-d and grouped convolutions: patches taken by slicing position by position, per group; per-sample
output gradients from autograd. Embedding: the same one-hot rows fed to ``nn.Linear``. Every
direction is compared with ``(G ⊗ A + λI)⁻¹ ∇W`` solved densely (per group for grouped convs).
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import kron_solve
from test_factors import (  # the float64 fixture and the reference helpers
    DTYPES,
    _float64,  # noqa: F401 (autouse fixture)
    mean_loss,
    one_kfac_step,
    per_sample_output_grads,
    reference_factors,
    with_bias_column,
)
from torch import nn
from torch.overrides import _get_current_function_mode_stack

from kfac_optim import KFAC, CurvatureConfig, KroneckerBlock, register_block
from kfac_optim.layers import (
    ConvBlock,
    EmbeddingBlock,
    LinearBlock,
    block_kind,
    discover_blocks,
    registered_blocks,
    unregister_block,
)

# -- convolutions ------------------------------------------------------------------------------


def conv_patches_nd(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Rows ``(N·L_out, C·prod(kernel))`` sliced from the padded input, output position by position."""
    dims = x.dim() - 2
    if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
        mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
        padded = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
    else:
        padded = F.pad(x, [p for size in reversed(conv.padding) for p in (size, size)])
    k, s, d = conv.kernel_size, conv.stride, conv.dilation
    out = [(padded.shape[2 + i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(dims)]
    rows = []
    for n in range(x.shape[0]):
        for position in itertools.product(*(range(o) for o in out)):
            window = padded[n][
                (slice(None),
                 *(slice(p * s[i], p * s[i] + d[i] * (k[i] - 1) + 1, d[i]) for i, p in enumerate(position)))
            ]
            rows.append(window.reshape(-1))
    return torch.stack(rows)


def output_rows(out_grads: torch.Tensor) -> torch.Tensor:
    """``(N, C, *S)`` → ``(N·L, C)``."""
    return out_grads.movedim(1, -1).reshape(-1, out_grads.shape[1])


CONV_CASES = [
    (nn.Conv1d, {"kernel_size": 3, "padding": 1}, (3, 2, 9)),
    (nn.Conv1d, {"kernel_size": 2, "stride": 2, "dilation": 2, "bias": False}, (2, 2, 11)),
    (nn.Conv1d, {"kernel_size": 4, "padding": "same", "dilation": 2}, (2, 2, 8)),
    (nn.Conv1d, {"kernel_size": 3, "padding": 2, "padding_mode": "circular"}, (2, 2, 7)),
    (nn.Conv3d, {"kernel_size": 2, "padding": 1}, (2, 2, 3, 4, 3)),
    (nn.Conv3d, {"kernel_size": (1, 2, 3), "stride": (1, 2, 1), "dilation": (2, 1, 1), "bias": False}, (2, 2, 4, 5, 6)),
    (nn.Conv3d, {"kernel_size": 3, "padding": "same"}, (2, 1, 3, 3, 4)),
]


@pytest.mark.parametrize("conv_type, conv_args, shape", CONV_CASES)
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
def test_conv1d_and_conv3d_match_dense_reference(conv_type, conv_args: dict, shape: tuple[int, ...]) -> None:
    layer = conv_type(shape[1], 3, **conv_args)
    x = torch.randn(shape)
    target = torch.randn_like(layer(x))
    bias = layer.bias is not None
    g_hat = output_rows(per_sample_output_grads(layer, x, target))
    A_ref, G_ref = reference_factors(with_bias_column(conv_patches_nd(layer, x), bias), g_hat, shape[0])
    optimizer, grad, direction = one_kfac_step(layer, x, target, damping=0.05)
    block = optimizer.blocks[0]
    assert isinstance(block, ConvBlock)
    torch.testing.assert_close(block.A.running, A_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block.G.running, G_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(direction, kron_solve(G_ref, A_ref, grad, 0.05), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("padding", [1, "same"])
def test_conv1d_steps_exactly_like_conv2d_with_a_1_by_k_kernel(method: str, padding) -> None:
    conv1 = nn.Conv1d(3, 4, 3, padding=padding, dilation=2 if padding == "same" else 1, stride=1)
    conv2 = nn.Conv2d(3, 4, (1, 3), padding=padding if padding == "same" else (0, 1), dilation=(1, conv1.dilation[0]))
    with torch.no_grad():
        conv2.weight.copy_(conv1.weight.unsqueeze(2))
        conv2.bias.copy_(conv1.bias)
    x = torch.randn(4, 3, 10)
    target = torch.randn(4, 4, 10)
    updates = []
    for layer, inputs, targets in ((conv1, x, target), (conv2, x.unsqueeze(2), target.unsqueeze(2))):
        optimizer = KFAC(layer, lr=0.3, momentum=0.9, damping=0.01, method=method, decomposition_update_steps=2,
                         **{"factor_update_steps": 1, **DTYPES})
        before = layer.weight.detach().clone()
        for _ in range(3):
            optimizer.zero_grad()
            mean_loss(layer, inputs, targets).backward()
            optimizer.step()
        updates.append((layer.weight.detach() - before).reshape(4, -1))
    torch.testing.assert_close(updates[0], updates[1], rtol=1e-6, atol=1e-10)


@pytest.mark.parametrize(
    "conv_type, channels, groups, shape",
    [
        (nn.Conv2d, (4, 6), 2, (3, 4, 5, 5)),
        (nn.Conv1d, (6, 6), 6, (3, 6, 8)),  # depthwise
        (nn.Conv1d, (3, 6), 3, (2, 3, 7)),  # depthwise with multiplier 2
    ],
)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_grouped_conv_is_one_kronecker_pair_per_group(conv_type, channels, groups, shape, bias, method) -> None:
    c_in, c_out = channels
    layer = conv_type(c_in, c_out, 3, padding=1, groups=groups, bias=bias)
    x = torch.randn(shape)
    target = torch.randn_like(layer(x))
    damping = 0.05
    patches = conv_patches_nd(layer, x)  # (N·L, C_in·K), channel-major
    g_hat = output_rows(per_sample_output_grads(layer, x, target))
    per_in, per_out = patches.shape[1] // groups, c_out // groups
    optimizer, grad, direction = one_kfac_step(layer, x, target, damping=damping, method=method)
    block = optimizer.blocks[0]
    assert block.A.running.shape[0] == block.G.running.shape[0] == groups
    out_rows = torch.arange(c_out).reshape(groups, per_out)
    for j in range(groups):
        a_rows = with_bias_column(patches[:, j * per_in : (j + 1) * per_in], bias)
        A_ref, G_ref = reference_factors(a_rows, g_hat[:, out_rows[j]], shape[0])
        torch.testing.assert_close(block.A.running[j], A_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(block.G.running[j], G_ref, rtol=1e-12, atol=1e-12)
    A, G = block.A.running, block.G.running
    if method == "inverse":  # π over all groups: mean diagonal entry of A over that of G
        pi = math.sqrt(float(A.diagonal(dim1=1, dim2=2).mean() / G.diagonal(dim1=1, dim2=2).mean()))
    for j in range(groups):
        g_j = grad[out_rows[j]]
        if method == "eigen":
            expected = kron_solve(G[j], A[j], g_j, damping)
        else:
            eye_a, eye_g = torch.eye(A.shape[-1]), torch.eye(G.shape[-1])
            expected = (
                torch.linalg.inv(G[j] + damping**0.5 / pi * eye_g) @ g_j
                @ torch.linalg.inv(A[j] + pi * damping**0.5 * eye_a)
            )
        torch.testing.assert_close(direction[out_rows[j]], expected, rtol=1e-9, atol=1e-12)


def test_depthwise_conv_factors_are_batched_not_one_per_group() -> None:
    optimizer = KFAC(nn.Conv1d(64, 64, 5, groups=64), lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    (block,) = optimizer.blocks
    assert block.A.running.shape == (64, 6, 6) and block.G.running.shape == (64, 1, 1)


# -- embeddings --------------------------------------------------------------------------------


def embedding_and_linear(vocabulary: int, dim: int) -> tuple[nn.Embedding, nn.Linear]:
    embedding = nn.Embedding(vocabulary, dim)
    linear = nn.Linear(vocabulary, dim, bias=False)
    with torch.no_grad():
        linear.weight.copy_(embedding.weight.T)
    return embedding, linear


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_embedding_steps_exactly_like_linear_on_one_hot_rows(method: str) -> None:
    vocabulary, dim = 7, 3
    embedding, linear = embedding_and_linear(vocabulary, dim)
    weights_before = embedding.weight.detach().clone()
    generator = torch.Generator().manual_seed(0)
    for step in range(4):
        tokens = torch.randint(0, vocabulary - 1, (5, 4), generator=generator)  # the last token never occurs
        target = torch.randn(5, 4, dim, generator=generator)
        for layer, inputs in ((embedding, tokens), (linear, F.one_hot(tokens, vocabulary).double())):
            if step == 0:
                layer.kfac = KFAC(layer, lr=0.2, momentum=0.9, damping=0.03, method=method,
                                  decomposition_update_steps=2,
                                  **{"factor_update_steps": 1, **DTYPES})
            layer.kfac.zero_grad()
            mean_loss(layer, inputs, target).backward()
            layer.kfac.step()
    assert isinstance(embedding.kfac.blocks[0], EmbeddingBlock) and embedding.kfac.blocks[0].A.running.shape == (7,)
    torch.testing.assert_close(embedding.weight.detach(), linear.weight.detach().T, rtol=1e-6, atol=1e-10)
    assert not torch.equal(embedding.weight, weights_before)


def test_embedding_matches_dense_reference() -> None:
    """A: the one-hot rows' Gram (diagonal), G from per-sample ĝ, direction (G ⊗ A + λI)⁻¹ vec(∇Wᵀ)."""
    embedding = nn.Embedding(6, 3)
    tokens = torch.randint(0, 6, (4, 5))
    target = torch.randn(4, 5, 3)
    g_hat = per_sample_output_grads(embedding, tokens, target).reshape(-1, 3)
    A_ref, G_ref = reference_factors(F.one_hot(tokens.reshape(-1), 6).double(), g_hat, 4)
    embedding.zero_grad()
    optimizer = KFAC(embedding, lr=1.0, kl_clip=None, damping=0.1,
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10, **DTYPES})
    before = embedding.weight.detach().clone()
    mean_loss(embedding, tokens, target).backward()
    grad = embedding.weight.grad.T.clone()
    optimizer.step()
    block = optimizer.blocks[0]
    torch.testing.assert_close(block.A.running, A_ref.diagonal(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block.G.running, G_ref, rtol=1e-12, atol=1e-12)
    direction = (before - embedding.weight.detach()).T
    torch.testing.assert_close(direction, kron_solve(G_ref, A_ref, grad, 0.1), rtol=1e-9, atol=1e-12)


def test_embedding_padding_positions_add_zero_rows() -> None:
    """A padding position is a row with a = 0 and ĝ = 0: it adds nothing to A or G, counts in R."""
    embedding = nn.Embedding(5, 3, padding_idx=0)
    tokens = torch.tensor([[0, 1, 2], [3, 0, 0]])
    target = torch.randn(2, 3, 3)
    g_hat = per_sample_output_grads(embedding, tokens, target).reshape(-1, 3)
    keep = (tokens.reshape(-1) != 0).double().unsqueeze(1)
    a_rows = F.one_hot(tokens.reshape(-1), 5).double() * keep
    A_ref, G_ref = reference_factors(a_rows, g_hat * keep, 2)
    padding_row = embedding.weight.detach()[0].clone()
    embedding.zero_grad()
    optimizer = KFAC(embedding, lr=1.0, damping=0.1, **{"factor_update_steps": 1, "decomposition_update_steps": 10,
                                                        **DTYPES})
    mean_loss(embedding, tokens, target).backward()
    optimizer.step()
    block = optimizer.blocks[0]
    torch.testing.assert_close(block.A.running, A_ref.diagonal(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block.G.running, G_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(embedding.weight.detach()[0], padding_row, rtol=0, atol=0)


def test_embedding_with_max_norm_takes_the_dense_kfac_step_from_its_renormalized_rows() -> None:
    """The forward renormalizes rows in place; the step is then ``W ← W − lr·Vᵀ`` for the rows as
    renormalized, ``V = (G ⊗ diag(A) + λI)⁻¹ vec(∇Wᵀ)`` with ``A = counts/(N·R)`` and
    ``G = N Σ g gᵀ`` over the N·R positions (mean convention), built here from the indices and the
    output-gradient (no momentum, no KL clip, decompositions every step)."""
    embedding = nn.Embedding(8, 4, max_norm=1.0)
    with torch.no_grad():
        embedding.weight.mul_(3.0)  # every row above max_norm: each looked-up row is renormalized
    damping, lr = 0.1, 0.1
    optimizer = KFAC(embedding, lr=lr, damping=damping, kl_clip=None,
                     **{"factor_update_steps": 1, "decomposition_update_steps": 1, **DTYPES})
    for step in range(2):
        indices = torch.randint(0, 8, (3, 5))
        optimizer.zero_grad()
        output = embedding(indices)
        output.retain_grad()
        output.pow(2).sum().backward()
        renormalized = embedding.weight.detach().clone()
        optimizer.step()
        if step == 0:  # the first step's factors are that step's statistics alone
            looked_up = renormalized[indices.unique()]
            assert torch.allclose(looked_up.norm(dim=1), torch.ones(len(looked_up)))
            n, rows = indices.shape[0], indices.numel()
            a = torch.bincount(indices.flatten(), minlength=8).double() / rows
            g_rows = output.grad.reshape(rows, 4).double()
            g = n * g_rows.T @ g_rows
            joint = embedding.weight.grad.T  # (D, V)
            dense = torch.kron(g, torch.diag(a)) + damping * torch.eye(4 * 8, dtype=torch.float64)
            direction = torch.linalg.solve(dense, joint.flatten()).reshape(joint.shape)
            torch.testing.assert_close(embedding.weight.detach(), renormalized - lr * direction.T, rtol=1e-6, atol=1e-8)
    assert torch.isfinite(embedding.weight).all() and optimizer.blocks[0].A.initialized


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_embedding_memory_is_linear_in_the_vocabulary(method: str) -> None:
    vocabulary, dim = 50_000, 512
    embedding = nn.Embedding(vocabulary, dim, dtype=torch.float32)
    optimizer = KFAC(embedding, lr=0.1, method=method, factor_update_steps=1, decomposition_update_steps=10)
    optimizer.zero_grad()
    embedding(torch.randint(0, vocabulary, (2, 8))).float().pow(2).sum().backward()
    optimizer.step()
    usage = optimizer.memory_usage()
    decomposition = dim * dim + dim if method == "eigen" else dim * dim
    assert usage["factors"] == 4 * (vocabulary + dim * dim)
    assert usage["pending"] == 4 * (vocabulary + dim * dim)
    assert usage["decompositions"] == 4 * (vocabulary + decomposition)
    assert usage["total"] < 4 * 3 * (vocabulary + dim * dim + dim)  # O(V + D²), never V²


def test_sparse_embedding_takes_the_sgd_path_bit_identically() -> None:
    embedding = nn.Embedding(6, 3, sparse=True)
    reference = nn.Embedding(6, 3, sparse=True)
    reference.load_state_dict(embedding.state_dict())
    with pytest.warns(UserWarning, match="sparse"):
        optimizer = KFAC(nn.Sequential(embedding), lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    tokens = torch.randint(0, 6, (4, 3))
    for layer, opt in ((embedding, optimizer), (reference, reference_optimizer)):
        layer(tokens).pow(2).sum().backward()
        opt.step()
    assert torch.equal(embedding.weight, reference.weight)


# -- the registry ------------------------------------------------------------------------------


class Scale(nn.Module):
    """``y = x · diag-free weight``: a user's layer, ``y = x Wᵀ`` with its own parameter name."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features, features))
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class FancyLinear(nn.Linear):
    pass


def test_register_block_makes_a_user_layer_a_kfac_layer_and_lookup_follows_the_mro() -> None:
    before = registered_blocks()
    try:
        assert block_kind(Scale(2)) is None
        register_block(Scale, LinearBlock)
        assert block_kind(Scale(2)) is LinearBlock
        assert block_kind(FancyLinear(2, 2)) is LinearBlock  # a subclass of a registered type
        layer = Scale(3)
        x, target = torch.randn(6, 3), torch.randn(6, 3)
        g_hat = per_sample_output_grads(layer, x, target)
        A_ref, G_ref = reference_factors(x, g_hat, 6)
        optimizer, grad, direction = one_kfac_step(layer, x, target, damping=0.1)
        torch.testing.assert_close(direction, kron_solve(G_ref, A_ref, grad, 0.1), rtol=1e-9, atol=1e-12)
        assert "Scale" in optimizer.describe() and "LinearBlock" in optimizer.describe()
    finally:
        for module_type in set(registered_blocks()) - set(before):
            unregister_block(module_type)
    assert block_kind(Scale(2)) is None


def test_register_block_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="module_type"):
        register_block(int, LinearBlock)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="block_class"):
        register_block(Scale, object)  # type: ignore[arg-type]


def test_a_block_can_decline_instances() -> None:
    class EvenOnly(LinearBlock):
        @classmethod
        def unsupported_reason(cls, module: nn.Module) -> str | None:
            return None if module.out_features % 2 == 0 else "odd width"

    before = registered_blocks()
    try:
        register_block(FancyLinear, EvenOnly)
        net = nn.Sequential(FancyLinear(3, 4), FancyLinear(4, 3))
        with pytest.warns(UserWarning, match="odd width"):
            optimizer = KFAC(net, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
        assert [type(b) for b in optimizer.blocks] == [EvenOnly]
        assert [r.status for r in optimizer.module_reports] == ["kfac", "unsupported"]
    finally:
        unregister_block(FancyLinear)
    assert registered_blocks() == before


def test_discover_blocks_is_public_and_agrees_with_the_optimizer() -> None:
    net = nn.Sequential(nn.Embedding(10, 4), nn.Conv1d(4, 4, 3, groups=4), nn.Flatten(), nn.Linear(32, 2))
    blocks = discover_blocks(net)
    assert [b.name for b in blocks] == ["0", "1", "3"]
    assert [type(b) for b in blocks] == [EmbeddingBlock, ConvBlock, LinearBlock]
    assert issubclass(EmbeddingBlock, KroneckerBlock)


def test_describe_lists_every_module_with_trainable_parameters() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    net[2].weight.requires_grad_(False)
    optimizer = KFAC(net, lr=0.1, params=[p for p in net.parameters() if p.requires_grad], factor_update_steps=1,
                     decomposition_update_steps=10)
    reports = {r.name: r for r in optimizer.module_reports}
    assert set(reports) == {"0", "1", "2"}
    assert reports["0"].block == "0" and "A 5x5 dense" in reports["0"].detail
    assert reports["1"].block is None and reports["1"].status == "unregistered"
    assert reports["2"].block is None and reports["2"].params == (("bias", (2,)),)
    text = optimizer.describe()
    assert "16/16 weight-matrix elements (100.0%)" in text and "LayerNorm" in text


def test_describe_names_a_tied_weight_and_the_block_that_owns_it() -> None:
    embedding = nn.Embedding(10, 4)
    head = nn.Linear(4, 10)
    head.weight = embedding.weight
    net = nn.Sequential(embedding, head)
    optimizer = KFAC(net, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    reports = {r.name: r for r in optimizer.module_reports}
    assert [b.name for b in optimizer.blocks] == ["0"]
    assert reports["1"].block == "0" and "preconditioned in block '0'" in reports["1"].detail
    assert "bias take the SGD path" in reports["1"].detail
    assert "weight tied with Linear '1'" in reports["0"].detail and "weight tied with Linear '1'" in reports["1"].detail
    assert "weight tied with Linear '1'" in optimizer.describe()


def test_a_tied_weight_the_block_cannot_take_warns_that_its_second_use_is_left_out() -> None:
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    second.weight = first.weight
    with pytest.warns(UserWarning, match="tied weights: '1' \\(Linear\\) shares the weight of block '0'"):
        optimizer = KFAC(nn.Sequential(first, second), lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    assert [b.name for b in optimizer.blocks] == ["0"]
    assert "this module's uses of the weight are left out" in {r.name: r for r in optimizer.module_reports}["1"].detail


def test_a_block_whose_hooks_never_fire_is_reported_at_the_first_factor_step() -> None:
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(3, 3)
            self.bypassed = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(self.used(x), self.bypassed.weight, self.bypassed.bias)

    net = Functional()
    optimizer = KFAC(net, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    with pytest.warns(RuntimeWarning, match=r"\['bypassed'\] produced no statistics"):
        net(torch.randn(4, 3)).sum().backward()
        optimizer.step()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.zero_grad()
        net(torch.randn(4, 3)).sum().backward()
        optimizer.step()


# -- multi-head attention ----------------------------------------------------------------------


def attention_by_hand(mha: nn.MultiheadAttention, query, key, value):
    """Sequence-first ``(L, N, E)`` inputs: the projections' outputs and the attention output before
    ``out_proj``, computed from the definition (no dropout, no masks), and the module's output."""
    E, heads = mha.embed_dim, mha.num_heads
    if mha._qkv_same_embed_dim:
        weights = mha.in_proj_weight.chunk(3)
    else:
        weights = (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
    biases = mha.in_proj_bias.chunk(3) if mha.in_proj_bias is not None else (None,) * 3
    q, k, v = (F.linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases, strict=True))

    def split(t):  # (L, N, E) → (N, heads, L, E/heads)
        return t.reshape(t.shape[0], t.shape[1], heads, E // heads).permute(1, 2, 0, 3)

    scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(E // heads)
    attended = (scores.softmax(-1) @ split(v)).permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], E)
    return (q, k, v), attended, mha.out_proj(attended)


def per_sample_grads_of(outputs: list[torch.Tensor], final: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
    """ĝ rows ``(L·N, ·)`` of each tensor in ``outputs`` (sequence-first), sample by sample."""
    per_tensor = [[] for _ in outputs]
    for n in range(final.shape[1]):
        loss = 0.5 * ((final[:, n] - target[:, n]) ** 2).sum()
        grads = torch.autograd.grad(loss, outputs, retain_graph=True)
        for rows, grad in zip(per_tensor, grads, strict=True):
            rows.append(grad[:, n])
    return [torch.stack(rows, 1).reshape(-1, rows[0].shape[-1]) for rows in per_tensor]


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("separate", [False, True])
def test_multihead_attention_matches_dense_reference(batch_first: bool, cross: bool, separate: bool) -> None:
    E, N, L, S = 4, 3, 2, 3 if cross else 2
    extra = {"kdim": 3, "vdim": 5} if separate else {}
    mha = nn.MultiheadAttention(E, 2, batch_first=batch_first, **extra)
    query = torch.randn(L, N, E)
    key = torch.randn(S, N, extra.get("kdim", E)) if (cross or separate) else query
    value = torch.randn(S, N, extra.get("vdim", E)) if (cross or separate) else query
    target = torch.randn(L, N, E)
    (q, k, v), attended, final = attention_by_hand(mha, query, key, value)
    g_q, g_k, g_v, g_out = per_sample_grads_of([q, k, v, final], final, target)

    def first(t):
        return t.transpose(0, 1) if batch_first else t

    mha.zero_grad()
    optimizer = KFAC(mha, lr=1.0, kl_clip=None, damping=0.1,
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10, **DTYPES})
    before = {name: p.detach().clone() for name, p in mha.named_parameters()}
    out, _ = mha(first(query), first(key), first(value), need_weights=False)
    torch.testing.assert_close(first(out), final, rtol=1e-12, atol=1e-12)  # the tap changes no value
    (0.5 * ((first(out) - target) ** 2).sum(-1).sum(0).mean()).backward()
    grads = {name: p.grad.clone() for name, p in mha.named_parameters()}
    optimizer.step()
    moved = {name: before[name] - p.detach() for name, p in mha.named_parameters()}
    blocks = {b.name: b for b in optimizer.blocks}

    def check(block, index, a_rows, g_rows, grad, direction, bias: bool):
        A_ref, G_ref = reference_factors(with_bias_column(a_rows, bias), g_rows, N)
        A = block.A.running if index is None else block.A.running[index]
        G = block.G.running if index is None else block.G.running[index]
        torch.testing.assert_close(A, A_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(G, G_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(direction, kron_solve(G_ref, A_ref, grad, 0.1), rtol=1e-9, atol=1e-12)

    rows = [x.reshape(-1, x.shape[-1]) for x in (query, key, value)]
    g_rows = (g_q, g_k, g_v)
    if separate:
        assert set(blocks) == {"q_proj", "k_proj", "v_proj", "out_proj"}
        for j, letter in enumerate("qkv"):
            name = f"{letter}_proj_weight"
            check(blocks[f"{letter}_proj"], None, rows[j], g_rows[j], grads[name], moved[name], False)
        torch.testing.assert_close(moved["in_proj_bias"], grads["in_proj_bias"], rtol=0, atol=0)  # SGD path
    else:
        assert set(blocks) == {"in_proj", "out_proj"}
        E_rows = torch.arange(3 * E).reshape(3, E)
        for j in range(3):
            grad = torch.cat([grads["in_proj_weight"][E_rows[j]], grads["in_proj_bias"][E_rows[j], None]], 1)
            direction = torch.cat([moved["in_proj_weight"][E_rows[j]], moved["in_proj_bias"][E_rows[j], None]], 1)
            check(blocks["in_proj"], j, rows[j], g_rows[j], grad, direction, True)
    out_grad = torch.cat([grads["out_proj.weight"], grads["out_proj.bias"][:, None]], 1)
    out_moved = torch.cat([moved["out_proj.weight"], moved["out_proj.bias"][:, None]], 1)
    check(blocks["out_proj"], None, attended.detach().reshape(-1, E), g_out, out_grad, out_moved, True)


def test_attention_tap_is_only_active_on_recording_forwards_and_leaves_eval_alone() -> None:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    optimizer = KFAC(layer, lr=0.1, factor_update_steps=2, decomposition_update_steps=10)
    with pytest.raises(AssertionError):  # an armed forward that raises (mismatched embed dim) still pops its tap
        layer.self_attn(torch.randn(2, 3, 5), torch.randn(2, 3, 5), torch.randn(2, 3, 5))
    assert not _get_current_function_mode_stack()
    x = torch.randn(3, 5, 8)
    for _ in range(3):
        optimizer.zero_grad()
        layer(x).pow(2).mean().backward()
        optimizer.step()
    names = [b.name for b in optimizer.blocks]
    assert names == ["self_attn.in_proj", "self_attn.out_proj", "linear1", "linear2"]
    assert all(b.A.initialized for b in optimizer.blocks)
    assert not _get_current_function_mode_stack()  # every pushed tap was popped


# -- a modern model ----------------------------------------------------------------------------


class TokenMixer(nn.Module):
    """Embedding → depthwise Conv1d mixer → TransformerEncoderLayer → LayerNorm → Linear head."""

    def __init__(self, vocabulary: int = 50, dim: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, dim)
        self.mixer = nn.Conv1d(dim, dim, 5, padding=2, groups=dim)
        self.encoder = nn.TransformerEncoderLayer(dim, 2, 4 * dim, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens)
        h = h + self.mixer(h.transpose(1, 2)).transpose(1, 2)
        return self.head(self.norm(self.encoder(h)).mean(1))


def test_kfac_preconditions_at_least_95_percent_of_a_modern_models_weight_matrices() -> None:
    """describe() says so, and the first update differs from SGD's (``p − lr·∇p``) for exactly the
    K-FAC parameters; every other parameter's update is SGD's, bit for bit."""
    torch.manual_seed(0)
    model = TokenMixer()
    optimizer = KFAC(model, lr=0.1, kl_clip=None, damping=0.01, factor_update_steps=1, decomposition_update_steps=10)
    text = optimizer.describe()
    matrices = {name: p.numel() for name, p in model.named_parameters() if p.dim() >= 2}
    kfac_params = {id(p) for block in optimizer.blocks for p in block.parameters()}
    covered = sum(n for name, n in matrices.items() if id(model.get_parameter(name)) in kfac_params)
    assert covered / sum(matrices.values()) >= 0.95
    assert f"{covered}/{sum(matrices.values())} weight-matrix elements" in text
    assert {r.name for r in optimizer.module_reports if r.block is None} == {
        "encoder.norm1", "encoder.norm2", "norm"
    }  # only the 1-d LayerNorm parameters take the SGD path

    tokens = torch.randint(0, 50, (8, 12), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(2))
    F.cross_entropy(model(tokens), labels).backward()
    sgd_updates = {name: p.detach().clone().add_(p.grad, alpha=-0.1) for name, p in model.named_parameters()}
    optimizer.step()
    for name, p in model.named_parameters():
        if id(p) in kfac_params:
            assert not torch.allclose(p, sgd_updates[name], rtol=1e-3, atol=1e-6), f"{name} moved as SGD would"
        else:
            assert torch.equal(p, sgd_updates[name]), f"{name} did not take the SGD path"


def test_a_model_with_attention_copies_and_pickles_with_inert_taps() -> None:
    import copy
    import pickle

    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
    optimizer = KFAC(layer, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    clone = copy.deepcopy(layer)
    restored = pickle.loads(pickle.dumps(layer))
    for other in (clone, restored):
        other(torch.randn(5, 3, 8)).sum().backward()
    assert all(block.pending_samples == 0 for block in optimizer.blocks)  # the copies record nothing
    layer(torch.randn(5, 3, 8)).sum().backward()
    assert all(block.pending_samples > 0 for block in optimizer.blocks)


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_sequence_first_linear_blocks_count_the_length_as_samples_and_the_optimizer_warns(loss_reduction: str) -> None:
    """docs/numerics.md: attention blocks count the batch N in either layout, Linear blocks dim 0 of
    their input. The same layer and batch, sequence-first vs batch-first: every A and attention's G
    agree; the Linear blocks' G differs by L/N (mean loss) or N/L (sum), and only the sequence-first
    optimizer warns."""
    N, L, E = 3, 5, 8
    torch.manual_seed(0)
    first = nn.TransformerEncoderLayer(E, 2, 16, dropout=0.0, batch_first=True)
    seq = nn.TransformerEncoderLayer(E, 2, 16, dropout=0.0, batch_first=False)
    seq.load_state_dict(first.state_dict())
    x = torch.randn(N, L, E)
    reduce = (lambda t: t.sum()) if loss_reduction == "sum" else (lambda t: t.sum() / N)
    blocks = {}
    for layer, inputs, batch_dim in ((first, x, 0), (seq, x.transpose(0, 1), 1)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer = KFAC(layer, lr=0.1,
                             curvature=CurvatureConfig(loss_reduction=loss_reduction, factor_dtype=torch.float64,
                                                       inv_dtype=torch.float64),
                             **{"factor_update_steps": 1, "decomposition_update_steps": 10})
        notes = [str(w.message) for w in caught if "sequence-first attention" in str(w.message)]
        assert len(notes) == batch_dim, notes  # a warning for the sequence-first layer only
        reduce(layer(inputs).pow(2)).backward()
        optimizer.step()
        blocks[batch_dim] = {b.name: b for b in optimizer.blocks}
    assert set(blocks[0]) == {"self_attn.in_proj", "self_attn.out_proj", "linear1", "linear2"}
    ratio = L / N if loss_reduction == "mean" else N / L
    for name, block in blocks[0].items():
        other = blocks[1][name]
        torch.testing.assert_close(other.A.running, block.A.running, rtol=1e-10, atol=1e-12)
        scale = ratio if name.startswith("linear") else 1.0
        torch.testing.assert_close(other.G.running, scale * block.G.running, rtol=1e-10, atol=1e-12)


def test_a_module_called_twice_per_forward_adds_both_calls_rows_and_its_samples_once() -> None:
    """Weight sharing, "expand": A over the rows of both calls, G = (1/N) Σ ĝ ĝᵀ over both calls'
    per-sample output-gradients, N the batch size (not twice it)."""
    layer = nn.Linear(3, 3)
    x, target = torch.randn(5, 3), torch.randn(5, 3)
    hidden = layer(x)
    out = layer(torch.tanh(hidden))
    rows = {0: [], 1: []}
    for n in range(5):
        grads = torch.autograd.grad(0.5 * ((out[n] - target[n]) ** 2).sum(), [hidden, out], retain_graph=True)
        for call, grad in enumerate(grads):
            rows[call].append(grad[n])
    g_hat = torch.cat([torch.stack(rows[0]), torch.stack(rows[1])])
    a_rows = with_bias_column(torch.cat([x, torch.tanh(hidden).detach()]), True)
    A_ref, G_ref = reference_factors(a_rows, g_hat, 5)
    layer.zero_grad()
    optimizer = KFAC(layer, lr=1.0, kl_clip=None, damping=0.1,
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10, **DTYPES})
    (0.5 * ((layer(torch.tanh(layer(x))) - target) ** 2).sum(1).mean()).backward()
    optimizer.step()
    torch.testing.assert_close(optimizer.blocks[0].A.running, A_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(optimizer.blocks[0].G.running, G_ref, rtol=1e-12, atol=1e-12)


# -- normalization layers (opt-in blocks) ------------------------------------------------------


@pytest.mark.parametrize(
    "make_layer, shape",
    [
        (lambda: nn.LayerNorm(4), (3, 5, 4)),
        (lambda: nn.RMSNorm(4), (3, 5, 4)),
        (lambda: nn.GroupNorm(2, 4), (3, 4, 2, 3)),
        (lambda: nn.BatchNorm2d(4), (5, 4, 2, 3)),
        (lambda: nn.BatchNorm1d(4), (6, 4)),
    ],
    ids=["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm2d", "BatchNorm1d"],
)
def test_norm_blocks_are_the_exact_per_unit_fisher(make_layer, shape) -> None:
    """F_i = (1/N) Σ_n ŝ_ni ŝ_niᵀ, ŝ the per-sample gradient of (γ_i, β_i); direction (F_i + λI)⁻¹ ∇_i."""
    from kfac_optim.layers import ChannelNormBlock, LayerNormBlock, RMSNormBlock

    layer = make_layer()
    x = torch.randn(shape)
    with torch.no_grad():
        layer.weight.normal_()
        if getattr(layer, "bias", None) is not None:
            layer.bias.normal_()
    target = torch.randn_like(layer(x))
    N = shape[0]
    params = [layer.weight] + ([layer.bias] if getattr(layer, "bias", None) is not None else [])
    per_sample = []
    out = layer(x)
    for n in range(N):  # per-sample gradients of mean-loss terms, times N: ŝ
        loss = 0.5 * ((out[n] - target[n]) ** 2).sum()
        per_sample.append(torch.stack([g.reshape(-1) for g in torch.autograd.grad(loss, params, retain_graph=True)],
                                      -1))
    s_hat = torch.stack(per_sample)  # (N, units, 1 or 2)
    fisher = torch.einsum("nui,nuj->uij", s_hat, s_hat) / N
    norm_blocks = {nn.LayerNorm: LayerNormBlock, nn.RMSNorm: RMSNormBlock, nn.GroupNorm: ChannelNormBlock,
                   nn.BatchNorm1d: ChannelNormBlock, nn.BatchNorm2d: ChannelNormBlock}
    layer.zero_grad()
    curvature = CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64, blocks=norm_blocks)
    optimizer = KFAC(layer, lr=1.0, kl_clip=None, damping=0.1, curvature=curvature, factor_update_steps=1,
                     decomposition_update_steps=10)
    snapshot = [p.detach().clone() for p in params]
    (0.5 * ((layer(x) - target) ** 2).reshape(N, -1).sum(1).mean()).backward()
    grad = torch.stack([p.grad.reshape(-1) for p in params], -1)
    optimizer.step()
    block = optimizer.blocks[0]
    torch.testing.assert_close(block.A.running, fisher, rtol=1e-10, atol=1e-12)
    moved = torch.stack([(b - p.detach()).reshape(-1) for b, p in zip(snapshot, params, strict=True)], -1)
    expected = torch.linalg.solve(fisher + 0.1 * torch.eye(fisher.shape[-1]), grad.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(moved, expected, rtol=1e-9, atol=1e-12)


# -- weight sharing: "reduce" ------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_reduce_makes_one_row_per_sample_for_linear_leading_dims(bias: bool) -> None:
    """a_n = mean over positions of the inputs, ĝ_n = sum over positions of ĝ: A, G = (1/N) Σ."""
    layer = nn.Linear(4, 3, bias=bias)
    x, target = torch.randn(5, 6, 4), torch.randn(5, 6, 3)
    g_hat = per_sample_output_grads(layer, x, target).sum(1)  # (N, out)
    A_ref, G_ref = reference_factors(with_bias_column(x.mean(1), bias), g_hat, 5)
    layer.zero_grad()
    optimizer, grad, direction = one_kfac_step(layer, x, target, damping=0.1,
                                               curvature=CurvatureConfig(weight_sharing="reduce",
                                                                         factor_dtype=torch.float64,
                                                                         inv_dtype=torch.float64))
    torch.testing.assert_close(optimizer.blocks[0].A.running, A_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(optimizer.blocks[0].G.running, G_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(direction, kron_solve(G_ref, A_ref, grad, 0.1), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("groups", [1, 2])
def test_reduce_makes_one_row_per_sample_for_conv_positions(groups: int) -> None:
    layer = nn.Conv1d(4, 4, 3, padding=1, groups=groups)
    x = torch.randn(3, 4, 7)
    target = torch.randn_like(layer(x))
    patches = conv_patches_nd(layer, x).reshape(3, 7, -1).mean(1)  # (N, C·K)
    g_hat = per_sample_output_grads(layer, x, target).sum(-1)  # (N, C_out)
    layer.zero_grad()
    optimizer, _, _ = one_kfac_step(layer, x, target, damping=0.1,
                                    curvature=CurvatureConfig(weight_sharing="reduce", factor_dtype=torch.float64,
                                                              inv_dtype=torch.float64))
    block = optimizer.blocks[0]
    per_in, per_out = patches.shape[1] // groups, 4 // groups
    for j in range(groups):
        A_ref, G_ref = reference_factors(
            with_bias_column(patches[:, j * per_in : (j + 1) * per_in], True),
            g_hat[:, j * per_out : (j + 1) * per_out], 3
        )
        A = block.A.running if groups == 1 else block.A.running[j]
        G = block.G.running if groups == 1 else block.G.running[j]
        torch.testing.assert_close(A, A_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(G, G_ref, rtol=1e-12, atol=1e-12)



def test_reduce_for_attention_is_one_row_per_sample_per_projection() -> None:
    E, N, L, S = 4, 3, 2, 3
    mha = nn.MultiheadAttention(E, 2)
    query, key = torch.randn(L, N, E), torch.randn(S, N, E)
    target = torch.randn(L, N, E)
    (q, k, v), attended, final = attention_by_hand(mha, query, key, key)
    g_rows = per_sample_grads_of([q, k, v, final], final, target)
    lengths = (L, S, S, L)
    g_hat = [g.reshape(n, N, -1).sum(0) for g, n in zip(g_rows, lengths, strict=True)]
    a_rows = [query.mean(0), key.mean(0), key.mean(0), attended.detach().mean(0)]
    mha.zero_grad()
    optimizer = KFAC(mha, lr=1.0, kl_clip=None, damping=0.1,
                     curvature=CurvatureConfig(weight_sharing="reduce", factor_dtype=torch.float64,
                                               inv_dtype=torch.float64),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10})
    out, _ = mha(query, key, key, need_weights=False)
    (0.5 * ((out - target) ** 2).sum(-1).sum(0).mean()).backward()
    optimizer.step()
    in_proj, out_proj = optimizer.blocks
    for j in range(3):
        A_ref, G_ref = reference_factors(with_bias_column(a_rows[j], True), g_hat[j], N)
        torch.testing.assert_close(in_proj.A.running[j], A_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(in_proj.G.running[j], G_ref, rtol=1e-12, atol=1e-12)
    A_ref, G_ref = reference_factors(with_bias_column(a_rows[3], True), g_hat[3], N)
    torch.testing.assert_close(out_proj.A.running, A_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_proj.G.running, G_ref, rtol=1e-12, atol=1e-12)


# -- weight sharing across the calls of one forward (RNN-style) ----------------------------------


def rnn_forward(layer: nn.Linear, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``h_t = layer(tanh(h_{t-1}) + x_t)``, ``h_0 = layer(x_0)``: the calls' inputs and outputs."""
    call_inputs, outputs = [], []
    for t, x in enumerate(inputs):
        call_input = x if t == 0 else torch.tanh(outputs[-1]) + x
        call_inputs.append(call_input)
        outputs.append(layer(call_input))
    return call_inputs, outputs


def rnn_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over samples of ``0.5‖out_n − target_n‖²`` (positions summed)."""
    return 0.5 * ((out - target) ** 2).reshape(len(out), -1).sum(1).mean()


def rnn_reference(layer: nn.Linear, inputs: list[torch.Tensor], target: torch.Tensor, sharing: str):
    """Dense A and G from per-sample output-gradients of every call (Eschenhagen et al. 2023):
    expand: every (call, position) a row; reduce: per sample, the mean input and the summed ĝ."""
    N = len(target)
    call_inputs, outputs = rnn_forward(layer, inputs)
    g_hat = torch.zeros(len(outputs), *outputs[0].shape)  # (calls, N, *positions, out)
    for n in range(N):
        sample_loss = 0.5 * ((outputs[-1][n] - target[n]) ** 2).sum()
        for call, grad in enumerate(torch.autograd.grad(sample_loss, outputs, retain_graph=True)):
            g_hat[call, n] = grad[n]
    a = torch.stack([x.detach() for x in call_inputs])  # (calls, N, *positions, in)
    bias = layer.bias is not None
    if sharing == "expand":
        return reference_factors(with_bias_column(a.reshape(-1, a.shape[-1]), bias),
                                 g_hat.reshape(-1, g_hat.shape[-1]), N)
    a_n = a.movedim(0, 1).reshape(N, -1, a.shape[-1]).mean(1)
    g_n = g_hat.movedim(0, 1).reshape(N, -1, g_hat.shape[-1]).sum(1)
    return reference_factors(with_bias_column(a_n, bias), g_n, N)


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
@pytest.mark.parametrize("calls, shape", [(2, (5, 3)), (3, (4, 2, 3))], ids=["2-calls", "3-calls-positions"])
def test_a_module_called_several_times_per_forward_matches_the_dense_reference(sharing, calls, shape) -> None:
    layer = nn.Linear(3, 3)
    inputs = [torch.randn(shape) for _ in range(calls)]
    target = torch.randn(shape)
    A_ref, G_ref = rnn_reference(layer, inputs, target, sharing)
    layer.zero_grad()
    optimizer = KFAC(layer, lr=1.0, kl_clip=None, damping=0.1,
                     curvature=CurvatureConfig(weight_sharing=sharing, factor_dtype=torch.float64,
                                               inv_dtype=torch.float64),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10})
    before = torch.cat([layer.weight.detach(), layer.bias.detach()[:, None]], 1)
    rnn_loss(rnn_forward(layer, inputs)[1][-1], target).backward()
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
    optimizer.step()
    block = optimizer.blocks[0]
    torch.testing.assert_close(block.A.running, A_ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(block.G.running, G_ref, rtol=1e-9, atol=1e-12)
    moved = before - torch.cat([layer.weight.detach(), layer.bias.detach()[:, None]], 1)
    torch.testing.assert_close(moved, kron_solve(G_ref, A_ref, grad, 0.1), rtol=1e-9, atol=1e-12)


def test_reduce_across_calls_makes_one_row_per_sample_per_backward_under_gradient_accumulation() -> None:
    """Two backward passes (two micro-batches) before one step: 2N rows, each reduced over its own
    pass's calls; N = both passes' samples."""
    layer = nn.Linear(3, 3, bias=False)
    batches = [[torch.randn(4, 3) for _ in range(2)] for _ in range(2)]
    targets = [torch.randn(4, 3) for _ in range(2)]
    a_rows, g_rows = [], []
    for inputs, target in zip(batches, targets, strict=True):
        call_inputs, outputs = rnn_forward(layer, inputs)
        a_rows.append(torch.stack([x.detach() for x in call_inputs]).mean(0))
        for n in range(4):
            grads = torch.autograd.grad(0.5 * ((outputs[-1][n] - target[n]) ** 2).sum(), outputs, retain_graph=True)
            g_rows.append(sum(g[n] for g in grads))
    A_ref, G_ref = reference_factors(torch.cat(a_rows), torch.stack(g_rows), 8)
    optimizer = KFAC(layer, lr=1.0, kl_clip=None, damping=0.1,
                     curvature=CurvatureConfig(weight_sharing="reduce", factor_dtype=torch.float64,
                                               inv_dtype=torch.float64),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10})
    for inputs, target in zip(batches, targets, strict=True):  # each micro-batch loss: mean over the step's 8 samples
        (rnn_loss(rnn_forward(layer, inputs)[1][-1], target) / 2).backward()
    optimizer.step()
    torch.testing.assert_close(optimizer.blocks[0].A.running, A_ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(optimizer.blocks[0].G.running, G_ref, rtol=1e-9, atol=1e-12)
    assert optimizer.blocks[0]._input_sums is None  # nothing held past the fold


def test_reduce_across_calls_drops_the_held_sums_of_a_discarded_backward() -> None:
    """zero_grad() discards a backward no step consumed: its held per-sample sums go with it."""
    layer = nn.Linear(3, 3)
    inputs, target = [torch.randn(4, 3) for _ in range(2)], torch.randn(4, 3)
    A_ref, G_ref = rnn_reference(layer, inputs, target, "reduce")
    optimizer = KFAC(layer, lr=1.0, kl_clip=None, damping=0.1,
                     curvature=CurvatureConfig(weight_sharing="reduce", factor_dtype=torch.float64,
                                               inv_dtype=torch.float64),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10})
    rnn_loss(rnn_forward(layer, [torch.randn(4, 3) for _ in range(2)])[1][-1], torch.randn(4, 3)).backward()
    optimizer.zero_grad()
    rnn_loss(rnn_forward(layer, inputs)[1][-1], target).backward()
    optimizer.step()
    torch.testing.assert_close(optimizer.blocks[0].A.running, A_ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(optimizer.blocks[0].G.running, G_ref, rtol=1e-9, atol=1e-12)


# -- tied weights: an embedding and a Linear head sharing one Parameter ----------------------------


class TiedModel(nn.Module):
    """``head(tanh(embedding(tokens)))`` with ``head.weight = embedding.weight`` ``(V, D)``."""

    def __init__(self, vocabulary: int, dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, dim)
        self.head = nn.Linear(dim, vocabulary)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        embedded = self.embedding(tokens)
        hidden = torch.tanh(embedded)
        return embedded, hidden, self.head(hidden)


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
def test_tied_embedding_and_head_use_the_nearest_kronecker_product_of_both_uses(sharing: str) -> None:
    """Per use, from per-sample gradients: embedding diag(counts/(N·R)) ⊗ (1/N) Σ ĝ ĝᵀ; head
    diag((1/N) Σ ĝ²) ⊗ (1/(N·R)) Σ a aᵀ (reduce: per sample, mean a and summed ĝ). A ⊗ G must be
    the best rank-1 approximation (SVD) of the rearranged sum; the step (G ⊗ diag(A) + λI)⁻¹ ∇Wᵀ."""
    V, D, N, R = 7, 3, 4, 5
    model = TiedModel(V, D)
    tokens, target = torch.randint(0, V, (N, R)), torch.randn(N, R, V)
    embedded, hidden, logits = model(tokens)
    g_emb, g_head = torch.zeros(N, R, D), torch.zeros(N, R, V)
    for n in range(N):
        grads = torch.autograd.grad(0.5 * ((logits[n] - target[n]) ** 2).sum(), [embedded, logits], retain_graph=True)
        g_emb[n], g_head[n] = grads[0][n], grads[1][n]
    x1 = torch.bincount(tokens.reshape(-1), minlength=V).double() / (N * R)
    y1 = g_emb.reshape(-1, D).T @ g_emb.reshape(-1, D) / N
    a = hidden.detach()
    if sharing == "reduce":
        a_rows, g_rows = a.mean(1), g_head.sum(1)
    else:
        a_rows, g_rows = a.reshape(-1, D), g_head.reshape(-1, V)
    x2, y2 = g_rows.square().sum(0) / N, a_rows.T @ a_rows / len(a_rows)
    rearranged = torch.outer(x1, y1.reshape(-1)) + torch.outer(x2, y2.reshape(-1))
    U, S, Vh = torch.linalg.svd(rearranged, full_matrices=False)
    nearest = S[0] * torch.outer(U[:, 0], Vh[0])

    model.zero_grad()
    optimizer = KFAC(model, lr=1.0, kl_clip=None, damping=0.1,
                     curvature=CurvatureConfig(weight_sharing=sharing, factor_dtype=torch.float64,
                                               inv_dtype=torch.float64),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10})
    before = model.embedding.weight.detach().clone()
    (0.5 * ((model(tokens)[2] - target) ** 2).reshape(N, -1).sum(1).mean()).backward()
    grad = model.embedding.weight.grad.clone()
    optimizer.step()
    (block,) = optimizer.blocks
    A, G = block.A.running, block.G.running
    torch.testing.assert_close(torch.outer(A, G.reshape(-1)), nearest, rtol=1e-9, atol=1e-12)
    assert (A >= 0).all() and torch.linalg.eigvalsh(G).min() > -1e-12
    moved = (before - model.embedding.weight.detach()).T
    torch.testing.assert_close(moved, kron_solve(G, torch.diag(A), grad.T, 0.1), rtol=1e-9, atol=1e-12)


def test_tied_block_equals_the_untied_embedding_when_the_head_records_nothing() -> None:
    V, D = 6, 3
    tied, plain = TiedModel(V, D), nn.Embedding(V, D)
    with torch.no_grad():
        plain.weight.copy_(tied.embedding.weight)
    tokens, target = torch.randint(0, V, (4, 5)), torch.randn(4, 5, D)
    factors = []
    for model, embedding in ((tied, tied.embedding), (plain, plain)):
        optimizer = KFAC(model, lr=1.0, kl_clip=None, damping=0.1,
                         **{"factor_update_steps": 1, "decomposition_update_steps": 10, **DTYPES})
        (0.5 * ((embedding(tokens) - target) ** 2).reshape(4, -1).sum(1).mean()).backward()
        optimizer.step()
        factors.append((optimizer.blocks[0].A.running, optimizer.blocks[0].G.running))
    torch.testing.assert_close(factors[0][0], factors[1][0], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(factors[0][1], factors[1][1], rtol=1e-12, atol=1e-15)


def tied_use_statistics(model: TiedModel, tokens: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
    """``[x1, Y1, x2, Y2]`` of one batch from per-sample gradients (expand): the embedding's
    ``counts/(N·R)`` and ``(1/N) Σ ĝ ĝᵀ``, the head's ``(1/N) Σ ĝ²`` and ``(1/(N·R)) Σ a aᵀ``."""
    (N, R), (V, D) = tokens.shape, model.embedding.weight.shape
    embedded, hidden, logits = model(tokens)
    g_emb, g_head = torch.zeros(N, R, D), torch.zeros(N, R, V)
    for n in range(N):
        grads = torch.autograd.grad(0.5 * ((logits[n] - target[n]) ** 2).sum(), [embedded, logits], retain_graph=True)
        g_emb[n], g_head[n] = grads[0][n], grads[1][n]
    a = hidden.detach().reshape(-1, D)
    g_emb, g_head = g_emb.reshape(-1, D), g_head.reshape(-1, V)
    counts = torch.bincount(tokens.reshape(-1), minlength=V).double()
    return [counts / (N * R), g_emb.T @ g_emb / N, g_head.square().sum(0) / N, a.T @ a / (N * R)]


def test_tied_factors_are_the_nearest_kronecker_product_of_each_uses_running_average() -> None:
    """Two factor steps (lr 0: one set of weights): each use's four factors are running-averaged on
    their own, and A ⊗ G is the best rank-1 approximation of the sum of the averages (what 2 ranks
    averaging the use factors also give; combining each batch first and averaging the combinations
    is not the same)."""
    V, D, N, R, decay = 7, 3, 4, 5, 0.5
    model = TiedModel(V, D)
    batches = [(torch.randint(0, V, (N, R)), torch.randn(N, R, V)) for _ in range(2)]
    first, second = (tied_use_statistics(model, *b) for b in batches)
    x1, y1, x2, y2 = (decay * old + (1 - decay) * new for old, new in zip(first, second, strict=True))
    rearranged = torch.outer(x1, y1.reshape(-1)) + torch.outer(x2, y2.reshape(-1))
    U, S, Vh = torch.linalg.svd(rearranged, full_matrices=False)
    nearest = S[0] * torch.outer(U[:, 0], Vh[0])

    optimizer = KFAC(model, lr=0.0, kl_clip=None, damping=0.1,
                     curvature=CurvatureConfig(factor_decay=decay, factor_dtype=torch.float64, inv_dtype=torch.float64),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10})
    for tokens, target in batches:
        optimizer.zero_grad()
        (0.5 * ((model(tokens)[2] - target) ** 2).reshape(N, -1).sum(1).mean()).backward()
        optimizer.step()
    (block,) = optimizer.blocks
    torch.testing.assert_close(torch.outer(block.A.running, block.G.running.reshape(-1)), nearest,
                               rtol=1e-9, atol=1e-12)


def test_a_tied_block_resumes_from_a_checkpoint_with_both_uses_running_averages() -> None:
    """The checkpoint holds each use's running factors ("uses"): 2 steps, save, load into a fresh
    optimizer, 2 more steps equal 4 steps in one go; a checkpoint without them is refused by name."""
    V, D, N, R = 7, 3, 4, 5
    batches = [(torch.randint(0, V, (N, R)), torch.randn(N, R, V)) for _ in range(4)]

    def train(model: TiedModel, optimizer: KFAC, steps: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for tokens, target in steps:
            optimizer.zero_grad()
            (0.5 * ((model(tokens)[2] - target) ** 2).reshape(N, -1).sum(1).mean()).backward()
            optimizer.step()

    def build(model: TiedModel) -> KFAC:
        return KFAC(model, lr=0.1, momentum=0.9, damping=0.1,
                    curvature=CurvatureConfig(factor_decay=0.5, factor_dtype=torch.float64, inv_dtype=torch.float64),
                    decomposition_update_steps=1, factor_update_steps=1)

    torch.manual_seed(0)
    straight = TiedModel(V, D)
    train(straight, build(straight), batches)
    torch.manual_seed(0)
    first = TiedModel(V, D)
    optimizer = build(first)
    train(first, optimizer, batches[:2])
    state, weights = optimizer.state_dict(), first.state_dict()
    assert set(state["kfac"]["blocks"]["embedding"]["uses"]) == {"embedding_A", "embedding_G", "head_A", "head_G"}
    resumed = TiedModel(V, D)
    resumed.load_state_dict(weights)
    optimizer = build(resumed)
    optimizer.load_state_dict(state)
    train(resumed, optimizer, batches[2:])
    torch.testing.assert_close(resumed.embedding.weight, straight.embedding.weight, rtol=0, atol=1e-12)
    del state["kfac"]["blocks"]["embedding"]["uses"]
    with pytest.raises(ValueError, match="layer 'embedding': expected 'uses'"):
        build(TiedModel(V, D)).load_state_dict(state)


def test_reduce_across_calls_with_the_sampled_fisher_records_only_the_sampled_backward() -> None:
    """fisher="sampled": the per-sample sums come from sample_fisher's backward (one row per sample),
    at targets drawn with the same generator; the training backward adds nothing."""
    from kfac_optim.fisher import sample_targets

    layer = nn.Linear(3, 3)
    inputs, target = [torch.randn(5, 3) for _ in range(2)], torch.randn(5, 3)
    sampled = sample_targets(rnn_forward(layer, inputs)[1][-1].detach(), "mse", torch.Generator().manual_seed(3))
    A_ref, G_ref = rnn_reference(layer, inputs, sampled, "reduce")
    G_ref = G_ref * (2 / 3) ** 2  # the sampled loss is F.mse_loss per sample: ĝ = (2/D)(out − t)
    layer.zero_grad()
    optimizer = KFAC(layer, lr=1.0, kl_clip=None, damping=0.1,
                     curvature=CurvatureConfig(weight_sharing="reduce", fisher="sampled", factor_dtype=torch.float64,
                                               inv_dtype=torch.float64),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10})
    out = rnn_forward(layer, inputs)[1][-1]
    optimizer.sample_fisher(out, "mse", generator=torch.Generator().manual_seed(3))
    rnn_loss(out, target).backward()
    optimizer.step()
    torch.testing.assert_close(optimizer.blocks[0].A.running, A_ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(optimizer.blocks[0].G.running, G_ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 1e12, 1e-12])
def test_nearest_kronecker_sum_is_the_best_rank_one_fit_of_the_rearranged_sum(dtype, scale: float) -> None:
    """Against the SVD of ``[x1 x2][vec y1 vec y2]ᵀ``, terms of very different scales included (no
    under/overflow in float32); a zero second term gives the first back, split as given."""
    from kfac_optim.linalg import nearest_kronecker_sum

    x1, x2 = torch.rand(7, dtype=dtype), torch.rand(7, dtype=dtype) * scale
    m1, m2 = torch.randn(3, 3, dtype=dtype), torch.randn(3, 3, dtype=dtype)
    y1, y2 = m1 @ m1.T * scale, m2 @ m2.T
    x, y = nearest_kronecker_sum(x1, y1, x2, y2)
    rearranged = torch.outer(x1.double(), y1.double().reshape(-1)) + torch.outer(x2.double(), y2.double().reshape(-1))
    U, S, Vh = torch.linalg.svd(rearranged, full_matrices=False)
    nearest = S[0] * torch.outer(U[:, 0], Vh[0])
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert (torch.outer(x.double(), y.double().reshape(-1)) - nearest).norm() <= tolerance * nearest.norm()
    assert (x >= 0).all()
    x, y = nearest_kronecker_sum(x1, y1, torch.zeros_like(x1), torch.zeros_like(y1))
    torch.testing.assert_close(x, x1, rtol=tolerance, atol=0)
    torch.testing.assert_close(y, y1, rtol=tolerance, atol=tolerance * y1.abs().max().item())
