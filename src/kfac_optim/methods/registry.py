"""The methods the optimizer's ``method`` argument names: :data:`METHODS`, filled by
:func:`register_method` (each method's module registers its class), and :func:`method_named`.

Owns: the name → class table and turning a name (or a :class:`~kfac_optim.methods.base.Method`)
into a method with its defaults. Must not know: what any method computes.
"""

from __future__ import annotations

from kfac_optim.methods.base import Method
from kfac_optim.methods.decompositions import Decomposer

METHODS: dict[str, type[Method]] = {}
"""The methods the optimizer's ``method`` argument names (:func:`register_method` adds one)."""


def register_method(cls: type[Method]) -> type[Method]:
    """Register ``cls`` under its ``name`` for the optimizer's ``method`` argument (usable as a class
    decorator; a method in its own module registers itself there). ``ValueError`` when the name is
    taken by another class."""
    if METHODS.setdefault(cls.name, cls) is not cls:
        raise ValueError(f"method name {cls.name!r} is taken by {METHODS[cls.name].__name__}")
    return cls


def method_named(name: str | Method) -> Method:
    """The :class:`Method` registered as ``name`` (:data:`METHODS`: ``"eigen"``, ``"inverse"``,
    ``"eigen_adam"``, ...) with its defaults; a :class:`Method` is returned as is. ``TypeError`` when
    the method has no :attr:`Method.decomposer`."""
    if isinstance(name, Method):
        method = name
    elif name not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {name!r}")
    else:
        method = METHODS[name]()
    if not isinstance(getattr(method, "decomposer", None), Decomposer):
        raise TypeError(f"method {type(method).__name__} has no decomposer: set Method.decomposer to a "
                        "kfac_optim.methods.decompositions.Decomposer (how its factors are decomposed, "
                        "shipped and saved)")
    return method
