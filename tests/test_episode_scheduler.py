"""The episode scheduler on a fake backend with a virtual clock (no Ray, no model): the batch trains on the
sampled ids only, episodes never wait for each other, redundant episodes complete a group while a slow
one still runs, failing and hanging envs cost their group and are counted, an env worker that freezes
holds up only its own episodes, the stop policy applies, and the seed cursor resumes. Hangs are endless
(an event set when the test ends), so no outcome depends on timing."""

from __future__ import annotations

import threading

import pytest
from fake_rollout import FakeBackend
from test_env_pool import ROOMY_S, HangAwarePool, hang

from roll.data.chat_turns import ChatTurns
from roll.distributed.errors import WorkerUnresponsiveError
from roll.envs import ENVIRONMENTS
from roll.envs.frozen_lake import FrozenLake, shortest_path
from roll.envs.pool import EnvPool
from roll.envs.seeds import SeedOrder
from roll.models.tokenizer import build_char_tokenizer
from roll.rollout.env_clients import LocalEnvs
from roll.rollout.episode import EpisodeBudget
from roll.rollout.episodes import EpisodeScheduler, EpisodeSpec
from roll.strategies.requests import SamplingParams

TOKENIZER = build_char_tokenizer("LDRUPGH_\n.,:IAnvalidctoswerhf ")
EOS = TOKENIZER.eos_token_id
RELEASE = threading.Event()
# The liveness bound of the fake frozen env worker, in virtual seconds: far above an episode's length.
LIVENESS_S = 30.0


class FaultyLake(FrozenLake):
    """FrozenLake whose steps raise for seeds in ``broken`` and hang for seeds in ``hung`` (every try)."""

    broken: set[int] = set()
    hung: set[int] = set()

    def reset(self, seed):
        self.seed_ = seed
        return super().reset(seed)

    def step(self, action_text):
        if self.seed_ in FaultyLake.broken:
            raise RuntimeError(f"lake {self.seed_} cracked")
        if self.seed_ in FaultyLake.hung:
            hang(RELEASE)
        return super().step(action_text)


@pytest.fixture(autouse=True)
def faulty_lake(monkeypatch):
    monkeypatch.setattr(ENVIRONMENTS, "_entries", {**ENVIRONMENTS._entries, "faulty_lake": FaultyLake})
    monkeypatch.setattr(ENVIRONMENTS, "_traits", {**ENVIRONMENTS._traits, "faulty_lake": {}})
    FaultyLake.broken, FaultyLake.hung = set(), set()
    RELEASE.clear()
    yield
    RELEASE.set()


def last_grid(context: list[int]) -> str:
    text = TOKENIZER.decode(list(context), skip_special_tokens=False)
    return text.rsplit("<|user|>", 1)[1].split("<|assistant|>", 1)[0]


def expert(slow: dict[str, float] | None = None, bad_turns: bool = False):
    """A fake policy: the shortest path's next letter and EOS, one virtual second per turn (``slow``:
    seconds by episode id prefix)."""

    def script(request):
        path = shortest_path(last_grid(request.prompt_ids)) or ["L"]
        ids = TOKENIZER.encode("X" if bad_turns else path[0], add_special_tokens=False) + [EOS]
        seconds = next(
            (s for prefix, s in (slow or {}).items() if request.request_id.startswith(prefix)), 1.0
        )
        return ids, seconds

    return script


class SlowEnvs(LocalEnvs):
    """In-process envs whose step results arrive ``latency(episode_id)`` virtual seconds after they are
    sent, on the fake backend's clock (resets at once)."""

    def __init__(self, pool, backend, latency):
        super().__init__(pool)
        self.backend, self.latency, self.due = backend, latency, []

    def send_resets(self, requests):
        self.due += [(self.backend.now, result) for result in self.pool.reset(requests)]

    def send(self, actions):
        for result in self.pool.step(actions):
            self.due.append((self.backend.now + self.latency(result.episode_id), result))

    def poll(self, timeout_s):
        ready = [r for at, r in self.due if at <= self.backend.now]
        if not ready and self.due and timeout_s > 0:
            self.backend.now = min(min(at for at, _ in self.due), self.backend.now + timeout_s)
            ready = [r for at, r in self.due if at <= self.backend.now]
        self.due = [(at, r) for at, r in self.due if r not in ready]
        return ready

    @property
    def pending(self):
        return len(self.due)


