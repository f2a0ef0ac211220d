"""Tests for roll.data.batch.Batch and roll.data.padding."""

from __future__ import annotations

import pickle

import pytest
import torch

from roll.data.batch import Batch
from roll.data.padding import left_pad, position_ids_from_mask, right_pad


def make_batch(n: int = 4) -> Batch:
    """Rows i carry ids [i, i+10], score i/10 and text 'r{i}' so alignment is checkable per row."""
    ids = torch.stack([torch.arange(n), torch.arange(n) + 10], dim=1)
    return Batch(
        tensors={"ids": ids, "score": torch.arange(n, dtype=torch.float32) / 10},
        non_tensors={"text": [f"r{i}" for i in range(n)]},
        meta={"step": 3},
    )


def row_ids(batch: Batch) -> list[int]:
    """Original row number of every row, read from the tensor field."""
    return batch["ids"][:, 0].tolist()


def assert_aligned(batch: Batch) -> None:
    """All fields of each row come from the same original row."""
    for i, r in enumerate(row_ids(batch)):
        assert batch["ids"][i].tolist() == [r, r + 10]
        assert batch["score"][i].item() == pytest.approx(r / 10)
        assert batch["text"][i] == f"r{r}"


# ---------------------------------------------------------------- construction and access


def test_construction_length_mismatch_names_fields():
    with pytest.raises(ValueError, match=r"'text' has 2 rows but field 'ids' has 3"):
        Batch(tensors={"ids": torch.zeros(3, 2)}, non_tensors={"text": ["a", "b"]})
    with pytest.raises(ValueError, match=r"'b' has 4 rows but field 'a' has 3"):
        Batch(tensors={"a": torch.zeros(3), "b": torch.zeros(4, 5)})


def test_construction_rejects_bad_values():
    with pytest.raises(ValueError, match="0-dim"):
        Batch(tensors={"x": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="list or tuple"):
        Batch(non_tensors={"text": "abc"})
    with pytest.raises(ValueError, match="both as a tensor and as a non-tensor"):
        Batch(tensors={"x": torch.zeros(2)}, non_tensors={"x": [1, 2]})


def test_len_keys_getitem_contains():
    batch = make_batch(4)
    assert len(batch) == 4
    assert len(Batch()) == 0
    assert batch.keys() == ["ids", "score", "text"]
    assert "text" in batch and "ids" in batch and "nope" not in batch
    assert batch["ids"].shape == (4, 2)
    assert batch["text"] == ["r0", "r1", "r2", "r3"]
    with pytest.raises(KeyError, match=r"available: \['ids', 'score', 'text'\]"):
        batch["nope"]
    with pytest.raises(TypeError, match="select"):
        batch[0]


def test_non_tensor_tuple_stored_as_list():
    batch = Batch(non_tensors={"t": ("a", "b")})
    assert batch["t"] == ["a", "b"] and isinstance(batch["t"], list)


def test_setitem_routes_and_checks_length():
    batch = make_batch(3)
    batch["mask"] = torch.ones(3, 5)
    batch["info"] = ({"a": 1}, {"a": 2}, {"a": 3})
    assert "mask" in batch.tensors and batch.non_tensors["info"] == [{"a": 1}, {"a": 2}, {"a": 3}]
    # Replacing a field with another type moves it between the dicts.
    batch["score"] = ["x", "y", "z"]
    assert "score" not in batch.tensors and batch["score"] == ["x", "y", "z"]
    with pytest.raises(ValueError, match=r"'bad' has 2 rows"):
        batch["bad"] = torch.zeros(2)
    with pytest.raises(TypeError):
        batch["bad"] = 5
    assert "bad" not in batch


def test_repr_is_compact():
    text = repr(make_batch(4))
    assert "len=4" in text and "ids: [4, 2] int64" in text and "score: [4] float32" in text
    assert "text" in text and "step" in text


# ---------------------------------------------------------------- row operations


def test_select_order_repeats_and_negatives():
    batch = make_batch(5)
    out = batch.select([3, 0, 3, -1])
    assert row_ids(out) == [3, 0, 3, 4]
    assert out["text"] == ["r3", "r0", "r3", "r4"]
    assert out.meta == {"step": 3}
    assert_aligned(out)
    assert row_ids(batch.select(torch.tensor([4, 1]))) == [4, 1]
    assert row_ids(batch.select(torch.tensor([True, False, True, False, False]))) == [0, 2]
    assert len(batch.select([])) == 0


def test_select_errors():
    batch = make_batch(3)
    with pytest.raises(IndexError, match="index 3 is out of range for a batch of 3"):
        batch.select([0, 3])
    with pytest.raises(TypeError, match="integers"):
        batch.select([0.5])
    with pytest.raises(ValueError, match="mask"):
        batch.select(torch.tensor([True, False]))


def test_derived_meta_is_a_copy():
    batch = make_batch(2)
    out = batch.select([0])
    out.meta["step"] = 99
    assert batch.meta["step"] == 3


def test_select_keys():
    batch = make_batch(3)
    out = batch.select_keys(["text", "ids"])
    assert sorted(out.keys()) == ["ids", "text"]
    assert out.meta == {"step": 3} and len(out) == 3
    with pytest.raises(KeyError, match="missing"):
        batch.select_keys(["missing"])


def test_chunk_equal_parts_and_indivisible_error():
    batch = make_batch(6)
    parts = batch.chunk(3)
    assert [row_ids(p) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert [p["text"] for p in parts] == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"]]
    assert all(p.meta == {"step": 3} for p in parts)
    with pytest.raises(ValueError, match=r"6 rows into 4 .*pad_to_divisor\(4\)"):
        batch.chunk(4)


def test_split_last_part_smaller():
    parts = make_batch(5).split(2)
    assert [row_ids(p) for p in parts] == [[0, 1], [2, 3], [4]]
    assert [p["text"] for p in parts] == [["r0", "r1"], ["r2", "r3"], ["r4"]]
    with pytest.raises(ValueError):
        make_batch(2).split(0)


def test_concat_roundtrip_and_meta_from_first():
    batch = make_batch(6)
    a, b = batch.select([0, 1, 2]), batch.select([3, 4, 5])
    b.meta = {"step": 7}
    out = Batch.concat([a, b])
    assert row_ids(out) == list(range(6))
    assert torch.equal(out["ids"], batch["ids"]) and out["text"] == batch["text"]
    assert out.meta == {"step": 3}
    assert row_ids(Batch.concat(batch.chunk(2))) == list(range(6))


def test_concat_errors():
    batch = make_batch(2)
    with pytest.raises(ValueError, match="same fields"):
        Batch.concat([batch, batch.select_keys(["ids"])])
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])
    other = make_batch(2)
    other["ids"] = other["ids"].float()
    with pytest.raises(ValueError, match="'ids'.*float32"):
        Batch.concat([batch, other])
    mixed = make_batch(2)
    mixed["score"] = [0.0, 0.1]
    with pytest.raises(ValueError, match="tensors in one batch"):
        Batch.concat([batch, mixed])


