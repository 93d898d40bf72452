"""The training application behind ``python -m examples.train``: one small module per job.

config (YAML runs and overrides), data (digits, CIFAR-10, ImageNet folders, synthetic images),
models (the networks and their tasks), optimizers (SGD, AdamW, KFAC and LR schedules),
mixed_precision (autocast, GradScaler, Apex), process_group (torchrun setup), trainer (the loop,
checkpoints, resume), report (records and the comparison table), plotting.
"""
