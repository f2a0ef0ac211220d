"""Episodes as tokens: observations tokenised as chat-template deltas, the policy's sampled ids kept as
sampled (checked with a merge-prone BPE tokenizer and a real engine), masks, budgets and stop reasons."""

from __future__ import annotations

import pytest
import torch

from roll.data.chat_turns import ChatTemplateError, ChatTurns
from roll.envs.base import TextEnv
from roll.envs.frozen_lake import FrozenLake, shortest_path
from roll.models.tokenizer import build_bpe_tokenizer, build_char_tokenizer
from roll.rollout.episode import Episode, EpisodeBudget, StopReason

LAKE_TEXTS = [FrozenLake(size=4).reset(seed)[0] for seed in range(40)]
CORPUS = [
    *LAKE_TEXTS,
    "Invalid action. Answer with one letter: L, D, R or U.",
    "L",
    "D",
    "R",
    "U",
    "RR",
    "DD",
] * 20
SYSTEM = "Reach G. Answer with one letter: L, D, R or U."


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer(CORPUS, vocab_size=320)


def test_the_bpe_tokenizer_merges_across_what_a_turn_boundary_would_be(bpe) -> None:
    # Why token-in-token-out matters: "R" sampled then "R" from the template would encode as one "RR".
    assert len(bpe.encode("RR", add_special_tokens=False)) == 1
    assert len(bpe.encode("R", add_special_tokens=False)) == 1


def test_an_observation_is_the_template_delta_after_the_policys_turn(bpe) -> None:
    chat = ChatTurns(bpe, [bpe.eos_token_id], SYSTEM)
    first = chat.first_prompt(LAKE_TEXTS[0])
    sampled = bpe.encode("D", add_special_tokens=False) + [bpe.eos_token_id]  # the policy's turn, as sampled
    observed = chat.observation_ids(LAKE_TEXTS[1])
    conversation = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": LAKE_TEXTS[0]},
        {"role": "assistant", "content": "D"},
        {"role": "user", "content": LAKE_TEXTS[1]},
    ]
    rendered = bpe.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert bpe.decode(first + sampled + observed) == rendered  # the same text as the template's
    assert bpe.decode(observed).startswith("\n<|im_start|>user\n")  # ChatML's newline after <|im_end|>
    # A turn ended by another stop id gets the end-of-turn token from the template, untrained.
    assert bpe.decode(chat.observation_ids("x", turn_closed=False)).startswith("<|im_end|>\n<|im_start|>user")


def test_a_template_without_a_tail_after_the_end_of_turn_token() -> None:
    chars = build_char_tokenizer("0123456789LDRUPGH_\n. ")
    chat = ChatTurns(chars, [chars.eos_token_id])
    assert chars.decode(chat.observation_ids("P_\n_G")) == "<|user|>P_\n_G<|assistant|>"


def test_templates_that_break_turn_by_turn_building_are_refused(bpe) -> None:
    rewriting = build_bpe_tokenizer(CORPUS, vocab_size=320)
    # Drops the content of every assistant turn but the last (as templates that strip earlier reasoning).
    rewriting.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = ChatTurns(rewriting, [rewriting.eos_token_id])
    with pytest.raises(ChatTemplateError, match="rewrites earlier turns"):
        chat.observation_ids("P_")
    with pytest.raises(ChatTemplateError, match="does not start with an end-of-turn token"):
        ChatTurns(bpe, [bpe.convert_tokens_to_ids("<|im_start|>")])


class ScriptedPolicy:
    """Plays an episode with fixed turns (text -> ids, plus the stop id), recording what it sampled."""

    def __init__(self, tokenizer, texts: list[str], finish: str = "stop"):
        self.tokenizer, self.texts, self.finish = tokenizer, list(texts), finish
        self.sampled: list[int] = []

    def turn(self, episode: Episode) -> None:
        _, budget = episode.next_request()
        ids = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False)
        ids = (ids + [self.tokenizer.eos_token_id] if self.finish == "stop" else ids)[:budget]
        self.sampled += ids
        finish = "length" if len(ids) == budget and self.finish != "stop" else self.finish
        episode.add_turn(ids, [-0.5] * len(ids), [3] * len(ids), finish)


def play(episode: Episode, policy: ScriptedPolicy) -> Episode:
    episode.start()
    while episode.next_request() is not None:
        policy.turn(episode)
    return episode


def budget(turns: int = 8, per_turn: int = 8, context: int = 512) -> EpisodeBudget:
    return EpisodeBudget(max_turns=turns, max_tokens_per_turn=per_turn, max_context_tokens=context)


def test_a_solved_episode_trains_on_exactly_the_sampled_ids(bpe) -> None:
    env = FrozenLake(size=4)
    path = shortest_path(env.reset(5)[0])
    policy = ScriptedPolicy(bpe, ["X", *path])  # one malformed turn first: the format penalty
    episode = play(Episode(env, 5, ChatTurns(bpe, [bpe.eos_token_id], SYSTEM), budget()), policy)
    assert episode.stop_reason is StopReason.ENV_DONE and episode.success
    trained = [i for i, m in zip(episode.response_ids, episode.loss_mask) if m]
    assert trained == policy.sampled  # the ids trained on are the ids sampled, in order
    assert len(episode.turns) == len(path) + 1 and episode.turns[0].action_is_valid is False
    assert episode.episode_return == pytest.approx(-0.1 + 1.0)
    for turn in episode.turns:  # each turn's span holds its own sampled ids, all trained
        assert all(episode.loss_mask[turn.start : turn.end])
    observation_spans = [(a.end, b.start) for a, b in zip(episode.turns, episode.turns[1:])]
    for start, end in observation_spans:
        assert end > start and not any(episode.loss_mask[start:end])
        assert set(episode.logprobs[start:end]) == {0.0} and set(episode.versions[start:end]) == {-1}
    assert episode.summary()["invalid_action_frac"] == pytest.approx(1 / (len(path) + 1))


