"""Prefix reuse across the turns of an episode: ``HFEngine`` keeps a request's KV under its
``cache_key`` and the next turn prefills only its new tokens (``roll.strategies.infer.prefix_store``).

Every test compares against the same requests without reuse (``prefix_cache_tokens=0``) or against a
fresh engine, and reads the engine's counters; all waits are on results, never on time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch

from roll.config.common import TinyModelConfig
from roll.models.loading import load_causal_lm, load_tokenizer
from roll.models.tiny import save_tiny_model
from roll.strategies.infer.hf import HFEngine
from roll.strategies.infer.prefix_store import PrefixStore, StoredPrefix, reusable_length
from roll.strategies.requests import GenerateRequest, GenerateResult, SamplingParams

WAIT_S = 60.0  # only reached when something is broken: the test then fails instead of hanging
FIRST_CHAR_ID = 6  # the tiny tokenizer's ids 6..16 are the characters "0".."9", "+"


def _tiny(seed: int) -> TinyModelConfig:
    # Two layers, so the second layer's keys come from hidden states the mask has already acted on;
    # room for long episodes.
    return TinyModelConfig(
        alphabet="0123456789+",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=256,
        seed=seed,
    )


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(_tiny(seed=0), tmp_path_factory.mktemp("models") / "two_layers"))


@pytest.fixture(scope="module")
def new_weights_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same architecture with other weights: what a weight update brings."""
    return str(save_tiny_model(_tiny(seed=1), tmp_path_factory.mktemp("models") / "two_layers_new"))


@pytest.fixture(scope="module")
def tok(model_path: str):
    return load_tokenizer(model_path)


