"""Pack named tensors into flat byte buckets and back (pure torch, no communication).

Weights travel as a few large uint8 buffers rather than one collective per parameter: per-collective
latency dominates for the many small tensors of a transformer. Sender and receivers agree on a plan (which
tensor sits at which byte offset of which bucket) before the transfer, so only raw bytes are sent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

# Offsets are aligned so that every tensor viewed out of a bucket starts on a boundary suitable for any
# dtype (``Tensor.view(dtype)`` needs the byte offset divisible by the element size).
ALIGNMENT = 16


@dataclass(frozen=True)
class TensorMeta:
    """Name, shape and dtype of one tensor: all a receiver needs to rebuild it from raw bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """Tensors sent together in one flat buffer: ``tensors[i]`` occupies bytes ``offsets[i]`` onwards."""

    tensors: tuple[TensorMeta, ...]
    offsets: tuple[int, ...]  # byte offsets into the buffer, each a multiple of ALIGNMENT
    nbytes: int  # buffer size: the end of the last tensor


def _align(offset: int) -> int:
    return (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def metas_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    """The :class:`TensorMeta` of each ``(name, tensor)`` pair, in order (e.g. ``named_parameters()``)."""
    return [TensorMeta(name, tuple(tensor.shape), tensor.dtype) for name, tensor in named_tensors]


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Group ``metas`` in order into buckets of at most ``bucket_bytes`` bytes each.

    A new bucket starts when the next tensor (at its aligned offset) would overflow the current one; a
    tensor larger than ``bucket_bytes`` gets a bucket of its own. Names must be unique, since receivers
    look tensors up by name.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    seen: set[str] = set()
    buckets: list[Bucket] = []
    tensors: list[TensorMeta] = []
    offsets: list[int] = []
    end = 0
    for meta in metas:
        if meta.name in seen:
            raise ValueError(f"tensor name {meta.name!r} appears twice in the weight-transfer plan")
        seen.add(meta.name)
        offset = _align(end)
        if tensors and offset + meta.nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(tensors), tuple(offsets), end))
            tensors, offsets, offset = [], [], 0
        tensors.append(meta)
        offsets.append(offset)
        end = offset + meta.nbytes
    if tensors:
        buckets.append(Bucket(tuple(tensors), tuple(offsets), end))
    return buckets


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    # reshape(-1) also turns a 0-d tensor into one element, which view(uint8) needs.
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def pack(
    bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy the bucket's tensors (looked up by name in ``tensors``) into one flat uint8 buffer.

    Returns a buffer of exactly ``bucket.nbytes`` bytes: ``out[:nbytes]`` when ``out`` (flat uint8) is given
    and large enough, so a sender can reuse one buffer, on its device, for every bucket; otherwise a new
    CPU buffer. The padding between tensors is left uninitialised. Raises ValueError naming the tensor when
    one is missing or its shape or dtype differs from the plan.
    """
    if out is not None and out.dtype == torch.uint8 and out.dim() == 1 and out.numel() >= bucket.nbytes:
        buffer = out[: bucket.nbytes]
    else:
        device = out.device if out is not None else torch.device("cpu")
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    for meta, offset in zip(bucket.tensors, bucket.offsets, strict=True):
        tensor = tensors.get(meta.name)
        if tensor is None:
            raise ValueError(f"tensor {meta.name!r} of the weight-transfer plan is missing")
        if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
            raise ValueError(
                f"tensor {meta.name!r} is {tuple(tensor.shape)} {tensor.dtype}, but the weight-transfer plan "
                f"expects {meta.shape} {meta.dtype}"
            )
        if meta.nbytes:
            buffer[offset : offset + meta.nbytes].copy_(_as_bytes(tensor))
    return buffer


def unpack(bucket: Bucket, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of ``buffer`` (flat uint8, at least ``bucket.nbytes``) as the bucket's named tensors.

    No bytes are copied: the views are valid only until the buffer is reused, so copy them into the model.
    """
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < bucket.nbytes:
        raise ValueError(
            f"a bucket of {bucket.nbytes} bytes needs a flat uint8 buffer at least that large, got "
            f"{tuple(buffer.shape)} {buffer.dtype}"
        )
    views: dict[str, torch.Tensor] = {}
    for meta, offset in zip(bucket.tensors, bucket.offsets, strict=True):
        raw = buffer[offset : offset + meta.nbytes]
        views[meta.name] = raw.view(meta.dtype).view(meta.shape)
    return views


def plan_fingerprint(plan: Sequence[Bucket]) -> int:
    """A 63-bit digest of the plan (names, shapes, dtypes, offsets), equal in every process for equal plans.

    Sent with each transfer so that a receiver whose plan differs in any way (not just in size) refuses
    the bytes instead of loading them into the wrong tensors.
    """
    digest = hashlib.sha256(repr(tuple(plan)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # non-negative, fits in int64
