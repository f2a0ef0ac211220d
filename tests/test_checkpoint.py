"""Atomic checkpoints: manifest and commit, pruning, write failures, verification, resume resolution."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from roll import checkpoint
from roll.checkpoint import CheckpointError

FILES = {"pipeline.pt": b"pipeline state " * 50, "actor/rank_0.distcp": bytes(range(256)) * 8}


def writer(files: dict[str, bytes] = FILES) -> Callable[[Path], None]:
    """A ``write`` callback that puts ``files`` (nested names allowed) into the staging directory."""

    def write(staging: Path) -> None:
        for name, data in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)

    return write


def staging_dirs(root: Path) -> list[Path]:
    return sorted(root.glob(".staging-*"))


def steps(root: Path) -> list[int]:
    return [step for step, _ in checkpoint.list_checkpoints(root)]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return checkpoint.checkpoints_root(tmp_path / "run")


def flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:-10])


# --- save -----------------------------------------------------------------------------------------------


def test_save_writes_a_step_directory_with_a_manifest_of_every_file(root: Path) -> None:
    """The committed directory is step_00000004; its manifest lists each file's size and SHA-256."""
    path = checkpoint.save_checkpoint(root, 4, writer(), keep_last=2)

    assert path == root / "step_00000004"
    assert path.is_dir()
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    assert manifest["step"] == 4
    assert manifest["files"] == {
        name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in FILES.items()
    }
    assert checkpoint.verify(path) is None
    assert staging_dirs(root) == []
    assert checkpoint.checkpoint_step(path) == 4


def test_keep_last_prunes_older_checkpoints(root: Path) -> None:
    """Only the newest ``keep_last`` checkpoints remain after each save."""
    for step in (1, 2, 3, 4):
        checkpoint.save_checkpoint(root, step, writer(), keep_last=2)
    assert steps(root) == [3, 4]


def test_pruning_waits_until_the_new_checkpoint_is_complete(root: Path) -> None:
    """While ``write`` runs, every old checkpoint is still there; a failed save prunes nothing."""
    checkpoint.save_checkpoint(root, 1, writer(), keep_last=1)
    seen_during_write: list[list[int]] = []

    def write(staging: Path) -> None:
        seen_during_write.append(steps(root))
        writer()(staging)

    checkpoint.save_checkpoint(root, 2, write, keep_last=1)
    assert seen_during_write == [[1]]
    assert steps(root) == [2]

    def failing(staging: Path) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(CheckpointError):
        checkpoint.save_checkpoint(root, 3, failing, keep_last=1)
    assert steps(root) == [2]


def test_saving_a_step_again_replaces_it(root: Path) -> None:
    """A step saved again (a restart rewound past it) replaces the old directory with the new state."""
    checkpoint.save_checkpoint(root, 5, writer({"pipeline.pt": b"old"}), keep_last=2)
    path = checkpoint.save_checkpoint(root, 5, writer({"pipeline.pt": b"new"}), keep_last=2)
    assert (path / "pipeline.pt").read_bytes() == b"new"
    assert checkpoint.verify(path) is None
    assert steps(root) == [5]


def test_a_full_disk_gives_checkpoint_error_and_keeps_the_previous_checkpoint(root: Path) -> None:
    """ENOSPC from ``write``: CheckpointError naming the step and the intact previous checkpoint."""
    previous = checkpoint.save_checkpoint(root, 4, writer(), keep_last=2)

    def full_disk(staging: Path) -> None:
        (staging / "pipeline.pt").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError) as caught:
        checkpoint.save_checkpoint(root, 8, full_disk, keep_last=2)

    message = str(caught.value)
    assert "step 8" in message
    assert "No space left on device" in message
    assert f"The previous checkpoint {previous} is intact" in message
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.ENOSPC
    assert staging_dirs(root) == []
    assert steps(root) == [4]
    assert checkpoint.verify(previous) is None


def test_a_failed_first_save_does_not_claim_a_previous_checkpoint(root: Path) -> None:
    """With nothing saved before, the message does not mention a previous checkpoint."""

    def full_disk(staging: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError, match="step 1") as caught:
        checkpoint.save_checkpoint(root, 1, full_disk, keep_last=2)
    assert "previous checkpoint" not in str(caught.value)
    assert staging_dirs(root) == []
    assert steps(root) == []


def test_a_non_os_error_from_write_propagates_unchanged(root: Path) -> None:
    """A bug in ``write`` is not disguised as a disk problem, and its staging directory is removed."""
    checkpoint.save_checkpoint(root, 1, writer(), keep_last=2)
    bug = ValueError("cannot pickle the dataset cursor")

    def broken(staging: Path) -> None:
        (staging / "pipeline.pt").write_bytes(b"partial")
        raise bug

    with pytest.raises(ValueError) as caught:
        checkpoint.save_checkpoint(root, 2, broken, keep_last=2)
    assert caught.value is bug
    assert staging_dirs(root) == []
    assert steps(root) == [1]


