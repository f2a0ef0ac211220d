"""Tests for starting and joining Ray (roll.distributed.ray_utils, roll.pipelines.common.init_ray)."""

from __future__ import annotations

import os

import pytest
import ray

from roll.config.common import RayConfig
from roll.pipelines.common import init_ray


@pytest.mark.usefixtures("ray_session")
def test_init_ray_is_a_no_op_when_ray_is_already_running(monkeypatch):
    before = ray.get_runtime_context().get_node_id(), ray.cluster_resources()
    # Neither a different CPU count nor an address (from the config or RAY_ADDRESS) may restart or
    # re-join Ray: the session's Ray, with its 4 logical GPUs, must stay the one in use.
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    init_ray(RayConfig(num_cpus=1))
    init_ray(RayConfig(address="127.0.0.1:1"))
    assert ray.is_initialized()
    after = ray.get_runtime_context().get_node_id(), ray.cluster_resources()
    assert after == before
    assert after[1].get("GPU") == 4


@pytest.mark.parametrize(
    ("config_address", "env_address", "expected"),
    [
        ("10.0.0.5:6379", None, "10.0.0.5:6379"),  # the config wins
        ("10.0.0.5:6379", "10.0.0.9:6379", "10.0.0.5:6379"),
        (None, "10.0.0.9:6379", "10.0.0.9:6379"),  # RAY_ADDRESS when the config has none
        (None, None, "local"),  # neither: start a Ray of its own, never one recorded on the machine
    ],
)
def test_init_ray_joins_the_configured_cluster_or_starts_a_local_one(
    monkeypatch, config_address, env_address, expected
):
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    if env_address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env_address)
    init_ray(RayConfig(address=config_address, num_cpus=3))
    assert len(calls) == 1
    assert calls[0].get("address") == expected
    # A local Ray gets the configured CPU count and workers at the driver's priority; joining leaves the
    # cluster's resources and settings alone.
    assert ("num_cpus" in calls[0]) == (expected == "local")
    assert calls[0].get("_system_config") == ({"worker_niceness": 0} if expected == "local" else None)


def test_a_cluster_that_cannot_be_joined_is_a_config_error_naming_the_setting(monkeypatch) -> None:
    from roll.config.loader import ConfigError

    def refuse(**kwargs):
        raise ConnectionError("no answer")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
    with pytest.raises(
        ConfigError, match="^RAY_ADDRESS: cannot join the Ray cluster at '10.0.0.9:6379': no answer$"
    ):
        init_ray(RayConfig())
    with pytest.raises(ConfigError, match="^ray.address: cannot join the Ray cluster at '10.0.0.5:6379'"):
        init_ray(RayConfig(address="10.0.0.5:6379"))
    # A local Ray that fails to start names no setting: the error is Ray's own.
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(ConnectionError, match="no answer"):
        init_ray(RayConfig())


@ray.remote(num_cpus=0)
def _niceness() -> int:
    import os

    return os.nice(0)


@pytest.mark.usefixtures("ray_session")
def test_workers_run_at_the_drivers_priority() -> None:
    """Ray's default niceness of 15 let any busy process on the machine starve a run's workers."""
    assert ray.get(_niceness.remote(), timeout=600) == 0


@ray.remote(num_cpus=0)
def _worker_env(name: str) -> str | None:
    import os

    return os.environ.get(name)


@pytest.mark.usefixtures("ray_session")
def test_workers_openmp_threads_spin_briefly_before_they_sleep() -> None:
    # Long spins of the last stage's threads would take the cores from the next stage's worker; no spin
    # at all makes every parallel region wake its threads through the kernel.
    from roll.distributed.ray_utils import WORKER_SPIN_COUNT

    # The timeouts only turn a hang into an error: a worker process may take minutes to start when busy.
    assert ray.get(_worker_env.remote("GOMP_SPINCOUNT"), timeout=600) == WORKER_SPIN_COUNT
    assert ray.get(_worker_env.remote("OMP_WAIT_POLICY"), timeout=600) is None


def test_a_user_set_openmp_wait_policy_wins(monkeypatch) -> None:
    from roll.distributed.ray_utils import WORKER_SPIN_COUNT, worker_runtime_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("ROLL_CPU_THREADS", raising=False)
    assert worker_runtime_env()["env_vars"] == {"GOMP_SPINCOUNT": WORKER_SPIN_COUNT}
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert worker_runtime_env()["env_vars"] == {"OMP_WAIT_POLICY": "PASSIVE"}
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert worker_runtime_env()["env_vars"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}


def test_the_drivers_cpu_share_reaches_every_worker(monkeypatch) -> None:
    """``ROLL_CPU_THREADS`` caps the threads of a node's workers (two runs, or test processes, sharing a
    machine); each role's ranks split it. Unset: every core."""
    from roll.distributed.ray_utils import worker_runtime_env
    from roll.workers.base import cpu_threads

    monkeypatch.delenv("ROLL_CPU_THREADS", raising=False)
    assert "ROLL_CPU_THREADS" not in worker_runtime_env()["env_vars"]
    assert cpu_threads() == os.cpu_count()
    monkeypatch.setenv("ROLL_CPU_THREADS", "1")
    assert worker_runtime_env()["env_vars"]["ROLL_CPU_THREADS"] == "1"
    assert cpu_threads() == 1
