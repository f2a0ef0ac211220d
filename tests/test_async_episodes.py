"""Asynchronous environments: the episode scheduler keeps playing (generating and stepping envs) while the
actor trains, a turn may start on newer weights than the turn before it, and no trained episode is older
than the staleness bound. The fake backend runs on a virtual clock; where the background thread is
involved, tests wait for a condition (with a generous deadline), never for an amount of time."""

from __future__ import annotations

import threading
import time

import pytest
from fake_rollout import FakeBackend
from test_episode_scheduler import EOS, TOKENIZER, FrozenRankEnvs, expert

from roll.data.chat_turns import ChatTurns
from roll.distributed.cluster import WorkerError
from roll.envs.frozen_lake import FrozenLake
from roll.envs.pool import EnvPool
from roll.envs.seeds import SeedOrder
from roll.rollout.backend import Events
from roll.rollout.env_clients import LocalEnvs
from roll.rollout.episode import EpisodeBudget
from roll.rollout.episodes import EpisodeScheduler, EpisodeSpec
from roll.strategies.requests import SamplingParams


def scheduler(backend: FakeBackend, ratio: int = 1, groups: int = 2, history_turns=None):
    spec = EpisodeSpec(
        groups_per_step=groups,
        group_size=2,
        budget=EpisodeBudget(max_turns=8, max_tokens_per_turn=4, max_context_tokens=400),
        async_generation_ratio=ratio,
        history_turns=history_turns,
    )
    pool = EnvPool("frozen_lake", {"size": 4})
    sched = EpisodeScheduler(
        backend,
        LocalEnvs(pool),
        ChatTurns(TOKENIZER, [EOS]),
        spec,
        SamplingParams(max_new_tokens=4, stop_token_ids=(EOS,)),
        SeedOrder(FrozenLake(size=4), held_out=10),
        TOKENIZER.pad_token_id,
        poll_s=0.01,
    )
    sched.clock = backend.clock
    return sched, pool


def wait_for(condition, what: str, deadline_s: float = 30.0) -> None:
    """Wait until ``condition()`` holds: the background thread makes it true; the deadline only turns a
    hang into a failure."""
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"the background thread never {what}"
        time.sleep(0.002)


def test_episodes_play_on_while_the_actor_trains_within_the_staleness_bound() -> None:
    backend = FakeBackend(expert(), num_workers=2)
    sched, pool = scheduler(backend, ratio=1)
    try:
        for step in range(1, 6):
            batch, metrics = sched.next_batch(step)
            assert len(batch) == 4 and metrics["episode/success"] == 1.0
            assert metrics["rollout/staleness_max"] <= 1  # the bound: ratio 1
            # "Training": with no next_batch waiting, the thread has the next step's groups played to
            # the end, so the next batch is ready before it is asked for.
            wait_for(lambda: sched.batch_ready, "played the next step's groups")
            backend.version = step  # the sync: tokens sampled from now on carry the new version
            sched.set_weights_version(step)
    finally:
        sched.close()


def test_while_no_batch_is_wanted_the_next_steps_episodes_generate_and_step() -> None:
    # Later groups take longer per turn, so the current batch completes while the next one still plays.
    def script(request):
        ids, _ = expert()(request)
        return ids, 1.0 + int(request.request_id[1:].split("e")[0])

    backend = FakeBackend(script)
    sched, pool = scheduler(backend, ratio=1, groups=2)
    with sched._lock:  # noqa: SLF001 - drive the pump by hand: deterministic
        sched._waiting = True  # noqa: SLF001
    while not sched.batch_ready:
        sched._pump()  # noqa: SLF001
    with sched._lock:  # noqa: SLF001 - what next_batch does once its batch is ready
        taken = sched._take_batch()  # noqa: SLF001
        sched._waiting = False  # noqa: SLF001
    assert [g.group_id for g in taken] == [0, 1]
    # "Training": the next step's groups (2, 3) are mid-episode; pumping with no batch wanted plays them
    # on (turns generated, environments stepped) and draws nothing more than the ratio asks for.
    playing = [g for g in sched._live]  # noqa: SLF001
    assert [g.group_id for g in playing] == [2, 3] and not any(g.complete for g in playing)
    steps, sent = pool.counters["steps"], len(backend.submits)
    while not sched.batch_ready:
        sched._pump()  # noqa: SLF001
    assert pool.counters["steps"] > steps and len(backend.submits) > sent
    assert sched._next_group_id == 4  # noqa: SLF001 - no group beyond the next step's was drawn
    sched.close()


def test_a_turn_may_start_on_newer_weights_than_the_turn_before_it() -> None:
    backend = FakeBackend(expert())
    sched, _ = scheduler(backend, ratio=1, groups=1)
    with sched._lock:  # noqa: SLF001 - drive the pump by hand: deterministic
        sched._waiting = True  # noqa: SLF001
    while not backend.submits:  # the envs' resets come back, then turn 1 of every episode is sent
        sched._pump()  # noqa: SLF001 - turn 1 is sampled by version 0
    backend.version = 1
    sched.set_weights_version(1)
    while not sched.batch_ready:
        sched._pump()  # noqa: SLF001
    group = next(iter(sched._drawn.values()))  # noqa: SLF001 - the batch about to be taken
    versions = [sorted({v for v in e.versions if v >= 0}) for e in group.members.values()]
    try:
        _, metrics = sched.next_batch(1)
    finally:
        sched.close()  # next_batch started the background thread
    assert [0, 1] in versions  # one episode, two weights versions: still within the bound
    assert metrics["rollout/staleness_max"] == 1 and metrics["rollout/stale_groups"] == 0


