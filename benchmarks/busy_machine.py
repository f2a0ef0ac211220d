"""Run a command on a busy machine: one CPU-bound process per core beside it, started before the command
and stopped after it, whatever its outcome.

Why: no test may depend on how busy the machine is (a CI machine shared with other jobs, a laptop
compiling something). A test that passes only when it has the cores to itself asserts speed, not
behaviour. This is how the checks of docs/development.md, "Checks beside a busy machine", are run:

    python benchmarks/busy_machine.py -- pytest -m "not slow"
    python benchmarks/busy_machine.py --hogs 4 -- pytest tests/test_liveness.py

Prints the command's wall time and the number of hogs, and exits with the command's exit code.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

# Each hog is a bare interpreter spinning: it holds one core and nothing else (no memory, no files).
HOG = [sys.executable, "-c", "while True: pass"]


def run_beside_hogs(command: list[str], hogs: int) -> int:
    """Start ``hogs`` spinning processes, run ``command`` to its end, stop the hogs; the exit code."""
    spinning = [subprocess.Popen(HOG) for _ in range(hogs)]
    started = time.monotonic()
    try:
        code = subprocess.call(command)
    finally:
        for hog in spinning:
            hog.kill()
        for hog in spinning:
            hog.wait()
    print(f"busy_machine: exit {code} after {time.monotonic() - started:.0f} s beside {hogs} CPU hog(s)")
    return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cores = os.cpu_count() or 1
    parser.add_argument("--hogs", type=int, default=cores, help="spinning processes (default: one per core)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    sys.exit(run_beside_hogs(command, args.hogs))


if __name__ == "__main__":
    main()
