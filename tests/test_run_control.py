"""A running ``roll train`` stopped the ways operators and schedulers stop it: SIGTERM (Slurm, Kubernetes),
SIGINT (Ctrl-C), and a worker frozen with SIGSTOP. Each ends with the conventional exit code, one line
that says what happened (and what was saved), valid metrics, and no Ray process of the run left behind.
Workers killed with SIGKILL are recovered from within the run, and each step is logged once.

The runs start their own local Ray (not the test session's), so its processes can be told apart. Every
wait for a run has minutes to spare (a busy machine stretches a run several times over); where a time is
asserted, it only tells the mechanism under test from the much later one that would act otherwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from roll import checkpoint

# A quick RL run: no warm start, no evaluation, many steps (it is stopped long before the end).
QUICK_RUN = (
    "sft_warm_start=null",
    "steps=100000",
    "data.eval_path=null",
    "eval.every_steps=0",
    "tracking.backends=[console,jsonl]",
)


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":  # a zombie has already exited
            table[int(entry.name)] = (int(fields[1]), cmdline)
    return table


def run_processes(driver_pid: int) -> dict[int, str]:
    """The Ray processes of the run whose driver is ``driver_pid``: its session's daemons (their
    session name ends in the driver's pid) and every descendant of them and of the driver."""
    table = processes()
    roots = {driver_pid} | {
        pid
        for pid, (_, cmd) in table.items()
        if "--session-name=session_" in cmd and f"_{driver_pid} " in cmd
    }
    found, frontier = set(roots), set(roots)
    while frontier:
        frontier = {pid for pid, (parent, _) in table.items() if parent in frontier} - found
        found |= frontier
    return {pid: table[pid][1] for pid in found - {driver_pid} if pid in table}


def start_run(repo_root: Path, output_dir: Path, *overrides: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "roll.cli",
            "train",
            "examples/quickstart.yaml",
            f"output_dir={output_dir}",
            *overrides,
        ],
        cwd=repo_root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_rows(path: Path, rows: int, run: subprocess.Popen, timeout_s: float = 900) -> None:
    wait_for_row(path, run, lambda row, count: count >= rows, f"{rows} rows", timeout_s)


