"""Time-sharing devices between colocated roles: before a stage runs, the roles it does not use offload
their state from the devices they share with it, and the roles it uses reload theirs.

So a colocated group never holds more than the running stage's roles on its devices (weight transfer is
the one stage that needs two: the trainer sends, the rollout engine receives).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from roll.distributed.cluster import Cluster


class Colocation:
    """``groups`` lists role names sharing devices (``device_mapping.colocation_groups``); roles in no
    group (CPU-only or alone on their devices) are never offloaded."""

    def __init__(self, clusters: Mapping[str, Cluster], groups: Sequence[Sequence[str]]):
        self.clusters = dict(clusters)
        # A role without a cluster (e.g. no reference model when kl_coef is 0) holds nothing to move.
        present = [[role for role in group if role in clusters] for group in groups]
        self.groups = [group for group in present if len(group) > 1]
        self.on_device = {role: True for group in self.groups for role in group}

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def start(self, setups: Mapping[str, Callable[[], Any]]) -> None:
        """Run each role's setup (``setups[role]()`` returns a future with ``get()``) so that colocated
        roles load one after another, each offloaded before the next loads: start-up, too, never holds
        two of them on shared devices. Roles in no group, and the first role of every group, start at
        once."""
        waves: list[list[str]] = [[role for role in setups if role not in self.on_device]]
        stays: set[str] = set()  # the last of each group to load stays on the devices
        for group in self.groups:
            loading = [role for role in group if role in setups]  # the rest are running already
            for index, role in enumerate(loading):
                if index >= len(waves):
                    waves.append([])
                waves[index].append(role)
            stays.update(loading[-1:])
        for wave in waves:
            futures = [setups[role]() for role in wave]
            for future in futures:
                future.get()
            for role in wave:
                if role in self.on_device and role not in stays:
                    self._move(role, to_device=False, metrics={})

    def use(self, *roles: str) -> dict[str, float]:
        """Make ``roles`` resident and everything colocated with them offloaded; returns the bytes moved
        per role (``offload/<role>_bytes``, summed over ranks) and the seconds taken (``time/offload_s``)."""
        metrics: dict[str, float] = {}
        for group in self.groups:
            if not any(role in group for role in roles):
                continue
            # Offload first so the devices are free before anything comes back.
            for role in group:
                if role not in roles and self.on_device[role]:
                    self._move(role, to_device=False, metrics=metrics)
            for role in group:
                if role in roles and not self.on_device[role]:
                    self._move(role, to_device=True, metrics=metrics)
        return metrics

    def offload(self, role: str, metrics: dict[str, float] | None = None) -> None:
        """Move ``role``'s state off the shared devices now (it comes back at its next ``use``)."""
        self._move(role, to_device=False, metrics=metrics if metrics is not None else {})

    def forget(self, role: str) -> dict[str, float]:
        """``role`` stopped: it holds nothing on the devices and takes no more turns. A role left alone
        on its devices comes back to them, as it will not take turns any more; returns what moved."""
        metrics: dict[str, float] = {}
        self.clusters.pop(role, None)
        self.on_device.pop(role, None)
        groups = [[r for r in group if r != role] for group in self.groups]
        for group in groups:
            if len(group) == 1 and not self.on_device[group[0]]:
                self._move(group[0], to_device=True, metrics=metrics)
        self.groups = [group for group in groups if len(group) > 1]
        self.on_device = {r: self.on_device[r] for group in self.groups for r in group}
        return metrics

    def _move(self, role: str, to_device: bool, metrics: dict[str, float]) -> None:
        cluster = self.clusters[role]
        per_rank = cluster.reload_states() if to_device else cluster.offload_states()
        self.on_device[role] = to_device
        key = f"offload/{role}_bytes"
        metrics[key] = metrics.get(key, 0.0) + sum(r["bytes"] for r in per_rank)
        # Ranks move in parallel: the stage waited for the slowest.
        metrics["time/offload_s"] = metrics.get("time/offload_s", 0.0) + max(r["seconds"] for r in per_rank)