class FrozenRankEnvs(LocalEnvs):
    """In-process envs on two "workers": the episodes ``on_frozen(episode_id)`` names live on rank 1,
    which freezes at virtual time ``frozen_from`` (the fake backend's clock): the resets, steps and
    closes sent to it from then on are taken and never run nor answered. With ``liveness_s``, a poll
    raises ``WorkerUnresponsiveError`` naming rank 1 once one of its calls has waited that long, as the
    liveness watch of a Ray call would."""

    def __init__(self, pool, backend, on_frozen, frozen_from=0.0, liveness_s=None):
        super().__init__(pool)
        self.backend, self.on_frozen = backend, on_frozen
        self.frozen_from, self.liveness_s = frozen_from, liveness_s
        self.unanswered: list[tuple[float, str, list[str]]] = []  # (sent at, method, episode ids)

    def _answered(self, method, items):
        """The items the live rank runs; rank 1's, once frozen, are recorded and never answered."""
        frozen = [item for item in items if self.on_frozen(item[0]) and self.backend.now >= self.frozen_from]
        if frozen:
            self.unanswered.append((self.backend.now, method, [item[0] for item in frozen]))
        return [item for item in items if item not in frozen]

    def send_resets(self, requests):
        super().send_resets(self._answered("reset", requests))

    def send(self, actions):
        super().send(self._answered("step", actions))

    def close(self, episode_ids):
        super().close([eid for eid, _ in self._answered("close", [(eid, None) for eid in episode_ids])])

    def poll(self, timeout_s):
        for sent, method, _ in self.unanswered:
            if self.liveness_s is not None and self.backend.now - sent >= self.liveness_s:
                raise WorkerUnresponsiveError("environment", 1, method, "the worker stopped answering")
        done = super().poll(timeout_s)
        if not done:
            self.backend.now += timeout_s  # waited for the frozen rank's answers, in vain
        return done

    @property
    def pending(self):
        return super().pending + sum(len(ids) for _, method, ids in self.unanswered if method != "close")


def scheduler(
    script,
    groups=2,
    group_size=2,
    redundancy=0,
    turns=8,
    env="frozen_lake",
    policy=None,
    timeout_s=30.0,
    workers=1,
    env_latency=None,
    pool_class=EnvPool,
):
    backend = FakeBackend(script, num_workers=workers)
    spec = EpisodeSpec(
        groups_per_step=groups,
        group_size=group_size,
        budget=EpisodeBudget(max_turns=turns, max_tokens_per_turn=4, max_context_tokens=400),
        redundancy=redundancy,
        stop_policy=policy or {},
    )
    pool = pool_class(env, {"size": 4}, step_timeout_s=timeout_s)
    chat = ChatTurns(TOKENIZER, [EOS])
    seeds = SeedOrder(FrozenLake(size=4), held_out=10)
    params = SamplingParams(max_new_tokens=4, stop_token_ids=(EOS,))
    envs = LocalEnvs(pool) if env_latency is None else SlowEnvs(pool, backend, env_latency)
    sched = EpisodeScheduler(backend, envs, chat, spec, params, seeds, TOKENIZER.pad_token_id)
    sched.clock = backend.clock
    return sched, backend, pool


