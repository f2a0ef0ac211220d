"""JSONL prompt datasets and a resumable, seeded batch iterator over them (other formats: ``formats``)."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["DatasetError", "load_jsonl", "read_jsonl", "parse_jsonl", "PromptIterator"]


class DatasetError(ValueError):
    """A dataset file or dataset setting is unusable; the message says which file, line and field."""


def load_jsonl(path: str | os.PathLike, required_keys: Sequence[str] = ()) -> list[dict]:
    """Read one JSON object per line; blank lines are skipped (see ``read_jsonl``)."""
    return [row for _, row in read_jsonl(path, required_keys)]


def read_jsonl(path: str | os.PathLike, required_keys: Sequence[str] = ()) -> list[tuple[int, dict]]:
    """``(line number, row)`` for every JSON object in a JSONL file; blank lines are skipped.

    Args:
        path: the ``.jsonl`` file.
        required_keys: keys every row must have (e.g. ``("prompt", "answer")``).

    Raises:
        DatasetError: the file is missing or empty, or a line is not UTF-8, not valid JSON, not an
            object, or lacks a required key. Messages name ``file:line``.
    """
    file = Path(path)
    if not file.is_file():
        what = "is a directory, not a file" if file.is_dir() else "does not exist"
        raise DatasetError(
            f"dataset file '{path}' {what} (set data.train_path / data.eval_path to a JSONL file; "
            f"relative paths are resolved from the working directory {os.getcwd()})"
        )
    with file.open("rb") as f:
        rows = parse_jsonl(path, f, required_keys)
    if not rows:
        raise DatasetError(f"dataset file '{path}' has no rows (it is empty or only blank lines)")
    return rows


def parse_jsonl(
    path: str | os.PathLike, lines: Iterable[bytes], required_keys: Sequence[str] = ()
) -> list[tuple[int, dict]]:
    """``(line number, row)`` for every JSON object in ``lines`` (the raw lines of ``path``, which names
    them in errors); see ``read_jsonl``."""
    rows: list[tuple[int, dict]] = []
    for lineno, raw in enumerate(lines, start=1):
        where = f"{path}:{lineno}"
        try:
            # utf-8-sig: a byte-order mark that some editors write first is not part of the JSON.
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise DatasetError(
                f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                "JSONL files must be UTF-8: re-save the file as UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
        missing = [k for k in required_keys if k not in row]
        if missing:
            raise DatasetError(
                f"{where}: row is missing required key(s) {missing}; the row has keys {sorted(row)}"
            )
        rows.append((lineno, row))
    return rows


class PromptIterator:
    """Endless seeded iteration over rows in batches of ``batch_size``, reshuffled each epoch.

    Every batch has exactly ``batch_size`` rows: the rows left at the end of an epoch that cannot fill
    a batch are skipped (they come back in another order next epoch). The order of epoch ``e`` depends
    only on ``(seed, e)``, so ``state_dict`` needs just the epoch and the position inside it.

    Attributes:
        epoch: epoch of the most recent batch (0 before the first).
        position: rows of the current epoch's order already returned.
    """

    def __init__(self, rows: list[dict], batch_size: int, seed: int = 0, shuffle: bool = True) -> None:
        if batch_size < 1:
            raise DatasetError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size > len(rows):
            raise DatasetError(
                f"batch_size {batch_size} is larger than the dataset ({len(rows)} rows); "
                "lower the batch size or add rows"
            )
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            # A string seed is hashed with SHA-512 by `random`, so the order is the same in every process
            # and Python version, and distinct (seed, epoch) pairs never collide as summed ints could.
            random.Random(f"roll.PromptIterator:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[dict]:
        """The next ``batch_size`` rows (shallow copies, so callers may add fields freely)."""
        return [dict(self.rows[i]) for i in self.next_indices()]

    def next_indices(self) -> list[int]:
        """Row indices of the next batch (for callers that keep per-row data alongside the rows)."""
        if self.position + self.batch_size > len(self.rows):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        indices = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return indices

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> list[dict]:
        return self.next_batch()

    def state_dict(self) -> dict:
        """Epoch and position, plus what the order depends on (checked on load)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": len(self.rows),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` so the following batches equal those of the run that saved it.

        Raises:
            DatasetError: the dataset size, seed or shuffle setting differs from the saved run, which
                would silently change the data order.
        """
        expected = {"seed": self.seed, "shuffle": self.shuffle, "num_rows": len(self.rows)}
        changed = [
            f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in expected.items() if state.get(k) != v
        ]
        if changed:
            raise DatasetError(
                "cannot resume the prompt order because the data setup changed (" + "; ".join(changed) + ")"
            )
        position = int(state["position"])
        if not 0 <= position <= len(self.rows):
            raise DatasetError(f"saved position {position} is outside the dataset of {len(self.rows)} rows")
        self.epoch = int(state["epoch"])
        self.position = position
        self._order = self._epoch_order(self.epoch)
