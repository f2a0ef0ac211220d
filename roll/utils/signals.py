"""Stopping a run on SIGINT or SIGTERM the way an operator expects.

Slurm and Kubernetes stop a job with SIGTERM, a person with Ctrl-C (SIGINT). Under ``stop_on_signals``
the first of either raises ``StopRequested`` in the driver's main thread: the pipeline's ``finally``
blocks release the workers and close the metric files, and the command prints one line (which signal,
during which step, what was saved) and exits with the conventional code, 128 + the signal number
(130, 143). A second signal exits at once, for when the clean-up itself is stuck.

Pipelines say what they are doing with ``set_activity``, so the line can name the step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_state = {"received": None, "activity": "start-up", "installed": False, "deferred": False, "during": None}


class StopRequested(BaseException):
    """The run was asked to stop. A BaseException, like KeyboardInterrupt, so that ``except Exception``
    handlers on the way up do not swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def set_activity(activity: str) -> None:
    """What the run is doing now (``"RL step 12 of 3000"``), for the line printed if it is stopped."""
    _state["activity"] = activity


def activity() -> str:
    """What the run was doing when the stop signal arrived (what it is doing now, before one)."""
    return _state["during"] or _state["activity"]


def received() -> int | None:
    """The stop signal received so far, if any."""
    return _state["received"]


def exit_code(signum: int) -> int:
    return 128 + signum


def _handle(signum: int, frame: FrameType | None) -> None:
    if _state["received"] is not None:
        sys.stderr.write(f"roll: second {signal.Signals(signum).name}: exiting now, without clean-up\n")
        sys.stderr.flush()
        os._exit(exit_code(signum))
    _state["received"] = signum
    _state["during"] = _state["activity"]  # the step it stopped in, not the saving that follows
    if _state["deferred"]:
        sys.stderr.write(
            f"roll: stopping on {signal.Signals(signum).name} once {_state['activity']} is finished and "
            "saved (send it again to exit at once, without clean-up)\n"
        )
        sys.stderr.flush()
        return
    raise StopRequested(signum)


@contextmanager
def deferred(enabled: bool = True) -> Iterator[None]:
    """Inside the block a first stop signal is only recorded, so the work in progress (a training
    step) can finish and be saved; ``raise_if_received`` then stops. A second signal still exits at
    once. With ``enabled`` False (nothing would be saved) the block changes nothing."""
    if not enabled or _state["received"] is not None:
        yield
        return
    _state["deferred"] = True
    try:
        yield
    finally:
        _state["deferred"] = False


def raise_if_received() -> None:
    """Raise ``StopRequested`` for a stop signal that ``deferred`` held back."""
    if _state["received"] is not None and _state["installed"]:
        raise StopRequested(_state["received"])


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into ``StopRequested`` inside the block (main thread only; elsewhere
    Python cannot install handlers and the block runs unchanged)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _handle) for sig in STOP_SIGNALS}
    _state.update(received=None, activity="start-up", installed=True, during=None)
    try:
        yield
    finally:
        _state["installed"] = False
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def reinstall() -> None:
    """Take the stop signals back after a library replaced their handlers: Ray's core worker installs
    its own SIGTERM handler in ``ray.init``, which dumps a stack and aborts (exit 134)."""
    if _state["installed"] and threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _handle)
