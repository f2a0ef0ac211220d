"""The tokenizer a run saves is the one it trained with, as plain transformers loads it.

For a Qwen2 directory, ``AutoTokenizer.from_pretrained`` builds a ``Qwen2Tokenizer`` whatever the saved
files say; the tiny models' tokenizers are built as one, so the ids a user (or vLLM) gets from a saved
``tiny_model/``, ``model/`` or checkpoint are the ids the run trained on, newlines and spaces included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer, Qwen2Config

from roll.config.loader import load_config
from roll.data.prompts import unknown_pieces
from roll.envs.base import make_env
from roll.models.loading import load_tokenizer
from roll.models.tiny import save_tiny_model
from roll.models.tokenizer import build_bpe_tokenizer, build_char_tokenizer
from roll.pipelines.preflight import load_run_tokenizer

REPO = Path(__file__).resolve().parent.parent
AGENTIC_EXAMPLES = ["agentic_frozenlake.yaml", "agentic_sokoban.yaml", "agentic_tool.yaml"]
RLVR_EXAMPLES = ["quickstart.yaml", "rlvr_multi_domain.yaml"]


def saved_and_loaded(config_file: str, tmp_path: Path):
    """The example's tokenizer as the run builds it in memory, and as plain transformers loads its saved
    tiny model directory."""
    cfg = load_config(REPO / "examples" / config_file)
    directory = save_tiny_model(cfg.model.tiny, tmp_path / "tiny_model")
    return cfg, load_run_tokenizer(cfg.model), AutoTokenizer.from_pretrained(str(directory))


def assert_same_ids(in_memory, loaded, texts: list[str]) -> None:
    """Both encode every text alike and the loaded one decodes it back (all but the characters outside a
    tiny model's alphabet, which both drop: an environment's "Invalid action." message has some)."""
    for text in texts:
        ids = in_memory(text, add_special_tokens=False)["input_ids"]
        assert loaded(text, add_special_tokens=False)["input_ids"] == ids, repr(text)
        if unknown_pieces(in_memory, [text]) == [[]]:
            assert loaded.decode(ids) == text, repr(text)
        else:
            assert loaded.decode(ids) == in_memory.decode(ids), repr(text)


def env_texts(cfg, tokenizer, seeds: int = 20) -> list[str]:
    """Observations of ``seeds`` episodes (the first and, after a valid and an invalid move, later ones),
    alone and rendered through the chat template as the episodes render them."""
    env = make_env(cfg.env.name, cfg.env.options)
    texts: list[str] = []
    for seed in range(seeds):
        first, _ = env.reset(seed)
        texts.append(first)
        for action in (cfg.model.tiny.alphabet[:1], "?"):
            texts.append(env.step(action)[0])
    system = [{"role": "system", "content": cfg.env.system_prompt}] if cfg.env.system_prompt else []
    for observation in texts[:]:
        messages = [*system, {"role": "user", "content": observation}]
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return texts


@pytest.mark.parametrize("config_file", AGENTIC_EXAMPLES)
def test_a_saved_agentic_tiny_model_loads_the_tokenizer_its_run_used(
    config_file: str, tmp_path: Path
) -> None:
    cfg, in_memory, loaded = saved_and_loaded(config_file, tmp_path)
    alphabet = cfg.model.tiny.alphabet
    assert "\n" in alphabet
    # Every character of the alphabet, whitespace included, is the same one token in both.
    for char in alphabet:
        (token,) = in_memory(char, add_special_tokens=False)["input_ids"]
        assert loaded(char, add_special_tokens=False)["input_ids"] == [token], repr(char)
    assert_same_ids(in_memory, loaded, env_texts(cfg, in_memory))
    # Our loader (driver, workers, preflight) gets the same tokenizer.
    ours = load_tokenizer(tmp_path / "tiny_model")
    assert_same_ids(in_memory, ours, env_texts(cfg, in_memory, seeds=3))


@pytest.mark.parametrize("config_file", RLVR_EXAMPLES)
def test_a_saved_rlvr_tiny_model_encodes_the_datasets_prompts_as_its_run_did(
    config_file: str, tmp_path: Path
) -> None:
    cfg, in_memory, loaded = saved_and_loaded(config_file, tmp_path)
    domains = (cfg.domains or {}).values()
    paths = [
        cfg.data.train_path,
        cfg.data.eval_path,
        *(p for d in domains for p in (d.train_path, d.eval_path)),
    ]
    prompts = [
        json.loads(line)["prompt"]
        for path in paths
        if path
        for line in (REPO / path).read_text().splitlines()[:200]
    ]
    assert prompts
    rendered = [
        in_memory.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]
    assert_same_ids(in_memory, loaded, prompts + rendered)


def test_the_merge_prone_bpe_saved_beside_a_qwen2_config_loads_unchanged(tmp_path: Path) -> None:
    corpus = ["P_\n__\nRR LDRU", "Invalid action. Answer with one letter: L, D, R or U."] * 20
    bpe = build_bpe_tokenizer(corpus, vocab_size=300)
    bpe.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(bpe)).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(loaded) is type(bpe)
    assert len(bpe("__\n", add_special_tokens=False)["input_ids"]) < 3  # it does merge
    texts = [*corpus[:2], "<|im_start|>user\nP_\n__<|im_end|>\n<|im_start|>assistant\n", "x \n\n y"]
    assert_same_ids(bpe, loaded, texts)


def test_a_tiny_model_saved_with_the_old_character_tokenizer_is_rebuilt(tmp_path: Path) -> None:
    cfg = load_config(REPO / "examples" / "agentic_frozenlake.yaml")
    directory = save_tiny_model(cfg.model.tiny, tmp_path / "tiny_model")
    config_file = directory / "tokenizer_config.json"
    old = {**json.loads(config_file.read_text()), "tokenizer_class": "TokenizersBackend"}  # as saved before
    config_file.write_text(json.dumps(old))
    save_tiny_model(cfg.model.tiny, directory)
    assert json.loads(config_file.read_text())["tokenizer_class"] == "Qwen2Tokenizer"


def test_characters_of_several_bytes_are_one_token_each() -> None:
    tokenizer = build_char_tokenizer("ab é█\n")
    text = "a é█\nb"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text
