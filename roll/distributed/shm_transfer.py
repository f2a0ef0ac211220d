"""Weight transfer through one shared-memory segment, for a trainer and rollout workers on one node.

A gloo broadcast between processes on one host pushes every byte through loopback sockets (several kernel
copies, the sender serving each receiver in turn). Here trainer rank 0 instead copies the weights once
into a file on ``/dev/shm`` that every receiver has mapped, and each receiver copies them once out of it
into its engine's model: one copy in, one copy out per receiver, no kernel in between.

Life of a segment (driven by :class:`~roll.distributed.weight_sync.WeightSync`):

1. the sender :meth:`SharedWeights.create` s it once per run, sized to the whole weight plan, with its
   blocks allocated up front (``posix_fallocate``) so that a full ``/dev/shm`` is an ``OSError`` now and
   not a SIGBUS in the middle of a later write;
2. every receiver :meth:`SharedWeights.open` s it (maps it, checks the header);
3. the sender :meth:`SharedWeights.unlink` s the file at once: the mappings stay valid, and nothing is
   left on ``/dev/shm`` however the processes end (even killed), the memory going back to the system
   when the last mapping goes;
4. each sync: the sender :func:`write_weights`, then (the controller waits in between, so reads never
   overlap writes) the receivers :func:`read_weights`.

The segment starts with a header page: magic, a random nonce (tells this run's segment from any other
file of that name), the plan fingerprint, the data size, the version written and whether writing
finished. Receivers check it, so a mismatch is an error saying expected vs found, never wrong weights.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import ray
import torch

from roll.distributed.weight_buckets import Bucket, pack, plan_fingerprint, unpack

SHM_DIR = "/dev/shm"
PREFIX = "roll-weights-"
# The data starts one page in, so every bucket can start on a page boundary (faster copies, no false
# sharing with the header).
HEADER_BYTES = 4096
BUCKET_ALIGNMENT = 4096
MAGIC = 0x524F4C4C57474854  # "ROLLWGHT"
# int64 slots of the header
_MAGIC, _NONCE, _FINGERPRINT, _DATA_BYTES, _VERSION, _STATE = range(6)
_WRITING, _READY = 1, 2

TensorsFor = Callable[[Bucket], Mapping[str, torch.Tensor]]
LoadBucket = Callable[[dict[str, torch.Tensor]], None]


class SharedWeightsError(RuntimeError):
    """The segment is not the one expected (another plan, version, or run), or reading/writing failed."""


@dataclass(frozen=True)
class Endpoint:
    """Where one end of a weight transfer runs: enough for the controller to pick the transfer path."""

    node_id: str  # the Ray node id: ranks on one node share /dev/shm
    ip: str
    host: str
    device: str  # "cpu" or "cuda": where the engine (or trainer) holds its weights
    shm_free_bytes: int  # free space of the shared-memory directory on this node


@dataclass(frozen=True)
class SegmentInfo:
    """What a receiver needs to map the sender's segment."""

    path: str
    nbytes: int  # whole file: header page + data
    nonce: int
    fingerprint: int
    host: str  # the sender's host, for error messages


def shm_free_bytes(directory: str = SHM_DIR) -> int:
    """Bytes an unprivileged process may still allocate in ``directory`` (0 when it does not exist)."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return 0
    return stats.f_bavail * stats.f_frsize


def local_endpoint(device: torch.device | str, shm_dir: str = SHM_DIR) -> Endpoint:
    """This process's :class:`Endpoint` (call it inside a Ray worker)."""
    return Endpoint(
        node_id=ray.get_runtime_context().get_node_id(),
        ip=ray.util.get_node_ip_address(),
        host=socket.gethostname(),
        device=torch.device(device).type,
        shm_free_bytes=shm_free_bytes(shm_dir),
    )


def _align(offset: int, to: int) -> int:
    return (offset + to - 1) // to * to


def segment_layout(plan: Sequence[Bucket]) -> tuple[list[int], int]:
    """Byte offset of each bucket in the segment, and the segment's total size (header included)."""
    offsets, end = [], HEADER_BYTES
    for bucket in plan:
        end = _align(end, BUCKET_ALIGNMENT)
        offsets.append(end)
        end += bucket.nbytes
    return offsets, _align(end, BUCKET_ALIGNMENT)