def test_an_unwritable_root_gives_checkpoint_error(read_only_parent: Path) -> None:
    """Permission denied while creating the checkpoints directory becomes CheckpointError."""
    root = read_only_parent / "checkpoints"
    with pytest.raises(CheckpointError, match="could not write the checkpoint of step 3"):
        checkpoint.save_checkpoint(root, 3, writer(), keep_last=2)
    assert not root.exists()


def test_a_root_under_a_regular_file_gives_checkpoint_error(tmp_path: Path) -> None:
    """An output_dir that is a file cannot hold checkpoints (this one fails for root too)."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file")
    with pytest.raises(CheckpointError, match="could not write the checkpoint of step 3"):
        checkpoint.save_checkpoint(blocker / "checkpoints", 3, writer(), keep_last=2)


# --- verify ----------------------------------------------------------------------------------------------


def test_verify_reports_a_missing_manifest(root: Path) -> None:
    path = checkpoint.save_checkpoint(root, 1, writer(), keep_last=2)
    (path / checkpoint.MANIFEST).unlink()
    assert checkpoint.verify(path) == "it has no manifest (it was never completed)"


def test_verify_reports_an_unreadable_manifest(root: Path) -> None:
    path = checkpoint.save_checkpoint(root, 1, writer(), keep_last=2)
    (path / checkpoint.MANIFEST).write_text('{"files": {"pipeline.pt"')
    problem = checkpoint.verify(path)
    assert problem is not None and problem.startswith("its manifest is unreadable")


def test_verify_reports_a_missing_file(root: Path) -> None:
    path = checkpoint.save_checkpoint(root, 1, writer(), keep_last=2)
    (path / "actor" / "rank_0.distcp").unlink()
    assert checkpoint.verify(path) == "actor/rank_0.distcp is missing"


def test_verify_reports_a_truncated_file(root: Path) -> None:
    path = checkpoint.save_checkpoint(root, 1, writer(), keep_last=2)
    truncate(path / "pipeline.pt")
    size = len(FILES["pipeline.pt"])
    assert checkpoint.verify(path) == (
        f"pipeline.pt has {size - 10} bytes, the manifest says {size} (truncated?)"
    )


def test_verify_reports_a_corrupted_file_of_the_same_size(root: Path) -> None:
    path = checkpoint.save_checkpoint(root, 1, writer(), keep_last=2)
    file = path / "actor" / "rank_0.distcp"
    flip_a_byte(file)
    assert file.stat().st_size == len(FILES["actor/rank_0.distcp"])
    assert checkpoint.verify(path) == "actor/rank_0.distcp does not match its checksum (corrupted)"


# --- latest_valid ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "reason"),
    [(truncate, "(truncated?)"), (flip_a_byte, "does not match its checksum (corrupted)")],
    ids=["truncated", "corrupted"],
)
def test_latest_valid_skips_a_broken_newest_checkpoint_with_a_warning(
    root: Path, caplog: pytest.LogCaptureFixture, damage: Callable[[Path], None], reason: str
) -> None:
    """The newest checkpoint fails verification: the previous one is returned and the skip is logged."""
    previous = checkpoint.save_checkpoint(root, 2, writer(), keep_last=3)
    newest = checkpoint.save_checkpoint(root, 4, writer(), keep_last=3)
    damage(newest / "pipeline.pt")

    with caplog.at_level(logging.WARNING, logger="roll.checkpoint"):
        assert checkpoint.latest_valid(root) == previous

    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(newest) in warnings[0].getMessage()
    assert reason in warnings[0].getMessage()


def test_latest_valid_is_none_without_a_valid_checkpoint(root: Path) -> None:
    assert checkpoint.latest_valid(root) is None  # the directory does not even exist
    path = checkpoint.save_checkpoint(root, 1, writer(), keep_last=2)
    (path / checkpoint.MANIFEST).unlink()
    assert checkpoint.latest_valid(root, warn=False) is None


def test_list_checkpoints_ignores_other_entries_and_sorts_by_step(root: Path) -> None:
    """Only step_<n> directories count, sorted numerically; files and staging directories do not."""
    for step in (9, 10):
        checkpoint.save_checkpoint(root, step, writer(), keep_last=5)
    (root / "step_00000011").write_text("a file, not a checkpoint")
    (root / ".staging-step_00000012-1").mkdir()
    (root / "notes").mkdir()
    assert steps(root) == [9, 10]


# --- resolve ---------------------------------------------------------------------------------------------


def test_resolve_latest_gives_the_newest_valid_checkpoint_of_the_run(tmp_path: Path) -> None:
    output_dir = tmp_path / "run"
    assert checkpoint.resolve(output_dir, "latest") is None
    root = checkpoint.checkpoints_root(output_dir)
    checkpoint.save_checkpoint(root, 1, writer(), keep_last=2)
    newest = checkpoint.save_checkpoint(root, 2, writer(), keep_last=2)
    assert checkpoint.resolve(output_dir, "latest") == newest


def test_resolve_accepts_a_checkpoint_directory(root: Path, tmp_path: Path) -> None:
    older = checkpoint.save_checkpoint(root, 1, writer(), keep_last=2)
    checkpoint.save_checkpoint(root, 2, writer(), keep_last=2)
    assert checkpoint.resolve(tmp_path / "elsewhere", str(older)) == older


def test_resolve_accepts_a_run_directory(tmp_path: Path) -> None:
    """A run directory resolves to its newest valid checkpoint, whatever output_dir is."""
    other_run = tmp_path / "other_run"
    root = checkpoint.checkpoints_root(other_run)
    checkpoint.save_checkpoint(root, 1, writer(), keep_last=2)
    newest = checkpoint.save_checkpoint(root, 2, writer(), keep_last=2)
    assert checkpoint.resolve(tmp_path / "run", str(other_run)) == newest


def test_resolve_rejects_a_run_directory_without_a_complete_checkpoint(tmp_path: Path) -> None:
    other_run = tmp_path / "other_run"
    path = checkpoint.save_checkpoint(checkpoint.checkpoints_root(other_run), 1, writer(), keep_last=2)
    (path / checkpoint.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        checkpoint.resolve(tmp_path / "run", str(other_run))


def test_resolve_rejects_a_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "checkpoints" / "step_00000007"
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.resolve(tmp_path, str(missing))


def test_resolve_rejects_a_directory_that_is_no_checkpoint(tmp_path: Path) -> None:
    stray = tmp_path / "weights"
    stray.mkdir()
    with pytest.raises(CheckpointError, match="is not a checkpoint directory"):
        checkpoint.resolve(tmp_path, str(stray))


def test_resolve_rejects_a_corrupt_checkpoint_naming_the_reason(root: Path, tmp_path: Path) -> None:
    """A named checkpoint is never silently replaced by another one: it fails, saying why."""
    checkpoint.save_checkpoint(root, 1, writer(), keep_last=2)
    path = checkpoint.save_checkpoint(root, 2, writer(), keep_last=2)
    flip_a_byte(path / "pipeline.pt")
    with pytest.raises(CheckpointError) as caught:
        checkpoint.resolve(tmp_path / "run", str(path))
    assert str(caught.value) == (
        f"checkpoint {path} cannot be loaded: pipeline.pt does not match its checksum (corrupted)"
    )


# --- prune -----------------------------------------------------------------------------------------------


def test_prune_removes_stale_staging_of_other_processes_only(root: Path) -> None:
    """Staging left by a dead process goes; this process's own live staging directory stays."""
    checkpoint.save_checkpoint(root, 1, writer(), keep_last=2)
    mine = root / f".staging-step_00000002-{os.getpid()}"
    dead = root / f".staging-step_00000002-{os.getpid() + 1}"
    suffix_clash = root / f".staging-step_00000002-1{os.getpid()}"  # ends in our pid, but is not ours
    for directory in (mine, dead, suffix_clash):
        directory.mkdir()
        (directory / "pipeline.pt").write_bytes(b"partial")

    checkpoint.prune(root, keep_last=2)

    assert staging_dirs(root) == [mine]
    assert steps(root) == [1]


