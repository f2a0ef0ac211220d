"""Full training state on disk, written atomically.

A checkpoint is one directory, ``<output_dir>/checkpoints/step_00000040``, holding everything a run
needs to go on as if it had never stopped: each trainer's weights, optimizer and LR schedule (torch
distributed checkpoint, one file per rank, reshardable) and its weights again in Hugging Face format,
every worker's and the driver's RNG states, and the pipeline's own state (``pipeline.pt``: step,
dataset cursor and prompts in flight, adaptive KL coefficient, the health monitors' history).

Nothing half-written is ever loaded. The state is written into a hidden staging directory; when every
file is there, a manifest of their sizes and SHA-256 checksums is written last and the directory is
renamed into place (one ``rename``, atomic on POSIX). Loading verifies the manifest; a checkpoint that
fails (truncated, corrupted, no manifest) is skipped with a warning and the previous one is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
MANIFEST = "manifest.json"
PIPELINE_STATE = "pipeline.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_STAGING_PREFIX = ".staging-"
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or none can be loaded; the message says which and why."""


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def save_checkpoint(root: Path, step: int, write: Callable[[Path], None], keep_last: int) -> Path:
    """Write the checkpoint of ``step`` under ``root`` through ``write(staging_dir)``, then commit it
    (manifest, rename) and prune all but the newest ``keep_last``. Returns the checkpoint's path.

    Raises:
        CheckpointError: the directory cannot be written (permissions, a full disk, ...) or ``write``
            failed. The staging directory is removed; every earlier checkpoint is untouched.
    """
    final = root / step_dir_name(step)
    staging = root / f"{_STAGING_PREFIX}{step_dir_name(step)}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
        write(staging)
        manifest = {"step": step, "created": time.time(), "files": _describe(staging)}
        _write_synced(staging / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        if final.exists():  # a step saved again after a restart rewound past it
            shutil.rmtree(final)
        os.replace(staging, final)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, OSError):
            kept = latest_valid(root, warn=False)
            raise CheckpointError(
                f"could not write the checkpoint of step {step} to {root}: {error}. "
                + (f"The previous checkpoint {kept} is intact. " if kept else "")
                + "Free disk space or make the directory writable (or set output_dir elsewhere)."
            ) from error
        raise
    try:
        _fsync_dir(root)
    except OSError as error:  # committed all the same; only its durability across a power cut is unsure
        logger.warning("could not fsync %s after saving step %d: %s", root, step, error)
    # Later checkpoints belong to a history this run abandoned (it resumed from an earlier one): the
    # newest checkpoint must always be this run's.
    for later, path in list_checkpoints(root):
        if later > step:
            shutil.rmtree(path, ignore_errors=True)
    prune(root, keep_last)
    return final


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoint directories under ``root`` as ``(step, path)``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def verify(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded (missing manifest, a file missing, truncated or
    corrupted), or None when every file matches its manifest entry."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = {
            str(name): (int(entry["size"]), str(entry["sha256"])) for name, entry in manifest["files"].items()
        }
    except FileNotFoundError:
        return "it has no manifest (it was never completed)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"its manifest is unreadable ({type(error).__name__}: {error})"
    for name, (size_expected, digest) in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != size_expected:
            return f"{name} has {size} bytes, the manifest says {size_expected} (truncated?)"
        if _sha256(file) != digest:
            return f"{name} does not match its checksum (corrupted)"
    return None


def latest_valid(root: Path, warn: bool = True) -> Path | None:
    """The newest checkpoint under ``root`` that verifies; broken ones are skipped with a warning."""
    for _, path in reversed(list_checkpoints(root)):
        problem = verify(path)
        if problem is None:
            return path
        if warn:
            logger.warning("skipping checkpoint %s: %s; trying the previous one", path, problem)
    return None


def checkpoint_step(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    if match is None:
        raise CheckpointError(f"{path} is not a checkpoint directory (expected a name like step_00000040)")
    return int(match.group(1))


def resolve(output_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint ``resume`` names: ``"latest"`` (newest valid one of the run, None if there is
    none), a checkpoint directory, or a run directory (its newest valid one).

    Raises:
        CheckpointError: a named checkpoint does not exist or fails verification.
    """
    if resume == "latest":
        return latest_valid(checkpoints_root(output_dir))
    path = Path(resume)
    if (path / CHECKPOINTS_DIR).is_dir():
        found = latest_valid(path / CHECKPOINTS_DIR)
        if found is None:
            raise CheckpointError(f"{path} holds no complete checkpoint to resume from")
        return found
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    checkpoint_step(path)
    problem = verify(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {problem}")
    return path


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints, and staging directories that a dead
    process left behind (never the live one of this process)."""
    for _, path in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
    for entry in root.glob(f"{_STAGING_PREFIX}*"):
        if not entry.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(entry, ignore_errors=True)


def _describe(directory: Path) -> dict[str, dict[str, Any]]:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_synced(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (a crash right after it keeps the new name)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
