"""Datasets in every format ROLL reads (JSONL, JSON, Parquet, Arrow, CSV, `save_to_disk` directories):
the same rows from each, `data.columns`, conversational prompts through the chat template, bad rows
named by file and row, and the chat-template history check of agentic runs. No Ray, no model."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import datasets
import pandas as pd
import pyarrow as pa
import pyarrow.feather
import pytest
from typer.testing import CliRunner

from roll.cli import app
from roll.config import load_config
from roll.config.common import DataConfig
from roll.config.loader import ConfigError
from roll.config.rlvr import DomainConfig, RLVRConfig
from roll.data.dataset import DatasetError, read_jsonl
from roll.data.formats import data_format, read_rows
from roll.data.prompts import load_prompts
from roll.data.template_history import history_rewrite
from roll.models.tokenizer import build_bpe_tokenizer, build_char_tokenizer
from roll.pipelines import preflight as preflight_module
from roll.pipelines.preflight import load_domains, preflight

ROWS = [
    {"prompt": "1+2", "answer": "3", "id": "a"},
    {"prompt": "10+20", "answer": "30", "id": "b"},
    {"prompt": "7+0", "answer": "007", "id": "c"},  # text that a number parser would change
]
# The same rows as a user's dataset names its columns.
THEIR_ROWS = [{"question": r["prompt"], "solution": r["answer"], "id": r["id"]} for r in ROWS]
CONVERSATION = [
    {"role": "system", "content": "add"},
    {"role": "user", "content": "1+2"},
]
# Messages with different keys: a Parquet struct column gives the user message `name: null`.
NAMED = [{"role": "system", "content": "add", "name": "s"}, {"role": "user", "content": "1+2"}]
QUICKSTART = "examples/quickstart.yaml"

datasets.disable_progress_bars()


@pytest.fixture
def chars():
    return build_char_tokenizer("0123456789+adsytem")


def write(path: Path, rows: list[dict]) -> Path:
    """``rows`` in the format ``path``'s extension names (a directory: saved with `datasets`)."""
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    elif suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(path, index=False)
    elif suffix == ".csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    elif suffix == ".arrow":
        pyarrow.feather.write_feather(pa.Table.from_pylist(rows), path)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def data(**kwargs) -> DataConfig:
    return DataConfig(**{"max_prompt_length": 64, **kwargs})


@pytest.mark.parametrize(
    "name", ["rows.jsonl", "rows.json", "rows.parquet", "rows.arrow", "rows.csv", "saved"]
)
def test_every_format_gives_the_same_rows(tmp_path: Path, name: str) -> None:
    assert [row for _, row in read_rows(write(tmp_path / name, ROWS))] == ROWS


def test_typed_and_nested_values_survive_the_typed_formats(tmp_path: Path) -> None:
    rows = [{"prompt": "3,6=9", "numbers": [3, 6], "target": 9, "messages": CONVERSATION}] * 2
    for name in ("t.jsonl", "t.json", "t.parquet", "t.arrow", "saved"):
        assert [row for _, row in read_rows(write(tmp_path / name, rows))] == rows, name


def test_arrow_stream_files_as_datasets_writes_them_and_json_lines_under_a_json_name(tmp_path: Path) -> None:
    saved = write(tmp_path / "saved", ROWS)
    (stream,) = saved.glob("*.arrow")  # what `datasets` keeps in its caches: Arrow's stream format
    assert [row for _, row in read_rows(stream)] == ROWS
    lines = tmp_path / "lines.json"
    lines.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    assert read_rows(lines)[1] == (f"{lines}:2", ROWS[1])


def test_each_row_is_named_by_line_or_row(tmp_path: Path) -> None:
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    assert [where for where, _ in read_rows(jsonl)] == [f"{jsonl}:1", f"{jsonl}:3"]  # JSONL: the line
    parquet = write(tmp_path / "r.parquet", ROWS)
    assert [where for where, _ in read_rows(parquet)] == [f"{parquet} row {i}" for i in (1, 2, 3)]
    csv = tmp_path / "r.csv"
    csv.write_text('prompt,answer\n"1+\n2",3\n4+5,9\n')  # a quoted cell may span lines
    assert [where for where, _ in read_rows(csv)] == [f"{csv} row 1 (line 2)", f"{csv} row 2 (line 4)"]


