"""RunDirectory: one run per output_dir, explicit resume or overwrite, and an exclusive lock."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from roll import checkpoint
from roll.config.loader import ConfigError
from roll.pipelines.run_dir import LOCK_FILE, RUN_FILES, RunDirectory


@pytest.fixture
def claims() -> Iterator[list[RunDirectory]]:
    """Collects every claimed RunDirectory and releases it after the test, so no lock outlives it."""
    held: list[RunDirectory] = []
    yield held
    for run_dir in held:
        run_dir.release()


def claim(
    held: list[RunDirectory], output_dir: Path, resume: str | None = None, overwrite: bool = False
) -> RunDirectory:
    run_dir = RunDirectory(str(output_dir), resume, overwrite)
    held.append(run_dir)
    return run_dir


def write_run(output_dir: Path) -> None:
    """What a finished step leaves behind: metrics, config and TensorBoard events."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "metrics.jsonl").write_text('{"step": 1, "time": 0.0}\n')
    (output_dir / "config.yaml").write_text("steps: 3\n")
    (output_dir / "tensorboard").mkdir()
    (output_dir / "tensorboard" / "events.out.tfevents.1").write_bytes(b"events")


def save(output_dir: Path, step: int) -> Path:
    def write(staging: Path) -> None:
        (staging / checkpoint.PIPELINE_STATE).write_bytes(f"state of step {step}".encode())

    return checkpoint.save_checkpoint(checkpoint.checkpoints_root(output_dir), step, write, keep_last=3)


def test_a_fresh_directory_is_claimed(tmp_path: Path, claims: list[RunDirectory]) -> None:
    """A new output_dir is created and locked; nothing is resumed."""
    output_dir = tmp_path / "runs" / "new"
    run_dir = claim(claims, output_dir)
    assert run_dir.resume_from is None
    assert run_dir.path == output_dir
    assert not run_dir.holds_run()
    assert (output_dir / LOCK_FILE).read_text() == f"pid {os.getpid()}\n"


def test_a_directory_holding_a_run_is_not_reused_silently(tmp_path: Path) -> None:
    """Without resume or overwrite, an existing run is an error that names every way forward."""
    write_run(tmp_path)
    with pytest.raises(ConfigError) as caught:
        RunDirectory(str(tmp_path))
    message = str(caught.value)
    assert "already holds a run" in message
    assert "--resume" in message
    assert "--overwrite" in message
    assert "choose another output_dir" in message
    assert (tmp_path / "metrics.jsonl").exists()  # nothing was touched


def test_checkpoints_alone_count_as_a_run(tmp_path: Path) -> None:
    save(tmp_path, 1)
    with pytest.raises(ConfigError, match="already holds a run"):
        RunDirectory(str(tmp_path))


def test_a_refused_claim_releases_the_lock(tmp_path: Path, claims: list[RunDirectory]) -> None:
    """After the 'already holds a run' error the directory is not left locked."""
    write_run(tmp_path)
    with pytest.raises(ConfigError, match="already holds a run"):
        RunDirectory(str(tmp_path))
    assert claim(claims, tmp_path, overwrite=True).resume_from is None


def test_overwrite_removes_the_run_files_and_nothing_else(tmp_path: Path, claims: list[RunDirectory]) -> None:
    write_run(tmp_path)
    save(tmp_path, 1)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine, not the run's")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")

    run_dir = claim(claims, tmp_path, overwrite=True)

    assert run_dir.resume_from is None
    assert not run_dir.holds_run()
    assert not any((tmp_path / name).exists() for name in RUN_FILES)
    assert (tmp_path / "notes.txt").read_text() == "mine, not the run's"
    assert (tmp_path / "data" / "train.jsonl").exists()
    assert (tmp_path / LOCK_FILE).exists()


def test_overwrite_of_a_fresh_directory_is_harmless(tmp_path: Path, claims: list[RunDirectory]) -> None:
    assert claim(claims, tmp_path / "new", overwrite=True).resume_from is None


@pytest.mark.parametrize("exists", [False, True], ids=["new", "empty"])
def test_resume_latest_without_a_run_starts_from_the_beginning(
    tmp_path: Path, claims: list[RunDirectory], exists: bool
) -> None:
    """``--resume`` on a directory that holds no run yet is not an error: the run simply starts."""
    output_dir = tmp_path / "run"
    if exists:
        output_dir.mkdir()
    assert claim(claims, output_dir, resume="latest").resume_from is None


