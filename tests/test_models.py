"""Character tokenizer, tiny model build/save/load round trip, and model path errors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import roll
from roll.config.common import TinyModelConfig
from roll.models.loading import ModelPathError, check_model_path, load_causal_lm, load_tokenizer
from roll.models.tiny import TINY_CONFIG_FILE, build_tiny_model, save_tiny_model
from roll.models.tokenizer import SPECIAL_TOKENS, build_char_tokenizer

ALPHABET = "0123456789+-*=() "
TINY = TinyModelConfig(
    alphabet=ALPHABET,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=32,
    seed=0,
)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny model saved to disk, shared by the read-only tests."""
    return save_tiny_model(TINY, tmp_path_factory.mktemp("models") / "tiny")


# --- tokenizer ---------------------------------------------------------------------------------------


def test_round_trip_keeps_spaces_and_digits() -> None:
    tokenizer = build_char_tokenizer(ALPHABET)
    text = "12 + 3 = 15"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    assert len(tokenizer(" ")["input_ids"]) == 1 and tokenizer(" ")["input_ids"] != [tokenizer.unk_token_id]


def test_no_special_tokens_added_automatically() -> None:
    tokenizer = build_char_tokenizer(ALPHABET)
    ids = tokenizer("12+3")["input_ids"]
    assert ids == tokenizer.convert_tokens_to_ids(list("12+3"))


def test_special_tokens_are_single_ids() -> None:
    tokenizer = build_char_tokenizer(ALPHABET)
    for token in SPECIAL_TOKENS.values():
        ids = tokenizer(token)["input_ids"]
        assert ids == [tokenizer.convert_tokens_to_ids(token)], token
    specials = [tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS.values()]
    assert len(set(specials)) == len(specials)
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.eos_token == "<|eos|>"
    assert tokenizer.unk_token == "<|unk|>"


def test_characters_outside_the_alphabet_are_dropped_and_named_by_the_data_check() -> None:
    """As a Qwen2 tokenizer drops bytes its vocabulary lacks (the data check refuses such rows)."""
    from roll.data.prompts import unknown_pieces

    tokenizer = build_char_tokenizer(ALPHABET)
    assert tokenizer("1x")["input_ids"] == [tokenizer.convert_tokens_to_ids("1")]
    assert unknown_pieces(tokenizer, ["1x2", "12"]) == [["x"], []]