@pytest.fixture
def make_engine(model_path: str, tok) -> Iterator:
    """Builds engines on fresh copies of the model; shuts every one down after the test."""
    engines: list[HFEngine] = []

    def make(path: str | None = None, **kwargs: object) -> HFEngine:
        engine = HFEngine(load_causal_lm(path or model_path), tok, "cpu", **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


def chars(length: int, salt: int) -> list[int]:
    """``length`` character ids, a fixed function of ``salt``."""
    return [FIRST_CHAR_ID + (7 * salt + 3 * i + i * i) % 11 for i in range(length)]


@dataclasses.dataclass
class Episode:
    key: str
    ids: list[int]  # the episode so far: the next turn's prompt
    max_new_tokens: int
    first_round: int = 0
    turns: int = 0


def play(
    engine: HFEngine, episodes: list[Episode], rounds: int, greedy: bool = True
) -> tuple[dict[tuple[str, int], GenerateResult], list[int], list[list[int]]]:
    """Multi-turn episodes as the episode scheduler runs them: in each round every started episode
    takes a turn (all submitted together, so their prefills share a batch), then its sampled tokens
    and an observation are appended. Returns the results by (key, turn), the prefill tokens computed
    in each round, and each round's prompts."""
    results: dict[tuple[str, int], GenerateResult] = {}
    per_round: list[int] = []
    prompts: list[list[int]] = []
    for round_ in range(rounds):
        playing = [e for e in episodes if e.first_round <= round_]
        params = [SamplingParams(max_new_tokens=e.max_new_tokens, greedy=greedy) for e in playing]
        requests = [
            GenerateRequest(f"{e.key}t{e.turns}", e.ids, p, cache_key=e.key) for e, p in zip(playing, params)
        ]
        before = engine.prefix_stats()["prefill_tokens"]
        engine.submit_many(requests)
        prompts.append([len(e.ids) for e in playing])
        for episode, request in zip(playing, requests):
            result = engine.await_result(request.request_id, WAIT_S)
            results[(episode.key, episode.turns)] = result
            observation = chars(2 + (episode.turns + len(episode.key)) % 3, salt=episode.turns)
            episode.ids = episode.ids + result.token_ids + observation
            episode.turns += 1
        per_round.append(engine.prefix_stats()["prefill_tokens"] - before)
    return results, per_round, prompts


def mixed_episodes() -> list[Episode]:
    """Episodes of different lengths, some starting later: their first (fresh) prefill shares a batch
    with others' reused ones."""
    return [
        Episode("a", chars(3, 1), 3),
        Episode("bb", chars(9, 2), 5),
        Episode("ccc", chars(5, 3), 4, first_round=1),
        Episode("d", chars(14, 4), 6, first_round=2),
    ]


def assert_same(reused: dict[tuple[str, int], GenerateResult], plain: dict[tuple[str, int], GenerateResult]):
    assert reused.keys() == plain.keys()
    for key, result in plain.items():
        assert reused[key].token_ids == result.token_ids, key
        assert reused[key].finish_reason == result.finish_reason, key
        torch.testing.assert_close(
            torch.tensor(reused[key].logprobs), torch.tensor(result.logprobs), atol=1e-5, rtol=0
        )


def await_all(engine: HFEngine, requests: list[GenerateRequest]) -> list[GenerateResult]:
    engine.submit_many(requests)
    return [engine.await_result(request.request_id, WAIT_S) for request in requests]


def assert_counts(stats: dict[str, int], **expected: int) -> None:
    assert {name: stats[name] for name in expected} == expected


GREEDY1 = SamplingParams(max_new_tokens=1, greedy=True)  # stores exactly the prompt


# ----- the store alone ------------------------------------------------------------------------------


def test_reusable_length_is_the_common_prefix_leaving_one_token_to_compute() -> None:
    assert reusable_length((1, 2, 3), (1, 2, 3, 4, 5)) == 3
    assert reusable_length((1, 2, 3), (1, 2, 3)) == 2  # the last prompt token's logits are needed
    assert reusable_length((1, 2, 3, 4), (1, 2)) == 1
    assert reusable_length((1, 9, 3), (1, 2, 3, 4)) == 1
    assert reusable_length((9,), (1, 2)) == 0
    assert reusable_length((), (1, 2)) == 0


def test_store_evicts_the_least_recently_stored_and_never_exceeds_its_budget() -> None:
    store = PrefixStore(max_tokens=10)

    def prefix(n: int) -> StoredPrefix:
        return StoredPrefix(tuple(range(n)), [(torch.zeros(1, n, 2), torch.zeros(1, n, 2))])

    store.put("a", prefix(4))
    store.put("b", prefix(4))
    store.put("a", prefix(5))  # a replaced: now the most recent
    assert store.stats()["tokens_held"] == 9
    store.put("c", prefix(3))  # evicts b, the least recently stored
    assert_counts(store.stats(), entries=2, tokens_held=8, evicted=1)
    assert store.take("b", range(9)) == (0, None)
    store.put("big", prefix(11))  # larger than the store: not kept, nothing else evicted
    assert store.stats()["entries"] == 2 and store.stats()["evicted"] == 2
    length, layers = store.take("a", list(range(3)) + [7, 8])
    assert length == 3 and layers[0][0].shape == (1, 3, 2)
    assert store.stats()["tokens_held"] == 3 and store.release(["c", "a"]) == 1
    assert PrefixStore(0).fits(1) is False
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        PrefixStore(-1)


# ----- the engine -------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_running_requests", [None, 2])
def test_reuse_gives_the_tokens_and_logprobs_of_full_prefills(make_engine, max_running_requests) -> None:
    """Several episodes of different lengths, fresh and continued prompts prefilled together (and with
    two slots, rows joining a running batch): the same greedy tokens and logprobs as without reuse."""
    reuse = make_engine(max_running_requests=max_running_requests)
    plain = make_engine(max_running_requests=max_running_requests, prefix_cache_tokens=0)
    with_reuse, reused_per_round, _ = play(reuse, mixed_episodes(), rounds=6)
    without, plain_per_round, _ = play(plain, mixed_episodes(), rounds=6)
    assert_same(with_reuse, without)
    stats = reuse.prefix_stats()
    turns = len(with_reuse)
    assert stats["misses"] == 4 and stats["hits"] == turns - 4  # every turn but the first reuses
    assert stats["prefill_tokens"] + stats["reused_tokens"] == sum(plain_per_round)
    assert sum(reused_per_round) < sum(plain_per_round) / 2
    assert plain.prefix_stats()["hits"] == 0 and plain.prefix_stats()["entries"] == 0


def test_prefill_tokens_grow_with_a_turns_new_tokens_not_with_the_episode(make_engine) -> None:
    """An 8-turn episode: with reuse, turn k > 0 prefills exactly the last sampled token (never fed to
    the model) and the observation; without, the whole episode so far."""
    reuse, plain = make_engine(), make_engine(prefix_cache_tokens=0)
    episodes = [Episode("solo", chars(6, 5), 5)]
    results, with_reuse, _ = play(reuse, episodes, rounds=8)
    _, without, prompt_lengths = play(plain, [Episode("solo", chars(6, 5), 5)], rounds=8)
    print(f"prefill tokens per turn, with reuse {with_reuse}, without {without}")
    assert without == [lengths[0] for lengths in prompt_lengths]
    new_tokens = [prompt_lengths[0][0]] + [
        prompt_lengths[k][0] - prompt_lengths[k - 1][0] - len(results[("solo", k - 1)].token_ids) + 1
        for k in range(1, 8)
    ]
    assert with_reuse == new_tokens
    assert max(with_reuse[1:]) <= 5  # one sampled token and an observation of 2-4 tokens
    assert without[-1] > 4 * without[0]
    stats = reuse.prefix_stats()
    assert stats["reused_tokens"] == sum(without) - sum(with_reuse)
    # What remains held is the last turn's prompt plus all its sampled tokens but the last.
    assert stats["entries"] == 1
    assert stats["tokens_held"] == prompt_lengths[-1][0] + len(results[("solo", 7)].token_ids) - 1


def test_a_prompt_that_does_not_extend_the_kept_ids_reuses_only_the_common_prefix(make_engine) -> None:
    """Diverging at the first token: a full prefill; in the middle: the tokens before it are reused;
    the kept ids exactly: all but the last. Each is right (against an engine without reuse)."""
    reuse, plain = make_engine(), make_engine(prefix_cache_tokens=0)
    prompt = chars(10, 6)
    await_all(reuse, [GenerateRequest(k, prompt, GREEDY1, cache_key=k) for k in ("x", "y", "z")])
    assert reuse.prefix_stats()["tokens_held"] == 30  # max_new_tokens=1: only the prompt was fed
    variants = {
        "x": [prompt[0] + 1] + prompt[1:] + chars(3, 7),  # nothing in common
        "y": prompt[:4] + [prompt[4] + 1] + prompt[5:] + chars(3, 8),  # the first 4 tokens in common
        "z": list(prompt),  # the same ids: the last one is computed again for its logits
    }
    params = SamplingParams(max_new_tokens=6, greedy=True)
    expected_reuse = {"x": 0, "y": 4, "z": 9}
    for key, ids in variants.items():
        before = reuse.prefix_stats()
        (got,) = await_all(reuse, [GenerateRequest(f"{key}2", ids, params, cache_key=key)])
        (want,) = await_all(plain, [GenerateRequest(f"{key}2", ids, params, cache_key=key)])
        after = reuse.prefix_stats()
        assert after["reused_tokens"] - before["reused_tokens"] == expected_reuse[key], key
        assert after["prefill_tokens"] - before["prefill_tokens"] == len(ids) - expected_reuse[key], key
        assert_same({(key, 1): got}, {(key, 1): want})
    assert reuse.prefix_stats()["misses"] == 3 + 1  # the three first requests and "x"


def _state_dict(path: str) -> dict[str, torch.Tensor]:
    return load_causal_lm(path).state_dict()


@pytest.mark.parametrize("how", ["load_weights", "weight_update"])
def test_new_weights_empty_the_store_and_the_next_turn_uses_them(make_engine, new_weights_path, how) -> None:
    reuse = make_engine()
    first = GenerateRequest("t0", chars(8, 9), SamplingParams(max_new_tokens=4, greedy=True), cache_key="e")
    (result,) = await_all(reuse, [first])
    assert reuse.prefix_stats()["entries"] == 1
    if how == "load_weights":
        reuse.load_weights(_state_dict(new_weights_path), version=1)
    else:
        with reuse.weight_update(1):
            for name, tensor in _state_dict(new_weights_path).items():  # bucket by bucket
                reuse.load_weights({name: tensor})
    assert reuse.prefix_stats()["entries"] == 0 and reuse.prefix_stats()["tokens_held"] == 0

    turn = list(first.prompt_ids) + result.token_ids + chars(3, 10)
    params = SamplingParams(max_new_tokens=6, greedy=True)
    before = reuse.prefix_stats()
    (got,) = await_all(reuse, [GenerateRequest("t1", turn, params, cache_key="e")])
    after = reuse.prefix_stats()
    assert after["reused_tokens"] == before["reused_tokens"] and after["misses"] == before["misses"] + 1
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(turn)
    assert set(got.weight_versions) == {1}
    (want,) = await_all(make_engine(new_weights_path), [GenerateRequest("t1", turn, params)])
    assert_same({("e", 1): got}, {("e", 1): want})


class OnForward:
    """Runs ``action`` at the start of the model's ``call``-th forward (on the serving thread, between
    two decode steps as far as the weights are concerned: the model lock is re-entrant)."""

    def __init__(self, engine: HFEngine, call: int, action) -> None:
        self.calls, self.call, self.action = 0, call, action
        self.handle = engine._model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.calls += 1
        if self.calls == self.call:
            self.action()


def test_a_turn_whose_weights_changed_while_it_ran_keeps_nothing(make_engine, new_weights_path) -> None:
    """Its KV mixes two weight versions: storing it would give the next turn KV of stale weights."""
    reuse = make_engine()
    new = _state_dict(new_weights_path)
    hook = OnForward(reuse, call=2, action=lambda: reuse.load_weights(new, version=1))  # after prefill
    (result,) = await_all(
        reuse,
        [GenerateRequest("t0", chars(8, 11), SamplingParams(max_new_tokens=4, greedy=True), cache_key="e")],
    )
    hook.handle.remove()
    assert len(result.token_ids) > 1 and result.weight_versions[0] == -1 and result.weight_versions[-1] == 1
    assert reuse.prefix_stats()["entries"] == 0


def test_release_memory_and_shutdown_empty_the_store(make_engine) -> None:
    reuse = make_engine()
    await_all(reuse, [GenerateRequest("t0", chars(8, 12), GREEDY1, cache_key="e")])
    assert reuse.prefix_stats()["entries"] == 1
    reuse.release_memory()
    assert reuse.prefix_stats()["entries"] == 0
    reuse.reacquire_memory()
    await_all(reuse, [GenerateRequest("t1", chars(8, 12), GREEDY1, cache_key="e")])
    assert reuse.prefix_stats()["entries"] == 1
    reuse.shutdown()
    assert reuse.prefix_stats()["entries"] == 0


def test_the_store_stays_within_its_budget_and_evicts_the_least_recently_used(make_engine) -> None:
    """Budget 40 tokens, entries of 12 (a 12-token prompt, one sampled token): three fit."""
    reuse = make_engine(prefix_cache_tokens=40)
    prompts = {key: chars(12, salt) for salt, key in enumerate("ABCDE")}

    def turn(key: str, ids: list[int]) -> GenerateResult:
        (result,) = await_all(reuse, [GenerateRequest(f"{key}{len(ids)}", ids, GREEDY1, cache_key=key)])
        assert reuse.prefix_stats()["tokens_held"] <= 40
        return result

    for key in "ABC":
        turn(key, prompts[key])
    assert_counts(reuse.prefix_stats(), entries=3, tokens_held=36, evicted=0)
    turn("D", prompts["D"])  # A, stored first, makes room
    assert reuse.prefix_stats()["evicted"] == 1
    # B's next turn takes B's entry and stores a longer one (15 tokens) as the most recent.
    hits = reuse.prefix_stats()["hits"]
    b = turn("B", prompts["B"] + [FIRST_CHAR_ID] + chars(2, 20))
    assert reuse.prefix_stats()["hits"] == hits + 1 and reuse.prefix_stats()["tokens_held"] == 12 + 12 + 15
    turn("E", prompts["E"])  # C, stored before D and B's new entry, makes room
    assert_counts(reuse.prefix_stats(), entries=3, tokens_held=12 + 15 + 12, evicted=2)
    hits = reuse.prefix_stats()["hits"]
    turn("B", prompts["B"] + [FIRST_CHAR_ID] + chars(2, 20) + b.token_ids + chars(2, 22))
    assert reuse.prefix_stats()["hits"] == hits + 1  # B survived: it was used after C and D were stored
    misses = reuse.prefix_stats()["misses"]
    for key in "AC":  # evicted: full prefills
        turn(key, prompts[key] + [FIRST_CHAR_ID] + chars(2, 21))
    assert reuse.prefix_stats()["misses"] == misses + 2
    big = make_engine(prefix_cache_tokens=11)
    await_all(big, [GenerateRequest("big", chars(12, 0), GREEDY1, cache_key="big")])
    assert big.prefix_stats()["entries"] == 0  # larger than the whole store: not kept


def test_release_prefixes_frees_entries_and_turns_still_running(make_engine) -> None:
    reuse = make_engine()
    await_all(reuse, [GenerateRequest(k, chars(12, i), GREEDY1, cache_key=k) for i, k in enumerate("AB")])
    assert reuse.release_prefixes(["A", "never-stored"]) == 1
    assert reuse.prefix_stats()["entries"] == 1 and reuse.prefix_stats()["tokens_held"] == 12
    before = reuse.prefix_stats()
    await_all(reuse, [GenerateRequest("A2", chars(12, 0) + chars(3, 5), GREEDY1, cache_key="A")])
    assert reuse.prefix_stats()["misses"] == before["misses"] + 1  # A's turn prefilled from scratch

    # An episode released while its turn runs (ended by an abort, say): the turn keeps nothing.
    hook = OnForward(reuse, call=1, action=lambda: reuse.release_prefixes(["C"]))
    await_all(reuse, [GenerateRequest("C1", chars(9, 3), SamplingParams(max_new_tokens=3), cache_key="C")])
    hook.handle.remove()
    assert reuse.release_prefixes(["C"]) == 0
    assert reuse.release_prefixes(["A", "B"]) == 2
    assert reuse.prefix_stats()["entries"] == 0 and reuse.prefix_stats()["tokens_held"] == 0


def test_sampled_continuation_is_the_same_with_and_without_reuse(make_engine) -> None:
    """Temperature 1 from one torch seed: every draw comes from the global generator in the same order
    (the batches are the same either way), and the logits differ by rounding only."""
    reuse, plain = make_engine(), make_engine(prefix_cache_tokens=0)
    torch.manual_seed(1234)
    with_reuse, _, _ = play(reuse, mixed_episodes(), rounds=5, greedy=False)
    torch.manual_seed(1234)
    without, _, _ = play(plain, mixed_episodes(), rounds=5, greedy=False)
    assert_same(with_reuse, without)
    assert reuse.prefix_stats()["hits"] == len(with_reuse) - 4
    torch.manual_seed(4321)  # and the draws do matter: another seed samples other tokens
    other, _, _ = play(make_engine(prefix_cache_tokens=0), mixed_episodes(), rounds=5, greedy=False)
    assert any(other[key].token_ids != without[key].token_ids for key in without)


# ----- through the rollout worker and the backend ------------------------------------------------------


@pytest.mark.slow  # a rollout worker of its own on Ray
@pytest.mark.usefixtures("ray_session")
def test_rollout_worker_reuses_prefixes_and_the_backend_releases_them(model_path: str) -> None:
    """Prefix reuse through a real rollout worker and the Ray backend, and the release of an episode's
    prefixes: the engine-level tests above cannot show the worker and backend wiring."""
    from roll.distributed.cluster import Cluster
    from roll.rollout.backend import RayBackend, RewardDispatch
    from roll.rollout.router import RolloutRouter
    from roll.workers.base import ModelSpec
    from roll.workers.rollout import RolloutSpec, RolloutWorker

    spec = RolloutSpec(ModelSpec(path=model_path), prefix_cache_tokens=64)
    rollout = Cluster("rollout", RolloutWorker, 1, spec)
    try:
        rollout.setup()
        router = RolloutRouter(rollout, collect_wait_s=0.5)
        backend = RayBackend(router, RewardDispatch(None, pad_id=0))
        params = SamplingParams(max_new_tokens=3, greedy=True)

        def turn(request: GenerateRequest) -> GenerateResult:
            backend.submit(0, [request])
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                for result in backend.poll(1.0).generated:
                    return result
            raise AssertionError(f"{request.request_id} did not finish")

        first = turn(GenerateRequest("e-t0", chars(8, 1), params, cache_key="e"))
        prompt = chars(8, 1) + first.token_ids + chars(3, 2)
        turn(GenerateRequest("e-t1", prompt, params, cache_key="e"))
        (stats,) = router.prefix_stats()
        assert stats["hits"] == 1 and stats["reused_tokens"] == 8 + len(first.token_ids) - 1
        assert stats["entries"] == 1
        backend.release_prefixes(0, ["e"])
        backend.drain(WAIT_S)  # the release call has landed
        assert router.prefix_stats()[0]["entries"] == 0
        assert rollout.call_rank(0, "release_prefixes", ["e"]) == 0
    finally:
        rollout.kill()


def test_the_config_default_is_the_engines() -> None:
    from roll.config.rlvr import RolloutConfig
    from roll.strategies.infer.prefix_store import DEFAULT_PREFIX_CACHE_TOKENS
    from roll.workers.rollout import RolloutSpec

    assert RolloutConfig().prefix_cache_tokens == DEFAULT_PREFIX_CACHE_TOKENS
    assert RolloutSpec.__dataclass_fields__["prefix_cache_tokens"].default == DEFAULT_PREFIX_CACHE_TOKENS
