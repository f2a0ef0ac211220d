"""Bucketed weight broadcast from a trainer (group rank 0) to inference workers (the other ranks).

One transfer, on every rank of a :class:`~roll.distributed.collective.CollectiveGroup`:

1. header: rank 0 broadcasts ``[version, buckets, bytes, plan fingerprint]``;
2. verdict: every receiver checks the header against what it expects, and all ranks agree (all-reduce)
   on whether to go on, so a mismatch fails every rank at once instead of leaving the sender waiting;
3. one broadcast per bucket, each followed on the receivers by ``load`` of that bucket's tensors;
4. acknowledgement: all ranks agree on whether every receiver loaded every bucket, so ``send_weights``
   returning means that all receivers now hold ``version``.

Every step has a timeout; a failure raises :class:`CollectiveError` in terms of group ranks and bucket
indices ("bucket 3/7 of version 12"); the calling worker adds its role and rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from roll.distributed.collective import CollectiveError, CollectiveGroup, all_reduce_max, broadcast
from roll.distributed.weight_buckets import Bucket, pack, plan_fingerprint, unpack

SENDER = 0  # group rank of the trainer that sends

TensorsFor = Callable[[Bucket], Mapping[str, torch.Tensor]]
LoadBucket = Callable[[dict[str, torch.Tensor]], None]


def _header(plan: Sequence[Bucket], version: int, device: torch.device) -> torch.Tensor:
    total = sum(bucket.nbytes for bucket in plan)
    return torch.tensor([version, len(plan), total, plan_fingerprint(plan)], dtype=torch.int64, device=device)


def _describe_header(values: Sequence[int]) -> str:
    version, buckets, total, fingerprint = values
    return f"version {version} ({buckets} buckets, {total} bytes, plan {fingerprint:016x})"


def _agree(group: CollectiveGroup, failed: bool, timeout_s: float, device: torch.device) -> list[int]:
    """Group ranks that raised ``failed``, as every rank sees them (one all-reduce of per-rank flags)."""
    flags = torch.zeros(group.world_size, dtype=torch.int64, device=device)
    flags[group.rank] = int(failed)
    all_reduce_max(group, flags, timeout_s)
    return [rank for rank, flag in enumerate(flags.tolist()) if flag]


def _buffer(plan: Sequence[Bucket], device: torch.device) -> torch.Tensor:
    # One buffer sized for the largest bucket, reused for all of them.
    return torch.empty(max((b.nbytes for b in plan), default=0), dtype=torch.uint8, device=device)


def send_weights(
    group: CollectiveGroup | None,
    plan: Sequence[Bucket],
    tensors_for: TensorsFor,
    version: int,
    timeout_s: float,
    device: torch.device,
) -> dict[str, float]:
    """Send the weights named by ``plan``, bucket by bucket, to every other rank of ``group``.

    ``tensors_for(bucket)`` returns (at least) that bucket's tensors by name; it is called once per bucket,
    in plan order, so a sharded trainer can gather the full parameters of one bucket at a time instead of
    the whole model. With FSDP every trainer rank must take part in those gathers, so every trainer rank
    calls this function: rank 0 with the group, the others with ``group=None``, which only calls
    ``tensors_for`` for each bucket and sends nothing. ``device`` holds the staging buffer and must suit
    the backend (CPU for gloo, this rank's GPU for NCCL).

    Whatever fails, ``tensors_for`` is still called once for every bucket before this function raises
    (unless ``tensors_for`` itself raised), so the trainer ranks' gathers stay matched.

    Returns ``{"bytes": total bytes, "seconds": elapsed, "buckets": count}``. Raises
    :class:`CollectiveError` if a receiver rejects the transfer (it expects another version or plan), a
    receiver fails to load a bucket, or any step fails or times out (``timeout_s`` applies to each step);
    ValueError from :func:`pack` if a tensor does not match the plan. After a CollectiveError raised by a
    failed or timed-out step (not a rejection or load failure) the group is broken: recreate it.
    """
    started = time.monotonic()
    total = sum(bucket.nbytes for bucket in plan)
    if group is None:
        for bucket in plan:
            tensors_for(bucket)
        return {"bytes": float(total), "seconds": time.monotonic() - started, "buckets": float(len(plan))}
    if group.rank != SENDER:
        raise ValueError(f"send_weights runs on group rank {SENDER}, not rank {group.rank}")

    header = _header(plan, version, device)
    gathered = 0  # buckets whose tensors_for has run; the rest are still owed to the other trainer ranks
    in_tensors_for = False
    try:
        broadcast(group, header, SENDER, timeout_s)
        rejected = _agree(group, False, timeout_s, device)
        if rejected:
            raise CollectiveError(
                f"receiver rank(s) {rejected} rejected {_describe_header(header.tolist())}: they expect "
                "another version or weight plan (see their errors)"
            )
        buffer = _buffer(plan, device)
        for index, bucket in enumerate(plan, start=1):
            where = f"bucket {index}/{len(plan)} of version {version}"
            in_tensors_for = True
            tensors = tensors_for(bucket)
            in_tensors_for, gathered = False, index
            try:
                packed = pack(bucket, tensors, out=buffer)
            except ValueError:
                # The receivers now wait for a bucket that will not come: they time out, and this group
                # can no longer agree on what comes next.
                group.broken = f"{where} could not be packed"
                raise
            if not bucket.nbytes:
                continue  # only empty tensors: nothing to send (the receivers skip it too)
            try:
                broadcast(group, packed, SENDER, timeout_s)
            except CollectiveError as exc:
                raise CollectiveError(f"sending {where}: {exc}") from exc
        failed = _agree(group, False, timeout_s, device)
    except Exception:
        if in_tensors_for:
            group.broken = "the sender failed to produce a bucket"
        else:
            # The other trainer ranks call tensors_for for every bucket whatever happens here (with FSDP
            # each call is a collective among the trainers): keep in step with them before raising.
            for bucket in plan[gathered:]:
                tensors_for(bucket)
        raise
    if failed:
        raise CollectiveError(
            f"receiver rank(s) {failed} failed to load version {version} (see their errors)"
        )
    return {"bytes": float(total), "seconds": time.monotonic() - started, "buckets": float(len(plan))}


def receive_weights(
    group: CollectiveGroup,
    plan: Sequence[Bucket],
    version: int,
    timeout_s: float,
    device: torch.device,
    load: LoadBucket,
) -> dict[str, float]:
    """Receive ``version`` of the weights named by ``plan`` from group rank 0, calling ``load`` per bucket.

    ``load`` gets views of the receive buffer by tensor name and must copy them (e.g. into the model's
    parameters) before it returns: the buffer is reused for the next bucket. If ``load`` raises, the
    remaining buckets are still received (so the group stays in step), the sender is told, and the error
    is raised here as a :class:`CollectiveError` once the transfer ends.

    Returns ``{"bytes", "seconds", "buckets"}`` like :func:`send_weights`. Raises :class:`CollectiveError`
    when the sender offers another version or plan (expected vs got), another receiver rejects it, or a
    step fails or times out.
    """
    if group.rank == SENDER:
        raise ValueError(f"receive_weights runs on the receivers, not on the sender (group rank {SENDER})")
    started = time.monotonic()
    expected = _header(plan, version, device)
    header = torch.zeros_like(expected)
    try:
        broadcast(group, header, SENDER, timeout_s)
    except CollectiveError as exc:
        raise CollectiveError(f"waiting for the header of version {version}: {exc}") from exc
    mismatch = not torch.equal(header, expected)
    rejected = _agree(group, mismatch, timeout_s, device)
    if mismatch:
        raise CollectiveError(
            f"group rank {group.rank} expected {_describe_header(expected.tolist())}, but the sender offers "
            f"{_describe_header(header.tolist())}"
        )
    if rejected:
        raise CollectiveError(f"receiver rank(s) {rejected} rejected version {version}; not loading it")

    buffer = _buffer(plan, device)
    load_error: Exception | None = None
    failed_at = ""
    for index, bucket in enumerate(plan, start=1):
        where = f"bucket {index}/{len(plan)} of version {version}"
        received = buffer[: bucket.nbytes]
        if bucket.nbytes:
            try:
                broadcast(group, received, SENDER, timeout_s)
            except CollectiveError as exc:
                raise CollectiveError(f"receiving {where}: {exc}") from exc
        if load_error is None:
            try:
                load(unpack(bucket, received))
            except Exception as exc:  # reported after the transfer, so that the sender is not left waiting
                load_error, failed_at = exc, where

    _agree(group, load_error is not None, timeout_s, device)
    if load_error is not None:
        raise CollectiveError(
            f"group rank {group.rank} failed to load {failed_at}: {load_error!r}"
        ) from load_error
    # Another receiver's failure is the sender's to report: this rank holds the whole of ``version``.
    total = sum(bucket.nbytes for bucket in plan)
    return {"bytes": float(total), "seconds": time.monotonic() - started, "buckets": float(len(plan))}
