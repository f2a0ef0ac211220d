"""Trainer -> inference weight transfer, driven from the single controller.

Two paths, picked once in :meth:`WeightSync.connect` by :func:`choose_transport`:

- **shared memory** (``shm``) when trainer rank 0 and every inference worker are on one node and the
  engines hold their weights in host memory: rank 0 writes the weights into one segment on ``/dev/shm``
  that every receiver has mapped, and each receiver copies them into its engine
  (``roll.distributed.shm_transfer``). No sockets, one copy in and one copy out per receiver.
- **collective** otherwise (ranks on several nodes, engines on GPUs, or ``/dev/shm`` too small): trainer
  rank 0 and every inference worker form one group (gloo on CPU, NCCL when both ends are on GPUs) and
  each sync broadcasts the full weights in fixed-size buckets (``roll.distributed.weight_transfer``).

Both tag each transfer with a version the receivers check, and sharded trainer ranks help gather each
bucket. A failure or a timeout is a ``WeightSyncError`` naming the sender and the receivers that failed
or stopped answering, never a hang.

What travels (the payload, ``roll.strategies.lora``): every weight, or from a LoRA actor only its adapter
to engines that merge one themselves (``loads_adapters``) and the merged weights to the others. After
each sync an optional ``SyncProbe`` checks that the engines now compute what the trainer does.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from roll.distributed.cluster import Cluster, ClusterFuture
from roll.distributed.liveness import RankWatch
from roll.distributed.shm_transfer import SHM_DIR, Endpoint
from roll.distributed.sync_probe import SyncProbe
from roll.strategies.lora import ADAPTER, FULL

_group_ids = itertools.count()
logger = logging.getLogger("roll")

SHM, COLLECTIVE = "shm", "collective"
TRANSPORTS = ("auto", COLLECTIVE)
# Room left on /dev/shm beside the segment: other users of it (Ray's object store spills, torch's
# multiprocessing tensors, NCCL) must not be squeezed out by the weights.
SHM_HEADROOM_BYTES = 256 << 20


class WeightSyncError(RuntimeError):
    """A weight transfer failed or timed out; the message names the sender and the receivers."""


@dataclass(frozen=True)
class TransportChoice:
    """The path a WeightSync uses (``shm`` or ``collective``) and why, for the log and the metrics."""

    path: str
    reason: str


def choose_transport(
    sender: Endpoint,
    receivers: Sequence[Endpoint],
    nbytes: int,
    requested: str = "auto",
    headroom_bytes: int = SHM_HEADROOM_BYTES,
) -> TransportChoice:
    """Shared memory when it can work, the collective path otherwise (pure: endpoints in, choice out).

    Shared memory needs every receiver on trainer rank 0's node (same Ray node id and IP: they then see
    the same ``/dev/shm``), every receiver's engine in host memory (a GPU engine would need a second copy
    through the host; NCCL or a CUDA IPC path serves it better), and room for ``nbytes`` plus
    ``headroom_bytes`` in rank 0's shared-memory directory. ``requested="collective"`` forces the collective
    path. The reason names the first rank that rules shared memory out.
    """
    if requested not in TRANSPORTS:
        raise ValueError(f"unknown weight transport {requested!r}; expected one of {', '.join(TRANSPORTS)}")
    if requested == COLLECTIVE:
        return TransportChoice(COLLECTIVE, "the collective path was requested")
    if not receivers:
        return TransportChoice(COLLECTIVE, "no receivers")
    for rank, receiver in enumerate(receivers):
        if (receiver.node_id, receiver.ip) != (sender.node_id, sender.ip):
            return TransportChoice(
                COLLECTIVE,
                f"rollout rank {rank} is on node {receiver.ip} ({receiver.node_id[:8]}), trainer rank 0 on "
                f"{sender.ip} ({sender.node_id[:8]})",
            )
        if receiver.device != "cpu":
            return TransportChoice(COLLECTIVE, f"rollout rank {rank} holds its weights on {receiver.device}")
    if sender.shm_free_bytes < nbytes + headroom_bytes:
        return TransportChoice(
            COLLECTIVE,
            f"shared memory has {sender.shm_free_bytes / 2**20:.0f} MiB free on {sender.host}, the weights "
            f"need {nbytes / 2**20:.0f} MiB plus {headroom_bytes / 2**20:.0f} MiB headroom",
        )
    where = f"node {sender.ip}"
    return TransportChoice(SHM, f"all {len(receivers)} rollout ranks share {where} with trainer rank 0")


class WeightSync:
    """Connects ``trainer`` (an actor cluster) to ``inference`` (rollout workers) and moves weights."""

    def __init__(
        self,
        trainer: Cluster,
        inference: Cluster,
        bucket_bytes: int,
        timeout_s: float,
        colocated: bool = False,
        transport: str = "auto",
        shm_dir: str = SHM_DIR,
        payload: str = "auto",
        probe: SyncProbe | None = None,
    ):
        """``colocated``: trainer and engines share GPUs. NCCL cannot put two ranks of a group on one GPU,
        so gloo carries such a transfer through host memory (a CUDA IPC path would avoid the copy).
        ``transport``: ``auto`` (shared memory where :func:`choose_transport` allows it) or
        ``collective`` (always the gloo/NCCL group, e.g. to compare). ``shm_dir``: where the shared
        segment lives (``/dev/shm``; tests point it elsewhere). ``payload``: ``auto`` (a LoRA actor's
        adapter to engines that load adapters, merged weights to others, every weight from a fully trained
        actor), or one the actor offers (``merged``, e.g. to compare bytes). ``probe``: checked after every
        sync (its ``max_logprob_diff`` and ``probe_s`` join the stats)."""
        choose_transport(Endpoint("", "", "", "cpu", 0), [], 0, transport)  # rejects an unknown name now
        self.trainer, self.inference, self.colocated = trainer, inference, colocated
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.transport, self.shm_dir = transport, shm_dir
        self.requested_payload, self.probe = payload, probe
        self.payload = FULL
        self.plan: list[Any] | None = None
        self.backend = "gloo"
        self.path = COLLECTIVE
        self.reason = ""
        self.version = -1  # the last version the receivers loaded
        self._segment_created = False  # trainer rank 0 holds a shared segment that close() must drop

    def connect(self) -> None:
        """Agree on the bucket plan, pick the path and set it up (once, after both clusters are set up):
        map the shared segment on every end, or form the collective group."""
        self.payload = self._choose_payload()
        self.inference.set_weight_payload(self.payload)
        sequences = self.probe.sequences if self.probe is not None else None
        self._wait(
            "giving both ends the sync probe",
            self.trainer.set_sync_probe(sequences, blocking=False),
            self.inference.set_sync_probe(sequences, blocking=False),
            via="path not chosen yet",
        )
        self.plan = self.trainer.weight_plan(self.bucket_bytes, self.payload)
        nbytes = sum(bucket.nbytes for bucket in self.plan)
        choice = TransportChoice(COLLECTIVE, "the collective path was requested")
        if self.transport != COLLECTIVE:
            sender, receivers = self._wait(
                "locating the weight-transfer ends",
                self.trainer.weight_endpoint(self.shm_dir, blocking=False),
                self.inference.weight_endpoint(self.shm_dir, blocking=False),
                via="path not chosen yet",
            )
            choice = choose_transport(sender[0], receivers, nbytes, self.transport)
        if choice.path == SHM:
            failure = self._connect_shm()
            if failure:
                choice = TransportChoice(COLLECTIVE, failure)
        self.path, self.reason = choice.path, choice.reason
        if self.path == COLLECTIVE:
            self._connect_collective()
        logger.info(
            "weight sync %s -> %s: %s (%s), %s weights, %d buckets, %.1f MB",
            self.trainer.role,
            self.inference.role,
            self.path_name,
            self.reason,
            self.payload,
            len(self.plan),
            nbytes / 1e6,
        )

    def _choose_payload(self) -> str:
        """The adapter alone when the actor trains one and every engine merges adapters itself; else
        the merged weights (LoRA) or every weight."""
        offered = self.trainer.weight_payloads()[0]
        if self.requested_payload != "auto":
            if self.requested_payload not in offered:
                wanted = self.requested_payload
                raise ValueError(f"the {self.trainer.role} offers {', '.join(offered)} weights, not {wanted}")
            return self.requested_payload
        if ADAPTER in offered and all(self.inference.loads_adapters()):
            return ADAPTER
        return offered[-1]

    @property
    def path_name(self) -> str:
        """``shm``, or the collective backend (``gloo``/``nccl``): what the sync stats call the path."""
        return SHM if self.path == SHM else self.backend

    def _connect_shm(self) -> str | None:
        """Create the segment on trainer rank 0 and map it on every receiver; then unlink its name, so
        nothing can be left on /dev/shm. Returns why shared memory is out (the segment could not be
        created), or None; a receiver that cannot map it is an error."""
        created = self._wait(
            "creating the shared weight segment",
            self.trainer.create_shared_weights(self.plan, self.shm_dir, blocking=False),
            via=SHM,
        )[0]
        info, refusal = created[0]
        if info is None:
            return refusal
        self._segment_created = True
        try:
            self._wait(
                "mapping the shared weight segment",
                self.inference.open_shared_weights(info, self.plan, blocking=False),
                via=SHM,
            )
        except BaseException:
            self.close()
            raise
        finally:
            # Mapped everywhere (or failed): the name has served its purpose either way.
            self.trainer.unlink_shared_weights()
        return None

    def _connect_collective(self) -> None:
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

    def sync(self, version: int) -> dict[str, Any]:
        """Send the trainer's current weights as ``version``; returns bytes, seconds, buckets, throughput
        (``gb_per_s``) and the ``path`` taken (``shm``, ``gloo`` or ``nccl``); the shared-memory path also
        splits the time into ``write_s`` (trainer) and ``read_s`` (receivers loading); ``payload`` says
        what was sent, and with a probe ``max_logprob_diff`` and ``probe_s`` are added."""
        if version <= self.version:
            raise ValueError(
                f"weights version {version} is not newer than the last one sent ({self.version})"
            )
        if self.plan is None:
            self.connect()
        start = time.perf_counter()
        extra: dict[str, Any] = {}
        if self.path == SHM:
            # Two calls, not one: the receivers must not read while rank 0 writes, and the controller's
            # ordering is the cheapest lock there is (a few ms of Ray calls, no polling).
            (sent,) = self._wait(
                f"writing weights version {version} to shared memory",
                self.trainer.write_shared_weights(version, blocking=False),
            )
            written = time.perf_counter()
            (received,) = self._wait(
                f"loading weights version {version} from shared memory",
                self.inference.load_shared_weights(version, blocking=False),
            )
            extra = {"write_s": written - start, "read_s": time.perf_counter() - written}
        else:
            sent, received = self._wait(
                f"sending weights version {version}",
                self.trainer.send_weights(self.plan, version, self.timeout_s, blocking=False),
                self.inference.receive_weights(self.plan, version, self.timeout_s, blocking=False),
            )
        seconds = time.perf_counter() - start
        self.version = version
        nbytes = sent[0]["bytes"]
        if self.probe is not None:  # raises SyncCheckError when an engine does not serve these weights
            engines = [stats["probe_logprobs"] for stats in received]
            extra.update(self.probe.compare(version, sent[0]["probe_logprobs"], engines))
            extra["probe_s"] = sent[0]["probe_s"] + max(stats["probe_s"] for stats in received)
        return {
            "bytes": nbytes,
            "seconds": seconds,
            "buckets": sent[0]["buckets"],
            "gb_per_s": nbytes / seconds / 1e9,
            "path": self.path_name,
            "payload": self.payload,
            **extra,
        }

    def close(self) -> None:
        """Drop the shared segment on every end (the collective group goes with the workers' shutdown).
        Safe to call twice; a worker that is already gone is skipped."""
        if not self._segment_created:
            return
        self._segment_created = False
        for cluster in (self.inference, self.trainer):
            try:
                cluster.close_shared_weights()
            except Exception as exc:  # cleanup: report, never mask the error that led here
                first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                logger.warning("closing the shared weight segment on %s: %s", cluster.role, first_line)

    def _wait(self, what: str, *futures: ClusterFuture, via: str | None = None) -> list[list[Any]]:
        """Every future's results; on any failure or timeout a WeightSyncError saying who did what
        (``via``: the path named in it, by default the one in use)."""
        # The collectives time out on their own after timeout_s; the margin lets their errors arrive first.
        deadline = time.monotonic() + self.timeout_s * 1.5 + 10.0
        refs = {ref: label for future in futures for ref, label in _labelled(future).items()}
        ranks = {ref: (future.role, rank) for future in futures for rank, ref in enumerate(future.refs)}
        # A frozen end would hold every other end in the collective until the timeout: watch them all.
        watch = RankWatch.combine(*(future.watch for future in futures))
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
            return [future.get() for future in futures]
        lines = [f"{who} did not answer within {self.timeout_s:.0f} s" for who in map(refs.get, pending)]
        lines += [f"{who}: {detail}" for who, detail in errors.items()]
        sender = f"{self.trainer.role} rank 0"
        receivers = f"{self.inference.role} ranks 0-{self.inference.world_size - 1}"
        via = via or self.path_name
        via = "shared memory" if via == SHM else via
        raise WeightSyncError(
            f"weight transfer failed while {what}, from {sender} to {receivers} ({via}):\n  "
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
