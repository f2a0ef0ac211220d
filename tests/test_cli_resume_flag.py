"""A bare ``--resume`` means the latest checkpoint; a stop signal during a step is deferred until saved."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from roll.cli import _resume_latest
from roll.utils import signals


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train", "cfg.yaml", "--resume"], ["train", "cfg.yaml", "--resume=latest"]),
        (
            ["train", "cfg.yaml", "--resume", "--overwrite"],
            ["train", "cfg.yaml", "--resume=latest", "--overwrite"],
        ),
        (
            ["train", "cfg.yaml", "--resume", "steps=10", "seed=3"],
            ["train", "cfg.yaml", "--resume=latest", "steps=10", "seed=3"],
        ),
        (["--resume"], ["--resume=latest"]),
    ],
    ids=["last", "before-an-option", "before-an-override", "alone"],
)
def test_a_bare_resume_means_latest(argv: list[str], expected: list[str]) -> None:
    assert _resume_latest(argv) == expected


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "cfg.yaml", "--resume", "runs/demo/checkpoints/step_00000040"],
        ["train", "cfg.yaml", "--resume", "runs/demo", "steps=10"],
        ["train", "cfg.yaml", "--resume", "latest"],
        ["train", "cfg.yaml", "--resume=runs/demo"],
        ["train", "cfg.yaml", "steps=10"],
    ],
    ids=["checkpoint-path", "run-dir-then-override", "explicit-latest", "equals-form", "no-resume"],
)
def test_resume_with_a_value_is_left_alone(argv: list[str]) -> None:
    assert _resume_latest(argv) == argv


def test_resume_latest_does_not_modify_its_argument() -> None:
    argv = ["train", "cfg.yaml", "--resume"]
    _resume_latest(argv)
    assert argv == ["train", "cfg.yaml", "--resume"]


@pytest.fixture
def clean_signal_state() -> Iterator[None]:
    """The module keeps its state in a global; restore it so a received signal does not leak."""
    saved = dict(signals._state)
    yield
    signals._state.clear()
    signals._state.update(saved)


def send_sigterm_and_wait() -> None:
    """Deliver SIGTERM to this process and wait until the interpreter has run the Python handler (at
    once, in practice: the deadline only keeps a broken handler from hanging the test)."""
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 60.0
    while signals.received() is None and time.monotonic() < deadline:
        time.sleep(0.001)


def test_a_deferred_signal_lets_the_step_finish_then_stops(
    clean_signal_state: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Inside ``deferred(True)`` SIGTERM is only recorded; ``raise_if_received`` stops afterwards."""
    finished_step = False
    with signals.stop_on_signals():
        signals.set_activity("RL step 7 of 10")
        with signals.deferred(True):
            send_sigterm_and_wait()
            assert signals.received() == signal.SIGTERM
            finished_step = True  # the block went on: the step can complete and be saved
        assert finished_step
        with pytest.raises(signals.StopRequested) as caught:
            signals.raise_if_received()
    assert caught.value.signum == signal.SIGTERM
    notice = capsys.readouterr().err  # one line saying what the run does before it stops
    assert "SIGTERM" in notice
    assert "RL step 7 of 10" in notice
    assert "again to exit at once" in notice


def test_without_deferral_the_signal_stops_at_once(clean_signal_state: None) -> None:
    """``deferred(False)`` changes nothing: the first SIGTERM raises StopRequested immediately."""
    reached_after_the_signal = False
    with signals.stop_on_signals():
        with pytest.raises(signals.StopRequested) as caught:
            with signals.deferred(False):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(2.0)  # interrupted by the handler's exception
                reached_after_the_signal = True
    assert caught.value.signum == signal.SIGTERM
    assert not reached_after_the_signal
    assert signals.received() == signal.SIGTERM


def test_raise_if_received_does_nothing_without_a_signal(clean_signal_state: None) -> None:
    with signals.stop_on_signals():
        with signals.deferred(True):
            pass
        signals.raise_if_received()
        assert signals.received() is None


def test_deferral_ends_with_its_block(clean_signal_state: None) -> None:
    """After a ``deferred`` block a first signal raises at once again."""
    with signals.stop_on_signals():
        with signals.deferred(True):
            pass
        with pytest.raises(signals.StopRequested):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(2.0)