def test_a_save_clears_stale_staging_left_by_a_crash(root: Path) -> None:
    """A crashed earlier driver's staging directory is gone after the next successful save."""
    stale = root / f".staging-step_00000001-{os.getpid() + 1}"
    stale.mkdir(parents=True)
    checkpoint.save_checkpoint(root, 1, writer(), keep_last=2)
    assert staging_dirs(root) == []


def test_saving_an_earlier_step_drops_the_abandoned_later_ones(root: Path) -> None:
    """A run resumed from an older checkpoint starts a new history: once it saves, the checkpoints after
    that step (the abandoned history) go, so "latest" is always this run's newest."""
    for step in (4, 6):
        checkpoint.save_checkpoint(root, step, writer(), keep_last=2)
    saved = checkpoint.save_checkpoint(root, 5, writer(), keep_last=2)
    assert steps(root) == [4, 5] and saved.is_dir()
    assert checkpoint.latest_valid(root) == saved


def test_a_manifest_of_the_wrong_shape_is_reported_not_raised(root: Path) -> None:
    path = checkpoint.save_checkpoint(root, 1, writer(), keep_last=2)
    for manifest in ('{"files": {"a.bin": {}}}', '{"files": []}', "[]"):
        (path / checkpoint.MANIFEST).write_text(manifest)
        assert "manifest is unreadable" in checkpoint.verify(path)