def test_a_batch_is_one_episode_per_row_trained_on_exactly_the_sampled_ids() -> None:
    sched, backend, pool = scheduler(expert(), groups=3, group_size=2)
    batch, metrics = sched.next_batch(1)
    assert len(batch) == 6 and batch["group_index"].tolist() == [0, 0, 1, 1, 2, 2]
    assert metrics["episode/success"] == 1.0 and "actions/invalid" not in metrics
    assert sum(v for k, v in metrics.items() if k.startswith("actions/")) == pytest.approx(1.0)
    assert batch["scores"].tolist() == [1.0] * 6  # the expert reaches the goal on every map
    for row in range(len(batch)):
        trained = batch["loss_mask"][row].bool()
        ids = batch["response_ids"][row][trained].tolist()
        text = TOKENIZER.decode(ids, skip_special_tokens=False)
        # Only the policy's letters and their EOS are trained; the observations are attended, not trained.
        assert set(text.replace("<|eos|>", "")) <= set("LDRU") and text.endswith("<|eos|>")
        assert batch["response_mask"][row].sum() > trained.sum()
        assert (batch["rollout_logprobs"][row][trained] == -0.5).all()
    assert set(batch["stop_reason"]) == {"env_done"}
    assert all(seed >= 10 for seed in batch["seed"])  # never a held-out seed
    assert pool.live == 0  # every env of the step was closed


def test_episodes_never_wait_for_each_other() -> None:
    # Episodes of group 0 take 5 virtual seconds per turn, the rest 1: the fast ones play many turns
    # before the slow ones finish their first.
    sched, backend, _ = scheduler(expert(slow={"g0": 5.0}), groups=2, group_size=2)
    sched.next_batch(1)
    fast_turn_2 = min(
        t for t, _, ids in backend.submits if any(i.startswith("g1") and i.endswith("t2") for i in ids)
    )
    slow_turn_1_back = min(t for rid, t in backend.generated_at.items() if rid.startswith("g0"))
    assert fast_turn_2 < slow_turn_1_back


def test_redundant_episodes_complete_a_group_while_a_slow_one_still_runs() -> None:
    # Each group starts 3 episodes for 2 places; episode e2 of every group is 100x slower.
    slow = {f"g{g}e2": 100.0 for g in range(2)}
    sched, backend, _ = scheduler(expert(slow=slow), groups=2, group_size=2, redundancy=1)
    batch, metrics = sched.next_batch(1)
    assert len(batch) == 4 and metrics["rollout/aborted_episodes"] == 2
    aborted = {rid for _, ids in backend.aborts for rid in ids}
    assert aborted == {"g0e2t0", "g1e2t0"}
    assert backend.now < 100.0  # the step never waited for the slow episodes


def test_a_group_keeps_its_first_started_episodes_not_its_first_to_end() -> None:
    # Episode e0 of every group is 100x slower than e1 and the redundant e2. Keeping the first two to end
    # (e1, e2) would drop every slow episode from the baseline; the group keeps e0 and e1, and e2, its
    # stand-in for an episode whose env fails, is aborted once they have ended.
    slow = {f"g{g}e0": 100.0 for g in range(2)}
    sched, backend, _ = scheduler(expert(slow=slow), groups=2, group_size=2, redundancy=1)
    batch, metrics = sched.next_batch(1)
    assert batch["episode_id"] == ["g0e0", "g0e1", "g1e0", "g1e1"]
    assert metrics["rollout/aborted_episodes"] == 0  # e2 had ended before e0: nothing left to abort
    assert backend.now >= 100.0  # the step waited for the slow episodes it keeps


def test_a_group_completes_from_its_fast_episodes_while_a_slow_env_still_runs() -> None:
    # Episode e2 of each group has an env that takes 100 virtual seconds per step, the others 0.01.
    latency = lambda episode_id: 100.0 if episode_id.endswith("e2") else 0.01  # noqa: E731
    sched, backend, _ = scheduler(expert(), groups=2, group_size=2, redundancy=1, env_latency=latency)
    batch, metrics = sched.next_batch(1)
    assert len(batch) == 4 and metrics["rollout/aborted_episodes"] == 2
    assert backend.now < 100.0  # nobody waited for the slow envs
    assert metrics["env/step_s"] < 1.0  # the slow steps never came back: not counted


