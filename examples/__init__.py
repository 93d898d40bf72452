"""The training application and small runnable recipes built on `kfac_optim` (not installed).

Run from the repository root as modules: ``python -m examples.train`` (a YAML config's runs,
compared), ``python -m examples.sweep`` (grid search), ``python -m examples.recipes.<name>``.
`examples.training` holds the application's parts (config, data, models, optimizers, mixed
precision, process group, trainer, report, plotting). Nothing in `kfac_optim` imports this package.
"""