def test_a_dataset_dict_directory_uses_its_only_split_or_the_one_the_path_names(tmp_path: Path) -> None:
    one = tmp_path / "one"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(one))
    assert read_rows(one)[0] == (f"{one} (split 'train') row 1", ROWS[0])
    both = tmp_path / "both"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    ).save_to_disk(str(both))
    with pytest.raises(DatasetError, match=r"is a DatasetDict with splits \['train', 'test'\]") as info:
        read_rows(both)
    assert f"'{both / 'train'}', '{both / 'test'}'" in str(info.value)
    assert [row for _, row in read_rows(both / "test")] == ROWS[:1]


def test_paths_that_name_no_dataset_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "rows.txt").write_text("1+2\n")
    with pytest.raises(
        DatasetError, match=r"has extension '.txt', which names no dataset format; use one of"
    ):
        data_format(tmp_path / "rows.txt")
    with pytest.raises(DatasetError, match="not a dataset saved with Hugging Face datasets' save_to_disk"):
        data_format(tmp_path)
    with pytest.raises(DatasetError, match="does not exist"):
        data_format(tmp_path / "missing.parquet")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"bad.parquet' cannot be read as parquet"):
        read_rows(tmp_path / "bad.parquet")


def test_loading_never_touches_the_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [write(tmp_path / name, ROWS) for name in ("r.parquet", "r.arrow", "r.csv", "saved")]

    def no_network(*args, **kwargs):
        raise AssertionError("loading a local dataset tried to open a connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    for path in paths:
        assert len(read_rows(path)) == 3


# ---------------------------------------------------------------- data.columns


@pytest.mark.parametrize("name", ["their.parquet", "their.jsonl", "their.csv", "saved"])
def test_columns_map_the_users_names_onto_roll_s(tmp_path: Path, chars, name: str) -> None:
    path = write(tmp_path / name, THEIR_ROWS)
    prompts = load_prompts(
        str(path), chars, data(columns={"prompt": "question", "answer": "solution"}), ["answer"], "answer"
    )
    assert prompts.rows == ROWS  # the mapped columns renamed, the others kept
    assert prompts.texts[0] == "<|user|>1+2<|assistant|>"


def test_a_missing_mapped_column_names_the_row_the_column_and_the_setting(tmp_path: Path, chars) -> None:
    path = write(tmp_path / "their.parquet", THEIR_ROWS)
    with pytest.raises(DatasetError) as info:
        load_prompts(
            str(path), chars, data(columns={"prompt": "question", "answer": "answer_text"}), ["answer"]
        )
    message = str(info.value)
    assert f"{path} row 1: row is missing required key(s) ['answer_text']" in message
    assert "data.columns maps onto 'answer'" in message and "['id', 'question', 'solution']" in message
    with pytest.raises(
        DatasetError, match=r"row 1: row is missing required key\(s\) \['prompt'\].*data.columns.prompt"
    ):
        load_prompts(str(path), chars, data())


def test_columns_merge_over_the_defaults_and_are_checked_at_load(repo_root: Path, monkeypatch) -> None:
    monkeypatch.chdir(repo_root)
    cfg = load_config(QUICKSTART, ["data.columns={prompt: question}"])
    assert cfg.data.columns == {"prompt": "question", "answer": "answer"}
    with pytest.raises(ConfigError, match=r"data.columns.answer: ' ' is not a column name"):
        load_config(QUICKSTART, ["data.columns.answer=' '"])
    with pytest.raises(ConfigError, match=r"`data.response_key`.* replaced by data.columns.answer"):
        load_config(QUICKSTART, ["data.response_key=solution"])  # what an older config says
    domains = load_config("examples/rlvr_multi_domain.yaml", ["domains.math.columns={prompt: problem}"])
    assert domains.domains["math"].columns == {"prompt": "problem"}  # over data.columns when rows load
    with pytest.raises(ConfigError, match=r"domains.code.columns.prompt: '' is not a column name"):
        load_config("examples/rlvr_multi_domain.yaml", ["domains.code.columns.prompt=''"])


def test_each_domain_reads_its_own_columns(tmp_path: Path, chars) -> None:
    cfg = RLVRConfig()
    cfg.data.columns = {"prompt": "question", "answer": "answer"}
    cfg.data.max_prompt_length = 64
    cfg.sft_warm_start = None
    cfg.domains = {
        "a": DomainConfig(
            train_path=str(write(tmp_path / "a.parquet", THEIR_ROWS)),
            reward="exact_match",
            columns={"answer": "solution"},
        ),
        "b": DomainConfig(
            train_path=str(
                write(tmp_path / "b.csv", [{"question": r["prompt"], "answer": r["answer"]} for r in ROWS])
            ),
            reward="exact_match",
        ),
    }
    cfg.rollout.rollout_batch_size = 2
    train, _ = load_domains(cfg, chars)
    assert [row["answer"] for row in train.rows] == ["3", "30", "007"] * 2
    assert train.domains == ["a"] * 3 + ["b"] * 3 and train.texts[3] == "<|user|>1+2<|assistant|>"
    cfg.domains["b"].columns = {"answer": "result"}
    with pytest.raises(
        DatasetError, match=r"b.csv row 1 \(line 2\): .*\['result'\].*domains.b.columns.answer"
    ):
        load_domains(cfg, chars)


# ---------------------------------------------------------------- conversations


@pytest.mark.parametrize("name", ["chat.jsonl", "chat.parquet", "saved"])
def test_conversational_prompts_go_through_the_chat_template(tmp_path: Path, chars, name: str) -> None:
    path = write(
        tmp_path / name, [{"prompt": NAMED, "answer": "3"}, {"prompt": CONVERSATION[1:], "answer": "3"}]
    )
    prompts = load_prompts(str(path), chars, data(), ["answer"])
    assert prompts.texts == ["<|system|>add<|user|>1+2<|assistant|>", "<|user|>1+2<|assistant|>"]
    assert prompts.rows[0]["prompt"] == NAMED  # the null `name` Parquet gave the user message is dropped
    assert prompts.token_ids[0] == chars(prompts.texts[0], add_special_tokens=False)["input_ids"]


def test_conversations_need_the_chat_template_and_well_formed_messages(tmp_path: Path, chars) -> None:
    path = write(tmp_path / "chat.jsonl", [{"prompt": CONVERSATION}])
    with pytest.raises(DatasetError, match=f"{path}:1: .*list of messages.*data.apply_chat_template=true"):
        load_prompts(str(path), chars, data(apply_chat_template=False))
    bad = [
        ([{"role": "user"}], "message 1 of the prompt"),
        ([*CONVERSATION, {"role": "assistant", "content": "3"}], "ends with an assistant message"),
        ([{"role": "narrator", "content": "1"}], "cannot render the prompt: unknown chat role: narrator"),
    ]
    for prompt, expected in bad:
        write(path, [{"prompt": "1+1"}, {"prompt": prompt}])
        with pytest.raises(DatasetError, match=f"{path}:2: .*{expected}"):
            load_prompts(str(path), chars, data())


# ---------------------------------------------------------------- bad rows, every format


@pytest.mark.parametrize("name", ["bad.parquet", "bad.csv", "saved", "bad.json"])
def test_bad_rows_are_named_by_file_and_row(tmp_path: Path, chars, name: str) -> None:
    is_csv = name.endswith(".csv")

    def where(row: int) -> str:
        return f"{tmp_path / name} row {row}" + (f" (line {row + 1})" if is_csv else "")

    def rejected(rows: list[dict], **kwargs) -> str:
        path = write(tmp_path / name, rows)
        with pytest.raises(DatasetError) as info:
            load_prompts(str(path), chars, data(**kwargs), ["answer"])
        return str(info.value)

    ok = {"prompt": "1+2", "answer": "3"}
    assert rejected([ok, ok, {"prompt": "", "answer": "3"}]).startswith(
        f"{where(3)}: the prompt ('prompt') is empty"
    )
    assert rejected([ok, {"prompt": "1+2" * 10, "answer": "1"}], max_prompt_length=8).startswith(
        f"{where(2)}: the prompt is 32 tokens, longer than data.max_prompt_length=8"
    )
    assert rejected([ok, {"prompt": "1+x", "answer": "3"}]).startswith(
        f"{where(2)}: field 'prompt' has characters the tokenizer does not know ('x')"
    )
    assert rejected([{"prompt": "1+2"}]).startswith(f"{where(1)}: row is missing required key(s) ['answer']")
    if not is_csv:  # CSV cells are text: a number or a null is a CSV-only impossibility
        assert rejected([{"prompt": 12, "answer": "3"}]).startswith(  # a column holds one type
            f"{where(1)}: the prompt ('prompt') is a int; it must be text or a list of"
        )
        assert rejected([ok, {"prompt": "1+2", "answer": None}]).startswith(f"{where(2)}: 'answer' is null")


def test_a_csv_row_with_too_many_cells_and_a_file_not_in_utf8(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    path.write_text("prompt,answer\n1+2,3\n1+2,3,4\n")
    with pytest.raises(DatasetError, match=rf"{path} row 2 \(line 3\): has 3 cells but the header names 2"):
        read_rows(path)
    path.write_bytes(b"prompt,answer\n1+2,3\ncaf\xe9,3\n")
    with pytest.raises(DatasetError, match=rf"{path}:3: not valid UTF-8 \(byte 0xe9 at column 4\)"):
        read_rows(path)


# ---------------------------------------------------------------- chat templates and history

CORPUS = ["q1 q2 next <think> r </think> y 1+2=3 L D R U"] * 20
# Drops the reasoning of every assistant turn but the last, as Qwen3's template does.
REWRITING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1].lstrip('\n') }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer(CORPUS, vocab_size=300)


