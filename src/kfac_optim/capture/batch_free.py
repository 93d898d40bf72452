"""Layers whose input has no batch dimension: found at the first factor step and left to SGD.

Owns: deciding, from the pending statistics of one factor step, which blocks were called with an
input that carries no batch dimension (embeddings with 1-D indices; any block kind whose every call
held one sample while other blocks saw batches), turning them to the SGD path, and saying so (a
one-time warning per block, and the reason in ``KFAC.describe()``; docs/design.md §3 "What N is").
Must not know: factor math, schedules, ranks (every rank decides from its own shapes; with equal
per-rank batch shapes they decide alike).

The pattern is a learned position embedding ``h = token(x) + position(torch.arange(T))``: the
position block's input is ``(T,)`` and its output ``(T, D)``, broadcast over the batch of N samples.
Autograd sums the output-gradient over the batch before the block's hook sees it, so the hook gets
``s_t = Σ_b g_bt`` and the per-sample rows ``g_bt`` are gone. No ``G`` built from ``s`` is a
per-sample Fisher: ``E[s sᵀ] = μμᵀ + (F − μμᵀ)/N`` (μ the mean per-sample gradient) mixes both terms
with weights that depend on N, so its statistics depend on the batch size and the world size.
Measured on the tiny GPT of tests/integration/test_feeding.py (trace of ``G``, mean of 8 batches, B=8 over
B=128): the per-sample reference (the token embedding's ``G``, which has the same rows ``∂ℓ/∂h``)
1.00; counting the T positions as samples (the old behaviour) 1.67; weight sharing over the known
batch size, ``G = N Σ_t s_t s_tᵀ``, 0.10 (and 22x the reference at B=128). So such a layer takes
the SGD path. The price, measured on the tiny GPT of benchmarks/transformer_diagnosis.py (B=16,
T=64, width 64, 2 blocks, 150 steps, lr 0.1 and 0.3, seeds 0 and 1): the held-out loss with the
position embedding preconditioned the old way was lower in 3 of 4 runs, by 0.008 and 0.019 on
average per lr, less than the spread between seeds (0.05-0.08).

The same holds for every block kind: Swin-V2's continuous position bias runs an MLP (Linear layers)
on a ``(1, T, T, 2)`` table of relative coordinates and broadcasts its ``(1, T, T, heads)`` output over
the batch; its output-gradient is summed over the batch just as well (its ``G`` changed ~10x between
batch 8 and 128). Such a call has one sample (dim 0 of size 1, or an unbatched input): a block
whose every call since the last fold held one sample, while another block saw more than one per
call, takes the SGD path too (a batch of 1 for the whole model is an ordinary batch). Not in a
sequence-first model (``nn.MultiheadAttention(batch_first=False)`` beside other blocks): there the
attention blocks count the batch and the others the sequence length, so a batch of one sequence
would look batch-free to the attention blocks (``layers.attention.sequence_first_note``).

The test tells a batch-free index tensor from a batch of token ids (``nn.Embedding(classes, D)``
called with labels ``(N,)`` is an ordinary batched use) by the batch of the same forward: a block
called with 1-D indices of length ``L`` per call is batch-free when the other blocks recorded a
different number of samples, N ≠ L, each counted once per call of the model (a table called twice in
one forward, as a diffusion transformer's class embedding, counts its labels once). When N = L it is taken as batched;
if another block's inputs also have L positions per sample (positions from ``arange(T)`` with a batch of
exactly T), the case is ambiguous and a warning says so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kfac_optim.diagnostics import warn_user
from kfac_optim.layers.attention import sequence_first_note
from kfac_optim.layers.base import KroneckerBlock
from kfac_optim.layers.embedding import EmbeddingBlock

logger = logging.getLogger(__name__)

REASON = (
    "its indices have no batch dimension (1-D, e.g. positions from torch.arange(T) broadcast over the batch): "
    "autograd sums its output-gradient over the batch before K-FAC sees it, so no per-sample statistics exist "
    "(docs/design.md §3, 'What N is')"
)
SINGLE_SAMPLE_REASON = (
    "its input has no batch dimension (one sample per call, e.g. a (1, T, T, 2) position table broadcast over "
    "the batch): autograd sums its output-gradient over the batch before K-FAC sees it, so no per-sample "
    "statistics exist (docs/design.md §3, 'What N is')"
)


def leave_batch_free_blocks_to_sgd(blocks: Sequence[KroneckerBlock]) -> dict[str, str]:
    """Turn the batch-free blocks among ``blocks`` to the SGD path (see the module docstring), from
    their pending statistics, and return their names with the reason. Call it once, with the
    pending statistics of a factor step settled."""
    left = _left_embeddings(blocks)
    batched = [] if sequence_first_note(list(blocks)) else [b for b in blocks if b.calls[0] > b.calls[1]]
    for block in blocks:
        calls, single = block.calls
        if block.sgd_reason is not None or not calls or single < calls or not batched:
            continue
        block.leave_to_sgd(SINGLE_SAMPLE_REASON)
        left[block.name] = SINGLE_SAMPLE_REASON
        warn_user(f"K-FAC layer '{block.name}' takes the SGD path: {SINGLE_SAMPLE_REASON}; each of its {calls} "
                  f"call(s) held one sample while other layers saw batches (e.g. '{batched[0].name}')",
                  RuntimeWarning)
    if left:
        logger.info("batch-free layers left to SGD: %s", sorted(left))
    return left


def _left_embeddings(blocks: Sequence[KroneckerBlock]) -> dict[str, str]:
    """The embedding blocks called with 1-D indices that are positions, not a batch, turned to SGD."""
    candidates = [b for b in blocks if isinstance(b, EmbeddingBlock) and b.unbatched[0] and b.sgd_reason is None]
    batched = [b for b in blocks if b.pending_samples and b not in candidates]
    left: dict[str, str] = {}
    for block in candidates:
        calls, rows = block.unbatched
        length = rows / calls
        if not batched:
            warn_user(f"K-FAC layer '{block.name}' was called with 1-D indices and no other layer recorded a batch "
                      "to compare with: it is taken as a batch of token ids", RuntimeWarning)
            continue
        # N is counted once per model call, the same for every layer (KroneckerBlock.count_samples), so the
        # table's own count is the batch's. Its indices per call are a batch when they number N per model
        # call: each call (calls = model calls) or all its calls in one model call (a conditioning table
        # called twice per forward, as a diffusion transformer's class embedding).
        batch = max(b.pending_samples for b in batched)
        if length not in (block.pending_samples / calls, block.pending_samples):
            block.leave_to_sgd(REASON)
            left[block.name] = REASON
            warn_user(f"K-FAC layer '{block.name}' takes the SGD path: {REASON}; its {length:g} indices per call "
                      f"({block.pending_samples} counted as samples) differ from the {batch} samples the other "
                      "layers saw", RuntimeWarning)
        elif length > 1 and any(b.A.pending_rows == length * b.pending_samples for b in batched):
            warn_user(f"K-FAC layer '{block.name}' was called with 1-D indices of length {length:g}, the batch size, "
                      f"and other layers see {length:g} positions per sample: it is taken as a batch of token ids; "
                      f"if they are positions broadcast over the batch, its statistics depend on the batch size "
                      "(docs/design.md §3, 'What N is'): use a batch size other than the sequence length, or "
                      "skip_layers", RuntimeWarning)
    return left
