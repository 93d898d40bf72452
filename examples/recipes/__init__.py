"""Short runnable recipes: K-FAC under DDP, mixed precision, gradient accumulation, checkpoint/resume,
on a transformer, and in the shape of PyTorch's ImageNet example (`imagenet`: ``mp.spawn`` DDP,
rank-0 checkpoints, ``--resume``, ``torch.amp``; synthetic images).

Each is a module with ``--help``: ``python -m examples.recipes.<name>`` from the repository root
(``torchrun ... -m examples.recipes.ddp`` for the distributed one). Most train a small MLP on a
synthetic classification task (`toy`); `transformer` trains a character-level language model on
the source of Python's ``argparse`` module. `ranks` is the DDP and FSDP recipes' ``torchrun`` setup.
They need only torch, and each prints what it checks.
"""
