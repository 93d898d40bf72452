"""Capture: the forward and backward hooks that record each block's layer inputs and output
gradients, the per-call bookkeeping (shared weights, tied uses, compiled graphs, batch-free
modules), and when capture is armed. Hands plain tensors to the estimator; knows no factor math.
See docs/architecture.md.
"""