def test_groups_older_than_the_bound_are_aborted_and_their_seeds_drawn_again_first() -> None:
    backend = FakeBackend(expert(slow={"g": 1000.0}))  # turns that never come back in this test
    sched, _ = scheduler(backend, ratio=1, groups=2)
    with sched._lock:  # noqa: SLF001
        sched._waiting = True  # noqa: SLF001
    sched._pump()  # noqa: SLF001 - draws the batch wanted now and the next one: 4 groups at version 0
    seeds = [g.seed for g in sched._live]  # noqa: SLF001
    assert len(seeds) == 4
    sent = {rid for _, _, ids in backend.submits for rid in ids}
    sched.set_weights_version(2)  # two updates later, version-0 work is older than the bound of 1
    sched._pump()  # noqa: SLF001
    assert {rid for _, ids in backend.aborts for rid in ids} == sent
    # Drawn again under new groups, first and in the same order, stamped with version 2.
    assert [g.seed for g in sched._live] == seeds  # noqa: SLF001
    assert all(g.group_id >= 4 and g.start_version == 2 for g in sched._live)  # noqa: SLF001
    sched.close()


def test_state_dict_holds_the_seeds_played_ahead_and_not_trained_on() -> None:
    backend = FakeBackend(expert())
    sched, _ = scheduler(backend, ratio=1, groups=2)
    try:
        first, _ = sched.next_batch(1)
        wait_for(lambda: sched.batch_ready, "played the next step's groups")
        state = sched.state_dict()
        ahead, _ = sched.next_batch(2)
    finally:
        sched.close()
    assert state["pending"][:2] == ahead["seed"][::2]  # the next batch's seeds, in draw order
    assert not set(state["pending"]) & set(first["seed"])


def test_a_lost_worker_in_the_background_thread_surfaces_as_its_own_error() -> None:
    class DyingBackend(FakeBackend):
        def poll(self, timeout_s: float) -> Events:
            raise WorkerError("rollout", 1, "collect_finished", "the worker process died")

    sched, _ = scheduler(DyingBackend(expert(), num_workers=2), ratio=1)
    with pytest.raises(WorkerError, match="rollout rank 1 failed in collect_finished"):
        sched.next_batch(1)
    sched.close()


def answers(call, what: str, deadline_s: float = 60.0):
    """``call()``'s result, failing if it has not returned by the deadline (which only turns a call
    that waits for a frozen worker into a failure instead of a hang)."""
    box = {}
    thread = threading.Thread(target=lambda: box.update(out=call()), daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert not thread.is_alive(), f"{what} waited for the frozen env worker"
    return box.get("out")


def test_while_an_env_reset_goes_unanswered_the_pipelines_calls_answer_at_once() -> None:
    """The background thread plays the next step's groups; group 1's env worker froze before their
    resets (and is never found out here). Everything the pipeline calls meanwhile answers at once, and
    a held-out episode plays to its end beside the unanswered reset."""
    backend = FakeBackend(expert())
    sched, pool = scheduler(backend, ratio=1, groups=2)
    sched.envs = envs = FrozenRankEnvs(pool, backend, lambda eid: eid.startswith("g1"))
    sched._thread = threading.Thread(target=sched._pump_forever, daemon=True)  # noqa: SLF001 - as next_batch
    sched._thread.start()  # noqa: SLF001
    try:
        first = lambda: sched._drawn.get(0)  # noqa: E731, SLF001 - group 0 while it is drawn
        wait_for(lambda: envs.unanswered and getattr(first(), "complete", False), "played group 0")
        assert answers(sched.state_dict, "state_dict")["pending"][:2] == [10, 11]  # both groups' seeds
        answers(lambda: sched.set_weights_version(1), "set_weights_version")
        assert answers(lambda: sched.batch_ready, "batch_ready") is False
        greedy = SamplingParams(max_new_tokens=4, greedy=True, stop_token_ids=(EOS,))
        (episode,) = answers(lambda: sched.play([3], greedy), "play")
        assert episode.seed == 3 and episode.success
    finally:
        answers(sched.close, "close")
    assert ("close", ["g1e0", "g1e1"]) in [(method, ids) for _, method, ids in envs.unanswered]


def test_held_out_play_goes_on_beside_training_episodes() -> None:
    backend = FakeBackend(expert())
    sched, _ = scheduler(backend, ratio=1, groups=2)
    try:
        sched.next_batch(1)
        greedy = SamplingParams(max_new_tokens=4, greedy=True, stop_token_ids=(EOS,))
        episodes = sched.play([3, 1, 2], greedy)
        assert [e.seed for e in episodes] == [3, 1, 2] and all(e.success for e in episodes)
        batch, _ = sched.next_batch(2)
        assert not {1, 2, 3} & set(batch["seed"])  # held-out seeds are never trained on
    finally:
        sched.close()
