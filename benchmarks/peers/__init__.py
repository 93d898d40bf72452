"""K-FAC against its peers on the clock: SGD, AdamW, Muon, K-FAC and (optional) SOAP on five CPU tasks.

    python -m benchmarks.peers                      # default size: 120 runs, 20.7 min measured (--jobs 3, load 15 -> 5)
                                                    # before nanogpt (30 CPU s a run) joined the four tasks
    python -m benchmarks.peers --quick --tasks mlp  # a smoke run of seconds
    python -m benchmarks.peers --tasks gpt --optimizers adamw muon kfac --jobs 1
    python -m benchmarks.peers.transformer_goal runs/peers  # EigenAdam's transformer recipe against AdamW and Muon

Every optimizer gets the same tuning budget: the same number of learning rates (a grid of the
same shape around a per-family centre, `benchmarks.peers.optimizers`, grown by one rate beyond an
edge while the best sits there, at most twice), each trained on seed 0
for the task's training-CPU-time budget and scored on a validation split held out from
training; the best lr then runs on the other seeds, and the test metric is reported
(`benchmarks.peers.protocol`). Weight decay is fixed per task, the same value for everyone (0 on
every task here: the runs are seconds long, and the optimizers do not share one decay
convention). Each task's batch size and budget are the same for every optimizer
(`benchmarks.peers.tasks`). The tables (`benchmarks.peers.analysis`) give the time to the best
peer's final metric and to AdamW's, and the metric at equal time.
"""
