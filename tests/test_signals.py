"""``stop_on_signals``: the first SIGINT/SIGTERM raises StopRequested, a second one exits at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from roll.utils import signals


def test_the_first_signal_raises_and_a_second_exits_at_once() -> None:
    code = textwrap.dedent(
        """
        import os, signal, time
        from roll.utils import signals

        with signals.stop_on_signals():
            signals.set_activity("RL step 3 of 10")
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(600)  # for good: only the signal ends it
            except signals.StopRequested as stop:
                print("stopped", stop.signum, signals.received(), signals.activity(), flush=True)
                os.kill(os.getpid(), signal.SIGTERM)  # stuck in clean-up: the operator insists
                time.sleep(600)
                print("not reached")
        """
    )
    # A signal a process sends itself is handled before os.kill returns: the run takes well under a
    # second (the interpreter's start), the timeout is only for a hang.
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 143
    assert result.stdout.splitlines() == [
        f"stopped {int(signal.SIGTERM)} {int(signal.SIGTERM)} RL step 3 of 10"
    ]
    assert "second SIGTERM: exiting now, without clean-up" in result.stderr


def test_handlers_are_restored_after_the_block() -> None:
    before = {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS}
    with signals.stop_on_signals():
        assert all(signal.getsignal(sig) is signals._handle for sig in signals.STOP_SIGNALS)
    assert {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS} == before


def test_exit_codes_are_the_conventional_ones() -> None:
    assert signals.exit_code(signal.SIGINT) == 130
    assert signals.exit_code(signal.SIGTERM) == 143
