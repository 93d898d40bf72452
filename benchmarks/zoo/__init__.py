"""The zoo of real-library models (:mod:`benchmarks.zoo.models`): one place builds them for the
benchmarks and for ``tests/models/``."""

from benchmarks.zoo.models import ZOO, ZooBatch, ZooModel, available

__all__ = ["ZOO", "ZooBatch", "ZooModel", "available"]