def test_repeat_interleave_and_tile():
    batch = make_batch(2)
    inter = batch.repeat(3, interleave=True)
    assert row_ids(inter) == [0, 0, 0, 1, 1, 1]
    assert inter["text"] == ["r0", "r0", "r0", "r1", "r1", "r1"]
    assert_aligned(inter)
    tiled = batch.repeat(2, interleave=False)
    assert row_ids(tiled) == [0, 1, 0, 1]
    assert tiled["text"] == ["r0", "r1", "r0", "r1"]
    assert_aligned(tiled)
    assert row_ids(batch.repeat(2)) == [0, 0, 1, 1]  # interleave is the default


def test_repeat_keeps_trailing_dims():
    batch = Batch(tensors={"x": torch.arange(8).reshape(2, 2, 2)})
    assert batch.repeat(2, interleave=False)["x"].shape == (4, 2, 2)
    assert batch.repeat(2, interleave=True)["x"].shape == (4, 2, 2)
    assert torch.equal(batch.repeat(2, interleave=True)["x"][1], batch["x"][0])


def test_group_by_non_tensor_first_seen_order():
    batch = make_batch(5)
    batch["group"] = ["b", "a", "b", "c", "a"]
    groups = batch.group_by("group")
    assert list(groups) == ["b", "a", "c"]
    assert row_ids(groups["b"]) == [0, 2]
    assert row_ids(groups["a"]) == [1, 4]
    assert groups["c"]["text"] == ["r3"]
    assert_aligned(groups["a"])


def test_group_by_tensor_gives_python_keys():
    batch = make_batch(4)
    batch["pid"] = torch.tensor([7, 5, 7, 5])
    groups = batch.group_by("pid")
    assert list(groups) == [7, 5]
    assert all(type(k) is int for k in groups)
    assert row_ids(groups[5]) == [1, 3]
    with pytest.raises(ValueError, match="1-D"):
        batch.group_by("ids")


def test_pad_to_divisor_and_unpad_round_trip():
    batch = make_batch(5)
    padded, num_padded = batch.pad_to_divisor(4)
    assert num_padded == 3 and len(padded) == 8
    assert row_ids(padded) == [0, 1, 2, 3, 4, 0, 1, 2]
    assert_aligned(padded)
    restored = padded.unpad(num_padded)
    assert torch.equal(restored["ids"], batch["ids"]) and restored["text"] == batch["text"]
    # Process shards and reassemble, the way data-parallel dispatch uses it.
    shards = padded.chunk(4)
    assert row_ids(Batch.concat(shards).unpad(num_padded)) == [0, 1, 2, 3, 4]