def test_skip_special_tokens_on_decode() -> None:
    tokenizer = build_char_tokenizer(ALPHABET)
    ids = tokenizer("<|user|>1 + 2<|assistant|>3<|eos|><|pad|>")["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "1 + 23"
    assert tokenizer.decode(ids) == "<|user|>1 + 2<|assistant|>3<|eos|><|pad|>"


def test_chat_template_generation_prompt() -> None:
    tokenizer = build_char_tokenizer(ALPHABET)
    messages = [{"role": "user", "content": "12+3"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>12+3<|assistant|>"
    ids = tokenizer(text)["input_ids"]
    expected = tokenizer.convert_tokens_to_ids(["<|user|>", "1", "2", "+", "3", "<|assistant|>"])
    assert ids == expected


def test_chat_template_full_conversation() -> None:
    tokenizer = build_char_tokenizer(ALPHABET)
    messages = [
        {"role": "system", "content": "add"},
        {"role": "user", "content": "1+2"},
        {"role": "assistant", "content": "3"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|system|>add<|user|>1+2<|assistant|>3<|eos|>"


def test_left_padding() -> None:
    tokenizer = build_char_tokenizer(ALPHABET)
    batch = tokenizer(["1", "123"], padding=True)
    assert batch["input_ids"][0][:2] == [tokenizer.pad_token_id] * 2
    assert batch["attention_mask"][0] == [0, 0, 1]


# --- tiny model --------------------------------------------------------------------------------------


def test_build_is_seeded_and_leaves_global_rng_alone() -> None:
    tokenizer = build_char_tokenizer(ALPHABET)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    first = build_tiny_model(TINY, tokenizer)
    assert torch.equal(torch.random.get_rng_state(), before)
    second = build_tiny_model(TINY, tokenizer)
    other = build_tiny_model(dataclasses.replace(TINY, seed=1), tokenizer)
    weight = "model.embed_tokens.weight"
    assert torch.equal(first.state_dict()[weight], second.state_dict()[weight])
    assert not torch.equal(first.state_dict()[weight], other.state_dict()[weight])
    assert first.dtype == torch.float32
    assert first.config.vocab_size == len(tokenizer)
    assert first.lm_head.weight is first.model.embed_tokens.weight


def test_saved_model_loads_with_identical_logits(saved_model: Path) -> None:
    tokenizer = load_tokenizer(str(saved_model))
    assert tokenizer.padding_side == "left"
    loaded = load_causal_lm(str(saved_model)).eval()
    in_memory = build_tiny_model(TINY, build_char_tokenizer(ALPHABET)).eval()
    batch = tokenizer(
        ["<|user|>12+3<|assistant|>", "<|user|>7<|assistant|>"], padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        expected = in_memory(**batch).logits
        actual = loaded(**batch).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_saved_model_generates(saved_model: Path) -> None:
    tokenizer = load_tokenizer(str(saved_model))
    model = load_causal_lm(str(saved_model)).eval()
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    batch = tokenizer(["<|user|>1+1<|assistant|>"], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=4, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    prompt_len = batch["input_ids"].shape[1]
    assert 1 <= out.shape[1] - prompt_len <= 4
    assert torch.equal(out[:, :prompt_len], batch["input_ids"])


def test_save_is_idempotent_and_rebuilds_on_new_config(tmp_path: Path) -> None:
    path = tmp_path / "tiny"
    assert save_tiny_model(TINY, path) == path
    weights = path / "model.safetensors"
    first_mtime = weights.stat().st_mtime_ns
    save_tiny_model(TINY, str(path))
    assert weights.stat().st_mtime_ns == first_mtime

    wider = dataclasses.replace(TINY, hidden_size=48)
    save_tiny_model(wider, path)
    assert load_causal_lm(str(path)).config.hidden_size == 48
    assert '"hidden_size": 48' in (path / TINY_CONFIG_FILE).read_text()
    # Only the final directory is left behind: no staging or moved-aside builds.
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]


def test_save_refuses_to_overwrite_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        save_tiny_model(TINY, tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


# --- path errors -------------------------------------------------------------------------------------


def test_missing_directory_raises_model_path_error(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_model"
    with pytest.raises(ModelPathError, match="does not exist") as info:
        load_causal_lm(str(missing))
    assert str(missing) in str(info.value)
    assert "model.path" in str(info.value) and "model.tiny" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)


def test_directory_without_config_raises(tmp_path: Path) -> None:
    with pytest.raises(ModelPathError, match="config.json") as info:
        check_model_path(str(tmp_path))
    assert str(tmp_path) in str(info.value)
    with pytest.raises(ModelPathError, match="config.json"):
        load_tokenizer(str(tmp_path))


def test_directory_without_tokenizer_raises(saved_model: Path, tmp_path: Path) -> None:
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((saved_model / name).read_bytes())
    with pytest.raises(ModelPathError, match="tokenizer") as info:
        load_tokenizer(str(tmp_path))
    assert str(tmp_path) in str(info.value)
    check_model_path(tmp_path, tokenizer=False)  # weights alone are enough for the model


def test_saved_model_passes_path_check(saved_model: Path) -> None:
    check_model_path(str(saved_model))


def test_loading_module_does_not_import_torch() -> None:
    code = "import sys, roll.models.loading; print('torch' in sys.modules, 'transformers' in sys.modules)"
    # Run from the repository root so the fresh interpreter imports this checkout of `roll`.
    repo_root = Path(roll.__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo_root
    ).stdout
    assert out.split() == ["False", "False"]
