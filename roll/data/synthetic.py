"""Small verifiable tasks generated from a seed, for the quickstart and tests (no downloads)."""

from __future__ import annotations

import json
import random
from pathlib import Path


def addition_rows(
    count: int, max_operand: int = 99, seed: int = 0, exclude: set[str] | None = None
) -> list[dict]:
    """Distinct ``{"prompt": "a+b", "answer": "a+b's value"}`` rows with 0 <= a, b <= max_operand."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    rows = []
    for a, b in pairs:
        prompt = f"{a}+{b}"
        if exclude and prompt in exclude:
            continue
        rows.append({"prompt": prompt, "answer": str(a + b)})
        if len(rows) == count:
            return rows
    raise ValueError(
        f"only {len(rows)} distinct problems exist with max_operand={max_operand}; asked for {count}"
    )


def write_addition_split(
    directory: str | Path, train: int = 4000, held_out: int = 200, seed: int = 0
) -> None:
    """Write ``train.jsonl`` and a disjoint ``eval.jsonl`` into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rows = addition_rows(train + held_out, seed=seed)
    for name, part in (("eval.jsonl", rows[:held_out]), ("train.jsonl", rows[held_out:])):
        with open(directory / name, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in part)


if __name__ == "__main__":
    import sys

    write_addition_split(sys.argv[1] if len(sys.argv) > 1 else "examples/data/addition")
