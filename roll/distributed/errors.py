"""Errors a driver call on a cluster raises; each names the role, the rank and the method."""

from __future__ import annotations

import re


class WorkerError(RuntimeError):
    """A remote worker failed; ``role`` and ``rank`` say which one."""

    def __init__(self, role: str, rank: int, method: str, detail: str):
        # Ray colours remote tracebacks for terminals; in log files the escape codes are noise.
        detail = re.sub(r"\x1b\[[0-9;]*m", "", detail)
        super().__init__(f"{role} rank {rank} failed in {method}():\n{detail}")
        self.role, self.rank, self.method = role, rank, method


class WorkerTimeoutError(WorkerError, TimeoutError):
    """A remote call did not finish within the configured timeout."""


class WorkerUnresponsiveError(WorkerError):
    """A worker that had answered stopped answering heartbeats: frozen (SIGSTOP), deadlocked while
    holding the interpreter, or swapping itself to a standstill. The run cannot go on without it."""
