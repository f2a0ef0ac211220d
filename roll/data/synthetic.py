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


def fraction_rows(count: int, seed: int = 0) -> list[dict]:
    """Math with LaTeX answers, for math-verify: ``\\frac{a}{d}+\\frac{b}{d}=`` -> ``\\frac{a+b}{d}`` (any
    equal value, e.g. the reduced fraction or a decimal, is also right)."""
    problems = [(a, b, d) for d in range(2, 10) for a in range(1, 10) for b in range(1, 10)]
    return [
        {"prompt": f"\\frac{{{a}}}{{{d}}}+\\frac{{{b}}}{{{d}}}=", "answer": f"\\frac{{{a + b}}}{{{d}}}"}
        for a, b, d in _sample(problems, count, seed)
    ]


# Countdown equations the generator builds targets from: every number used once, a reference answer.
_COUNTDOWN_FORMS = {
    "{0}+{1}+{2}": lambda a, b, c: a + b + c,
    "{0}*{1}+{2}": lambda a, b, c: a * b + c,
    "{0}*{1}-{2}": lambda a, b, c: a * b - c,
    "{0}+{1}-{2}": lambda a, b, c: a + b - c,
    "({0}+{1})*{2}": lambda a, b, c: (a + b) * c,
}


def countdown_rows(count: int, seed: int = 0) -> list[dict]:
    """Countdown with three numbers: ``3,5,7=22`` asks for an equation using each of 3, 5 and 7 once
    that makes 22 (reference ``answer``: one such equation)."""
    problems = [
        (form, (a, b, c))
        for form in _COUNTDOWN_FORMS
        for a in range(1, 10)
        for b in range(1, 10)
        for c in range(1, 10)
        if a <= b  # + and * commute: (a, b) and (b, a) give the same problem
    ]
    rows, seen = [], set()
    for form, numbers in _sample(problems, len(problems), seed):
        equation, target = form.format(*numbers), _COUNTDOWN_FORMS[form](*numbers)
        shown = sorted(numbers)
        key = (tuple(shown), target)
        if target <= 0 or key in seen:
            continue
        seen.add(key)
        prompt = ",".join(map(str, shown)) + f"={target}"
        rows.append({"prompt": prompt, "numbers": shown, "target": target, "answer": equation})
        if len(rows) == count:
            return rows
    raise ValueError(f"only {len(rows)} distinct countdown problems exist; asked for {count}")


def linear_code_rows(count: int, seed: int = 0) -> list[dict]:
    """Code: from ``f(0)=1,f(1)=4`` write the body of ``f=lambda x:`` (``3*x+1``); the tests call f on
    0..3, so the pass fraction credits a right intercept with a wrong slope."""
    problems = [(slope, intercept) for slope in range(1, 10) for intercept in range(0, 20)]
    return [
        {
            "prompt": f"f(0)={b},f(1)={a + b}",
            "answer": f"{a}*x+{b}",
            "code_prefix": "f=lambda x:",
            "tests": [{"call": f"f({x})", "expected": a * x + b} for x in range(4)],
        }
        for a, b in _sample(problems, count, seed)
    ]


# The colours of examples/data/shapes, as RGB; each drawn with a little noise so no two images are equal.
SHAPE_COLOURS = {
    "red": (210, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 210),
    "yellow": (225, 195, 30),
}
SHAPES_PROMPT = "how many and what colour?"


def shape_rows(count: int, image_size: int = 56, seed: int = 0) -> list[dict]:
    """``{"prompt", "images": [PNG bytes], "answer": "<count> <colour>"}`` rows: a white picture whose
    quadrants hold 1 to 4 squares of one colour (size, place and shade drawn at random), asked how many
    squares there are and their colour. Reading the picture is the only way to the answer: 16 answers,
    so a blind guess scores 1/16."""
    import io

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    half = image_size // 2
    rows = []
    for _ in range(count):
        colour = rng.choice(sorted(SHAPE_COLOURS))
        quadrants = rng.sample(range(4), rng.randint(1, 4))
        image = Image.new("RGB", (image_size, image_size), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        for quadrant in quadrants:
            side = rng.randint(half // 2, half - 4)
            left = (quadrant % 2) * half + rng.randint(1, half - side - 1)
            top = (quadrant // 2) * half + rng.randint(1, half - side - 1)
            shade = tuple(min(255, max(0, c + rng.randint(-25, 25))) for c in SHAPE_COLOURS[colour])
            draw.rectangle([left, top, left + side - 1, top + side - 1], fill=shade)
        encoded = io.BytesIO()
        image.save(encoded, format="PNG")
        rows.append(
            {"prompt": SHAPES_PROMPT, "images": [encoded.getvalue()], "answer": f"{len(quadrants)} {colour}"}
        )
    return rows


def write_shapes_split(directory: str | Path, train: int = 2000, held_out: int = 200, seed: int = 0) -> None:
    """Write ``train.parquet`` and ``eval.parquet`` of ``shape_rows`` (images as PNG bytes, the way
    ``datasets`` stores an image column) into ``directory``; the held-out pictures are drawn apart."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, rows in (
        ("train", shape_rows(train, seed=seed)),
        ("eval", shape_rows(held_out, seed=seed + 1)),
    ):
        pq.write_table(pa.Table.from_pylist(rows), directory / f"{name}.parquet")


def _sample(items: list, count: int, seed: int) -> list:
    if count > len(items):
        raise ValueError(f"only {len(items)} distinct problems exist; asked for {count}")
    shuffled = list(items)
    random.Random(seed).shuffle(shuffled)
    return shuffled[:count]


# Domain -> (row generator, training rows, held-out rows) of examples/data/multi_domain.
MULTI_DOMAIN_SPLITS = {
    "math": (fraction_rows, 548, 100),
    "countdown": (countdown_rows, 1000, 100),
    "code": (linear_code_rows, 140, 40),
}


def write_multi_domain_split(directory: str | Path, seed: int = 0) -> None:
    """Write ``<domain>/train.jsonl`` and a disjoint ``<domain>/eval.jsonl`` for each domain of
    ``MULTI_DOMAIN_SPLITS`` into ``directory``."""
    for name, (generate, train, held_out) in MULTI_DOMAIN_SPLITS.items():
        rows = generate(train + held_out, seed=seed)
        _write_split(Path(directory) / name, rows[held_out:], rows[:held_out])


def _write_split(directory: Path, train: list[dict], held_out: list[dict]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, part in (("eval.jsonl", held_out), ("train.jsonl", train)):
        with open(directory / name, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in part)


if __name__ == "__main__":
    import sys

    task = sys.argv[1] if len(sys.argv) > 1 else "addition"
    if task == "multi_domain":
        write_multi_domain_split(sys.argv[2] if len(sys.argv) > 2 else "examples/data/multi_domain")
    elif task == "shapes":
        write_shapes_split(sys.argv[2] if len(sys.argv) > 2 else "examples/data/shapes")
    else:
        write_addition_split(sys.argv[2] if len(sys.argv) > 2 else "examples/data/addition")
