"""The stand-in's ``apex.amp`` namespace, exporting what Apex's ``apex/amp/__init__.py`` does.

See the ``apex`` package docstring for what is modelled and what is left out.
"""

from ._amp_state import _amp_state, master_params
from .amp import init
from .frontend import initialize, load_state_dict, state_dict
from .handle import disable_casts, scale_loss

__all__ = [
    "_amp_state",
    "disable_casts",
    "init",
    "initialize",
    "load_state_dict",
    "master_params",
    "scale_loss",
    "state_dict",
]
