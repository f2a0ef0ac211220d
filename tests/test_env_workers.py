"""Environment workers on Ray: each rank hosts a pool of environments and steps many episodes per call;
an env's own failure comes back in the results, a lost worker process as an error naming role and rank."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from roll.distributed.cluster import Cluster, WorkerError
from roll.envs import ENVIRONMENTS
from roll.envs.frozen_lake import FrozenLake, shortest_path
from roll.envs.pool import OK
from roll.workers.environment import EnvSpec, EnvWorker

pytestmark = pytest.mark.usefixtures("ray_session")


def test_each_rank_steps_its_episodes_in_one_call() -> None:
    # The call timeout only turns a hang into an error: the actors' start takes minutes on a busy machine.
    envs = Cluster("environment", EnvWorker, 2, EnvSpec("frozen_lake", {"size": 4}), timeout_s=900)
    try:
        envs.setup()
        placed = {0: [("a", 1), ("b", 2)], 1: [("c", 3)]}
        starts = {rank: envs.call_rank(rank, "reset", requests) for rank, requests in placed.items()}
        assert [r.observation for r in starts[1]] == [FrozenLake(size=4).reset(3)[0]]
        moves = {
            rank: [(r.episode_id, shortest_path(r.observation)[0]) for r in results]
            for rank, results in starts.items()
        }
        stepped = {rank: envs.call_rank(rank, "step", actions) for rank, actions in moves.items()}
        assert [r.episode_id for r in stepped[0]] == ["a", "b"] and all(r.status == OK for r in stepped[0])
        assert envs.call_rank(0, "counters") == {
            "resets": 2,
            "steps": 2,
            "retries": 0,
            "errors": 0,
            "timeouts": 0,
        }
        with pytest.raises(WorkerError, match="environment rank 1 failed in step"):
            envs.call_rank(1, "step", [("a", "L")])  # episode a lives on rank 0: a caller's bug, reported
        pids = {info["rank"]: info["pid"] for info in envs.ping()}
        # An environment worker never loads torch (its import would lengthen every start and replacement).
        assert "libtorch" not in Path(f"/proc/{pids[0]}/maps").read_text()
        pid = pids[1]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match="environment rank 1"):
            envs.call_rank(1, "step", [("c", "D")])
    finally:
        envs.kill()


@ENVIRONMENTS.register("gated_lake")  # the workers import this module (plugins) and register it too
class GatedLake(FrozenLake):
    """A lake whose steps for seed 1 wait until a gate file exists (another process creates it)."""

    def __init__(self, gate: str = "", **options):
        super().__init__(**options)
        self.gate = gate

    def reset(self, seed):
        self.seed_ = seed
        return super().reset(seed)

    def step(self, action_text):
        import time

        while self.seed_ == 1 and not os.path.exists(self.gate):
            time.sleep(0.01)
        return super().step(action_text)


@pytest.mark.slow  # a Ray worker of its own
def test_a_slow_call_does_not_hold_up_the_next_call_to_the_same_worker(tmp_path) -> None:
    """The scheduler sends the steps of whichever turns came back together in calls of their own: a call
    whose env is slow must not make later calls to the worker wait (calls run concurrently). The slow
    env waits for a file the test creates only after the second call has returned, so with calls run
    one at a time the second call could never return."""
    import ray

    gate = tmp_path / "gate"
    envs = Cluster(
        "environment",
        EnvWorker,
        1,
        EnvSpec("gated_lake", {"size": 4, "gate": str(gate)}, step_timeout_s=600),
        timeout_s=900,
        plugins=["test_env_workers"],
    )
    try:
        envs.setup()
        envs.call_rank(0, "reset", [("slow", 1), ("fast", 2)])
        slow = envs.call_rank(0, "step", [("slow", "L")], blocking=False)
        fast = envs.call_rank(0, "step", [("fast", "L")], blocking=False)
        (result,) = fast.get()  # returns while the slow call still waits for the gate
        assert result.status == OK and not ray.wait(slow.refs, timeout=0)[0]
        gate.touch()
        assert slow.get()[0].status == OK
    finally:
        envs.kill()
