"""One run per output directory: a new run never mixes into an old one, two drivers never write to the
same directory at once, and a resumed run finds the checkpoint it names. Decided before Ray starts or
anything is written."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import IO

from roll import checkpoint
from roll.config.loader import ConfigError

LOCK_FILE = ".roll.lock"
# What a run writes into its directory; --overwrite removes these and nothing else, so an output_dir
# pointed at a directory holding other files never loses them.
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "samples.jsonl",
    "tensorboard",
    "wandb",  # W&B's files of the run (offline runs to sync), unless WANDB_DIR puts them elsewhere
    checkpoint.CHECKPOINTS_DIR,
    "model",
    "critic",
    "sft",
    "tiny_model",
    "health",
)


class RunDirectory:
    """The claimed output directory of a run; ``resume_from`` is the checkpoint to load (or None).

    Holds an exclusive lock on ``<output_dir>/.roll.lock`` until ``release()`` or the process ends."""

    def __init__(self, output_dir: str, resume: str | None = None, overwrite: bool = False):
        """``resume``: ``"latest"`` or a checkpoint / run directory (see ``checkpoint.resolve``).

        Raises:
            ConfigError: the directory holds a run and neither ``resume`` nor ``overwrite`` was given;
                ``resume`` names no loadable checkpoint; another driver holds the directory; it cannot
                be written.
        """
        if resume is not None and overwrite:
            raise ConfigError("--resume and --overwrite contradict each other: choose one")
        self.path = Path(output_dir)
        self._lock = self._acquire()
        try:
            self.resume_from = self._checkpoint_to_resume(resume) if resume is not None else None
            if resume is None:
                self._clear_if_allowed(overwrite)
        except BaseException:
            self.release()
            raise

    def _acquire(self) -> IO[str]:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            lock = (self.path / LOCK_FILE).open("a+")
        except OSError as error:
            raise ConfigError(
                f"output_dir {self.path} cannot be written ({error.strerror}); choose another output_dir"
            ) from error
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise ConfigError(
                f"output_dir {self.path} is in use by a running job ({holder}); wait for it to end or "
                "choose another output_dir"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}\n")
        lock.flush()
        if not os.access(self.path, os.W_OK):
            lock.close()
            raise ConfigError(f"output_dir {self.path} is not writable; choose another output_dir")
        return lock

    def _checkpoint_to_resume(self, resume: str) -> Path | None:
        try:
            found = checkpoint.resolve(self.path, resume)
        except checkpoint.CheckpointError as error:
            raise ConfigError(str(error)) from error
        if found is None and self.holds_run():
            raise ConfigError(
                f"{self.path} holds a run but no complete checkpoint to resume from; start it again with "
                "--overwrite, or choose another output_dir"
            )
        return found  # None: nothing there yet, so the run starts from the beginning

    def holds_run(self) -> bool:
        return any((self.path / name).exists() for name in ("metrics.jsonl", checkpoint.CHECKPOINTS_DIR))

    def _clear_if_allowed(self, overwrite: bool) -> None:
        if not self.holds_run():
            return
        if not overwrite:
            raise ConfigError(
                f"output_dir {self.path} already holds a run. Resume it (roll resume {self.path}, or add "
                "--resume), start it again with --overwrite, or choose another output_dir"
            )
        for name in RUN_FILES:
            target = self.path / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()

    def release(self) -> None:
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
