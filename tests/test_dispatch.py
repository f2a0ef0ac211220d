"""Tests for roll.distributed.dispatch: how arguments are split per rank and results merged (no Ray)."""

from __future__ import annotations

import pytest
import torch

from roll.data.batch import Batch
from roll.distributed.dispatch import DISPATCH_MODES, Dispatch, mean_metrics


def make_batch(n: int) -> Batch:
    """Row i carries id i and text 't{i}' so the order of rows after split/collect is checkable."""
    return Batch(
        tensors={"ids": torch.arange(n), "pair": torch.arange(2 * n).reshape(n, 2)},
        non_tensors={"text": [f"t{i}" for i in range(n)]},
        meta={"step": 7},
    )


def test_every_dispatch_enum_member_has_a_mode():
    assert set(DISPATCH_MODES) == set(Dispatch)


# ------------------------------------------------------------------ ONE_TO_ALL


def test_one_to_all_gives_every_rank_the_same_arguments():
    mode = DISPATCH_MODES[Dispatch.ONE_TO_ALL]
    per_rank = mode.split(3, (1, "a"), {"k": [5]})
    assert per_rank == [((1, "a"), {"k": [5]})] * 3


def test_one_to_all_collects_the_list_of_rank_results():
    mode = DISPATCH_MODES[Dispatch.ONE_TO_ALL]
    assert mode.collect(["r0", "r1", "r2"]) == ["r0", "r1", "r2"]


# ------------------------------------------------------------------ ALL_TO_ALL


def test_all_to_all_sends_item_i_of_each_list_to_rank_i():
    mode = DISPATCH_MODES[Dispatch.ALL_TO_ALL]
    per_rank = mode.split(3, (["a0", "a1", "a2"], (10, 11, 12)), {"k": ["k0", "k1", "k2"]})
    assert per_rank == [
        (("a0", 10), {"k": "k0"}),
        (("a1", 11), {"k": "k1"}),
        (("a2", 12), {"k": "k2"}),
    ]
    assert mode.collect([0, 1, 2]) == [0, 1, 2]


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((["only", "two"],), {}),  # list too short
        ((["a", "b", "c", "d"],), {}),  # list too long
        (("not a list",), {}),  # not a list at all
        ((["a", "b", "c"],), {"k": ["k0"]}),  # a keyword argument of the wrong length
    ],
)
def test_all_to_all_rejects_arguments_that_are_not_one_item_per_rank(args, kwargs):
    with pytest.raises(ValueError, match="ALL_TO_ALL dispatch needs one list of 3 items"):
        DISPATCH_MODES[Dispatch.ALL_TO_ALL].split(3, args, kwargs)


# ------------------------------------------------------------------ DP_COMPUTE


def test_dp_compute_chunks_batches_in_rank_order_and_broadcasts_other_arguments():
    mode = DISPATCH_MODES[Dispatch.DP_COMPUTE]
    batch = make_batch(6)
    per_rank = mode.split(3, (batch, 0.5), {"other": make_batch(3), "flag": True})
    assert len(per_rank) == 3
    for rank, (args, kwargs) in enumerate(per_rank):
        shard, scale = args
        assert isinstance(shard, Batch)
        assert shard["ids"].tolist() == [2 * rank, 2 * rank + 1]
        assert shard["text"] == [f"t{2 * rank}", f"t{2 * rank + 1}"]
        assert shard.meta == {"step": 7}
        assert scale == 0.5
        assert kwargs["flag"] is True
        assert kwargs["other"]["ids"].tolist() == [rank]


def test_dp_compute_rejects_a_batch_that_does_not_divide_by_the_world_size():
    with pytest.raises(ValueError) as info:
        DISPATCH_MODES[Dispatch.DP_COMPUTE].split(4, (make_batch(6),), {})
    message = str(info.value)
    assert "6 rows" in message
    assert "4 data-parallel ranks" in message
    assert "multiple of the world size" in message


def test_dp_compute_collect_concatenates_batches_in_rank_order():
    mode = DISPATCH_MODES[Dispatch.DP_COMPUTE]
    batch = make_batch(6)
    shards = [args[0] for args, _ in mode.split(3, (batch,), {})]
    merged = mode.collect(shards)
    assert isinstance(merged, Batch)
    assert torch.equal(merged["ids"], batch["ids"])
    assert torch.equal(merged["pair"], batch["pair"])
    assert merged["text"] == batch["text"]


def test_dp_compute_collect_averages_metric_dicts_over_the_ranks_that_report_them():
    merged = DISPATCH_MODES[Dispatch.DP_COMPUTE].collect(
        [{"loss": 1.0, "lr": 0.1}, {"loss": 3.0, "lr": 0.1}, {"loss": 2.0, "only_rank2": 5.0}]
    )
    assert merged == pytest.approx({"loss": 2.0, "lr": 0.1, "only_rank2": 5.0})


def test_dp_compute_collect_returns_the_list_for_other_results():
    assert DISPATCH_MODES[Dispatch.DP_COMPUTE].collect([1, None, "x"]) == [1, None, "x"]


def test_mean_metrics_of_a_single_rank_is_that_rank():
    assert mean_metrics([{"a": 1.5}]) == {"a": 1.5}


def test_maxima_stay_maxima_over_micro_batches_optimizer_steps_and_ranks():
    """A ``*_max`` metric (``ratio_max``, ``logprob_diff_max``) is the largest value, not an average of
    the parts' maxima; other metrics are averaged and loss terms summed over micro-batches as before."""
    from roll.workers.trainer import _accumulate, _step_values

    sums: dict[str, float] = {}
    for micro in (
        {"ratio_max": 1.5, "ratio_mean": 1.0, "loss": 0.25},
        {"ratio_max": 3.0, "ratio_mean": 2.0, "loss": 0.5},
    ):
        _accumulate(sums, micro)
    assert _step_values(sums) == pytest.approx({"ratio_max": 3.0, "ratio_mean": 1.5, "loss": 0.75})
    ranks = [{"ratio_max": 3.0, "ratio_mean": 1.5}, {"ratio_max": 7.0, "ratio_mean": 0.5}]
    assert DISPATCH_MODES[Dispatch.DP_COMPUTE].collect(ranks) == pytest.approx(
        {"ratio_max": 7.0, "ratio_mean": 1.0}
    )


# ------------------------------------------------------------------ RANK_ZERO


def test_rank_zero_calls_every_rank_but_returns_rank_zeros_result():
    mode = DISPATCH_MODES[Dispatch.RANK_ZERO]
    assert mode.split(2, ("x",), {"y": 1}) == [(("x",), {"y": 1})] * 2
    assert mode.collect(["from rank 0", "from rank 1"]) == "from rank 0"
