"""``python -m benchmarks.large_batch``: steps and CPU time to a target accuracy as the batch grows.

Two tasks on MNIST-1D-style data generated here (``data.py``, 40k samples), batches from 128 to the
largest with several steps per epoch; SGD, AdamW, Muon, SOAP (if heavyball is installed) and K-FAC (the
drop-in and EigenAdam), each with the same lr grid at every batch (``study.py``), and the projection of
the measured step counts to P data-parallel GPUs on ResNet-50 (``projection.py``). docs/large_batch.md.
"""
