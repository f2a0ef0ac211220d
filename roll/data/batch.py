"""``Batch``: named tensors sharing a leading batch dimension, per-sample Python objects and a ``meta`` dict.

This is the unit of data that the pipeline hands to clusters and that workers hand back. Every
row-wise operation works along dim 0; tensors may have any trailing dims ([B], [B, L], [B, L, V] ...).
Per-sample Python objects (prompt text, reward metadata, environment info) live in ``non_tensors`` as
lists of length B. ``meta`` carries batch-level values (global step, sampling params) and is copied
shallowly into every derived batch.

The class holds only plain attributes so that pickle (and Ray, which pickles it) can move it between
processes.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["Batch"]


class Batch:
    """Named tensors ``[B, ...]``, named lists of length B and a ``meta`` dict.

    Args:
        tensors: name -> tensor whose dim 0 is the batch dim.
        non_tensors: name -> sequence of per-sample objects (stored as a Python list).
        meta: batch-level values; not indexed by row.

    Raises:
        ValueError: a field's length differs from the others, a tensor is 0-dim, or a name is used
            both as a tensor and as a non-tensor.
        TypeError: a value has the wrong type.
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, list] | None = None,
        meta: dict | None = None,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.non_tensors: dict[str, list] = {}
        self.meta: dict = dict(meta) if meta else {}
        for key, value in (tensors or {}).items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"Batch tensor '{key}' must be a torch.Tensor, got {type(value).__name__}")
            self[key] = value
        for key, value in (non_tensors or {}).items():
            if key in self.tensors:
                raise ValueError(f"Batch field '{key}' is given both as a tensor and as a non-tensor")
            if not isinstance(value, (list, tuple)):
                raise TypeError(
                    f"Batch non-tensor '{key}' must be a list or tuple of per-sample values, "
                    f"got {type(value).__name__}"
                )
            self[key] = value

    # ------------------------------------------------------------------ mapping-like access

    def __len__(self) -> int:
        """Batch size B; 0 when the batch has no fields."""
        for value in self.tensors.values():
            return value.shape[0]
        for items in self.non_tensors.values():
            return len(items)
        return 0

    def __getitem__(self, key: str) -> torch.Tensor | list:
        """The tensor ``[B, ...]`` or list of length B stored under ``key``."""
        if not isinstance(key, str):
            # Also stops `for row in batch` from looping over integer keys with a confusing KeyError.
            raise TypeError(
                f"Batch is indexed by field name, got {type(key).__name__}; use select() to take rows"
            )
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"Batch has no field '{key}'; available: {self.keys()}")

    def __setitem__(self, key: str, value: torch.Tensor | list | tuple) -> None:
        """Store a tensor (into ``tensors``) or a list/tuple (into ``non_tensors``), replacing ``key``.

        Raises:
            ValueError: the value's length differs from the batch size of the other fields.
            TypeError: the value is neither a tensor nor a list/tuple.
        """
        if not isinstance(key, str):
            raise TypeError(f"Batch field names must be str, got {type(key).__name__}")
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                raise ValueError(f"Batch tensor '{key}' is 0-dim; it needs a leading batch dim")
            length = value.shape[0]
        elif isinstance(value, (list, tuple)):
            length = len(value)
        else:
            raise TypeError(
                f"Batch field '{key}' must be a torch.Tensor or a list/tuple of per-sample values, "
                f"got {type(value).__name__}"
            )
        self._check_length(key, length)
        # A name lives in exactly one of the two dicts.
        self.tensors.pop(key, None)
        self.non_tensors.pop(key, None)
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.non_tensors[key] = list(value)

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.non_tensors

    def keys(self) -> list[str]:
        """Tensor names, then non-tensor names, in insertion order."""
        return [*self.tensors, *self.non_tensors]

    def _check_length(self, key: str, length: int) -> None:
        """Raise if ``length`` differs from the length of any other field than ``key``."""
        for other, value in self.tensors.items():
            if other != key and value.shape[0] != length:
                raise ValueError(
                    f"Batch field '{key}' has {length} rows but field '{other}' has {value.shape[0]}; "
                    "all fields must share the batch dimension"
                )
        for other, items in self.non_tensors.items():
            if other != key and len(items) != length:
                raise ValueError(
                    f"Batch field '{key}' has {length} rows but field '{other}' has {len(items)}; "
                    "all fields must share the batch dimension"
                )

    # ------------------------------------------------------------------ construction helpers

    def _new(
        self, tensors: dict[str, torch.Tensor], non_tensors: dict[str, list], meta: dict | None = None
    ) -> Batch:
        """A batch from already-consistent fields, skipping per-field validation."""
        out = Batch.__new__(Batch)
        out.tensors = tensors
        out.non_tensors = non_tensors
        out.meta = dict(self.meta if meta is None else meta)
        return out

    def _slice(self, start: int, stop: int) -> Batch:
        """Rows ``start:stop``; tensors are views (pickling compacts them, see ``__getstate__``)."""
        return self._new(
            {k: t[start:stop] for k, t in self.tensors.items()},
            {k: items[start:stop] for k, items in self.non_tensors.items()},
        )

    # ------------------------------------------------------------------ row operations

    def select(self, indices: Sequence[int] | torch.Tensor) -> Batch:
        """Rows at ``indices`` in the given order (repeats allowed, negatives count from the end).

        Args:
            indices: ints, a 1-D integer tensor, or a bool mask of shape [B].
        """
        index = _normalize_indices(indices, len(self))
        positions = index.tolist()
        return self._new(
            {k: t[index.to(t.device)] for k, t in self.tensors.items()},
            {k: [items[i] for i in positions] for k, items in self.non_tensors.items()},
        )

    def select_keys(self, keys: Iterable[str]) -> Batch:
        """A batch with only the named fields (meta kept); unknown names raise KeyError."""
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch has no field(s) {missing}; available: {self.keys()}")
        return self._new(
            {k: t for k, t in self.tensors.items() if k in keys},
            {k: list(items) for k, items in self.non_tensors.items() if k in keys},
        )

    def chunk(self, n: int) -> list[Batch]:
        """``n`` consecutive parts of equal size (e.g. one per data-parallel rank).

        Raises:
            ValueError: ``len(self)`` is not divisible by ``n``.
        """
        if n < 1:
            raise ValueError(f"chunk: n must be >= 1, got {n}")
        if len(self) % n:
            raise ValueError(
                f"cannot chunk a batch of {len(self)} rows into {n} equal parts; "
                f"call pad_to_divisor({n}) first and unpad() the results"
            )
        size = len(self) // n
        return [self._slice(i * size, (i + 1) * size) for i in range(n)]

    def split(self, size: int) -> list[Batch]:
        """Consecutive parts of ``size`` rows (e.g. micro-batches); the last may be smaller, none empty."""
        if size < 1:
            raise ValueError(f"split: size must be >= 1, got {size}")
        return [self._slice(start, start + size) for start in range(0, len(self), size)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all ``batches`` in order; every batch must have the same fields. Meta from the first.

        Raises:
            ValueError: no batches, different field names, or tensors whose dtype or trailing shape differ.
        """
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        first = batches[0]
        for i, batch in enumerate(batches[1:], start=1):
            if set(batch.keys()) != set(first.keys()):
                raise ValueError(
                    f"Batch.concat: batch {i} has fields {sorted(batch.keys())} "
                    f"but batch 0 has {sorted(first.keys())}; all batches need the same fields"
                )
            if set(batch.tensors) != set(first.tensors):
                mixed = sorted(set(batch.tensors) ^ set(first.tensors))
                raise ValueError(f"Batch.concat: fields {mixed} are tensors in one batch, lists in another")
        tensors = {}
        for key, ref in first.tensors.items():
            for i, batch in enumerate(batches):
                t = batch.tensors[key]
                # torch.cat would silently promote dtypes, hiding e.g. a float mask meeting a long mask.
                if t.dtype != ref.dtype or t.shape[1:] != ref.shape[1:]:
                    raise ValueError(
                        f"Batch.concat: tensor '{key}' of batch {i} is {t.dtype} {list(t.shape)} but "
                        f"batch 0 has {ref.dtype} {list(ref.shape)} (trailing dims and dtype must match)"
                    )
            tensors[key] = torch.cat([b.tensors[key] for b in batches], dim=0)
        non_tensors = {key: [x for b in batches for x in b.non_tensors[key]] for key in first.non_tensors}
        return first._new(tensors, non_tensors)

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row ``n`` times.

        ``interleave=True`` keeps copies of a row together (a a b b), which is what grouped sampling
        (several responses per prompt) needs; ``False`` tiles the whole batch (a b a b).
        """
        if n < 1:
            raise ValueError(f"repeat: n must be >= 1, got {n}")
        if interleave:
            tensors = {k: t.repeat_interleave(n, dim=0) for k, t in self.tensors.items()}
            non_tensors = {k: [x for x in items for _ in range(n)] for k, items in self.non_tensors.items()}
        else:
            tensors = {k: t.repeat(n, *([1] * (t.dim() - 1))) for k, t in self.tensors.items()}
            non_tensors = {k: items * n for k, items in self.non_tensors.items()}
        return self._new(tensors, non_tensors)

    def group_by(self, key: str) -> dict[Any, Batch]:
        """Split rows by the value of ``key`` (a non-tensor or a 1-D tensor), groups in first-seen order.

        Tensor values become Python scalars, so ``batch.group_by("prompt_id")[3]`` works.
        """
        values = self[key]
        if isinstance(values, torch.Tensor):
            if values.dim() != 1:
                raise ValueError(f"group_by: tensor '{key}' must be 1-D [B], got shape {list(values.shape)}")
            values = values.tolist()
        groups: dict[Any, list[int]] = {}
        for i, value in enumerate(values):
            try:
                groups.setdefault(value, []).append(i)
            except TypeError:
                raise TypeError(
                    f"group_by: value of '{key}' at row {i} is an unhashable {type(value).__name__}"
                ) from None
        return {value: self.select(rows) for value, rows in groups.items()}

    def pad_to_divisor(self, divisor: int) -> tuple[Batch, int]:
        """Append copies of rows from the start so that the length is divisible by ``divisor``.

        Returns:
            (padded batch, number of rows added); pass the number to ``unpad`` on the (concatenated)
            results to drop the outputs computed for the padding rows.
        """
        if divisor < 1:
            raise ValueError(f"pad_to_divisor: divisor must be >= 1, got {divisor}")
        size = len(self)
        if size == 0:
            raise ValueError("pad_to_divisor: cannot pad an empty batch (there is no row to repeat)")
        num_padded = -size % divisor
        if num_padded == 0:
            return self._new(dict(self.tensors), {k: list(v) for k, v in self.non_tensors.items()}), 0
        # Cycle from the start: a divisor larger than the batch needs some rows more than once.
        padding = self.select([i % size for i in range(num_padded)])
        return Batch.concat([self, padding]), num_padded

    def unpad(self, num_padded: int) -> Batch:
        """Drop the last ``num_padded`` rows (undoes ``pad_to_divisor``)."""
        if not 0 <= num_padded <= len(self):
            raise ValueError(f"unpad: num_padded must be in [0, {len(self)}], got {num_padded}")
        return self._slice(0, len(self) - num_padded)

    def shuffle(self, generator: torch.Generator | None = None) -> Batch:
        """Rows in a random order (all fields permuted together)."""
        return self.select(torch.randperm(len(self), generator=generator))

    # ------------------------------------------------------------------ whole-batch operations

    def union(self, other: Batch) -> Batch:
        """Fields of both batches (same length) in one batch; ``meta`` merged.

        Raises:
            ValueError: lengths differ, or a field or meta key present in both has different values.
        """
        if self.keys() and other.keys() and len(self) != len(other):
            raise ValueError(f"Batch.union: batches have {len(self)} and {len(other)} rows")
        for key in self.keys():
            if key in other and not _values_equal(self[key], other[key]):
                raise ValueError(f"Batch.union: field '{key}' is in both batches with different values")
        for key, value in self.meta.items():
            if key in other.meta and not _values_equal(value, other.meta[key]):
                raise ValueError(f"Batch.union: meta '{key}' differs: {value!r} vs {other.meta[key]!r}")
        out = self._new(
            dict(self.tensors), {k: list(v) for k, v in self.non_tensors.items()}, {**self.meta, **other.meta}
        )
        for key, value in other.tensors.items():
            out.tensors.setdefault(key, value)
        for key, items in other.non_tensors.items():
            out.non_tensors.setdefault(key, list(items))
        return out

    def to(self, device: torch.device | str) -> Batch:
        """All tensors moved to ``device``; non-tensors and meta unchanged."""
        return self._new(
            {k: t.to(device) for k, t in self.tensors.items()},
            {k: list(items) for k, items in self.non_tensors.items()},
        )

    # ------------------------------------------------------------------ pickling and display

    def __getstate__(self) -> dict:
        # Pickling a view writes its whole storage: a chunk of a large batch sent to one rank would
        # otherwise carry every rank's rows. Clone such views so only this batch's rows travel.
        tensors = {k: _compact(t) for k, t in self.tensors.items()}
        return {"tensors": tensors, "non_tensors": self.non_tensors, "meta": self.meta}

    def __setstate__(self, state: dict) -> None:
        self.tensors = state["tensors"]
        self.non_tensors = state["non_tensors"]
        self.meta = state["meta"]

    def __repr__(self) -> str:
        tensors = ", ".join(
            f"{k}: {list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for k, t in self.tensors.items()
        )
        parts = [f"len={len(self)}", f"tensors={{{tensors}}}"]
        if self.non_tensors:
            parts.append(f"non_tensors={list(self.non_tensors)}")
        if self.meta:
            parts.append(f"meta={list(self.meta)}")
        return f"Batch({', '.join(parts)})"


def _normalize_indices(indices: Sequence[int] | torch.Tensor, size: int) -> torch.Tensor:
    """Row indices as a 1-D long CPU tensor in ``[0, size)``; bool masks become the positions set."""
    if isinstance(indices, torch.Tensor):
        index = indices.detach().cpu()
        if index.dtype == torch.bool:
            if index.shape != (size,):
                raise ValueError(f"select: bool mask has shape {list(index.shape)}, expected [{size}]")
            return index.nonzero().flatten()
        if index.is_floating_point() or index.is_complex():
            raise TypeError(f"select: indices must be integers, got a {index.dtype} tensor")
        if index.dim() != 1:
            raise ValueError(f"select: indices must be 1-D, got shape {list(index.shape)}")
        index = index.long()
    else:
        items = list(indices)
        if items and all(isinstance(i, bool) for i in items):
            return _normalize_indices(torch.tensor(items, dtype=torch.bool), size)
        try:
            # operator.index rejects floats, which a plain torch.tensor(..., dtype=long) would truncate.
            index = torch.tensor([operator.index(i) for i in items], dtype=torch.long)
        except TypeError:
            raise TypeError(f"select: indices must be integers, got {items!r}") from None
    if index.numel() and (index.min() < -size or index.max() >= size):
        bad = index[(index < -size) | (index >= size)][0].item()
        raise IndexError(f"select: index {bad} is out of range for a batch of {size} rows")
    return torch.where(index < 0, index + size, index)


def _values_equal(a: Any, b: Any) -> bool:
    """Equality that works for tensors (same dtype, shape and values) and for plain Python values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # e.g. numpy arrays, whose == is element-wise and whose bool() is ambiguous
        return False


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a copy when it is a view of a larger storage."""
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone()
    return t
