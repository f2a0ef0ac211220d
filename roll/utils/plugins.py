"""User modules that register their own rewards, estimators or losses (``imports:`` in a config).

They are imported in the driver before the config is validated, so their registry names check out,
and again in every worker process, where the registries are used.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from collections.abc import Sequence


def import_plugins(modules: Sequence[str], search_path: str | None = None) -> None:
    """Import ``modules``; ``search_path`` (the driver's working directory) is tried first, the way
    ``python -m`` finds modules next to the user. Raises ImportError naming the module and, when the
    module itself is broken (a syntax error, an exception while it runs), the file and line."""
    if search_path and search_path not in sys.path:
        sys.path.insert(0, search_path)
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and (module == e.name or module.startswith(f"{e.name}.")):
                raise ImportError(f"cannot import '{module}' (listed in `imports`): {e}") from e
            raise ImportError(f"cannot import '{module}' (listed in `imports`): {_describe(e)}") from e
        except Exception as e:  # anything the module raises while it runs is the module's own error
            raise ImportError(f"cannot import '{module}' (listed in `imports`): {_describe(e)}") from e


def _describe(error: Exception) -> str:
    """``file:line: Kind: message`` for an error raised inside a module's own code."""
    if isinstance(error, SyntaxError):
        where, message = f"{error.filename}:{error.lineno}", error.msg
    else:
        # The innermost frame outside the import machinery is where the module's code failed.
        frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<")]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        message = str(error)
    return f"{where}: {type(error).__name__}: {message}"
