"""A KV cache for continuous batching: rows join and leave between decode steps.

Rows are left-padded to a common length, as in Hugging Face ``generate``; the attention mask and
position ids say which cache columns are real. Two things differ from ``DynamicCache``:

- Each layer keeps its keys and values in a buffer with spare room, so appending a token writes in
  place. ``DynamicLayer`` concatenates the whole cache at every token, which costs time quadratic in
  the response length (thousands of tokens in RL).
- Whole rows can be dropped (a finished or aborted request frees its slot at once) and appended (a new
  request joins after its prefill), with the shorter side padded on the left.
- A prefill can start from KV kept from an earlier request (``from_prefixes``, ``row_states``): each
  row's kept part is right-aligned before the prefill's own columns, so a row whose new part is shorter
  than the longest has masked columns between the two. Attention reads only the mask and positions are
  given explicitly, so such a hole costs room, never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

__all__ = ["SlotCache"]

_MIN_ROOM = 16  # columns of spare room allocated at least when a buffer grows


class _GrowingLayer(DynamicLayer):
    """One attention layer's keys and values [B, heads, T, dim] inside buffers with room to grow."""

    def __init__(self) -> None:
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._length = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        added = key_states.shape[-2]
        if self._key_buffer is None:
            shape = (*key_states.shape[:-2], added + _MIN_ROOM, key_states.shape[-1])
            self._key_buffer, self._value_buffer = key_states.new_empty(shape), value_states.new_empty(shape)
            self._length = 0
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        elif self._length + added > self._key_buffer.shape[-2]:
            # Doubling keeps the copies amortised to O(1) per token.
            self._set(self.keys, self.values, room=self._length + added)
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[..., self._length : self._length + added, :] = key_states
        self._value_buffer[..., self._length : self._length + added, :] = value_states
        self._length += added
        self._publish()
        return self.keys, self.values

    def _set(self, keys: torch.Tensor | None, values: torch.Tensor | None, room: int) -> None:
        """Copy ``keys``/``values`` into fresh buffers with ``room`` free columns after them."""
        if keys is None or values is None or keys.numel() == 0:
            self._key_buffer = self._value_buffer = None
            self._length = 0
            self.keys = self.values = None
            self.is_initialized = False
            return
        length = keys.shape[-2]
        shape = (*keys.shape[:-2], length + room, keys.shape[-1])
        self._key_buffer = keys.new_empty(shape)
        self._value_buffer = values.new_empty(shape)
        self._key_buffer[..., :length, :] = keys
        self._value_buffer[..., :length, :] = values
        self._length = length
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._publish()

    def _publish(self) -> None:
        assert self._key_buffer is not None and self._value_buffer is not None
        self.keys = self._key_buffer[..., : self._length, :]
        self.values = self._value_buffer[..., : self._length, :]

    @classmethod
    def of_rows(cls, rows: Sequence[tuple[torch.Tensor, torch.Tensor] | None], room: int) -> _GrowingLayer:
        """A layer whose row i holds ``rows[i]`` (keys, values [heads, T_i, dim]) right-aligned to the
        longest, zeros elsewhere (None: a row with nothing), with ``room`` free columns after them."""
        keys0, values0 = next(row for row in rows if row is not None)
        length = max(row[0].shape[-2] for row in rows if row is not None)
        keys = keys0.new_zeros((len(rows), keys0.shape[0], length + room, keys0.shape[-1]))
        values = values0.new_zeros((len(rows), values0.shape[0], length + room, values0.shape[-1]))
        for index, row in enumerate(rows):
            if row is not None:
                keys[index, :, length - row[0].shape[-2] : length] = row[0]
                values[index, :, length - row[1].shape[-2] : length] = row[1]
        layer = cls()
        layer._key_buffer, layer._value_buffer, layer._length = keys, values, length
        layer.dtype, layer.device, layer.is_initialized = keys.dtype, keys.device, True
        layer._publish()
        return layer

    def keep(self, rows: torch.Tensor, first_column: int) -> None:
        """Keep only ``rows``, and only the columns from ``first_column`` on (one copy)."""
        if self.keys is None:
            return
        # Left-padding columns every kept row has are dropped with the rows.
        self._set(self.keys[rows, :, first_column:], self.values[rows, :, first_column:], room=_MIN_ROOM)

    def append_rows(self, other: _GrowingLayer) -> None:
        """Append ``other``'s rows below these, left-padding whichever side is shorter with zeros."""
        if other.keys is None:
            return
        if self.keys is None:
            self._set(other.keys, other.values, room=_MIN_ROOM)
            return
        length = max(self.keys.shape[-2], other.keys.shape[-2])
        keys = torch.cat([_left_pad(self.keys, length), _left_pad(other.keys, length)])
        values = torch.cat([_left_pad(self.values, length), _left_pad(other.values, length)])
        self._set(keys, values, room=_MIN_ROOM)


def _left_pad(states: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - states.shape[-2]
    return torch.nn.functional.pad(states, (0, 0, missing, 0)) if missing else states


class SlotCache(Cache):
    """The decode loop's cache: a Hugging Face ``Cache`` of ``_GrowingLayer`` plus row operations.

    The caller keeps the attention mask [B, T] that goes with it, and passes it to ``keep`` and
    ``append_rows`` so both stay aligned."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=_GrowingLayer)

    def keep(self, rows: torch.Tensor, first_column: int) -> None:
        """Drop every row not in ``rows`` and the leading ``first_column`` columns of each layer."""
        for layer in self.layers:
            layer.keep(rows, first_column)

    @classmethod
    def from_prefixes(
        cls, prefixes: Sequence[list[tuple[torch.Tensor, torch.Tensor]] | None], room: int
    ) -> SlotCache:
        """A cache for a prefill whose row i starts from ``prefixes[i]`` (per layer (keys, values)
        [heads, T_i, dim]; None: from nothing), right-aligned to the longest, with ``room`` free columns
        per layer for the prefill's own tokens. At least one prefix must be given."""
        template = next(prefix for prefix in prefixes if prefix is not None)
        cache = cls()
        for index in range(len(template)):
            rows = [None if prefix is None else prefix[index] for prefix in prefixes]
            cache.layers.append(_GrowingLayer.of_rows(rows, room))
        return cache

    def row_states(self, row: int, columns: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of row ``row``'s keys and values in ``columns`` (a bool mask over the columns, e.g. the
        row's attention mask), per layer [heads, columns kept, dim]: what a prefix store keeps."""
        return [(layer.keys[row][:, columns], layer.values[row][:, columns]) for layer in self.layers]

    def append_rows(self, other: SlotCache) -> None:
        """Append the rows of ``other`` (a fresh prefill), padding on the left to a common length."""
        while len(self.layers) < len(other.layers):
            self.layers.append(_GrowingLayer())
        for mine, theirs in zip(self.layers, other.layers):
            mine.append_rows(theirs)