def _map(path: str, nbytes: int) -> torch.Tensor:
    """The file as one flat uint8 tensor over a MAP_SHARED mapping (writes are seen by every mapper)."""
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


class SharedWeights:
    """One process's mapping of the weight segment: the sender's (``owner``) or a receiver's."""

    def __init__(self, info: SegmentInfo, plan: Sequence[Bucket], memory: torch.Tensor, owner: bool):
        self.info, self.plan, self.owner = info, list(plan), owner
        self.memory: torch.Tensor | None = memory
        self.offsets, _ = segment_layout(plan)

    # ------------------------------------------------------------------ life cycle
    @classmethod
    def create(cls, plan: Sequence[Bucket], directory: str = SHM_DIR) -> SharedWeights:
        """Allocate a segment for ``plan`` in ``directory``. Raises OSError (ENOSPC when too small), and
        then leaves no file behind."""
        _, nbytes = segment_layout(plan)
        path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                # Reserve every block now: on tmpfs a sparse file that cannot grow kills the writer with
                # SIGBUS at the first page that finds no room.
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
            memory = _map(path, nbytes)
        except BaseException:
            _remove(path)
            raise
        info = SegmentInfo(path, nbytes, secrets.randbits(62), plan_fingerprint(plan), socket.gethostname())
        header = memory[:HEADER_BYTES].view(torch.int64)
        header.zero_()
        header[_MAGIC], header[_NONCE], header[_FINGERPRINT] = MAGIC, info.nonce, info.fingerprint
        header[_DATA_BYTES], header[_VERSION] = nbytes - HEADER_BYTES, -1
        return cls(info, plan, memory, owner=True)

    @classmethod
    def open(cls, info: SegmentInfo, plan: Sequence[Bucket]) -> SharedWeights:
        """Map the sender's segment. Raises SharedWeightsError if it is missing (another node?) or not
        the segment of ``info`` and ``plan``."""
        if plan_fingerprint(plan) != info.fingerprint:
            raise SharedWeightsError(
                f"the weight plan here differs from the sender's (fingerprint {plan_fingerprint(plan):016x} "
                f"vs {info.fingerprint:016x})"
            )
        try:
            size = os.stat(info.path).st_size
        except FileNotFoundError:
            raise SharedWeightsError(
                f"shared-memory segment {info.path} of host {info.host} is not on this host "
                f"({socket.gethostname()}): is this worker on another node?"
            ) from None
        if size != info.nbytes:
            raise SharedWeightsError(f"segment {info.path} is {size} bytes, expected {info.nbytes}")
        segment = cls(info, plan, _map(info.path, info.nbytes), owner=False)
        magic, nonce = segment._header()[_MAGIC].item(), segment._header()[_NONCE].item()
        if (magic, nonce) != (MAGIC, info.nonce):
            segment.close()
            raise SharedWeightsError(f"{info.path} is not the weight segment of this run (nonce differs)")
        return segment

    def unlink(self) -> None:
        """Remove the file name (the sender, once every receiver has mapped it); mappings stay valid."""
        if self.owner:
            _remove(self.info.path)

    def close(self) -> None:
        """Drop this mapping (and, for the sender, the file if still there); idempotent, never raises."""
        self.memory = None
        self.unlink()

    # ------------------------------------------------------------------ data
    def _header(self) -> torch.Tensor:
        if self.memory is None:
            raise SharedWeightsError(f"segment {self.info.path} is closed")
        return self.memory[:HEADER_BYTES].view(torch.int64)

    def bucket_view(self, index: int) -> torch.Tensor:
        """The flat uint8 slot of bucket ``index`` (0-based) in the mapping."""
        if self.memory is None:
            raise SharedWeightsError(f"segment {self.info.path} is closed")
        start = self.offsets[index]
        return self.memory[start : start + self.plan[index].nbytes]

    def begin_write(self) -> None:
        header = self._header()
        header[_VERSION], header[_STATE] = -1, _WRITING

    def end_write(self, version: int) -> None:
        # Version last: a reader that sees it finished sees every byte before it (the controller orders
        # the calls anyway; this catches a reader started too early, or a writer that died half-way).
        header = self._header()
        header[_VERSION], header[_STATE] = version, _READY

    def check_readable(self, version: int) -> None:
        """Raise SharedWeightsError unless the segment holds the complete ``version``."""
        header = self._header()
        state, found = header[_STATE].item(), header[_VERSION].item()
        if state != _READY:
            raise SharedWeightsError(
                f"expected version {version} in {self.info.path}, but the sender has not finished writing"
            )
        if found != version:
            raise SharedWeightsError(f"expected version {version} in {self.info.path}, found version {found}")


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _copy_into(bucket: Bucket, tensors: Mapping[str, torch.Tensor], slot: torch.Tensor) -> None:
    """Pack ``bucket`` into ``slot``. Contiguous CPU tensors go through libc ``memmove``: its streaming
    stores skip reading the destination first, which makes them faster than ``Tensor.copy_``; the
    rest (GPU, non-contiguous) and every check go through :func:`pack`."""
    plain = all(
        (t := tensors.get(m.name)) is not None
        and t.device.type == "cpu"
        and t.is_contiguous()
        and tuple(t.shape) == m.shape
        and t.dtype == m.dtype
        for m in bucket.tensors
    )
    if not plain:
        pack(bucket, tensors, out=slot)
        return
    base = slot.data_ptr()
    for meta, offset in zip(bucket.tensors, bucket.offsets, strict=True):
        if meta.nbytes:
            ctypes.memmove(base + offset, tensors[meta.name].data_ptr(), meta.nbytes)


