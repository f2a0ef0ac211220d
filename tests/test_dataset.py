"""Tests for roll.data.dataset: JSONL loading errors and the resumable PromptIterator."""

from __future__ import annotations

import json

import pytest

from roll.data.dataset import DatasetError, PromptIterator, load_jsonl, read_jsonl


def write(tmp_path, text: str, name: str = "data.jsonl"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def rows(n: int) -> list[dict]:
    return [{"id": i, "prompt": f"p{i}"} for i in range(n)]


def ids(batch: list[dict]) -> list[int]:
    return [row["id"] for row in batch]


# ---------------------------------------------------------------- load_jsonl


def test_load_jsonl_reads_rows_and_skips_blank_lines(tmp_path):
    path = write(tmp_path, '{"prompt": "a", "answer": 1}\n\n   \n{"prompt": "b", "answer": 2}\n')
    assert load_jsonl(path, required_keys=["prompt", "answer"]) == [
        {"prompt": "a", "answer": 1},
        {"prompt": "b", "answer": 2},
    ]
    assert load_jsonl(str(path))[1]["prompt"] == "b"


def test_load_jsonl_missing_file_names_path_and_setting(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError, match="does not exist") as info:
        load_jsonl(missing)
    assert str(missing) in str(info.value) and "data.train_path" in str(info.value)
    with pytest.raises(DatasetError, match="is a directory"):
        load_jsonl(tmp_path)


def test_load_jsonl_malformed_json_names_file_and_line(tmp_path):
    path = write(tmp_path, '{"prompt": "a"}\n\n{"prompt": oops}\n')
    with pytest.raises(DatasetError, match="invalid JSON") as info:
        load_jsonl(path)
    assert f"{path}:3:" in str(info.value)


def test_load_jsonl_non_object_row(tmp_path):
    path = write(tmp_path, '{"prompt": "a"}\n["prompt", "b"]\n')
    with pytest.raises(DatasetError, match="must be a JSON object, got list") as info:
        load_jsonl(path)
    assert f"{path}:2:" in str(info.value)


def test_load_jsonl_missing_required_key_lists_row_keys(tmp_path):
    lines = [json.dumps({"prompt": "a", "answer": 1}), json.dumps({"question": "b"})]
    path = write(tmp_path, "\n".join(lines) + "\n")
    with pytest.raises(DatasetError) as info:
        load_jsonl(path, required_keys=("prompt", "answer"))
    message = str(info.value)
    assert f"{path}:2:" in message
    assert "['prompt', 'answer']" in message  # what is missing
    assert "['question']" in message  # what the row has


def test_load_jsonl_empty_file(tmp_path):
    with pytest.raises(DatasetError, match="no rows") as info:
        load_jsonl(write(tmp_path, "\n  \n"))
    assert "data.jsonl" in str(info.value)


def test_dataset_error_is_a_value_error():
    assert issubclass(DatasetError, ValueError)


# ---------------------------------------------------------------- PromptIterator


def test_batch_size_larger_than_dataset_is_an_error():
    with pytest.raises(DatasetError, match="batch_size 5 is larger than the dataset \\(4 rows\\)"):
        PromptIterator(rows(4), batch_size=5)
    with pytest.raises(DatasetError):
        PromptIterator(rows(4), batch_size=0)


def test_deterministic_per_seed():
    def first_batches(seed: int) -> list[list[int]]:
        it = PromptIterator(rows(20), batch_size=4, seed=seed)
        return [ids(it.next_batch()) for _ in range(10)]

    assert first_batches(1) == first_batches(1)
    assert first_batches(1) != first_batches(2)


def test_epoch_covers_each_row_once_and_drops_tail():
    it = PromptIterator(rows(10), batch_size=3, seed=0)
    epoch0 = [ids(it.next_batch()) for _ in range(3)]
    assert it.epoch == 0
    seen = [i for batch in epoch0 for i in batch]
    assert len(set(seen)) == 9  # 9 distinct rows; the 10th is the dropped tail
    assert all(len(b) == 3 for b in epoch0)
    nxt = it.next_batch()  # would need the tail plus 2 rows: rolls over instead
    assert it.epoch == 1 and len(nxt) == 3 and it.position == 3


def test_reshuffled_each_epoch():
    it = PromptIterator(rows(12), batch_size=12, seed=3)
    first, second = ids(it.next_batch()), ids(it.next_batch())
    assert sorted(first) == sorted(second) == list(range(12))
    assert first != second
    assert it.epoch == 1


def test_no_shuffle_keeps_file_order():
    it = PromptIterator(rows(5), batch_size=2, shuffle=False)
    assert [ids(it.next_batch()) for _ in range(3)] == [[0, 1], [2, 3], [0, 1]]


def test_batches_are_copies():
    data = rows(4)
    it = PromptIterator(data, batch_size=4, shuffle=False)
    it.next_batch()[0]["response"] = "x"
    assert "response" not in data[0]


def test_state_dict_resume_continues_the_same_order():
    data = rows(10)
    reference = PromptIterator(data, batch_size=3, seed=7)
    expected = [ids(reference.next_batch()) for _ in range(12)]

    run = PromptIterator(data, batch_size=3, seed=7)
    for _ in range(5):  # stop mid-epoch 1
        run.next_batch()
    state = json.loads(json.dumps(run.state_dict()))  # survives a JSON checkpoint
    resumed = PromptIterator(data, batch_size=3, seed=7)
    resumed.load_state_dict(state)
    assert resumed.epoch == run.epoch == 1
    assert [ids(resumed.next_batch()) for _ in range(7)] == expected[5:]


def test_load_state_dict_rejects_changed_setup():
    state = PromptIterator(rows(10), batch_size=2, seed=1).state_dict()
    with pytest.raises(DatasetError, match="num_rows: saved 10, now 11"):
        PromptIterator(rows(11), batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(DatasetError, match="seed"):
        PromptIterator(rows(10), batch_size=2, seed=2).load_state_dict(state)


def test_load_jsonl_rejects_bytes_that_are_not_utf8_naming_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n\n{"prompt": "\xff"}\n')
    with pytest.raises(DatasetError, match="not valid UTF-8") as info:
        load_jsonl(path)
    assert f"{path}:3: not valid UTF-8 (byte 0xff at column 13)" in str(info.value)


def test_load_jsonl_accepts_a_byte_order_mark(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes('\ufeff{"prompt": "a"}\n{"prompt": "b"}\n'.encode())
    assert [row["prompt"] for row in load_jsonl(path)] == ["a", "b"]


def test_read_jsonl_gives_file_line_numbers(tmp_path):
    path = write(tmp_path, '{"prompt": "a"}\n\n\n{"prompt": "b"}\n')
    assert read_jsonl(path) == [(1, {"prompt": "a"}), (4, {"prompt": "b"})]
