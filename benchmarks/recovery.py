"""Automatic recovery against a by-hand restart, on a real ``roll train`` job.

In one run of this script:
  1. a job starts (``examples/quickstart.yaml`` without warm start or eval, checkpoints every
     ``--every`` steps); its rollout worker is killed with SIGKILL, later its actor worker: each time the
     seconds from the kill to the next step logged in metrics.jsonl are measured (the job recovers by
     itself); then the same with ``checkpoint.standby_workers=true``;
  2. the driver of a second job is killed with SIGKILL, and ``roll train ... --resume`` is started by
     hand at once: the seconds from the kill to its first new step are measured (start-up included, as
     an operator would live it).
It prints both, their ratio, and the steps lost or repeated in each job's metrics.jsonl (goal: 0; the
by-hand restart repeats the steps since its last checkpoint by design, and they are logged once).

    python benchmarks/recovery.py [--every 20]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = (
    "sft_warm_start=null",
    "data.eval_path=null",
    "eval.every_steps=0",
    "tracking.backends=[console,jsonl]",
)


def start(out: Path, steps: int, every: int, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = [sys.executable, "-m", "roll.cli", "train", "examples/quickstart.yaml", f"output_dir={out}"]
    command += [*RUN, f"steps={steps}", f"checkpoint.every_steps={every}", *extra]
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def wait_rows(out: Path, count: int, job: subprocess.Popen, timeout_s: float = 300) -> float:
    """Wait until metrics.jsonl has ``count`` rows past the ones seen at the call; returns when."""
    seen = len(rows(out))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if job.poll() is not None and len(rows(out)) < seen + count:
            raise RuntimeError(f"the job ended early:\n{job.stderr.read()[-3000:]}")
        if len(rows(out)) >= seen + count:
            return time.monotonic()
        time.sleep(0.01)
    raise TimeoutError(f"{out}: no {count} new rows in {timeout_s} s")


def next_step_after(out: Path, job: subprocess.Popen, killed_at: float, last_step: int) -> float:
    """Seconds from ``killed_at`` to the first row with a step past ``last_step`` (after a rewind the
    file is cut back, so its length says nothing)."""
    while True:
        if job.poll() is not None and job.returncode != 0:
            raise RuntimeError(f"the job failed:\n{job.stderr.read()[-3000:]}")
        if any(row["step"] > last_step for row in rows(out)):
            return time.monotonic() - killed_at
        time.sleep(0.01)


def worker_pid(driver: int, role: str) -> int:
    """The pid of the job's live ``ray::<role>`` process (a descendant of the driver's Ray session)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            table[int(entry.name)] = (parent, cmd)
    roots = {driver} | {pid for pid, (_, cmd) in table.items() if f"_{driver} " in cmd and "session_" in cmd}
    found, frontier = set(roots), set(roots)
    while frontier:
        frontier = {pid for pid, (parent, _) in table.items() if parent in frontier} - found
        found |= frontier
    # With standby workers a second, idle process of the role waits: the live one is the older one
    # (a standby is made after the cluster it stands in for, and a new one after it takes over).
    candidates = [pid for pid in found if table[pid][1].startswith(f"ray::{role}")]
    return min(candidates, key=_start_time)


def _start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def lost_or_repeated(out: Path, steps: int) -> tuple[int, int]:
    logged = [row["step"] for row in rows(out)]
    return len(set(range(1, steps + 1)) - set(logged)), len(logged) - len(set(logged))


def automatic(work: Path, steps: int, every: int, standby: bool) -> dict[str, float]:
    out = work / ("standby" if standby else "auto")
    job = start(out, steps, every, f"checkpoint.standby_workers={str(standby).lower()}")
    times = {}
    for role, after in (("RolloutWorker", 3 * every // 2), ("ActorWorker", 3 * every // 2)):
        wait_rows(out, after, job)
        last = rows(out)[-1]["step"]
        killed = time.monotonic()
        os.kill(worker_pid(job.pid, role), signal.SIGKILL)
        times[role] = next_step_after(out, job, killed, last)
    job.wait(timeout=600)
    if job.returncode != 0:
        raise RuntimeError(job.stderr.read()[-3000:])
    times["lost"], times["repeated"] = lost_or_repeated(out, steps)
    return times


def by_hand(work: Path, steps: int, every: int) -> dict[str, float]:
    out = work / "hand"
    job = start(out, steps, every)
    wait_rows(out, 3 * every // 2, job)
    last = rows(out)[-1]["step"]
    killed = time.monotonic()
    os.kill(job.pid, signal.SIGKILL)  # the driver: Ray's processes of the job go with it
    job.wait()
    resumed = start(out, steps, every, "--resume")
    seconds = next_step_after(out, resumed, killed, last)
    resumed.wait(timeout=600)
    if resumed.returncode != 0:
        raise RuntimeError(resumed.stderr.read()[-3000:])
    lost, repeated = lost_or_repeated(out, steps)
    return {"seconds": seconds, "lost": lost, "repeated": repeated}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--every", type=int, default=20, help="checkpoint.every_steps of the jobs")
    parser.add_argument("--steps", type=int, default=200, help="steps of each job")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="roll-recovery-") as tmp:
        auto = automatic(Path(tmp), args.steps, args.every, standby=False)
        standby = automatic(Path(tmp), args.steps, args.every, standby=True)
        hand = by_hand(Path(tmp), args.steps, args.every)
    print(f"{'kill':<44}{'seconds to next step':>22}{'/ by hand':>12}")
    for label, seconds in (
        ("rollout worker (automatic)", auto["RolloutWorker"]),
        ("actor worker (automatic)", auto["ActorWorker"]),
        ("rollout worker (automatic, standby workers)", standby["RolloutWorker"]),
        ("actor worker (automatic, standby workers)", standby["ActorWorker"]),
        ("driver, then --resume by hand", hand["seconds"]),
    ):
        print(f"{label:<44}{seconds:>22.2f}{seconds / hand['seconds']:>12.2f}")
    print("goal: automatic / by hand <= 0.33")
    for label, job in (("automatic", auto), ("standby", standby), ("by hand", hand)):
        print(f"steps lost / logged twice, {label}: {job['lost']:.0f} / {job['repeated']:.0f}")


if __name__ == "__main__":
    main()
