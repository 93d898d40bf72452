"""Estimator: the blocks' Kronecker factors over time: folding captured statistics into running
averages (inline or in a background worker), the decomposition steps, and the directions they
give. Knows no param groups, learning rates or step lengths. See docs/architecture.md.
"""
