"""Why a layer of a registered kind still takes the SGD path, whatever its block: the reasons that
hold for every block kind.

Owns: recognising modules whose parameters K-FAC's real, weight-space factors do not describe:
complex parameters, weights under ``torch.nn.utils.parametrize`` (``weight_norm``,
``spectral_norm``, ...) and weights pruned with ``torch.nn.utils.prune``; and the reason given for
a ``ParametrizationList`` (the module that holds a parametrized weight's originals).
Must not know: blocks, hooks, the step. Discovery (``layers.registry``) asks it first, before a
block's own ``unsupported_reason``.
"""

from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.prune import BasePruningMethod


def declined_reason(module: nn.Module) -> str | None:
    """Why no block may precondition ``module`` (None: its block decides), in words for ``describe()``."""
    if any(p.is_complex() for p in module.parameters(recurse=False)):
        return ("complex parameters: K-FAC's factors are real and would drop the imaginary part of the "
                "gradient; they take the SGD path (real and imaginary parts train exactly as under SGD)")
    if parametrize.is_parametrized(module):
        kinds = ", ".join(f"{name} by {_parametrization_kinds(plist)}"
                          for name, plist in module.parametrizations.items())
        return (f"parametrized weight ({kinds}; torch.nn.utils.parametrize): its gradient reaches the "
                "parametrization's originals, not the weight the factors describe; they take the SGD path")
    pruned = [hook._tensor_name for hook in module._forward_pre_hooks.values() if isinstance(hook, BasePruningMethod)]
    if pruned:
        names = ", ".join(pruned)
        return (f"pruned with torch.nn.utils.prune ({names} = {names}_orig ⊙ mask): the gradient reaches "
                f"{names}_orig, not the weight the factors describe; it takes the SGD path")
    return None


def originals_reason(module: nn.Module) -> str | None:
    """For a ``ParametrizationList`` (``<layer>.parametrizations.<weight>``): why its originals take
    the SGD path (None for any other module)."""
    if not isinstance(module, parametrize.ParametrizationList):
        return None
    return (f"the originals of a weight parametrized by {_parametrization_kinds(module)} "
            "(torch.nn.utils.parametrize): K-FAC preconditions a layer's own weight, not a parametrization's "
            "inputs; they take the SGD path")


def _parametrization_kinds(plist: nn.ModuleList) -> str:
    """The parametrizations' class names, e.g. ``_WeightNorm``."""
    return " then ".join(type(p).__name__ for p in plist)
