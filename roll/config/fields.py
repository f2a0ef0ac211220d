"""``option``: a dataclass field that carries its one-line documentation and, optionally, its bounds."""

from __future__ import annotations

import copy
import dataclasses
import typing
from typing import Any

REQUIRED = "???"


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",  # noqa: A002 - mirrors argparse
    *,
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
) -> Any:
    """Declare a config field with its default, a one-line doc shown by ``roll config --docs`` and the
    bounds its value must respect (``gt``: >, ``ge``: >=, ``le``: <=; each entry of a list; an unset
    optional value is not checked). ``out_of_bounds`` reports violations under the field's dotted key at
    load time."""
    if not help:
        raise ValueError("every config field needs a one-line help text")
    metadata: dict[str, Any] = {"help": help}
    bounds = {name: value for name, value in (("gt", gt), ("ge", ge), ("le", le)) if value is not None}
    if bounds:
        metadata["bounds"] = bounds
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


def named_sections(annotation: Any) -> type | None:
    """The dataclass ``X`` of a ``dict[str, X]`` field (sections keyed by a name), else None."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is dict and len(args) == 2:
        return nested_dataclass(args[1])
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
        named = named_sections(hints[f.name])
        if named is not None:
            docs.update(field_docs(named, prefix=f"{name}.<name>."))
    return docs


def _bound_text(bounds: dict[str, float]) -> str:
    low = "(" if "gt" in bounds else "[" if "ge" in bounds else None
    if low is not None and "le" in bounds:
        return f"in {low}{bounds.get('gt', bounds.get('ge'))}, {bounds['le']}]"
    if "le" in bounds:
        return f"<= {bounds['le']}"
    return f"> {bounds['gt']}" if "gt" in bounds else f">= {bounds['ge']}"


def _within(value: float, bounds: dict[str, float]) -> bool:
    return (
        ("gt" not in bounds or value > bounds["gt"])
        and ("ge" not in bounds or value >= bounds["ge"])
        and ("le" not in bounds or value <= bounds["le"])
    )


def out_of_bounds(config: Any, prefix: str = "") -> list[str]:
    """``"<key> must be > 0 (got -1)"`` for every field of ``config`` (nested sections too) whose value
    is outside the bounds its ``option`` declares."""
    problems = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            problems += out_of_bounds(value, prefix=f"{prefix}{f.name}.")
            continue
        if isinstance(value, dict):  # named sections, e.g. RLVR's domains
            for name, section in value.items():
                if dataclasses.is_dataclass(section):
                    problems += out_of_bounds(section, prefix=f"{prefix}{f.name}.{name}.")
            continue
        bounds = f.metadata.get("bounds")
        if bounds and isinstance(value, (int, float)) and not _within(value, bounds):
            problems.append(f"{prefix}{f.name} must be {_bound_text(bounds)} (got {value})")
        elif bounds and isinstance(value, (list, tuple)):  # a list of numbers: each element
            outside = [v for v in value if isinstance(v, (int, float)) and not _within(v, bounds)]
            if outside:
                problems.append(f"{prefix}{f.name}: each entry must be {_bound_text(bounds)} (got {outside})")
    return problems
