"""Every end-of-sequence id a model declares ends a response, in the engine and in Hugging Face
``generate``: chat models list several in ``generation_config.json`` (Qwen2.5: ``<|im_end|>`` and
``<|endoftext|>``) while the tokenizer names one. Extra ``stop_token_ids`` end a response too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from roll.data.batch import Batch
from roll.data.padding import left_pad
from roll.models.loading import end_of_sequence_ids, load_causal_lm, load_tokenizer
from roll.strategies import hf_generate
from roll.strategies.infer.hf import HFEngine
from roll.strategies.requests import GenerateRequest, SamplingParams

GREEDY = SamplingParams(max_new_tokens=8, greedy=True)


def as_batch(prompts: list[list[int]], pad_id: int) -> Batch:
    ids, mask = left_pad(prompts, pad_id)
    return Batch(tensors={"prompt_ids": ids, "prompt_mask": mask})


def responses(out: Batch) -> list[tuple[list[int], str]]:
    lengths = out["response_mask"].sum(dim=1).tolist()
    return [
        (out["response_ids"][row, :n].tolist(), out["finish_reason"][row]) for row, n in enumerate(lengths)
    ]


def cut_at(tokens: list[int], stops: set[int]) -> tuple[list[int], str]:
    """What greedy decoding gives when ``stops`` end it: the plain tokens up to the first stop."""
    for index, token in enumerate(tokens):
        if token in stops:
            return tokens[: index + 1], "stop"
    return tokens, "length"


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text) for text in ("12+3", "7+", "99+11", "4")]


@pytest.fixture(scope="module")
def plain(tiny_model_path, tokenizer, prompts) -> list[tuple[list[int], str]]:
    """Greedy responses of the tiny model, which declares one EOS."""
    model = load_causal_lm(tiny_model_path)
    out = hf_generate.generate(
        model, as_batch(prompts, tokenizer.pad_token_id), GREEDY, tokenizer.eos_token_id, 0
    )
    return responses(out)


@pytest.fixture(scope="module")
def second_eos(plain, tokenizer) -> int:
    """A token the tiny model emits greedily as the first token of a response that goes on after it."""
    for tokens, _ in plain:
        if len(tokens) > 1 and tokens[0] != tokenizer.eos_token_id:
            return tokens[0]
    raise AssertionError(f"no response of two tokens or more to cut short: {plain}")


@pytest.fixture(scope="module")
def two_eos_path(tiny_model_path, second_eos, tokenizer, tmp_path_factory) -> str:
    """The tiny model saved again with a generation config that lists two EOS ids, as chat models do."""
    path = tmp_path_factory.mktemp("models") / "two_eos"
    shutil.copytree(tiny_model_path, path, dirs_exist_ok=True)
    config_file = Path(path) / "generation_config.json"
    config = json.loads(config_file.read_text())
    config["eos_token_id"] = [tokenizer.eos_token_id, second_eos]
    config_file.write_text(json.dumps(config))
    return str(path)


def test_the_end_of_sequence_ids_are_the_tokenizers_and_the_generation_configs(
    two_eos_path, tokenizer, second_eos
) -> None:
    model = load_causal_lm(two_eos_path)
    assert end_of_sequence_ids(load_tokenizer(two_eos_path), model) == (tokenizer.eos_token_id, second_eos)
    assert end_of_sequence_ids(tokenizer) == (tokenizer.eos_token_id,)


def test_hf_generate_stops_at_every_declared_eos(two_eos_path, tokenizer, prompts, plain, second_eos) -> None:
    model, loaded = load_causal_lm(two_eos_path), load_tokenizer(two_eos_path)
    batch = as_batch(prompts, tokenizer.pad_token_id)
    out = hf_generate.generate(
        model, batch, GREEDY, end_of_sequence_ids(loaded, model), tokenizer.pad_token_id
    )
    expected = [cut_at(tokens, {tokenizer.eos_token_id, second_eos}) for tokens, _ in plain]
    assert responses(out) == expected
    assert any(reason == "stop" and tokens[-1] == second_eos for tokens, reason in expected)


def test_the_engine_stops_at_every_declared_eos(two_eos_path, tokenizer, prompts, plain, second_eos) -> None:
    engine = HFEngine(load_causal_lm(two_eos_path), load_tokenizer(two_eos_path), "cpu")
    try:
        expected = [cut_at(tokens, {tokenizer.eos_token_id, second_eos}) for tokens, _ in plain]
        assert responses(engine.generate(as_batch(prompts, tokenizer.pad_token_id), GREEDY)) == expected
        engine.submit(GenerateRequest("one", prompts[0], GREEDY))
        result = engine.await_result("one", timeout_s=30)
        assert (result.token_ids, result.finish_reason) == expected[0]
    finally:
        engine.shutdown()


def test_stop_token_ids_end_a_response_besides_the_eos(
    tiny_model_path, tokenizer, prompts, plain, second_eos
):
    params = SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=(second_eos,))
    expected = [cut_at(tokens, {tokenizer.eos_token_id, second_eos}) for tokens, _ in plain]
    batch = as_batch(prompts, tokenizer.pad_token_id)
    model = load_causal_lm(tiny_model_path)
    out = hf_generate.generate(model, batch, params, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert responses(out) == expected
    engine = HFEngine(model, tokenizer, "cpu")
    try:
        assert responses(engine.generate(batch, params)) == expected
        assert responses(engine.generate(batch, GREEDY)) == plain  # other params: only the EOS stops
    finally:
        engine.shutdown()
    assert params.as_greedy().stop_token_ids == (second_eos,)
