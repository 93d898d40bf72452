"""Measurement scripts (step time, scaling, communication bytes, work plans, AMP steps) and RESULTS.md.

Run from the repository root as modules, e.g. ``python -m benchmarks.step_time --help``. They use
`kfac_optim` and, for data and models, the training application in `examples.training`;
`benchmarks.output` writes a script's JSON and plot, and the JSON a study of searches resumes from.
"""