def test_an_env_that_raises_or_hangs_costs_its_group_and_is_counted() -> None:
    FaultyLake.broken = {10}  # the first training seed
    FaultyLake.hung = {11}  # the second
    # The hung steps time out at once; every other env call has all the time it needs.
    sched, _, _ = scheduler(
        expert(), groups=2, group_size=2, env="faulty_lake", timeout_s=ROOMY_S, pool_class=HangAwarePool
    )
    batch, metrics = sched.next_batch(1)
    assert len(batch) == 4 and 10 not in batch["seed"] and 11 not in batch["seed"]
    assert metrics["rollout/dropped_groups"] == 2
    assert metrics["env/error_frac"] > 0 and metrics["env/timeout_frac"] > 0
    assert metrics["episode/success"] == 1.0


def test_a_step_stops_with_the_envs_error_when_every_group_fails() -> None:
    FaultyLake.broken = set(range(10, 200))
    sched, _, _ = scheduler(expert(), groups=1, group_size=2, env="faulty_lake")
    with pytest.raises(RuntimeError, match="dropped in one step.*cracked"):
        sched.next_batch(1)


def test_a_frozen_env_worker_holds_up_only_its_episodes_and_fails_the_step_at_the_liveness_bound() -> None:
    """Group 1's episodes live on an environment worker that froze before their resets: group 0 plays
    to the end meanwhile, and the step fails with the worker's own error once its reset went unanswered
    for the liveness bound (the pipeline replaces the worker as it does a dead one). Closing the
    scheduler then sends the frozen episodes' closes and waits for none."""
    sched, backend, pool = scheduler(expert(), groups=2, group_size=2)
    sched.envs = envs = FrozenRankEnvs(pool, backend, lambda eid: eid.startswith("g1"), liveness_s=LIVENESS_S)
    with pytest.raises(WorkerUnresponsiveError, match="environment rank 1 failed in reset"):
        sched.next_batch(1)
    assert backend.now >= LIVENESS_S
    assert [g.group_id for g in sched._drawn.values() if g.complete] == [0]  # noqa: SLF001 - played on meanwhile
    assert not any(request_id.startswith("g1") for _, _, ids in backend.submits for request_id in ids)
    sched.close()
    assert [(method, ids) for _, method, ids in envs.unanswered] == [
        ("reset", ["g1e0", "g1e1"]),
        ("close", ["g1e0", "g1e1"]),
    ]
    assert pool.live == 0  # group 0's envs were closed; group 1's never started


def test_a_close_that_never_answers_holds_up_nobody() -> None:
    """A redundant episode's env worker freezes after its reset, while its turn generates: its group
    completes from the other two, and its close, sent to the frozen worker, is never waited for."""
    sched, backend, pool = scheduler(expert(slow={"g0e2": 100.0}), groups=1, group_size=2, redundancy=1)
    sched.envs = envs = FrozenRankEnvs(
        pool, backend, lambda eid: eid == "g0e2", frozen_from=0.5, liveness_s=LIVENESS_S
    )
    batch, metrics = sched.next_batch(1)
    assert len(batch) == 2 and metrics["rollout/aborted_episodes"] == 1
    assert backend.now < LIVENESS_S
    assert [(method, ids) for _, method, ids in envs.unanswered] == [("close", ["g0e2"])]


def test_the_stop_policy_masks_or_zeroes_episodes_by_their_stop_reason() -> None:
    # A policy that only writes invalid turns: every episode ends at max_turns with return 3 * -0.1.
    for rule, score, trained in [("train", -0.3, True), ("zero", 0.0, True), ("mask", -0.3, False)]:
        sched, _, _ = scheduler(expert(bad_turns=True), groups=1, turns=3, policy={"max_turns": rule})
        batch, metrics = sched.next_batch(1)
        assert metrics["episode/stop/max_turns"] == 1.0 and metrics["episode/invalid_action_frac"] == 1.0
        assert batch["scores"].tolist() == pytest.approx([score, score])
        assert bool(batch["loss_mask"].sum() > 0) is trained


