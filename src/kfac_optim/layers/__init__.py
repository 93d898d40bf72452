"""Kronecker blocks, one per supported module kind, and the registry that picks them.

Built-in registrations: ``nn.Linear``; ``nn.Conv1d``, ``nn.Conv2d``, ``nn.Conv3d`` (any groups);
``nn.Embedding``; ``nn.MultiheadAttention`` (input projections and ``out_proj``); Hugging Face's
``transformers.pytorch_utils.Conv1D`` (a Linear with its weight transposed, registered by name:
transformers is not imported). Add your own with :func:`register_block`. Normalization layers have blocks
(``layers.norm``) that are not registered by default.
"""

from __future__ import annotations

from torch import nn

from kfac_optim.layers.attention import InProjectionBlock, OutProjectionBlock, ProjectionBlock
from kfac_optim.layers.base import KroneckerBlock
from kfac_optim.layers.conv import ConvBlock
from kfac_optim.layers.conv_statistics import ConvStatistics, Expand, Reduce, ReduceAbove, SampledPositions
from kfac_optim.layers.embedding import EmbeddingBlock
from kfac_optim.layers.factor import DiagonalFactor, Factor
from kfac_optim.layers.linear import LinearBlock, TransposedLinearBlock
from kfac_optim.layers.norm import ChannelNormBlock, LayerNormBlock, NormBlock, RMSNormBlock
from kfac_optim.layers.registry import (
    ModuleReport,
    block_kind,
    discover,
    discover_blocks,
    register_block,
    register_block_by_path,
    registered_blocks,
    unregister_block,
)

for _module_type, _block_class in (
    (nn.Linear, LinearBlock),
    (nn.Conv1d, ConvBlock),
    (nn.Conv2d, ConvBlock),
    (nn.Conv3d, ConvBlock),
    (nn.Embedding, EmbeddingBlock),
    (nn.MultiheadAttention, InProjectionBlock),
):
    register_block(_module_type, _block_class)
register_block_by_path("transformers.pytorch_utils.Conv1D", TransposedLinearBlock)

__all__ = [
    "ChannelNormBlock",
    "LayerNormBlock",
    "NormBlock",
    "RMSNormBlock",
    "ConvBlock",
    "ConvStatistics",
    "Expand",
    "Reduce",
    "ReduceAbove",
    "SampledPositions",
    "DiagonalFactor",
    "EmbeddingBlock",
    "Factor",
    "InProjectionBlock",
    "KroneckerBlock",
    "LinearBlock",
    "ModuleReport",
    "OutProjectionBlock",
    "ProjectionBlock",
    "TransposedLinearBlock",
    "block_kind",
    "discover",
    "discover_blocks",
    "register_block",
    "register_block_by_path",
    "registered_blocks",
    "unregister_block",
]
