"""Tests for roll.distributed.placement: device tables, role placement and placed Clusters on real Ray.

The session Ray declares 4 logical GPUs on one CPU node (see conftest). A DeviceTable's placement
group holds all of them, so one table is shared by this module and removed at its end; a leaked table
would starve every later test that reserves devices. The multi-node case needs its own Ray
(``ray.cluster_utils.Cluster``) and runs in a subprocess (tests/multinode_placement_probe.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import ray

from roll.distributed.cluster import Cluster
from roll.distributed.device_mapping import role_devices
from roll.distributed.dispatch import Dispatch
from roll.distributed.placement import DeviceSlot, DeviceTable, RankPlacement, place_role
from roll.distributed.worker import Worker, register

pytestmark = pytest.mark.usefixtures("ray_session")


class PlacedWorker(Worker):
    """Reports its environment, so a test can see what its placement set."""

    @register(Dispatch.ONE_TO_ALL)
    def getenv(self, name: str) -> str | None:
        return os.environ.get(name)


@pytest.fixture(scope="module")
def table(ray_session: None) -> Iterator[DeviceTable]:
    """One table for the module: probing the bundles starts worker processes, so it is built once (with
    minutes to spare: starting them takes that long on a busy machine)."""
    table = DeviceTable.create(timeout_s=600)
    try:
        yield table
    finally:
        table.remove()


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., Cluster]]:
    """Clusters of PlacedWorker, killed when the test ends (before the module's table is removed)."""
    clusters: list[Cluster] = []

    def make(role: str, world_size: int, placements: list[RankPlacement] | None, **kwargs) -> Cluster:
        cluster = Cluster(role, PlacedWorker, world_size, config=None, placements=placements, **kwargs)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.kill()


def assert_ranks_where_planned(
    pings: list[dict], placements: list[RankPlacement], table: DeviceTable
) -> None:
    """Each rank runs on the node of its devices and sees exactly their GPU ids."""
    assert [p["rank"] for p in pings] == list(range(len(placements)))
    for ping, placement in zip(pings, placements, strict=True):
        slots = [table.slot(d) for d in placement.devices]
        assert ping["node_id"] == placement.node_id == slots[0].node_id
        assert ping["cuda_visible_devices"] == ",".join(s.gpu_id for s in slots)
        assert ping["devices"] == ",".join(str(d) for d in placement.devices)


# ------------------------------------------------------------------ the device table


def test_table_numbers_the_sessions_four_logical_gpus(table):
    assert table.num_devices == 4
    assert [s.index for s in table.slots] == [0, 1, 2, 3]
    assert [table.slot(i).gpu_id for i in range(4)] == ["0", "1", "2", "3"]  # one node: ids in order
    assert {s.node_id for s in table.slots} == {ray.get_runtime_context().get_node_id()}
    assert sorted(s.bundle_index for s in table.slots) == [0, 1, 2, 3]
    assert table.placement_group is not None
    assert ray.available_resources().get("GPU", 0) == 0  # the table holds every device
    with pytest.raises(IndexError, match="device 4 out of range"):
        table.slot(4)


def test_second_table_cannot_reserve_held_devices_and_leaves_nothing_behind(table):
    with pytest.raises(RuntimeError, match="could not reserve 4 devices within 1 s: only 0 of"):
        DeviceTable.create(timeout_s=1)
    pending = [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]
    assert len(pending) == 1  # only the module's table: the failed one was removed


# ------------------------------------------------------------------ placed clusters


@pytest.mark.slow  # starts several placed clusters
def test_placed_clusters_run_where_their_plans_say(table, make_cluster):
    """A colocated plan (actor [0, 1] + rollout [0, 1]), a disaggregated one (the same actor + rollout
    [2, 3]) and a model-parallel role (2 devices per worker). Every actor starts worker processes that
    import torch, so all clusters are started at once, and the two plans share their actor cluster."""
    roles = {
        "actor": role_devices("actor", [0, 1]),
        "rollout_colocated": role_devices("rollout_colocated", [0, 1]),
        "rollout_disaggregated": role_devices("rollout_disaggregated", "range(2,4)"),
        "model_parallel": role_devices("model_parallel", "range(4)", None, num_devices_per_worker=2),
    }
    # The caller's env reaches the worker, but the placement's CUDA_VISIBLE_DEVICES wins over it.
    env = {"CUDA_VISIBLE_DEVICES": "7", "ROLL_TEST_FLAG": "kept"}
    placed = {}
    for name, role in roles.items():
        placements = place_role(role, table)
        assert placements is not None and len(placements) == role.world_size
        placed[name] = (make_cluster(name, role.world_size, placements, env=env), placements)
    pings = {}
    for name, (cluster, placements) in placed.items():
        pings[name] = cluster.ping()
        assert_ranks_where_planned(pings[name], placements, table)
        assert cluster.getenv("ROLL_TEST_FLAG") == ["kept"] * len(placements)

    def visible(name: str) -> list[str]:
        return [p["cuda_visible_devices"] for p in pings[name]]

    gpu = [table.slot(i).gpu_id for i in range(4)]
    assert visible("actor") == visible("rollout_colocated") == gpu[:2]  # time-sharing devices 0 and 1
    assert visible("rollout_disaggregated") == gpu[2:]
    assert visible("model_parallel") == [",".join(gpu[:2]), ",".join(gpu[2:])]
    assert [p["devices"] for p in pings["model_parallel"]] == ["0,1", "2,3"]
    options = placed["actor"][1][0].options
    assert options["num_gpus"] < 0.05 and options["num_cpus"] == 0  # ~100 colocated ranks fit a device


def test_cpu_only_role_is_not_placed(table):
    assert place_role(role_devices("reward", None, 2), table) is None


# ------------------------------------------------------------------ invalid plans


def test_device_outside_the_table_is_rejected_naming_the_key(table):
    with pytest.raises(
        ValueError, match=r"^rollout.device_mapping: names device 4 but the cluster has 4 devices"
    ):
        place_role(role_devices("rollout", [3, 4]), table)


def test_empty_table_suggests_logical_devices():
    with pytest.raises(ValueError, match=r"^actor.device_mapping: .*no devices.*ray.num_gpus: N"):
        place_role(role_devices("actor", [0]), DeviceTable([], None))


def test_worker_devices_on_two_nodes_are_rejected():
    slots = [DeviceSlot(i, f"node{i // 2}", "10.0.0.1", str(i % 2), i) for i in range(4)]
    fake = DeviceTable(slots, None)  # two nodes of two devices; never scheduled on
    with pytest.raises(ValueError, match=r"^actor.device_mapping: rank 0 would use devices spread") as info:
        place_role(role_devices("actor", [1, 2], None, 2), fake)
    assert "device 1 on node node0" in str(info.value) and "device 2 on node node1" in str(info.value)


def test_cluster_needs_one_placement_per_rank(table):
    placements = place_role(role_devices("actor", [0, 1]), table)
    with pytest.raises(ValueError, match="actor: 2 placements given for world_size 3"):
        Cluster("actor", PlacedWorker, 3, config=None, placements=placements)


def test_removed_table_cannot_place():
    table = DeviceTable([DeviceSlot(0, "n", "ip", "0", 0)], None)  # as a table looks after remove()
    with pytest.raises(RuntimeError, match="device table was removed"):
        place_role(role_devices("actor", [0]), table)


# ------------------------------------------------------------------ two nodes


# Two Ray nodes plus four torch-importing workers: too long for the fast tier.
@pytest.mark.slow
def test_two_node_cluster_places_ranks_on_the_node_of_their_devices(repo_root: Path):
    """Ranks land on the node that owns their devices across two Ray nodes: needs a two-node Ray cluster of
    its own, started in a subprocess."""
    tests_dir = repo_root / "tests"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, not the session's
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tests_dir), env.get("PYTHONPATH")) if p)
    # Ray's test cluster records its address in <temp dir>/ray/ray_current_cluster, where any ray.init()
    # without an address on this machine (a `roll train` of a test run beside this one) would find and
    # join it, and die with it. A temp dir of its own keeps it to itself (short: Ray's socket paths
    # must fit in 107 characters).
    env["RAY_TMPDIR"] = ray_tmp = tempfile.mkdtemp(prefix="roll-probe-", dir="/tmp")
    try:
        result = subprocess.run(
            [sys.executable, str(tests_dir / "multinode_placement_probe.py")],
            env=env,
            cwd=repo_root,
            capture_output=True,
            text=True,
            timeout=900,  # only a hang comes near this
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    slots = [DeviceSlot(**s) for s in report["slots"]]
    pings = report["pings"]
    assert [p["rank"] for p in pings] == [0, 1, 2, 3]
    assert pings[0]["node_id"] == pings[1]["node_id"] != pings[2]["node_id"] == pings[3]["node_id"]
    for rank, ping in enumerate(pings):
        assert ping["devices"] == str(rank)
        assert ping["node_id"] == slots[rank].node_id
        assert ping["cuda_visible_devices"] == slots[rank].gpu_id
    assert sorted(s.gpu_id for s in slots) == ["0", "0", "1", "1"]  # GPU ids are per node