@pytest.fixture(scope="module")
def rewriting():
    tokenizer = build_bpe_tokenizer(CORPUS, vocab_size=300)
    tokenizer.chat_template = REWRITING_TEMPLATE
    return tokenizer


def test_a_template_that_rewrites_history_is_found(bpe, rewriting, chars) -> None:
    assert history_rewrite(bpe) is None and history_rewrite(chars, system_prompt="sys") is None
    problem = history_rewrite(rewriting, name="models/thinker")
    assert problem.startswith("the chat template of models/thinker rewrites earlier turns")
    assert "'sistant\\n<think>\\nr\\n</think>\\n\\ny<|im_end|>\\n' while it is the last turn" in problem
    assert "but as ...'sistant\\ny<|im_end|>\\n' once a user turn follows" in problem


def test_the_rewriting_template_is_refused_for_agentic_runs_and_accepted_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, repo_root: Path, bpe, rewriting
) -> None:
    monkeypatch.chdir(repo_root)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(preflight_module, "load_run_tokenizer", lambda model: rewriting)
    agentic = load_config("examples/agentic_frozenlake.yaml", [f"output_dir={tmp_path / 'a'}"])
    with pytest.raises(
        ConfigError, match="model: the chat template of the tiny model rewrites earlier turns"
    ):
        preflight(agentic)
    # An RLVR run renders each prompt once: conversations rendered with the same template are fine.
    chat = write(tmp_path / "chat.parquet", [{"prompt": CONVERSATION, "answer": "3"}] * 4)
    rlvr = load_config(
        QUICKSTART,
        [
            f"output_dir={tmp_path / 'r'}",
            f"data.train_path={chat}",
            "data.eval_path=null",
            "eval.every_steps=0",
            "sft_warm_start=null",
            "rollout.rollout_batch_size=2",
            "data.max_prompt_length=48",
            "model.tiny.max_position_embeddings=64",
        ],
    )
    inputs = preflight(rlvr)
    assert inputs.train.texts[0] == rewriting.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=False
    )
    monkeypatch.setattr(preflight_module, "load_run_tokenizer", lambda model: bpe)
    assert preflight(agentic).train is None  # a template that keeps history passes


# ---------------------------------------------------------------- end to end


def test_the_quickstart_runs_from_parquet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, repo_root: Path
) -> None:
    monkeypatch.chdir(repo_root)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    paths = {}
    for split in ("train", "eval"):
        rows = [row for _, row in read_jsonl(f"examples/data/addition/{split}.jsonl")]
        paths[split] = write(tmp_path / f"{split}.parquet", rows)
    overrides = [
        f"output_dir={tmp_path / 'run'}",
        f"data.train_path={paths['train']}",
        f"data.eval_path={paths['eval']}",
    ]
    result = CliRunner().invoke(app, ["config", QUICKSTART, *overrides])
    assert result.exit_code == 0 and f"train_path: {paths['train']}" in result.stdout, result.output
    inputs = preflight(load_config(QUICKSTART, overrides))
    assert len(inputs.train) == 4000 and len(inputs.eval) == 200
    assert inputs.train.rows[0] == read_jsonl("examples/data/addition/train.jsonl")[0][1]
    assert not (tmp_path / "run").exists()