def write_weights(
    segment: SharedWeights | None, plan: Sequence[Bucket], tensors_for: TensorsFor, version: int
) -> dict[str, float]:
    """Write ``version`` of the weights into ``segment``, bucket by bucket.

    As with the collective :func:`~roll.distributed.weight_transfer.send_weights`, every trainer rank
    calls this (with FSDP each ``tensors_for`` is a gather all ranks make): rank 0 with its segment, the
    others with ``None``, which only calls ``tensors_for``. ``tensors_for`` is called once per bucket even
    if writing fails, so the ranks stay in step; the first error is raised at the end, naming the bucket.
    """
    started = time.monotonic()
    total = sum(bucket.nbytes for bucket in plan)
    if segment is not None:
        segment.begin_write()
    error: Exception | None = None
    for index, bucket in enumerate(plan):
        tensors = tensors_for(bucket)
        if segment is None or error is not None:
            continue
        try:
            _copy_into(bucket, tensors, segment.bucket_view(index))
        except Exception as exc:  # raised after the loop, so that the other trainer ranks keep in step
            error = SharedWeightsError(
                f"writing bucket {index + 1}/{len(plan)} of version {version} to {segment.info.path}: {exc}"
            )
            error.__cause__ = exc
    if error is not None:
        raise error
    if segment is not None:
        segment.end_write(version)
    return {"bytes": float(total), "seconds": time.monotonic() - started, "buckets": float(len(plan))}


def read_weights(segment: SharedWeights, version: int, load: LoadBucket) -> dict[str, float]:
    """Load ``version`` from ``segment``, calling ``load`` with each bucket's tensors (views of the shared
    memory: ``load`` copies them into the model, which is the one copy a receiver makes)."""
    started = time.monotonic()
    segment.check_readable(version)
    plan = segment.plan
    for index, bucket in enumerate(plan):
        try:
            load(unpack(bucket, segment.bucket_view(index)))
        except Exception as exc:
            raise SharedWeightsError(
                f"loading bucket {index + 1}/{len(plan)} of version {version}: {exc!r}"
            ) from exc
    # The sender may have begun the next version while this one was read only if the controller broke
    # its ordering; then the bytes may be torn: refuse them.
    segment.check_readable(version)
    total = sum(bucket.nbytes for bucket in plan)
    return {"bytes": float(total), "seconds": time.monotonic() - started, "buckets": float(len(plan))}
