"""Trainer -> inference weight transfer, driven from the single controller.

Trainer rank 0 and every inference worker form one collective group (gloo on CPU, NCCL when both ends are
on GPUs). Each sync broadcasts the full weights in fixed-size buckets, tagged with a version the
receivers check; sharded trainer ranks help gather each bucket. A failure or a timeout is a
``WeightSyncError`` naming the sender and the receivers that failed or stopped answering, never a hang.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from roll.distributed.cluster import Cluster, ClusterFuture
from roll.distributed.liveness import RankWatch

_group_ids = itertools.count()


class WeightSyncError(RuntimeError):
    """A weight transfer failed or timed out; the message names the sender and the receivers."""


class WeightSync:
    """Connects ``trainer`` (an actor cluster) to ``inference`` (rollout workers) and moves weights."""

    def __init__(
        self,
        trainer: Cluster,
        inference: Cluster,
        bucket_bytes: int,
        timeout_s: float,
        colocated: bool = False,
    ):
        """``colocated``: trainer and engines share GPUs. NCCL cannot put two ranks of a group on one GPU,
        so gloo carries such a transfer through host memory (a CUDA IPC path would avoid the copy)."""
        self.trainer, self.inference, self.colocated = trainer, inference, colocated
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.plan: list[Any] | None = None
        self.backend = "gloo"
        self.version = -1  # the last version the receivers loaded

    def connect(self) -> None:
        """Form the collective group and agree on the bucket plan (once, after both clusters are set up)."""
        devices = {*self.trainer.device_type(), *self.inference.device_type()}
        self.backend = transfer_backend(devices, self.colocated)
        address, port = self.trainer.master_address()
        name = f"roll-weights-{os.getpid()}-{next(_group_ids)}"
        args = (name, self.backend, address, port, 1 + self.inference.world_size, self.timeout_s)
        self._wait(
            "joining the weight-transfer group",
            self.trainer.join_weight_group(*args, blocking=False),
            self.inference.join_weight_group(*args, blocking=False),
        )
        self.plan = self.trainer.weight_plan(self.bucket_bytes)

    def sync(self, version: int) -> dict[str, float]:
        """Send the trainer's current weights as ``version``; returns bytes, seconds and throughput."""
        if version <= self.version:
            raise ValueError(
                f"weights version {version} is not newer than the last one sent ({self.version})"
            )
        if self.plan is None:
            self.connect()
        start = time.perf_counter()
        sent, _ = self._wait(
            f"sending weights version {version}",
            self.trainer.send_weights(self.plan, version, self.timeout_s, blocking=False),
            self.inference.receive_weights(self.plan, version, self.timeout_s, blocking=False),
        )
        seconds = time.perf_counter() - start
        self.version = version
        nbytes = sent[0]["bytes"]
        return {
            "bytes": nbytes,
            "seconds": seconds,
            "buckets": sent[0]["buckets"],
            "gb_per_s": nbytes / seconds / 1e9,
        }

    def _wait(self, what: str, send: ClusterFuture, receive: ClusterFuture) -> tuple[list[Any], list[Any]]:
        """Both sides' results; on any failure or timeout a WeightSyncError saying who did what."""
        # The collectives time out on their own after timeout_s; the margin lets their errors arrive first.
        deadline = time.monotonic() + self.timeout_s * 1.5 + 10.0
        refs = {**_labelled(send), **_labelled(receive)}
        ranks = {
            ref: (future.role, rank) for future in (send, receive) for rank, ref in enumerate(future.refs)
        }
        # A frozen end would hold every other end in the collective until the timeout: watch them all.
        watch = RankWatch.combine(send.watch, receive.watch)
        pending = list(refs)
        while pending and time.monotonic() < deadline:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(1.0, self.timeout_s))
            watch.poll(ranks[ref] for ref in pending)
            if any(_failed(ref) for ref in refs if ref not in pending):
                # The failed rank's peers time out of the same collective within timeout_s: wait for
                # their errors, then call whoever is still silent stuck.
                _, pending = ray.wait(pending, num_returns=len(pending), timeout=self.timeout_s + 1.0)
                break
        errors = {refs[ref]: _error(ref) for ref in refs if ref not in pending and _failed(ref)}
        if not pending and not errors:
            return send.get(), receive.get()
        lines = [f"{who} did not answer within {self.timeout_s:.0f} s" for who in map(refs.get, pending)]
        lines += [f"{who}: {detail}" for who, detail in errors.items()]
        sender = f"{self.trainer.role} rank 0"
        receivers = f"{self.inference.role} ranks 0-{self.inference.world_size - 1}"
        raise WeightSyncError(
            f"weight transfer failed while {what}, from {sender} to {receivers} ({self.backend}):\n  "
            + "\n  ".join(lines)
        )


def transfer_backend(device_types: set[str], colocated: bool) -> str:
    """NCCL when every end computes on a GPU and no GPU holds two ends (NCCL cannot put two ranks of a
    group on one device); gloo otherwise."""
    return "nccl" if device_types == {"cuda"} and not colocated else "gloo"


def _labelled(future: ClusterFuture) -> dict[ray.ObjectRef, str]:
    return {ref: f"{future.role} rank {rank}" for rank, ref in enumerate(future.refs)}


def _failed(ref: ray.ObjectRef) -> bool:
    return _error(ref) is not None


def _error(ref: ray.ObjectRef) -> str | None:
    try:
        ray.get(ref, timeout=0)
    except RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        return f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1]}"
    except RayActorError as e:
        return f"the worker process died ({e})"
    return None
