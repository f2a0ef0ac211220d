"""Read back what an offline W&B run wrote, with wandb's own record type and no network.

wandb 0.31 ships no Python reader of its ``.wandb`` files (its writer and ``wandb sync`` are in the Go
``wandb-core``), so this reads the file format: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then
LevelDB-log records in 32 KiB blocks (4-byte checksum, 2-byte length, 1-byte type: full, first, middle,
last), each payload a ``wandb_internal_pb2.Record`` protobuf.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32768
FILE_HEADER = struct.Struct("<4sHB")
CHUNK_HEADER = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """Every record of one ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = FILE_HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path} is not a W&B 0.x data file"
    found, pending, position = [], b"", FILE_HEADER.size
    while position + CHUNK_HEADER.size <= len(data):
        left = BLOCK - position % BLOCK
        if left < CHUNK_HEADER.size:  # the writer pads a block's tail that cannot hold a header
            position += left
            continue
        _, length, kind = CHUNK_HEADER.unpack_from(data, position)
        if kind == 0:
            position += left
            continue
        start = position + CHUNK_HEADER.size
        pending += data[start : start + length]
        position = start + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
            pending = b""
    return found


@dataclass
class Segment:
    """One ``wandb.init`` of a run: its config, the step it rewound the run to, the rows it logged."""

    directory: Path
    run_id: str
    project: str
    tags: list[str]
    start_time: float
    config: dict[str, Any]
    rewound_to: int | None
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)


def _value(item: Any) -> tuple[str, Any]:
    key = "/".join(item.nested_key) if item.nested_key else item.key
    return key, json.loads(item.value_json)


def segments(wandb_dir: Path) -> list[Segment]:
    """Every offline run under ``wandb_dir`` (``<dir>/offline-run-*``), oldest first."""
    found = []
    for path in wandb_dir.glob("offline-run-*/run-*.wandb"):
        segment = None
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
                config = dict(_value(item) for item in run.config.update)
                branch = config.get("_wandb", {}).get("branch_point")
                start = run.start_time.seconds + run.start_time.nanos / 1e9
                rewound_to = int(branch["step"]) if branch else None
                segment = Segment(
                    path.parent, run.run_id, run.project, list(run.tags), start, config, rewound_to
                )
            elif kind == "history":
                assert segment is not None
                row = dict(_value(item) for item in record.history.item)
                segment.rows.setdefault(int(row["_step"]), {}).update(row)
        assert segment is not None, f"{path} holds no run record"
        found.append(segment)
    return sorted(found, key=lambda s: s.start_time)


def history(found: list[Segment]) -> dict[int, dict[str, Any]]:
    """The run's history as W&B shows it once the segments are synced in order: a rewind cuts the rows
    after its step, then the segment's rows follow."""
    rows: dict[int, dict[str, Any]] = {}
    for segment in found:
        if segment.rewound_to is not None:
            rows = {step: row for step, row in rows.items() if step <= segment.rewound_to}
        for step, row in segment.rows.items():
            rows.setdefault(step, {}).update(row)
    return dict(sorted(rows.items()))


def table(segment: Segment, step: int, key: str) -> dict[str, Any]:
    """The table (``{"columns", "data"}``) that ``segment`` logged under ``key`` at ``step``."""
    path = segment.rows[step][f"{key}/path"]
    return json.loads((segment.directory / "files" / path).read_text())
