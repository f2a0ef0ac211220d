"""Dataset files in the formats users keep them in, read locally into rows, each with where it came from.

JSONL and JSON are read with the standard library (errors name the line and column), Parquet and Arrow
with pyarrow (the Arrow backend of Hugging Face ``datasets``), CSV with the standard library (every cell
is text: "007" stays "007"), and a directory written by ``datasets``' ``save_to_disk`` with
``datasets.load_from_disk``, which memory-maps it. Nothing here touches the network.

Every row comes with a ``where`` that names it in error messages: ``file:line`` for JSONL (the line in
an editor) and ``file row N`` (1-based) for the other formats.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

from roll.data.dataset import DatasetError, parse_jsonl, read_jsonl

__all__ = ["FORMATS", "Located", "data_format", "read_rows"]

# File extension (lower case) -> format. A directory is a dataset saved with `datasets`.
FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
SAVED = "saved"  # the format of a `save_to_disk` directory
# Files `save_to_disk` writes: a Dataset has both of the first two, a DatasetDict the third.
_DATASET_FILES = ("state.json", "dataset_info.json")
_DATASET_DICT_FILE = "dataset_dict.json"

# (where, row): a row and the place that names it in error messages.
Located = tuple[str, dict]


def data_format(path: str | os.PathLike) -> str:
    """The format of the dataset at ``path`` (a value of ``FORMATS`` or ``"saved"``), from its
    extension or, for a directory, the files ``save_to_disk`` writes. Reads no data.

    Raises:
        DatasetError: nothing is at ``path``, its extension is not a known one, or it is a directory
            that ``datasets`` did not save.
    """
    file = Path(path)
    if file.is_dir():
        if (file / _DATASET_DICT_FILE).is_file() or all((file / name).is_file() for name in _DATASET_FILES):
            return SAVED
        raise DatasetError(
            f"'{path}' is a directory, but not a dataset saved with Hugging Face datasets' save_to_disk "
            f"(it has no {_DATASET_DICT_FILE}, or no {' and '.join(_DATASET_FILES)}); point it at a data "
            f"file ({_supported()}) or at such a directory"
        )
    if not file.exists():
        raise DatasetError(
            f"dataset file '{path}' does not exist (relative paths are resolved from the working "
            f"directory {os.getcwd()})"
        )
    fmt = FORMATS.get(file.suffix.lower())
    if fmt is None:
        what = f"extension '{file.suffix}'" if file.suffix else "no extension"
        raise DatasetError(
            f"dataset file '{path}' has {what}, which names no dataset format; use one of {_supported()}, "
            "or a directory saved with datasets' save_to_disk (rename the file if its content is one "
            "of these formats)"
        )
    return fmt


def _supported() -> str:
    return ", ".join(FORMATS)


def read_rows(path: str | os.PathLike) -> list[Located]:
    """Every row of the dataset at ``path`` as a dict, with the ``where`` that names it; the file is read
    once. A DatasetDict directory must hold one split, or the path must name one (``DIR/train``).

    Raises:
        DatasetError: the path is unusable (see ``data_format``), the file does not parse, a row is not
            an object, or there are no rows. Messages name the file and the line or row.
    """
    fmt = data_format(path)
    if fmt == "jsonl":
        located = [(f"{path}:{lineno}", row) for lineno, row in read_jsonl(path)]
    elif fmt == "json":
        located = _read_json(path)
    elif fmt == "csv":
        located = _read_csv(path)
    else:
        located = _read_arrow_backed(path, fmt)
    if not located:
        raise DatasetError(f"dataset '{path}' has no rows")
    return located


def _numbered(path: str | os.PathLike, rows: list, label: str = "") -> list[Located]:
    return [(f"{path}{label} row {i}", row) for i, row in enumerate(rows, start=1)]


def _text(path: str | os.PathLike, raw: bytes) -> str:
    """``raw`` (the bytes of ``path``) as UTF-8 text, a leading byte-order mark dropped, or an error
    naming the line."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise DatasetError(
            f"{path}:{line}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {column}); re-save the "
            "file as UTF-8"
        ) from None


def _read_json(path: str | os.PathLike) -> list[Located]:
    """A JSON array of objects; a ``.json`` file holding one object per line is read as JSONL."""
    raw = Path(path).read_bytes()
    text = _text(path, raw)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and text.lstrip().startswith("{"):  # JSON Lines under a .json name
            return [(f"{path}:{lineno}", row) for lineno, row in parse_jsonl(path, io.BytesIO(raw))]
        raise DatasetError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, list):
        raise DatasetError(
            f"{path}: a .json dataset must be an array of row objects ([{{...}}, {{...}}]) or one object per "
            f"line, got a JSON {type(data).__name__}"
        )
    located = _numbered(path, data)
    for where, row in located:
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: each row must be a JSON object, got {type(row).__name__}")
    return located


def _read_csv(path: str | os.PathLike) -> list[Located]:
    """A header line naming the columns, then one row per record; every cell is text."""
    reader = csv.reader(io.StringIO(_text(path, Path(path).read_bytes()), newline=""))
    try:
        header = next(reader)
    except StopIteration:
        return []
    except csv.Error as e:
        raise DatasetError(f"{path}:1: invalid CSV header ({e})") from None
    duplicated = sorted({name for name in header if header.count(name) > 1})
    if duplicated:
        raise DatasetError(f"{path}:1: the header names column(s) {duplicated} more than once; rename them")
    located: list[Located] = []
    line = reader.line_num  # the line a record starts on (a quoted cell may span lines)
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            return located
        except csv.Error as e:
            raise DatasetError(f"{path}:{line + 1}: invalid CSV ({e})") from None
        where = f"{path} row {len(located) + 1} (line {line + 1})"
        line = reader.line_num
        if not cells:
            continue  # a blank line
        if len(cells) != len(header):
            raise DatasetError(
                f"{where}: has {len(cells)} cells but the header names {len(header)} columns; quote "
                "cells that hold commas"
            )
        located.append((where, dict(zip(header, cells, strict=True))))


def _read_arrow_backed(path: str | os.PathLike, fmt: str) -> list[Located]:
    """The rows of a Parquet file, an Arrow IPC file or stream, or a saved dataset directory."""
    import pyarrow as pa

    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return _numbered(path, pq.read_table(path).to_pylist())
        if fmt == "arrow":
            return _numbered(path, _read_arrow_file(path).to_pylist())
        return _read_saved(path)
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"dataset '{path}' cannot be read as {fmt}: {e}") from None


def _read_arrow_file(path: str | os.PathLike):  # -> pyarrow.Table
    """Arrow's file format (Feather v2, ``pyarrow.ipc.new_file``) or its stream format, which is what
    ``datasets`` writes into its caches and ``save_to_disk`` directories."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            return pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_stream(source).read_all()


def _read_saved(path: str | os.PathLike) -> list[Located]:
    """A ``save_to_disk`` directory; for a DatasetDict, its only split."""
    # Offline before `datasets` is first imported (it reads the setting then): loading from disk never
    # needs the network, and nothing must try.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    loaded = datasets.load_from_disk(str(path))
    label = ""
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if len(splits) != 1:
            choices = ", ".join(f"'{Path(path) / name}'" for name in splits)
            raise DatasetError(
                f"'{path}' is a DatasetDict with splits {splits}; point the path at the one to use: {choices}"
            )
        label = f" (split '{splits[0]}')"
        loaded = loaded[splits[0]]
    return _numbered(path, loaded.to_list(), label)
