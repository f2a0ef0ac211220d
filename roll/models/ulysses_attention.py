"""Ulysses attention: attention over a whole packed row whose tokens are split across a sequence group's
ranks (``roll.strategies.sequence_parallel`` splits the row and makes the group).

Each rank holds its slice's queries, keys and values for every head. An all-to-all swaps that for every
token's, for 1/S of the heads; the packed kernel attends over the whole row; a second all-to-all swaps
back. The ``sdpa_varlen`` kernel (``roll.models.varlen_attention``) calls this when the forward pass
carries a ``sequence_shard``: an object with ``group`` (``size``, ``rank``, ``group``: the torch process
group) and ``position_ids`` (the whole row's, which say where its sequences start).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over equal chunks of dim 0; its gradient is the same exchange of the
    gradient's chunks."""

    @staticmethod
    def forward(ctx, tensor, group):  # noqa: ANN001, ANN205
        ctx.group = group
        return _exchange(tensor, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return _exchange(grad, ctx.group), None


def _exchange(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    # Both contiguous: the collective reads and writes memory in order (``empty_like`` of a transposed
    # tensor, attention's query, would keep its strides and scramble the chunks).
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor, group=group)
    return out


def _sequence_to_heads(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """[1, H, n, D] (every head, this rank's tokens) -> [1, H/S, S*n, D] (this rank's heads, every token)."""
    _, heads, tokens, dim = tensor.shape
    size = group.size
    chunks = tensor[0].reshape(size, heads // size, tokens, dim)  # chunk j: the heads rank j attends with
    received = _AllToAll.apply(chunks, group.group)  # received[i]: rank i's tokens, this rank's heads
    return received.transpose(0, 1).reshape(heads // size, size * tokens, dim)[None]


def _heads_to_sequence(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """[1, S*n, H/S, D] (attention's output layout) -> [1, n, H, D]."""
    _, tokens, heads, dim = tensor.shape
    size = group.size
    chunks = tensor[0].reshape(size, tokens // size, heads, dim)  # chunk i: rank i's tokens
    received = _AllToAll.apply(chunks, group.group)  # received[j]: rank j's heads of this rank's tokens
    return received.transpose(0, 1).reshape(tokens // size, size * heads, dim)[None]


def ulysses_attention(
    inner: Any,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    shard: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention contract (``query`` [1, H, n, D], ``key``/``value`` [1, H_kv, n, D] of this
    rank's n tokens, out [1, n, H, D]) over the whole packed row: ``inner`` (a packed attention function)
    attends over every token for H/S heads between two all-to-alls."""
    group = shard.group
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % group.size:
        raise ValueError(f"{heads} attention heads do not divide by sequence_parallel_size {group.size}")
    if kv_heads % group.size:
        key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    query, key, value = (_sequence_to_heads(t, group) for t in (query, key, value))
    kwargs["position_ids"] = shard.position_ids
    out, _ = inner(module, query, key, value, None, **kwargs)
    return _heads_to_sequence(out, group), None
