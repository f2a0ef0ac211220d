"""Multi-node placement probe, run by tests/test_placement.py in a subprocess.

``ray.cluster_utils.Cluster`` starts its own Ray, which cannot coexist with the test session's Ray in
one process, hence the subprocess. It starts two nodes with two logical GPUs each, builds a
DeviceTable, places a 4-rank ``actor`` on devices [0, 1, 2, 3] and prints one JSON object: the table's
slots and every rank's ping. The test reads it and checks that ranks landed where the table says.

Run with ``tests/`` on PYTHONPATH, so the node processes (which inherit the environment) import
``ProbeWorker`` from this module by name.
"""

from __future__ import annotations

import dataclasses
import json
import logging

from roll.distributed.worker import Worker


class ProbeWorker(Worker):
    """A worker that only answers ``ping``."""


def main() -> None:
    import importlib

    import ray
    from ray.cluster_utils import Cluster as RayCluster

    from roll.distributed.cluster import Cluster
    from roll.distributed.device_mapping import role_devices
    from roll.distributed.placement import DeviceTable, place_role

    # Run as a script this module is __main__, whose classes Ray would pickle by value; the module
    # imported by name makes it pickle ProbeWorker by reference, as the worker processes import it.
    worker_cls = importlib.import_module("multinode_placement_probe").ProbeWorker

    ray_cluster = RayCluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "include_dashboard": False}
    )
    try:
        ray_cluster.add_node(num_cpus=2, num_gpus=2)
        ray.init(address=ray_cluster.address, logging_level=logging.WARNING)
        ray_cluster.wait_for_nodes()
        table = DeviceTable.create(timeout_s=600)  # actor start-up takes minutes on a busy machine
        try:
            role = role_devices("actor", [0, 1, 2, 3])
            placements = place_role(role, table)
            cluster = Cluster("actor", worker_cls, role.world_size, config=None, placements=placements)
            try:
                pings = cluster.ping()
            finally:
                cluster.kill()
        finally:
            table.remove()
        print(json.dumps({"slots": [dataclasses.asdict(s) for s in table.slots], "pings": pings}))
    finally:
        ray.shutdown()
        ray_cluster.shutdown()


if __name__ == "__main__":
    main()
