"""User modules that register their own rewards, estimators or losses (``imports:`` in a config).

They are imported in the driver before the config is validated, so their registry names check out,
and again in every worker process, where the registries are used.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence


def import_plugins(modules: Sequence[str], search_path: str | None = None) -> None:
    """Import ``modules``; ``search_path`` (the driver's working directory) is tried first, the way
    ``python -m`` finds modules next to the user. Raises ImportError naming the module."""
    if search_path and search_path not in sys.path:
        sys.path.insert(0, search_path)
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ImportError(f"cannot import '{module}' (listed in `imports`): {e}") from e