def test_resume_latest_with_a_run_but_no_complete_checkpoint_fails(tmp_path: Path) -> None:
    """Metrics but no loadable checkpoint: resuming would silently start over, so it is refused."""
    write_run(tmp_path)
    broken = save(tmp_path, 1)
    (broken / checkpoint.MANIFEST).unlink()
    with pytest.raises(ConfigError) as caught:
        RunDirectory(str(tmp_path), resume="latest")
    assert "no complete checkpoint to resume from" in str(caught.value)
    assert "--overwrite" in str(caught.value)


def test_resume_latest_picks_the_newest_checkpoint(tmp_path: Path, claims: list[RunDirectory]) -> None:
    write_run(tmp_path)
    save(tmp_path, 2)
    newest = save(tmp_path, 4)
    run_dir = claim(claims, tmp_path, resume="latest")
    assert run_dir.resume_from == newest
    assert (tmp_path / "metrics.jsonl").exists()  # resuming keeps the run's files


def test_resume_latest_skips_a_corrupt_newest_checkpoint(tmp_path: Path, claims: list[RunDirectory]) -> None:
    write_run(tmp_path)
    previous = save(tmp_path, 2)
    newest = save(tmp_path, 4)
    (newest / checkpoint.PIPELINE_STATE).write_bytes(b"garbage")
    assert claim(claims, tmp_path, resume="latest").resume_from == previous


def test_resume_of_a_named_broken_checkpoint_is_a_config_error(tmp_path: Path) -> None:
    """A checkpoint path that fails verification is reported as a ConfigError with the reason."""
    path = save(tmp_path, 2)
    (path / checkpoint.PIPELINE_STATE).unlink()
    with pytest.raises(ConfigError, match=f"{checkpoint.PIPELINE_STATE} is missing"):
        RunDirectory(str(tmp_path), resume=str(path))


def test_resume_and_overwrite_together_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="contradict each other"):
        RunDirectory(str(tmp_path / "run"), resume="latest", overwrite=True)
    assert not (tmp_path / "run").exists()  # refused before anything was created


def test_a_second_claim_in_the_same_process_is_refused(tmp_path: Path, claims: list[RunDirectory]) -> None:
    """flock locks belong to an open file description: a second open of the lock file conflicts."""
    claim(claims, tmp_path)
    with pytest.raises(ConfigError) as caught:
        RunDirectory(str(tmp_path))
    message = str(caught.value)
    assert "is in use by a running job" in message
    assert f"pid {os.getpid()}" in message
    # The refused claim must neither steal nor drop the first one's lock.
    assert (tmp_path / LOCK_FILE).read_text() == f"pid {os.getpid()}\n"
    with pytest.raises(ConfigError, match="is in use"):
        RunDirectory(str(tmp_path))


def test_another_process_is_refused_while_the_directory_is_held(
    tmp_path: Path, claims: list[RunDirectory]
) -> None:
    """A second driver (a separate process) gets the 'in use' error naming the holder's pid."""
    claim(claims, tmp_path)
    code = textwrap.dedent(
        f"""
        from roll.config.loader import ConfigError
        from roll.pipelines.run_dir import RunDirectory
        try:
            RunDirectory({str(tmp_path)!r})
        except ConfigError as error:
            print(error)
        else:
            print("claimed")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "is in use by a running job" in result.stdout
    assert f"pid {os.getpid()}" in result.stdout


def test_release_lets_the_directory_be_claimed_again(tmp_path: Path, claims: list[RunDirectory]) -> None:
    first = claim(claims, tmp_path)
    first.release()
    first.release()  # a second release is harmless
    second = claim(claims, tmp_path)
    assert second.resume_from is None
    assert (tmp_path / LOCK_FILE).read_text() == f"pid {os.getpid()}\n"


@pytest.mark.parametrize("inside", [False, True], ids=["the-dir-itself", "a-new-subdir"])
def test_an_unwritable_output_dir_is_a_config_error(read_only_parent: Path, inside: bool) -> None:
    output_dir = read_only_parent / "run" if inside else read_only_parent
    with pytest.raises(ConfigError, match="cannot be written.*choose another output_dir"):
        RunDirectory(str(output_dir))


def test_an_output_dir_under_a_file_is_a_config_error(tmp_path: Path) -> None:
    """A path through a regular file cannot be created (this one fails for root too)."""
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match="cannot be written.*choose another output_dir"):
        RunDirectory(str(tmp_path / "a_file" / "run"))
