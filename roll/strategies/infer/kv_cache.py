"""A KV cache for continuous batching: rows join and leave between decode steps.

Rows are left-padded to a common length, as in Hugging Face ``generate``; the attention mask and
position ids say which cache columns are real. Two things differ from ``DynamicCache``:

- Each layer keeps its keys and values in a buffer with spare room, so appending a token writes in
  place. ``DynamicLayer`` concatenates the whole cache at every token, which costs time quadratic in
  the response length (thousands of tokens in RL).
- Whole rows can be dropped (a finished or aborted request frees its slot at once) and appended (a new
  request joins after its prefill), with the shorter side padded on the left.
"""

from __future__ import annotations

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

    def append_rows(self, other: SlotCache) -> None:
        """Append the rows of ``other`` (a fresh prefill), padding on the left to a common length."""
        while len(self.layers) < len(other.layers):
            self.layers.append(_GrowingLayer())
        for mine, theirs in zip(self.layers, other.layers):
            mine.append_rows(theirs)
