"""Benchmark: what one sandboxed run costs, against a plain subprocess, side by side in one run.

Variants, in milliseconds of wall-clock time per call, measured in the calling process:

* ``subprocess``: ``subprocess.run([sys.executable, "-I", "-c", "print(1)"])``, the floor: starting
  an interpreter at all;
* ``run_python/<isolation>``: ``roll.sandbox.run_python("print(1)")`` under each isolation that works
  here ("unshare", "bwrap" if installed and working, and "none"): launcher, namespaces, mounts,
  privilege drop, interpreter;
* ``code_tests/<isolation>``: the ``code_tests`` reward on a response defining ``f`` with 4
  function-call tests (one sandboxed run plus the harness's fork and result checking).

These machines are noisy (other jobs share them), so the variants are interleaved: every round runs
each variant once, in a new random order, and the first ``--warmup`` rounds are left out (the first
call of a mode also probes it). Each variant's median and 90th percentile over the remaining rounds
are printed, with the ratio of its median to the subprocess median.

    python benchmarks/sandbox.py [--rounds 40] [--warmup 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from roll.rewards.code import code_tests
from roll.sandbox import SandboxUnavailable, resolve_isolation, run_python

TRIVIAL = "print(1)"
SAMPLE = {"tests": [{"call": f"f({x})", "expected": 3 * x + 1} for x in range(4)]}
RESPONSE = "```python\ndef f(x):\n    return 3 * x + 1\n```"


def baseline() -> None:
    done = subprocess.run([sys.executable, "-I", "-c", TRIVIAL], capture_output=True, check=True)
    assert done.stdout == b"1\n"


def sandboxed(isolation: str) -> Callable[[], None]:
    def call() -> None:
        result = run_python(TRIVIAL, isolation=isolation)
        assert result.ok and result.stdout == "1\n", result

    return call


def rewarded(isolation: str) -> Callable[[], None]:
    def call() -> None:
        out = code_tests("prompt", RESPONSE, SAMPLE, isolation=isolation)
        assert out.score == 1.0, out

    return call


def isolations() -> list[str]:
    """The namespaced modes that work here, then "none"."""
    working = []
    for mode in ("unshare", "bwrap"):
        try:
            resolve_isolation(mode)
        except SandboxUnavailable as e:
            print(f"skipping {mode}: {e}")
            continue
        working.append(mode)
    return [*working, "none"]


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="rounds run first and left out")
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-round order")
    args = parser.parse_args()

    variants: dict[str, Callable[[], None]] = {"subprocess": baseline}
    modes = isolations()
    for mode in modes:
        variants[f"run_python/{mode}"] = sandboxed(mode)
    for mode in modes:
        variants[f"code_tests/{mode}"] = rewarded(mode)

    rng = random.Random(args.seed)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(args.warmup + args.rounds):
        order = list(variants)
        rng.shuffle(order)
        for name in order:
            start = time.perf_counter()
            variants[name]()
            elapsed_ms = (time.perf_counter() - start) * 1000
            if round_index >= args.warmup:
                times[name].append(elapsed_ms)

    root = os.geteuid() == 0
    print(
        f"\n{platform.node()}: {os.cpu_count()} CPUs, Linux {platform.release()}, Python "
        f"{platform.python_version()}, {'root (sandbox under a throwaway uid)' if root else 'unprivileged'}; "
        f"{args.rounds} rounds after {args.warmup} warm-up, interleaved"
    )
    base = statistics.median(times["subprocess"])
    print(f"{'variant':<22}{'median ms':>11}{'p90 ms':>9}{'x subprocess':>14}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<22}{median:>11.1f}{p90(values):>9.1f}{median / base:>14.2f}")


if __name__ == "__main__":
    main()
