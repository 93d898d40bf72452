"""Short runnable recipes: K-FAC under DDP, mixed precision, gradient accumulation, checkpoint/resume.

Each is a module with ``--help``: ``python -m examples.recipes.<name>`` from the repository root
(``torchrun ... -m examples.recipes.ddp`` for the distributed one). They train a small MLP on a
synthetic classification task (`toy`), so they need only torch, and each prints what it checks.
"""
