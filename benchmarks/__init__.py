"""The project's training harness: `benchmarks/train.py` and the small modules it is built from.

Nothing in `kfac_optim` imports this package; it imports `kfac_optim` only to build the optimizer.
"""
