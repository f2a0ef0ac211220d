"""Environment workers on Ray: each rank hosts a pool of environments and steps many episodes per call;
an env's own failure comes back in the results, a lost worker process as an error naming role and rank."""

from __future__ import annotations

import os
import signal

import pytest

from roll.distributed.cluster import Cluster, WorkerError
from roll.envs.frozen_lake import FrozenLake, shortest_path
from roll.envs.pool import OK
from roll.workers.environment import EnvSpec, EnvWorker

pytestmark = pytest.mark.usefixtures("ray_session")


def test_each_rank_steps_its_episodes_in_one_call() -> None:
    envs = Cluster("environment", EnvWorker, 2, EnvSpec("frozen_lake", {"size": 4}), timeout_s=60)
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
        (pid,) = [info["pid"] for info in envs.ping() if info["rank"] == 1]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match="environment rank 1"):
            envs.call_rank(1, "step", [("c", "D")])
    finally:
        envs.kill()