def wait_for_row(
    path: Path, run: subprocess.Popen, wanted: Callable[[dict, int], bool], what: str, timeout_s: float = 900
) -> None:
    """Wait until the last row of ``path`` (and the number of rows) satisfies ``wanted``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert run.poll() is None, run.communicate()
        lines = path.read_text().splitlines() if path.is_file() else []
        if lines:
            try:
                last = json.loads(lines[-1])
            except json.JSONDecodeError:  # a row being written
                last = None
            if last is not None and wanted(last, len(lines)):
                return
        time.sleep(0.2)
    run.kill()
    raise AssertionError(f"{path} did not reach {what} in {timeout_s} s")


def finish(run: subprocess.Popen, timeout_s: float = 300) -> tuple[int, str, str]:
    try:
        stdout, stderr = run.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        run.kill()
        stdout, stderr = run.communicate()
        raise AssertionError(f"the run did not end within {timeout_s} s:\n{stderr[-3000:]}") from None
    return run.returncode, stdout, stderr


def assert_valid_metrics(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(rows[0]["step"], rows[0]["step"] + len(rows)))
    return rows


def assert_nothing_left(ray_processes: dict[int, str]) -> None:
    deadline = time.monotonic() + 120
    alive = ray_processes
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        table = processes()
        alive = {pid: cmd for pid, cmd in ray_processes.items() if pid in table}
    assert not alive, f"Ray processes of the run outlived it: {alive}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop", "exit_code", "overrides", "metrics_file", "activity"),
    [
        (signal.SIGTERM, 143, QUICK_RUN, "metrics.jsonl", "RL step"),
        (
            signal.SIGINT,
            130,
            (*QUICK_RUN[1:], "sft_warm_start.steps=100000"),
            "sft/metrics.jsonl",
            "SFT warm-start step",
        ),
    ],
    ids=["SIGTERM during RL", "SIGINT during the SFT warm start"],
)
def test_a_stop_signal_ends_the_run_cleanly(
    repo_root: Path,
    tmp_path: Path,
    stop: signal.Signals,
    exit_code: int,
    overrides: tuple[str, ...],
    metrics_file: str,
    activity: str,
) -> None:
    """SIGTERM during RL and SIGINT during the warm start end a real `roll train` with the conventional
    exit code, one line saying what was saved, and no Ray process left. Needs a whole run with its own
    Ray. After SIGTERM the step in progress is finished and checkpointed, and the line names `roll resume`
    on the run (that command, resuming a run exactly, is test_resume's RLVR test)."""
    out = tmp_path / "run"
    run = start_run(repo_root, out, *overrides)
    wait_for_rows(out / metrics_file, 2, run)
    ray_processes = run_processes(run.pid)
    assert any("raylet" in cmd for cmd in ray_processes.values()), ray_processes
    run.send_signal(stop)
    code, _, stderr = finish(run)
    assert code == exit_code, stderr
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(f"roll: stopped by {stop.name} during {activity} "), stderr
    assert "Workers released." in line
    assert "Traceback" not in stderr and "SIGTERM received" not in stderr
    rows = assert_valid_metrics(out / metrics_file)
    if activity == "RL step":
        # The step in progress finished and was saved (a checkpoint that verifies): resuming loses nothing.
        last = checkpoint.latest_valid(checkpoint.checkpoints_root(out))
        assert last is not None and checkpoint.checkpoint_step(last) == rows[-1]["step"], stderr
        assert f"The last checkpoint is {last}; continue with: roll resume {out}" in line
    else:  # the warm start writes no checkpoints
        assert "Nothing was saved" in line
    assert_nothing_left(ray_processes)


@pytest.mark.slow
def test_killed_workers_of_every_role_are_recovered_and_a_frozen_one_past_the_budget_ends_the_run(
    repo_root: Path, tmp_path: Path
) -> None:
    """SIGKILL the rollout, reward and reference workers, then the actor worker of a running job: the
    first three are replaced without a rollback, the actor restarts from the last checkpoint (beside
    the others, which outlive it) and trains on. Then, with the restart budget spent, a rollout worker
    frozen with SIGSTOP ends the run at the liveness bound, naming it, with no process left; every step
    is in metrics.jsonl exactly once. Recoveries and a frozen worker exist only in a whole run (one run
    for both: each costs a run's start-up)."""
    out = tmp_path / "run"
    overrides = (*QUICK_RUN, "checkpoint.every_steps=4", "checkpoint.max_restarts=4")
    overrides += ("algorithm.kl_coef=0.001",)  # a reference model to kill
    overrides += ("reward=math_verify",)  # scored on reward workers (exact_match is scored in the controller)
    # The call the rollout worker freezes in could wait out its 900 s timeout: only the liveness bound ends
    # it sooner. That bound also applies to every busy worker of the run (setting up, importing, training
    # while other processes take the cores): 10 s is far above how long a busy one leaves a heartbeat waiting.
    overrides += ("ray.liveness_timeout_s=10", "ray.call_timeout_s=900")
    run = start_run(repo_root, out, *overrides)
    # One loss at a time: each kill waits for the row that counts the previous recovery (a lost worker is
    # noticed in the step that next calls it, which then finishes). The actor's comes after the first
    # checkpoint (step 4) and, about step 8, leaves steps to train after its restart.
    wait_for_rows(out / "metrics.jsonl", 2, run)
    for recovered, role in enumerate(("RolloutWorker", "RewardWorker", "ReferenceWorker", "ActorWorker")):
        if recovered:
            wait_for_row(
                out / "metrics.jsonl",
                run,
                lambda row, _, done=recovered, actor=role == "ActorWorker": (
                    row["recovery/restarts"] >= done and (row["step"] > 4 or not actor)
                ),
                f"{recovered} recoveries",
            )
        (pid,) = [p for p, cmd in run_processes(run.pid).items() if cmd.startswith(f"ray::{role}")]
        os.kill(pid, signal.SIGKILL)
    # The restarted actor trains two steps past the one that counted its recovery.
    wait_for_row(out / "metrics.jsonl", run, lambda row, _: row["recovery/restarts"] >= 4, "4 recoveries")
    trained_to = assert_valid_metrics(out / "metrics.jsonl")[-1]["step"] + 2
    wait_for_row(out / "metrics.jsonl", run, lambda row, _: row["step"] >= trained_to, f"step {trained_to}")

    ray_processes = run_processes(run.pid)
    (rollout,) = [pid for pid, cmd in ray_processes.items() if cmd.startswith("ray::RolloutWorker")]
    os.kill(rollout, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        code, stdout, stderr = finish(run)
    finally:
        os.kill(rollout, signal.SIGCONT) if rollout in processes() else None
    assert code == 1, stderr[-3000:]
    assert "after 4 recoveries (checkpoint.max_restarts=4); giving up" in stderr, stderr[-3000:]
    assert "rollout rank 0 failed in" in stderr and "stopped answering" in stderr, stderr[-3000:]
    # Noticed within 4/3 of the 10 s bound plus a poll, then released (the frozen rank is killed without
    # being asked, the actor blocked in the weight broadcast to it gets 10 s to shut down): well under a
    # minute, and far below the 900 s of the call it froze in.
    assert time.monotonic() - stopped < 300
    rows = assert_valid_metrics(out / "metrics.jsonl")
    assert rows[0]["step"] == 1 and rows[-1]["step"] >= trained_to
    assert rows[-1]["recovery/restarts"] == 4
    log = stdout + stderr
    for role in ("rollout", "reward", "reference"):
        assert f"lost {role} rank 0; replacing {role} workers" in log, log[-3000:]
    assert "lost actor rank 0; restarting every worker from" in log, log[-3000:]
    assert_nothing_left(ray_processes)
