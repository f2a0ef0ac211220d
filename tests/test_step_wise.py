"""Step-wise episodes (one training sample per turn): each turn is generated from a window of the episode
(the current observation, plus ``history_turns`` earlier turns as recorded), the sample trains on exactly
the ids sampled from exactly that context (a merge-prone BPE tokenizer), anchors group turns by state,
the batch is padded evenly with rows nothing counts, and the trainer's LR schedule ends at its last
optimizer step whatever the episodes' lengths."""

from __future__ import annotations

import pytest
import torch
from fake_rollout import FakeBackend
from test_episodes import CORPUS, SYSTEM, ScriptedPolicy, budget, play

from roll.data.batch import Batch
from roll.data.chat_turns import ChatTurns
from roll.envs.frozen_lake import FrozenLake, shortest_path
from roll.envs.pool import EnvPool
from roll.envs.seeds import SeedOrder
from roll.models.tokenizer import build_bpe_tokenizer
from roll.rollout.env_clients import LocalEnvs
from roll.rollout.episode import Episode, EpisodeBudget
from roll.rollout.episode_batch import pad_evenly
from roll.rollout.episodes import EpisodeScheduler, EpisodeSpec
from roll.strategies.requests import SamplingParams


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer(CORPUS, vocab_size=320)


def test_a_markov_turn_sees_only_the_current_observation(bpe) -> None:
    env = FrozenLake(size=4)
    path = shortest_path(env.reset(5)[0])
    chat = ChatTurns(bpe, [bpe.eos_token_id], SYSTEM)
    policy = ScriptedPolicy(bpe, ["X", *path])
    episode = play(Episode(env, 5, chat, budget(), history_turns=0), policy)
    assert episode.success and len(episode.turns) == len(path) + 1
    for k, turn in enumerate(episode.turns):
        # Its context is the first prompt around the observation the turn answered, nothing more.
        assert episode.turn_context(k) == chat.first_prompt(turn.observation)
    assert episode.turns[1].observation.startswith("Invalid action.")  # what the env said after "X"
    # The record is the trajectory's: the same ids, masks and observations as a trajectory-wise episode.
    whole = play(Episode(env, 5, chat, budget()), ScriptedPolicy(bpe, ["X", *path]))
    assert whole.response_ids == episode.response_ids and whole.loss_mask == episode.loss_mask


def test_a_turn_with_history_sees_earlier_turns_token_for_token(bpe) -> None:
    env = FrozenLake(size=4)
    path = shortest_path(env.reset(7)[0])
    chat = ChatTurns(bpe, [bpe.eos_token_id], SYSTEM)
    episode = play(Episode(env, 7, chat, budget(), history_turns=1), ScriptedPolicy(bpe, path))
    assert len(path) >= 3
    assert episode.turn_context(0) == episode.turn_context(1)[: len(episode.prompt_ids)] == episode.prompt_ids
    for k in range(1, len(episode.turns)):
        before, turn = episode.turns[k - 1], episode.turns[k]
        # The first prompt around the previous turn's observation, then the ids recorded since that turn:
        # its sampled ids (never re-encoded: BPE would merge "R" + "R") and the observation after it.
        expected = chat.first_prompt(before.observation) + episode.response_ids[before.start : turn.start]
        assert episode.turn_context(k) == expected
        sampled = bpe.encode(path[k - 1], add_special_tokens=False) + [bpe.eos_token_id]
        assert episode.response_ids[before.start : before.end] == sampled


def test_the_step_wise_context_budget_is_the_window_not_the_episode(bpe) -> None:
    # A context that fits one observation and a turn, not the whole episode: step-wise plays on.
    env = FrozenLake(size=4)
    chat = ChatTurns(bpe, [bpe.eos_token_id], SYSTEM)
    room = len(chat.first_prompt(env.reset(0)[0])) + 40
    walls = ["U"] * 6
    windowed = Episode(env, 0, chat, budget(turns=6, context=room), history_turns=0)
    step_wise = play(windowed, ScriptedPolicy(bpe, walls))
    whole = play(Episode(env, 0, chat, budget(turns=6, context=room)), ScriptedPolicy(bpe, walls))
    assert step_wise.stop_reason.value == "max_turns" and len(step_wise.turns) == 6
    assert whole.stop_reason.value == "context_limit" and len(whole.turns) < 6


def fake_policy(tokenizer, seen: dict[str, list[int]], wrong_every: int = 3):
    """The shortest path's next move, but a wall-bump ("U") every ``wrong_every``-th request, recording
    each request's prompt."""
    eos = tokenizer.eos_token_id
    counter = iter(range(10**6))

    def script(request):
        seen[request.request_id] = list(request.prompt_ids)
        text = tokenizer.decode(list(request.prompt_ids), skip_special_tokens=False)
        grid = text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0].split(".")[-1].strip()
        move = (shortest_path(grid) or ["L"])[0]
        if next(counter) % wrong_every == 0:
            move = "U"
        return tokenizer.encode(move, add_special_tokens=False) + [eos], 1.0

    return script


