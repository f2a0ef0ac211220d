"""Optional dependencies shipped as extras of roll-rl (``pip install 'roll-rl[wandb]'``).

Config validation asks ``is_installed`` (finds the package without importing it, so a load stays fast and
a broken optional package cannot break a run that does not use it); the code that needs the package
calls ``import_extra`` when it first runs, so a missing one is an error naming the extra to install.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


def install_hint(extra: str) -> str:
    return f"pip install 'roll-rl[{extra}]'"


def is_installed(module: str) -> bool:
    """Whether the top-level ``module`` can be imported (looked up, not imported)."""
    return importlib.util.find_spec(module) is not None


def import_extra(module: str, extra: str) -> ModuleType:
    """``import module``; raises ImportError naming the extra when the package itself is missing (an
    error inside an installed package is raised as it is)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module:
            raise
        raise ImportError(f"{module} is not installed; install the extra: {install_hint(extra)}") from error
