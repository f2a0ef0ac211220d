"""Row fields under ROLL's names: a dataset's own column names mapped onto the ones ROLL reads.

ROLL reads the prompt from ``prompt`` and the reference answer (the SFT target, and what most rewards
compare with) from ``answer``; rewards may read other fields by name. ``data.columns`` maps any of
these names onto a column of the user's data, e.g. ``{prompt: question, answer: solution}``. No torch:
config code imports this.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from roll.data.dataset import DatasetError
from roll.data.formats import Located
from roll.data.images import IMAGES  # noqa: F401 - a row field, as PROMPT and ANSWER are

PROMPT = "prompt"
ANSWER = "answer"
# What `data.columns` maps when it does not say otherwise: every field from the column of its own name.
DEFAULT_COLUMNS: dict[str, str] = {PROMPT: PROMPT, ANSWER: ANSWER}


def merged_columns(*layers: Mapping[str, str]) -> dict[str, str]:
    """``DEFAULT_COLUMNS`` with each layer's entries over the earlier ones (data.columns, then a
    domain's columns)."""
    merged = dict(DEFAULT_COLUMNS)
    for layer in layers:
        merged.update(layer)
    return merged


def check_columns(key: str, columns: Mapping[str, str]) -> list[str]:
    """Config problems of a column mapping at ``key`` (``data.columns``, ``domains.<name>.columns``)."""
    return [
        f"{key}.{field}: '{column}' is not a column name; map the field to the name of a column of your data"
        for field, column in columns.items()
        if not isinstance(column, str) or not column.strip()
    ]


def map_columns(
    located: Sequence[Located], columns: Mapping[str, str], required: Sequence[str], key: str = "data.columns"
) -> list[dict]:
    """The rows with each mapped column renamed to its field (``columns``: field -> column; other
    columns kept as they are), after checking that every row has a value for each ``required`` field.

    Raises:
        DatasetError: at the first row that lacks a required column or holds null in it, naming the row
            (``where``), the column, and the ``key`` that maps it.
    """
    renamed = {field: column for field, column in columns.items() if field != column}
    rows = []
    for where, row in located:
        for field in required:
            column = columns.get(field, field)
            if column not in row:
                mapped = f" (the column {key} maps onto '{field}')" if column != field else ""
                raise DatasetError(
                    f"{where}: row is missing required key(s) ['{column}']{mapped}; the row has keys "
                    f"{sorted(row)}: rename the column, or map it with {key}.{field}=<your column>"
                )
            if row[column] is None:
                raise DatasetError(f"{where}: '{column}' is null; every row needs a value there")
        if renamed:
            values = {field: row[column] for field, column in renamed.items() if column in row}
            row = {name: value for name, value in row.items() if name not in renamed.values()}
            row.update(values)
        rows.append(row)
    return rows