def test_seeds_of_groups_not_trained_on_are_played_again_after_a_restart() -> None:
    sched, _, _ = scheduler(expert(), groups=2, group_size=2)
    first, _ = sched.next_batch(1)
    state = sched.state_dict()
    again, _ = sched.next_batch(2)
    resumed, _, _ = scheduler(expert(), groups=2, group_size=2)
    resumed.load_state_dict(state)
    assert resumed.next_batch(2)[0]["seed"] == again["seed"]
    # Mid-step state (a worker lost while groups were live) keeps their seeds first, but never the
    # held-out seed of an evaluation cut short.
    params = sched.params
    sched._draw_items([99])
    sched._start([sched._new_group(3, 1, params, False)])
    assert sched.state_dict()["pending"][0] == 99 and 3 not in sched.state_dict()["pending"]


def test_held_out_play_returns_one_episode_per_seed_in_order() -> None:
    sched, _, _ = scheduler(expert())
    episodes = sched.play([3, 1, 2], SamplingParams(max_new_tokens=4, greedy=True, stop_token_ids=(EOS,)))
    assert [e.seed for e in episodes] == [3, 1, 2] and all(e.success for e in episodes)


def test_with_a_merge_prone_tokenizer_the_batch_holds_exactly_the_ids_the_engine_sampled() -> None:
    """A BPE tokenizer trained locally merges "R" + "R" into one id: the batch must hold the engine's ids
    turn by turn, never a re-encoding of the decoded episode."""
    from roll.models.tokenizer import build_bpe_tokenizer

    lakes = [FrozenLake(size=4).reset(seed)[0] for seed in range(30)]
    bpe = build_bpe_tokenizer([*lakes, "RR", "DD", "R", "D", "L", "U"] * 20, vocab_size=320)
    assert len(bpe.encode("RR", add_special_tokens=False)) == 1
    sampled: dict[str, list[int]] = {}

    def script(request):
        text = bpe.decode(list(request.prompt_ids), skip_special_tokens=False)
        grid = text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        ids = bpe.encode((shortest_path(grid) or ["L"])[0], add_special_tokens=False) + [bpe.eos_token_id]
        sampled[request.request_id] = ids
        return ids, 1.0

    backend = FakeBackend(script)
    spec = EpisodeSpec(groups_per_step=2, group_size=2, budget=EpisodeBudget(8, 4, 600))
    chat = ChatTurns(bpe, [bpe.eos_token_id])
    seeds = SeedOrder(FrozenLake(size=4), held_out=10)
    params = SamplingParams(max_new_tokens=4)
    envs = LocalEnvs(EnvPool("frozen_lake", {"size": 4}))
    sched = EpisodeScheduler(backend, envs, chat, spec, params, seeds, bpe.pad_token_id)
    sched.clock = backend.clock
    batch, metrics = sched.next_batch(1)
    assert metrics["episode/success"] == 1.0
    for row, episode_id in enumerate(batch["episode_id"]):
        trained = batch["loss_mask"][row].bool()
        turns = [ids for rid, ids in sampled.items() if rid.rsplit("t", 1)[0] == episode_id]
        in_order = [sampled[f"{episode_id}t{k}"] for k in range(len(turns))]
        assert batch["response_ids"][row][trained].tolist() == [i for ids in in_order for i in ids]


def test_turns_name_their_episode_for_prefix_reuse_and_ended_episodes_are_released() -> None:
    """Each turn's request carries its episode id (the engine keeps that episode's KV between turns),
    and every episode is released once it ends, redundant (aborted) ones included: no KV outlives its
    episode."""
    released: list[str] = []
    keys: dict[str, str] = {}

    class Recording(FakeBackend):
        def submit(self, worker, requests):
            keys.update({r.request_id: r.cache_key for r in requests})
            super().submit(worker, requests)

        def release_prefixes(self, worker, cache_keys):
            released.extend(cache_keys)

    slow = {f"g{g}e2": 100.0 for g in range(2)}
    backend = Recording(expert(slow=slow))
    sched, _, _ = scheduler(expert(), groups=2, group_size=2, redundancy=1)
    sched.backend = backend
    sched.clock = backend.clock
    sched.next_batch(1)
    assert keys and all(request_id.startswith(key + "t") for request_id, key in keys.items())
    episodes = {f"g{g}e{k}" for g in range(2) for k in range(3)}
    assert sorted(released) == sorted(episodes)  # each exactly once, the aborted e2s too
