"""Ray placement of device-mapped roles: global device index -> (node, GPU id) -> actor options.

``DeviceTable.create`` reserves every GPU of the Ray cluster in ONE placement group (one ``{"GPU": 1}``
bundle per device) and learns which node and GPU id each bundle landed on. Global device indices are
then a deterministic order of those bundles, with the devices of one node consecutive, so that
``device_mapping: [0, 1]`` means "the first two GPUs of the first node" on every run.

Workers do not reserve whole GPUs: each rank asks for a small fraction of its first device's bundle, so
many colocated roles fit on one device (they time-share it; the pipeline offloads state between
stages), and ``CUDA_VISIBLE_DEVICES`` is set from the table to *all* the rank's devices, which Ray's own
fractional assignment (one GPU per actor) cannot express for model-parallel ranks. The same code runs on
logical GPUs declared on a CPU-only node (``ray.init(num_gpus=4)``), which is how it is tested.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from roll.distributed.device_mapping import RoleDevices, validate_plan

# The GPU share one rank reserves on its first device's bundle: small enough that ~100 colocated ranks
# fit on one device, non-zero so Ray still schedules the actor inside the bundle and exposes its GPU.
GPU_SHARE_PER_RANK = 0.01


@dataclass(frozen=True)
class DeviceSlot:
    """Where one global device lives: its node, the GPU id Ray assigned there and its bundle."""

    index: int
    node_id: str
    node_ip: str
    gpu_id: str
    bundle_index: int


@ray.remote(num_cpus=0, num_gpus=GPU_SHARE_PER_RANK)
def _probe_bundle() -> tuple[str, str, list[Any]]:
    """Node id, node IP and GPU ids seen by a task running inside one bundle."""
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), ray.get_gpu_ids()


def _gpu_sort_key(gpu_id: str) -> tuple[int, int | str]:
    # Numeric ids sort numerically (10 after 9); UUID-style ids (from a CUDA_VISIBLE_DEVICES of UUIDs)
    # sort as text, after the numbers, so mixed ids never compare int with str.
    return (0, int(gpu_id)) if gpu_id.isdigit() else (1, gpu_id)


class DeviceTable:
    """Every GPU of the Ray cluster, reserved in one placement group and numbered 0..N-1.

    Build it with ``DeviceTable.create()``; call ``remove()`` when the job ends, since the placement
    group holds the GPUs (logical or real) until it is removed."""

    def __init__(self, slots: list[DeviceSlot], pg: PlacementGroup | None):
        self._slots = list(slots)
        self._pg = pg

    @classmethod
    def create(cls, timeout_s: float = 60.0) -> DeviceTable:
        """Reserve all GPUs of the alive Ray nodes and map them to global indices. A cluster without
        GPUs gives an empty table (no placement group): only CPU-only roles can run there."""
        if not ray.is_initialized():
            raise RuntimeError("DeviceTable.create() needs a running Ray: call ray.init() first")
        num_devices = int(ray.cluster_resources().get("GPU", 0))
        if num_devices == 0:
            return cls([], None)
        pg = placement_group([{"GPU": 1}] * num_devices, strategy="PACK")
        try:
            slots = _locate_bundles(pg, num_devices, timeout_s)
        except BaseException:
            # A pending group would grab the GPUs as soon as they free up: never leave one behind.
            remove_placement_group(pg)
            raise
        return cls(slots, pg)

    @property
    def num_devices(self) -> int:
        return len(self._slots)

    @property
    def slots(self) -> tuple[DeviceSlot, ...]:
        """All devices, in global index order."""
        return tuple(self._slots)

    @property
    def placement_group(self) -> PlacementGroup | None:
        """The group holding every device (None for an empty table)."""
        return self._pg

    def slot(self, index: int) -> DeviceSlot:
        """The device with global index ``index``."""
        if not 0 <= index < len(self._slots):
            raise IndexError(f"device {index} out of range: the cluster has {len(self._slots)} devices")
        return self._slots[index]

    def remove(self) -> None:
        """Release the devices (idempotent). Actors placed on them should be killed first."""
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None

    def __repr__(self) -> str:
        nodes = len({s.node_id for s in self._slots})
        return f"DeviceTable(num_devices={self.num_devices}, nodes={nodes})"


def _locate_bundles(pg: PlacementGroup, num_devices: int, timeout_s: float) -> list[DeviceSlot]:
    start = time.monotonic()
    if not pg.wait(timeout_seconds=timeout_s):
        available = ray.available_resources().get("GPU", 0)
        raise RuntimeError(
            f"could not reserve {num_devices} devices within {timeout_s:.0f} s: only {available:g} of the "
            f"cluster's {num_devices} GPUs are free (another job, placement group or actor holds the "
            "rest; a pipeline reserves every GPU of the cluster once, at start)"
        )
    refs = [
        _probe_bundle.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i
            )
        ).remote()
        for i in range(num_devices)
    ]
    remaining = max(timeout_s - (time.monotonic() - start), 1.0)
    try:
        answers = ray.get(refs, timeout=remaining)
    except GetTimeoutError:
        raise RuntimeError(
            f"reserved {num_devices} devices but probing them did not finish within {timeout_s:.0f} s "
            "(are the nodes' workers starting?)"
        ) from None
    located = []
    for bundle, (node_id, node_ip, gpu_ids) in enumerate(answers):
        if len(gpu_ids) != 1:
            raise RuntimeError(f"bundle {bundle} of the device placement group saw GPU ids {gpu_ids}")
        located.append((node_ip, node_id, str(gpu_ids[0]), bundle))
    located.sort(key=lambda s: (s[0], s[1], _gpu_sort_key(s[2])))
    return [DeviceSlot(i, node_id, ip, gpu, bundle) for i, (ip, node_id, gpu, bundle) in enumerate(located)]


@dataclass
class RankPlacement:
    """How to start one rank: ``options`` for the Ray actor's ``.options(...)`` and ``env`` for its
    process (applied by ``Worker.__init__`` before anything initialises CUDA)."""

    options: dict[str, Any]
    env: dict[str, str]
    node_id: str
    devices: list[int] = field(default_factory=list)


def place_role(role: RoleDevices, table: DeviceTable) -> list[RankPlacement] | None:
    """One placement per rank of ``role``, or None for a CPU-only role (it is placed by Ray freely).

    Raises ``ValueError`` naming ``<role>.device_mapping`` when an index is not in ``table`` or when one
    rank's devices span nodes (a model-parallel worker's devices must share a node)."""
    if role.device_mapping is None:
        return None
    problems = validate_plan([role], table.num_devices)
    if problems:
        raise ValueError("; ".join(problems))
    # Check every rank before building any option, so a bad plan is reported whole and early.
    rank_slots = [[table.slot(d) for d in role.devices_of(rank)] for rank in range(role.world_size)]
    for rank, slots in enumerate(rank_slots):
        if len({s.node_id for s in slots}) > 1:
            where = ", ".join(f"device {s.index} on node {s.node_id[:8]}" for s in slots)
            raise ValueError(
                f"{role.role}.device_mapping: rank {rank} would use devices spread over several nodes "
                f"({where}); the devices of one worker must be on one node, so list each worker's "
                f"{role.num_devices_per_worker} devices from the same node (devices of a node are "
                "numbered consecutively)"
            )
    if table.placement_group is None:
        raise RuntimeError(f"{role.role}: the device table was removed; create a new one to place roles")
    return [_rank_placement(slots, table) for slots in rank_slots]


def _rank_placement(slots: list[DeviceSlot], table: DeviceTable) -> RankPlacement:
    strategy = PlacementGroupSchedulingStrategy(
        placement_group=table.placement_group,
        placement_group_bundle_index=slots[0].bundle_index,
        # Tasks the worker starts (e.g. engine helpers) must not be squeezed into the GPU bundle.
        placement_group_capture_child_tasks=False,
    )
    return RankPlacement(
        options={"scheduling_strategy": strategy, "num_gpus": GPU_SHARE_PER_RANK, "num_cpus": 0},
        env={
            "CUDA_VISIBLE_DEVICES": ",".join(s.gpu_id for s in slots),
            "ROLL_DEVICES": ",".join(str(s.index) for s in slots),
        },
        node_id=slots[0].node_id,
        devices=[s.index for s in slots],
    )
