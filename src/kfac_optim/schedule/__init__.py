"""Schedule: when curvature work happens: the factor and decomposition intervals (constant,
milestone schedules or chosen from the cost model), the cost model itself, and the staggering of
decompositions across steps. Decides only when, never what is computed. See docs/architecture.md.
"""
