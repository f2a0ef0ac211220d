"""Ulysses sequence parallelism: the ranks of a sequence group share each packed micro-batch's tokens.

With ``sequence_parallel_size: S`` the trainer's W ranks form W/S groups of S consecutive ranks. The
ranks of a group get the same rows (``roll.distributed.dispatch``); each forward pass packs them into one
row without padding (``roll.strategies.hf_forward``), and each rank of the group runs the model on 1/S of
that row's tokens (``split_pack``). Outside attention a token needs no other token, so embeddings, MLPs,
norms and the head run on the rank's slice alone: activations are 1/S of the sequence's. Around attention
(``roll.models.ulysses_attention``, which the ``sdpa_varlen`` kernel calls) an all-to-all swaps the
split: each rank gets every token's queries, keys and values for 1/S of the heads, attends over the whole
sequence, and a second all-to-all swaps back. What the head computes at the kept positions (logprobs,
entropies, values) is gathered so that every rank of the group holds the whole micro-batch's, and
computes the same loss (``PackShard.gather``: its backward keeps a rank's own positions' gradient only,
so the group's gradients sum to the micro-batch's once).

FSDP2 shards the weights over all W ranks. The trainer counts each group's rows once
(``roll.workers.trainer``): the loss's denominator and the reported loss terms (the gradient's scale
stays W: each rank of a group holds a part of the group's gradient).

Grouped-query attention: with fewer KV heads than S (or a count S does not divide), the KV heads are
repeated to one per query head before the swap, as verl does; the query heads must divide by S.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# The attention implementations whose kernel runs ``ulysses_attention`` (``roll.models.varlen_attention``).
SEQUENCE_PARALLEL_KERNELS = frozenset({"sdpa_varlen"})


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's sequence group: ``size`` consecutive ranks of the trainer's process group."""

    size: int
    rank: int  # this rank's place in its group
    group: Any  # the torch process group of those ranks (None for a group of one)


def new_sequence_group(size: int) -> SequenceGroup:
    """Make the sequence groups of the default process group (every rank calls this, in the same order),
    and return this rank's. ``size`` 1: no group, no collective."""
    if size == 1:
        return SequenceGroup(1, 0, None)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"sequence_parallel_size {size} does not divide the {world} ranks")
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))  # every rank makes every group
        if first <= rank < first + size:
            mine = group
    return SequenceGroup(size, rank % size, mine)


def sequence_parallel_problem(
    size: int, world_size: int, config: Any, attn_implementation: str
) -> str | None:
    """Why a model of ``config`` (a transformers config) cannot run with ``sequence_parallel_size``
    ``size`` on ``world_size`` ranks, or None."""
    if world_size % size:
        return f"it does not divide the {world_size} ranks (world_size)"
    if attn_implementation not in SEQUENCE_PARALLEL_KERNELS:
        kernels = ", ".join(sorted(SEQUENCE_PARALLEL_KERNELS))
        return (
            f"it splits packed rows, and model.attn_implementation is {attn_implementation}: set it to "
            f"{kernels}"
        )
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    if heads % size:
        return f"the model's {heads} attention heads do not divide by it"
    return None


def check_sequence_parallel(
    role: str, size: int, world_size: int, path: str, attn_implementation: str
) -> None:
    """Raise a ValueError naming ``<role>.sequence_parallel_size`` when the model at ``path`` cannot be
    split so (``sequence_parallel_problem``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    problem = sequence_parallel_problem(size, world_size, config, attn_implementation)
    if problem is not None:
        raise ValueError(f"{role}.sequence_parallel_size is {size}, but {problem}")


def set_sequence_group(model: torch.nn.Module, group: SequenceGroup) -> None:
    """Make ``model``'s packed forward passes (``roll.strategies.hf_forward``) sequence-parallel."""
    model._roll_sequence_group = group  # noqa: SLF001 - read by sequence_group_of


def sequence_group_of(model: torch.nn.Module) -> SequenceGroup | None:
    """The sequence group ``model``'s forward passes split their packed rows over, or None."""
    group = getattr(model, "_roll_sequence_group", None)
    return group if group is not None and group.size > 1 else None


@dataclass(frozen=True)
class PackShard:
    """One rank's slice of a packed row, and what attention and the gather need of the whole.

    Passed to the model's forward as the ``sequence_shard`` keyword, which transformers hands on to the
    attention function of every layer (and which gradient checkpointing's recomputation keeps)."""

    group: SequenceGroup
    position_ids: torch.Tensor  # [1, N] the whole (padded) pack's: where its sequences start
    kept_counts: tuple[int, ...]  # kept positions in each rank's slice, in rank order

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """[1, n_kept_here, ...] per rank -> [1, n_kept, ...] on every rank, in pack order."""
        return _GatherKept.apply(values, self)


def split_pack(
    group: SequenceGroup, input_ids: torch.Tensor, position_ids: torch.Tensor, kept: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PackShard]:
    """This rank's slice of a packed row ``input_ids``/``position_ids`` [1, N] whose outputs are read at
    the (ascending) positions ``kept``.

    The row is padded to a multiple of the group's size with a sequence of its own (position ids from 0,
    so attention keeps it apart). Returns the slice's ids and position ids [1, N/S], the kept positions
    inside it (relative to its start), a mask over ``kept`` of those that fall in it, and the shard."""
    size, length = group.size, input_ids.shape[1]
    padded = -(-length // size) * size
    if padded > length:
        extra = padded - length
        input_ids = torch.cat([input_ids, input_ids.new_zeros(1, extra)], dim=1)
        position_ids = torch.cat([position_ids, torch.arange(extra, device=position_ids.device)[None]], dim=1)
    width = padded // size
    start = group.rank * width
    bounds = torch.arange(0, padded + 1, width, device=kept.device)
    counts = torch.bucketize(kept, bounds, right=True) - 1  # the rank whose slice holds each kept position
    kept_counts = tuple(int(c) for c in torch.bincount(counts, minlength=size).tolist())
    here = counts == group.rank
    shard = PackShard(group, position_ids, kept_counts)
    local_ids = input_ids[:, start : start + width]
    local_positions = position_ids[:, start : start + width]
    return local_ids, local_positions, kept[here] - start, here, shard


class _GatherKept(torch.autograd.Function):
    """Every rank's kept outputs, concatenated in rank order. Each rank then computes the same loss from
    them, so the gradient a rank sends back through its own outputs is its slice of the whole's."""

    @staticmethod
    def forward(ctx, values, shard):  # noqa: ANN001, ANN205
        counts, group = shard.kept_counts, shard.group
        most = max(counts)
        padded = values.new_zeros((most, *values.shape[2:]))
        padded[: values.shape[1]] = values[0]
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group.group)
        ctx.start = sum(counts[: group.rank])
        ctx.count = counts[group.rank]
        return torch.cat([part[:count] for part, count in zip(parts, counts)])[None]

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad[:, ctx.start : ctx.start + ctx.count], None