def test_each_budget_ends_the_episode_with_its_own_reason(bpe) -> None:
    chat = ChatTurns(bpe, [bpe.eos_token_id], SYSTEM)
    env = FrozenLake(size=4)
    walls = play(Episode(env, 0, chat, budget(turns=3)), ScriptedPolicy(bpe, ["U"] * 3))
    assert walls.stop_reason is StopReason.MAX_TURNS and len(walls.turns) == 3
    rambling = play(
        Episode(env, 0, chat, budget(per_turn=4)), ScriptedPolicy(bpe, ["L, D and then R"], "length")
    )
    assert rambling.stop_reason is StopReason.TURN_TRUNCATED and len(rambling.response_ids) == 4
    prompt = len(chat.first_prompt(env.reset(0)[0]))
    tight = play(Episode(env, 0, chat, budget(context=prompt + 6)), ScriptedPolicy(bpe, ["U"] * 8))
    assert (
        tight.stop_reason is StopReason.CONTEXT_LIMIT and len(tight.turns) == 1
    )  # no room for observation 2
    assert len(tight.prompt_ids) + len(tight.response_ids) <= prompt + 6
    none_left = Episode(env, 0, chat, budget(context=prompt))
    none_left.start()
    assert none_left.stop_reason is StopReason.CONTEXT_LIMIT and none_left.next_request() is None
    aborted = Episode(env, 0, chat, budget())
    aborted.start()
    aborted.add_turn([5], [-1.0], [1], "abort")
    assert aborted.stop_reason is StopReason.ABORTED and aborted.next_request() is None


class BrokenEnv(TextEnv):
    def __init__(self, fail_at: str):
        self.fail_at = fail_at

    def reset(self, seed):
        if self.fail_at == "reset":
            raise OSError("no map")
        return "P_G", {}

    def step(self, action_text):
        raise RuntimeError("the simulator crashed")


def test_an_env_that_raises_ends_its_episode_not_the_run(bpe) -> None:
    chat = ChatTurns(bpe, [bpe.eos_token_id])
    crashed = play(Episode(BrokenEnv("step"), 0, chat, budget()), ScriptedPolicy(bpe, ["R"]))
    assert crashed.stop_reason is StopReason.ENV_ERROR and "the simulator crashed" in crashed.error
    unborn = play(Episode(BrokenEnv("reset"), 0, chat, budget()), ScriptedPolicy(bpe, []))
    assert unborn.stop_reason is StopReason.ENV_ERROR and unborn.prompt_ids == [] and "no map" in unborn.error


def test_a_real_engine_samples_the_ids_the_episode_trains_on(bpe) -> None:
    """A tiny Qwen2 on the BPE vocabulary plays FrozenLake through the engine; the episode's trained ids
    are the engine's sampled ids, and a teacher-forced forward pass over the episode gives the engine's
    logprobs at exactly the trained positions."""
    from roll.config.common import TinyModelConfig
    from roll.models.tiny import build_tiny_model
    from roll.strategies.infer.hf import HFEngine
    from roll.strategies.requests import GenerateRequest, SamplingParams

    cfg = TinyModelConfig(
        alphabet="x",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    model = build_tiny_model(cfg, bpe)
    # A random model almost never samples <|im_end|>: a bias on it makes turns end, so that episodes
    # have several turns with observations between them.
    head = torch.nn.Linear(cfg.hidden_size, len(bpe), bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[bpe.eos_token_id] = 6.0  # about half the probability
    model.lm_head = head
    torch.manual_seed(0)
    engine = HFEngine(model, bpe, "cpu")
    chat = ChatTurns(bpe, [bpe.eos_token_id], SYSTEM)
    turns = []
    try:
        for seed in range(4):
            episode = Episode(FrozenLake(size=4), seed, chat, budget(turns=4, per_turn=6, context=400))
            episode.start()
            sampled: list[int] = []
            while (request := episode.next_request()) is not None:
                context, room = request
                params = SamplingParams(max_new_tokens=room, temperature=1.0)
                engine.submit(GenerateRequest(f"e{seed}-{len(episode.turns)}", context, params))
                result = engine.await_result(f"e{seed}-{len(episode.turns)}", timeout_s=60)
                sampled += result.token_ids
                episode.add_turn(
                    result.token_ids, result.logprobs, result.weight_versions, result.finish_reason
                )
            mask = torch.tensor(episode.loss_mask, dtype=torch.bool)
            response = torch.tensor(episode.response_ids)
            assert response[mask].tolist() == sampled
            ids = torch.tensor([episode.prompt_ids + episode.response_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(episode.prompt_ids) - 1 : -1]
            forced = torch.log_softmax(logits.float(), -1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
            assert torch.allclose(forced[mask], torch.tensor(episode.logprobs)[mask], atol=1e-4)
            turns.append(len(episode.turns))
    finally:
        engine.shutdown()
    assert max(turns) >= 3  # observations sat between sampled turns
