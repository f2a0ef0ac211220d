"""Dispatch modes: how one driver call becomes per-rank calls, and how per-rank results become one value.

Pure functions (no Ray), so every mode is unit-tested without starting actors.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

RankArgs = list[tuple[tuple, dict]]


def is_batch(value: Any) -> bool:
    """Whether ``value`` is a ``roll.data.batch.Batch``, without importing torch for the question: a Batch
    exists only once its module is imported, so a process that never holds one (an environment worker)
    starts without paying for torch's import."""
    module = sys.modules.get("roll.data.batch")
    return module is not None and isinstance(value, module.Batch)


class Dispatch(str, Enum):
    ONE_TO_ALL = "one_to_all"  # every rank gets the same arguments; the result is the list of rank results
    ALL_TO_ALL = (
        "all_to_all"  # argument i of every list goes to rank i; the result is the list of rank results
    )
    DP_COMPUTE = "dp_compute"  # Batch arguments are split by data-parallel rank; results are concatenated
    RANK_ZERO = "rank_zero"  # like ONE_TO_ALL, but only rank 0's result is returned (e.g. exported weights)


@dataclass(frozen=True)
class DispatchMode:
    split: Callable[[int, tuple, dict], RankArgs]
    collect: Callable[[list[Any]], Any]


def split_one_to_all(world_size: int, args: tuple, kwargs: dict) -> RankArgs:
    return [(args, kwargs)] * world_size


def split_all_to_all(world_size: int, args: tuple, kwargs: dict) -> RankArgs:
    for value in (*args, *kwargs.values()):
        if not isinstance(value, (list, tuple)) or len(value) != world_size:
            raise ValueError(
                f"ALL_TO_ALL dispatch needs one list of {world_size} items (one per rank) per argument"
            )
    return [
        (tuple(a[rank] for a in args), {k: v[rank] for k, v in kwargs.items()}) for rank in range(world_size)
    ]


def split_data_parallel(world_size: int, args: tuple, kwargs: dict) -> RankArgs:
    """Chunk every Batch argument into ``world_size`` equal shards; other arguments go to all ranks."""

    def shards(value: Any) -> list[Any]:
        if is_batch(value):
            if len(value) % world_size != 0:
                raise ValueError(
                    f"a batch of {len(value)} rows cannot be split evenly across {world_size} data-parallel "
                    "ranks; make the batch size a multiple of the world size"
                )
            return value.chunk(world_size)
        return [value] * world_size

    split_args = [shards(a) for a in args]
    split_kwargs = {k: shards(v) for k, v in kwargs.items()}
    return [
        (tuple(a[rank] for a in split_args), {k: v[rank] for k, v in split_kwargs.items()})
        for rank in range(world_size)
    ]


def collect_list(results: list[Any]) -> list[Any]:
    return list(results)


def collect_rank_zero(results: list[Any]) -> Any:
    return results[0]


def collect_data_parallel(results: list[Any]) -> Any:
    """Concatenate Batches in rank order; average numeric metric dicts; otherwise return the list."""
    if results and all(is_batch(r) for r in results):
        return type(results[0]).concat(results)
    if all(isinstance(r, dict) for r in results):
        return mean_metrics(results)
    return list(results)


def mean_metrics(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """Average each metric over the ranks (or steps) that reported it; a ``*_max`` metric is the largest."""
    keys = {k for m in per_rank for k in m}
    combined: dict[str, float] = {}
    for k in sorted(keys):
        values = [m[k] for m in per_rank if k in m]
        combined[k] = max(values) if is_max_metric(k) else sum(values) / len(values)
    return combined


def is_max_metric(name: str) -> bool:
    """Metrics named ``*_max`` are maxima: combined over micro-batches, steps and ranks by ``max``."""
    return name.endswith("_max")


def dispatch_mode(mode: Dispatch, replicas: int = 1) -> DispatchMode:
    """How ``mode`` splits and collects on a cluster whose ranks hold each data-parallel shard ``replicas``
    times over (consecutive ranks: a sequence-parallel group, ``roll.strategies.sequence_parallel``):
    DP_COMPUTE splits Batches into world_size / replicas shards, gives each to its group's every rank, and
    keeps the first rank's result of each group (the others computed the same)."""
    if mode is not Dispatch.DP_COMPUTE or replicas == 1:
        return DISPATCH_MODES[mode]

    def split(world_size: int, args: tuple, kwargs: dict) -> RankArgs:
        shards = split_data_parallel(world_size // replicas, args, kwargs)
        return [shards[rank // replicas] for rank in range(world_size)]

    def collect(results: list[Any]) -> Any:
        return collect_data_parallel(results[::replicas])

    return DispatchMode(split, collect)


DISPATCH_MODES: dict[Dispatch, DispatchMode] = {
    Dispatch.ONE_TO_ALL: DispatchMode(split_one_to_all, collect_list),
    Dispatch.ALL_TO_ALL: DispatchMode(split_all_to_all, collect_list),
    Dispatch.DP_COMPUTE: DispatchMode(split_data_parallel, collect_data_parallel),
    Dispatch.RANK_ZERO: DispatchMode(split_one_to_all, collect_rank_zero),
}
