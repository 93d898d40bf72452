"""Warnings attributed to the user's line of code.

The optimizer warns from deep inside ``step()``, which users reach through ``torch.optim``'s step
wrappers, ``GradScaler.step`` or Apex amp's patched step, so no fixed ``stacklevel`` names the right
line. :func:`warn_user` walks the stack to the first frame outside those packages.
"""

import sys
import warnings

_INTERNAL_PACKAGES = ("kfac_optim", "torch", "apex", "contextlib")  # contextlib: decorator frames


def _is_internal(module_name: str) -> bool:
    return module_name.split(".", 1)[0] in _INTERNAL_PACKAGES


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointed at the nearest caller outside kfac_optim, torch and apex."""
    frame = sys._getframe(1)  # warn_user's caller, which warnings.warn knows as stacklevel 2
    level = 2
    while frame.f_back is not None and _is_internal(frame.f_globals.get("__name__", "")):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