def test_the_scheduler_makes_one_row_per_turn_from_the_contexts_it_sent(bpe) -> None:
    seen: dict[str, list[int]] = {}
    backend = FakeBackend(fake_policy(bpe, seen))
    spec = EpisodeSpec(
        groups_per_step=2,
        group_size=3,
        budget=EpisodeBudget(max_turns=8, max_tokens_per_turn=4, max_context_tokens=400),
        history_turns=0,
        divisor=4,
    )
    chat = ChatTurns(bpe, [bpe.eos_token_id], SYSTEM)
    params = SamplingParams(max_new_tokens=4, stop_token_ids=(bpe.eos_token_id,))
    sched = EpisodeScheduler(
        backend,
        LocalEnvs(EnvPool("frozen_lake", {"size": 4})),
        chat,
        spec,
        params,
        SeedOrder(FrozenLake(size=4), held_out=10),
        bpe.pad_token_id,
    )
    sched.clock = backend.clock
    batch, metrics = sched.next_batch(1)
    real = ~batch["padding"]
    turns = int(real.sum())
    assert len(batch) % 4 == 0 and len(batch) - turns < 4
    assert metrics["rollout/turn_samples"] == turns and metrics["episode/turns"] * 6 == turns
    # Every real row: the prompt is exactly the context the engine was sent for that turn, and the trained
    # ids are exactly what it sampled (one request per turn, ids "<episode>t<k>").
    for row in real.nonzero().squeeze(-1).tolist():
        episode_id, k = batch["episode_id"][row], int(batch["turn_index"][row])
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        assert prompt == seen[f"{episode_id}t{k}"]
        trained = batch["response_ids"][row][batch["loss_mask"][row].bool()].tolist()
        assert trained[-1] == bpe.eos_token_id and len(trained) == int(batch["response_mask"][row].sum())
    # Rows of one episode: consecutive turn indices from 0; its score is the episode's return on every row.
    for episode in batch["episode_index"][real].unique().tolist():
        rows = (batch["episode_index"] == episode).nonzero().squeeze(-1)
        assert batch["turn_index"][rows].tolist() == list(range(len(rows)))
        assert batch["scores"][rows].unique().numel() == 1
        assert batch["scores"][rows[0]].item() == pytest.approx(batch["turn_rewards"][rows].sum().item())
    # Anchors: rows share one exactly when they are in one group and answered the same observation.
    prompts = [tuple(p[m.bool()].tolist()) for p, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    rows = real.nonzero().squeeze(-1).tolist()
    for a in rows:
        for b in rows:
            same_state = batch["group_index"][a] == batch["group_index"][b] and prompts[a] == prompts[b]
            assert (batch["anchor_index"][a] == batch["anchor_index"][b]) == same_state
    assert len(set(batch["anchor_index"][real].tolist())) < turns  # the start states repeat in a group
    # Padding rows: copies nothing trains on and nothing counts.
    fill = batch["padding"]
    assert not batch["loss_mask"][fill].any() and (batch["episode_index"][fill] == -1).all()


def test_padding_spreads_over_every_chunk() -> None:
    batch = Batch(
        tensors={
            "row": torch.arange(5),
            "loss_mask": torch.ones(5, 2),
            "episode_index": torch.arange(5),
            "anchor_index": torch.arange(5),
        }
    )
    padded = pad_evenly(batch, 4)
    # 4 chunks of 2 (shards x mini-batches): each has a real row first; no chunk is all filler.
    assert padded["row"].tolist() == [0, 1, 2, 2, 3, 3, 4, 4]
    assert padded["padding"].tolist() == [False, False, False, True, False, True, False, True]
    assert padded["loss_mask"][:, 0].tolist() == [1, 1, 1, 0, 1, 0, 1, 0]
    assert pad_evenly(batch, 5)["padding"].sum() == 0 and len(pad_evenly(batch, 1)) == 5


def test_the_lr_schedule_ends_at_the_last_optimizer_step_whatever_the_turn_counts(tiny_model_path) -> None:
    from roll.workers.actor import ActorSpec, ActorWorker, OptimizerSpec
    from roll.workers.base import ModelSpec

    steps, mini_batches = 3, 2
    spec = ActorSpec(
        model=ModelSpec(path=tiny_model_path),
        optimizer=OptimizerSpec(lr=1e-3, total_steps=steps * mini_batches, lr_scheduler="linear"),
        mini_batches_per_epoch=mini_batches,
    )
    worker = ActorWorker("actor", 0, 1, spec)
    worker.setup()
    lrs = []
    for turns in (5, 13, 8):  # episodes of other lengths each step: other row counts
        batch = pad_evenly(_turn_rows(turns), mini_batches)
        lrs.append(worker.train_step(batch)["lr"])
    # Every step made exactly 2 optimizer steps, so the schedule ran to its end at the last one.
    assert worker.scheduler.last_epoch == steps * mini_batches
    assert worker.scheduler.get_last_lr()[0] == pytest.approx(0.0)
    # Each step's reported LR is the mean over its 2 updates: (1 - s/6) for s = 0..5.
    assert lrs == pytest.approx([1e-3 * (1 - 0.5 / 6), 1e-3 * (1 - 2.5 / 6), 1e-3 * (1 - 4.5 / 6)])


def _turn_rows(n: int) -> Batch:
    torch.manual_seed(n)
    return Batch(
        tensors={
            "prompt_ids": torch.randint(0, 10, (n, 4)),
            "prompt_mask": torch.ones(n, 4, dtype=torch.long),
            "response_ids": torch.randint(0, 10, (n, 2)),
            "response_mask": torch.ones(n, 2, dtype=torch.long),
            "loss_mask": torch.ones(n, 2, dtype=torch.long),
            "advantages": torch.randn(n, 2),
            "episode_index": torch.arange(n),
            "anchor_index": torch.arange(n),
        }
    )
