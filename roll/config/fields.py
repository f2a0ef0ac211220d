"""``option``: a dataclass field that carries its one-line documentation."""

from __future__ import annotations

import copy
import dataclasses
import typing
from typing import Any

REQUIRED = "???"


def option(default: Any = dataclasses.MISSING, help: str = "") -> Any:  # noqa: A002 - mirrors argparse
    """Declare a config field with its default and a one-line doc shown by ``roll config --docs``."""
    if not help:
        raise ValueError("every config field needs a one-line help text")
    metadata = {"help": help}
    if default is dataclasses.MISSING:
        # OmegaConf's marker for a mandatory value: reading it unset raises MissingMandatoryValue.
        return dataclasses.field(default=REQUIRED, metadata={**metadata, "required": True})
    if isinstance(default, (list, dict, set)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def nested_dataclass(annotation: Any) -> type | None:
    """The dataclass inside ``X`` or ``X | None``, else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def field_docs(cls: type, prefix: str = "") -> dict[str, str]:
    """Map every dotted field name of a config dataclass (nested ones too) to its help text."""
    hints = typing.get_type_hints(cls)
    docs: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        docs[name] = f.metadata.get("help", "")
        inner = nested_dataclass(hints[f.name])
        if inner is not None:
            docs.update(field_docs(inner, prefix=f"{name}."))
    return docs
