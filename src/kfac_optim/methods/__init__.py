"""Decomposition methods as types: how a pair of factor decompositions is applied to a gradient.

One module per method (``eigen``, ``inverse``, ``eigen_adam``, ``root``), the interface they share
(``base.Method``, ``base.Basis``), the registry the optimizer's ``method`` argument reads
(``registry``), and the other axis, how each factor is decomposed, shipped, saved and sized
(``decompositions.Decomposer``, ``power_refresh``). Below ``registry.method_named`` no method is
named by a string or tested by type: blocks, checkpoints and the distributed layer ask a method
(or its decomposer) for what depends on it (docs/design.md §3).
Must not know: modules, hooks, ranks, schedules; a factor is read through
``decompositions.FactorView`` (``layers.factor.Factor`` is one).

A joint gradient is ``(out, in)`` (or ``(k, out, in)`` for grouped factors) with ``G`` on the left
and ``A`` on the right; the formulas: docs/numerics.md, "Methods and the update" and "Eigen-Adam".
A new method: one module with a subclass of ``base.Method`` registered with
``registry.register_method`` and imported here (docs/architecture.md). This face gathers the
public names of the package's modules.
"""

from kfac_optim.methods.base import Basis, Method
from kfac_optim.methods.decompositions import Decomposer, FactorView
from kfac_optim.methods.eigen import DEFAULT_MAX_RANK, Eigen, rotate, unrotate
from kfac_optim.methods.eigen_adam import EIGEN_ADAM_MAX_RANK, EIGEN_ADAM_THIN_WIDTH, REFRESHES, EigenAdam
from kfac_optim.methods.inverse import DampedInverse
from kfac_optim.methods.registry import METHODS, method_named, register_method
from kfac_optim.methods.root import RootKronecker

__all__ = ["DEFAULT_MAX_RANK", "EIGEN_ADAM_MAX_RANK", "EIGEN_ADAM_THIN_WIDTH", "METHODS", "REFRESHES", "Basis",
           "DampedInverse", "Decomposer", "Eigen", "EigenAdam", "FactorView", "Method", "RootKronecker",
           "method_named", "register_method", "rotate", "unrotate"]
