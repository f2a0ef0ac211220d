"""The trainer's weights to the rollout workers, and the one count of their version in the driver.

Every weights version the scheduler stamps its work with comes from here: ``version`` is the version the
rollout workers hold (0: the initial weights). It moves when the actor's weights are published after a
step, when a checkpoint is loaded, and back to 0 when new rollout workers start from the initial model;
a replacement of lost rollout workers keeps it (they receive the trained weights under that version).
Without rollout workers (the hybrid engine generates with the actor's own weights) nothing travels,
but the version still counts the updates, so staleness means the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from roll.distributed.device_mapping import is_colocated
from roll.distributed.sync_probe import SyncProbe, probe_sequences
from roll.distributed.weight_sync import WeightSync

if TYPE_CHECKING:
    from roll.pipelines.roles import RoleSet
    from roll.pipelines.worker_specs import WorkerPlan


class WeightPublisher:
    """``on_version`` is told every new version (the scheduler's ``set_weights_version``); ``before_sync``
    runs before each transfer (colocation: the actor and the rollout workers on their devices)."""

    def __init__(self, on_version: Callable[[int], None], before_sync: Callable[[], Any]):
        self.version = 0
        self.sync: WeightSync | None = None
        self._on_version, self._before_sync = on_version, before_sync

    @property
    def sends(self) -> bool:
        """Whether a publish sends weights (there are rollout workers to receive them)."""
        return self.sync is not None

    def reset(self) -> None:
        """New rollout workers started from the initial model: they hold version 0."""
        self.version = 0

    def connect(self, sync: WeightSync) -> None:
        """Transfer through ``sync`` from now on (new rollout workers, or a new actor)."""
        self.close()
        sync.connect()
        self.sync = sync

    def reconnect(self, sync: WeightSync) -> None:
        """Rollout workers that replace lost ones: they get the trained weights under the version the lost
        ones held, so the scheduler's staleness bookkeeping goes on unchanged."""
        self.connect(sync)
        if self.version > 0:
            self._send(self.version)

    def publish(self) -> dict[str, float]:
        """The trainer's weights as the next version (one per step in a run that never lost its rollout
        workers, so there version == step); returns the transfer's step metrics (none with nothing sent)."""
        version = self.version + 1
        sent = self._send(version) if self.sync is not None else {}
        self._set(version)
        metrics = {
            f"sync/{key}": float(sent[key])
            for key in ("gb_per_s", "bytes", "max_logprob_diff")
            if key in sent
        }
        if "probe_s" in sent:
            metrics["time/sync_probe_s"] = float(sent["probe_s"])  # part of time/sync_s
        return metrics

    def restore(self, step: int) -> None:
        """After a checkpoint of ``step`` loaded into the actor: fresh rollout workers get version ``step``,
        as in the run that saved it; ones that outlived a lost trainer hold a later version of the
        abandoned steps, so theirs counts on from it."""
        if step > 0:
            version = max(step, self.version + 1)
            if self.sync is not None:
                self._send(version)
            self.version = version
        self._on_version(self.version)

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
            self.sync = None

    def _send(self, version: int) -> dict[str, object]:
        assert self.sync is not None
        self._before_sync()
        return self.sync.sync(version=version)

    def _set(self, version: int) -> None:
        self.version = version
        self._on_version(version)


def rollout_transfer(roles: RoleSet, plan: WorkerPlan, vocab: int, seed: int, timeout_s: float) -> WeightSync:
    """The transfer from the actor's ranks to the live rollout workers (not yet connected), checked after
    every sync on the probe (``rollout.sync_probe_*``) unless it is off."""
    spec, probe = plan.sync_probe, None
    if spec is not None:
        probe = SyncProbe(probe_sequences(vocab, spec.sequences, seed), spec.tolerance)
    return WeightSync(
        roles.live["actor"],
        roles.live["rollout"],
        bucket_bytes=plan.weight_bucket_bytes,
        timeout_s=timeout_s,
        colocated=is_colocated(roles.devices["actor"], roles.devices["rollout"]),
        probe=probe,
    )
