"""Tests for roll.distributed.ray_utils."""

from __future__ import annotations

import pytest
import ray

from roll.config.common import RayConfig
from roll.distributed.ray_utils import init_ray


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