def test_pad_to_divisor_edge_cases():
    batch = make_batch(2)
    same, num_padded = batch.pad_to_divisor(2)
    assert num_padded == 0 and row_ids(same) == [0, 1]
    big, num_padded = batch.pad_to_divisor(5)  # divisor larger than the batch cycles rows
    assert num_padded == 3 and row_ids(big) == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="empty"):
        Batch().pad_to_divisor(2)
    with pytest.raises(ValueError):
        batch.unpad(3)


def test_union_merges_fields_and_meta():
    batch = make_batch(3)
    extra = Batch(tensors={"ids": batch["ids"].clone(), "reward": torch.ones(3)}, meta={"version": 2})
    out = batch.union(extra)
    assert sorted(out.keys()) == ["ids", "reward", "score", "text"]
    assert out.meta == {"step": 3, "version": 2}
    assert "reward" not in batch  # the inputs are not modified


def test_union_conflicts():
    batch = make_batch(3)
    other_ids = batch["ids"].clone()
    other_ids[1, 0] = 99
    with pytest.raises(ValueError, match="'ids'"):
        batch.union(Batch(tensors={"ids": other_ids}))
    with pytest.raises(ValueError, match="'text'"):
        batch.union(Batch(non_tensors={"text": ["r0", "r1", "changed"]}))
    with pytest.raises(ValueError, match="'ids'"):  # same values, different dtype
        batch.union(Batch(tensors={"ids": batch["ids"].float()}))
    with pytest.raises(ValueError, match="rows"):
        batch.union(make_batch(2))
    with pytest.raises(ValueError, match="meta 'step'"):
        batch.union(Batch(tensors={"r": torch.ones(3)}, meta={"step": 4}))


def test_shuffle_is_aligned_permutation_and_seeded():
    batch = make_batch(16)
    out = batch.shuffle(torch.Generator().manual_seed(0))
    assert sorted(row_ids(out)) == list(range(16))
    assert row_ids(out) != list(range(16))
    assert_aligned(out)
    again = batch.shuffle(torch.Generator().manual_seed(0))
    assert row_ids(again) == row_ids(out)


def test_to_device():
    out = make_batch(2).to("cpu")
    assert out["ids"].device.type == "cpu" and out["text"] == ["r0", "r1"] and out.meta == {"step": 3}


def test_pickle_round_trip():
    batch = make_batch(4)
    batch["info"] = [{"k": i} for i in range(4)]
    out = pickle.loads(pickle.dumps(batch))
    assert out.keys() == batch.keys()
    assert torch.equal(out["ids"], batch["ids"]) and torch.equal(out["score"], batch["score"])
    assert out["info"] == batch["info"] and out.meta == batch.meta


def test_pickled_chunk_does_not_carry_the_whole_storage():
    big = Batch(tensors={"x": torch.zeros(8, 4096)})
    shard = big.chunk(8)[0]
    assert len(pickle.dumps(shard)) < len(pickle.dumps(big)) / 4
    assert torch.equal(pickle.loads(pickle.dumps(shard))["x"], torch.zeros(1, 4096))


# ---------------------------------------------------------------- padding helpers


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert torch.equal(ids, torch.tensor([[5, 6, 7], [0, 0, 8]]))
    assert torch.equal(mask, torch.tensor([[1, 1, 1], [0, 0, 1]]))
    assert ids.dtype == torch.long and mask.dtype == torch.long
    ids, mask = left_pad([[1, 2]], pad_id=9, length=4)
    assert torch.equal(ids, torch.tensor([[9, 9, 1, 2]]))
    assert torch.equal(mask, torch.tensor([[0, 0, 1, 1]]))


def test_right_pad():
    ids, mask = right_pad([[5, 6, 7], [8], []], pad_id=-1)
    assert torch.equal(ids, torch.tensor([[5, 6, 7], [8, -1, -1], [-1, -1, -1]]))
    assert torch.equal(mask, torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]]))
    ids, _ = right_pad([torch.tensor([3, 4])], pad_id=0, length=3)
    assert torch.equal(ids, torch.tensor([[3, 4, 0]]))


def test_pad_too_long_errors():
    with pytest.raises(ValueError, match="sequence 1 has 3 tokens, longer than the pad length 2"):
        left_pad([[1], [1, 2, 3]], pad_id=0, length=2)
    with pytest.raises(ValueError, match="longer than the pad length"):
        right_pad([[1, 2, 3]], pad_id=0, length=2)


def test_position_ids_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]])
    pos = position_ids_from_mask(mask)
    assert torch.equal(pos, expected) and pos.dtype == torch.long
    assert torch.equal(position_ids_from_mask(mask.bool()), expected)
