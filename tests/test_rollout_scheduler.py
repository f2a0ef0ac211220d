"""The rollout scheduler against a fake backend with controlled latencies (deterministic, no Ray):
lifecycle, routing, reward overlap, dynamic sampling, abort, staleness, state."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fake_rollout import FakeBackend, FakeTokenizer

from roll.algorithms.filters import GROUP_FILTERS
from roll.data.dataset import PromptIterator
from roll.data.prompts import PromptSet
from roll.distributed.errors import WorkerError
from roll.rollout.backend import Events
from roll.rollout.lifecycle import IllegalTransition, Sample, SampleState, stage_seconds
from roll.rollout.load_balancer import LoadBalancer
from roll.rollout.scheduler import RolloutScheduler, SchedulerSpec
from roll.strategies.requests import GenerateRequest, GenerateResult, SamplingParams

S = SampleState
PARAMS = SamplingParams(max_new_tokens=8)


def prompt_set(n: int) -> PromptSet:
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(n)]
    return PromptSet(rows, [r["prompt"] for r in rows], [[i + 1] for i in range(n)])


def row_of(request: GenerateRequest) -> int:
    return request.prompt_ids[0] - 1


def sample_index(request: GenerateRequest) -> int:
    return int(request.request_id.rsplit("-", 1)[1])


def scheduler(backend: FakeBackend, n_prompts: int = 64, seed: int = 0, **spec: object) -> RolloutScheduler:
    spec = {"rollout_batch_size": 4, "num_return_sequences": 4, **spec}
    prompts = prompt_set(n_prompts)
    order = PromptIterator(prompts.rows, spec["rollout_batch_size"], seed=seed)
    return RolloutScheduler(
        backend, prompts, order, SchedulerSpec(**spec), PARAMS, FakeTokenizer(), clock=backend.clock
    )


def distinct(request: GenerateRequest) -> tuple[list[int], float]:
    """Sample k of every prompt answers k+1 tokens after 1 + k seconds: rewards differ in every group."""
    k = sample_index(request)
    return [1] * (k + 1), 1.0 + k


# ----- lifecycle ---------------------------------------------------------------------------------------


def test_lifecycle_allows_only_forward_moves_and_times_each_stage() -> None:
    sample = Sample("r", group_id=0, index=0, times={S.QUEUED: 1.0})
    sample.move(S.GENERATING, 1.5)
    sample.move(S.REWARDING, 4.0)
    with pytest.raises(IllegalTransition, match="rewarding to queued"):
        sample.move(S.QUEUED, 5.0)
    sample.move(S.DONE, 4.25)
    assert sample.finished
    assert stage_seconds(sample) == {"queue": 0.5, "generate": 2.5, "reward": 0.25}
    sample.move(S.FILTERED, 5.0)
    with pytest.raises(IllegalTransition):
        sample.move(S.ABORTED, 6.0)
    queued = Sample("q", 0, 1)
    with pytest.raises(IllegalTransition, match="queued to done"):
        queued.move(S.DONE, 0.0)
    queued.move(S.ABORTED, 0.0)


def test_the_lifecycle_and_the_request_types_load_without_torch_or_ray(repo_root: Path) -> None:
    # A fresh interpreter: this one has long imported torch.
    code = (
        "import sys\n"
        "import roll.rollout.lifecycle, roll.strategies.requests\n"
        "assert not {'torch', 'ray'} & set(sys.modules), sorted({'torch', 'ray'} & set(sys.modules))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root)


# ----- routing ----------------------------------------------------------------------------------------


def test_groups_are_placed_whole_least_loaded_and_in_contiguous_runs() -> None:
    balancer = LoadBalancer(2)
    # Equal loads: the split of batch generation (first half to worker 0).
    assert balancer.place_groups([4, 4, 4, 4]) == [0, 0, 1, 1]
    for i in range(8):
        balancer.assign_to(f"a{i}", 0)
    assert balancer.place_groups([4]) == [1], "new prompts go to the least-loaded worker"
    # A cap of 10: worker 0 (8 in flight) takes no group of 4; worker 1 takes two, then none fits.
    assert balancer.place_groups([4, 4, 4], cap=10) == [1, 1]
    # A group larger than the cap still runs on an idle worker.
    assert LoadBalancer(1).place_groups([16], cap=4) == [0]


def test_sync_batch_is_the_draw_order_split_like_batch_generation() -> None:
    backend = FakeBackend(distinct, num_workers=2)
    sched = scheduler(backend)
    batch, metrics = sched.next_batch(1)
    expected_prompts = PromptIterator(prompt_set(64).rows, 4, seed=0).next_indices()
    assert batch["sample"][::4] == [prompt_set(64).rows[i] for i in expected_prompts]
    assert batch["group_index"].tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    # One call per worker; worker 0 got the first two groups, worker 1 the last two.
    assert [(worker, len(ids)) for _, worker, ids in backend.submits] == [(0, 8), (1, 8)]
    assert backend.submits[0][2][:4] == [f"g0-{k}" for k in range(4)]
    # Responses right-padded to max_new_tokens with their logprobs and finish reasons; scores attached.
    assert batch["response_mask"].sum(dim=1).tolist() == [1, 2, 3, 4] * 4
    assert batch["response_ids"].shape == (16, PARAMS.max_new_tokens)
    assert batch["rollout_logprobs"][0].tolist() == [-0.5] + [0.0] * 7
    assert batch["scores"].tolist() == [1.0, 2.0, 3.0, 4.0] * 4
    assert batch["response_text"][:2] == ["b", "bb"]
    assert metrics["rollout/prompts_per_step"] == 4 and metrics["rollout/filtered_frac"] == 0.0
    assert metrics["rollout/generate_s"] == pytest.approx(2.5)  # 1..4 s, as scripted
    assert metrics["rollout/staleness_max"] == 0


def test_max_running_requests_caps_each_worker_and_groups_join_as_others_finish() -> None:
    backend = FakeBackend(distinct, num_workers=1)
    sched = scheduler(backend, max_running_requests=8)
    batch, metrics = sched.next_batch(1)
    assert backend.max_running == [8]
    assert [len(ids) for _, _, ids in backend.submits] == [8, 4, 4], "two groups, then one per freed group"
    assert len(batch) == 16 and metrics["rollout/queue_s"] > 0


# ----- reward as soon as a sample finishes ---------------------------------------------------------------


def test_reward_starts_when_a_sample_finishes_while_the_rest_still_generate() -> None:
    def long_tail(request: GenerateRequest) -> tuple[list[int], float]:
        long = request.request_id == "g0-0"  # the first sample of the first prompt drawn
        return [1, 2], 50.0 if long else 1.0

    backend = FakeBackend(long_tail, reward_s=0.5)
    sched = scheduler(backend)
    sched.next_batch(1)
    # Every short sample was scored at t=1, long before the long one ended (t=50) ...
    short = [t for rid, t in backend.scored_at.items() if rid != "g0-0"]
    assert max(short) == 1.0 and backend.generated_at["g0-0"] == 50.0
    # ... so the batch was ready one reward after the longest sample, not after 16 serial rewards.
    assert backend.now == pytest.approx(50.5)


# ----- dynamic sampling -------------------------------------------------------------------------------------


def test_dynamic_sampling_keeps_only_groups_whose_rewards_differ_and_aborts_the_surplus() -> None:
    def half_solved(request: GenerateRequest) -> tuple[list[int], float]:
        # Even rows: every sample answers alike (no signal). Odd rows: answers differ.
        # Prompts drawn later take longer, so some are still running when the batch fills.
        k = sample_index(request) if row_of(request) % 2 else 0
        return [1] * (k + 1), 1.0 + int(request.request_id[1:].split("-")[0])

    backend = FakeBackend(half_solved)
    sched = scheduler(backend, group_filters=["equal_rewards"], max_additional_running_prompts=2)
    batch, metrics = sched.next_batch(1)
    rows = [int(sample["answer"]) for sample in batch["sample"][::4]]
    assert all(row % 2 == 1 for row in rows), rows
    groups = batch["scores"].view(4, 4)
    assert (groups.max(dim=1).values > groups.min(dim=1).values).all()
    assert metrics["rollout/filtered_frac"] > 0
    assert metrics["rollout/prompts_per_step"] >= 8
    assert metrics["rollout/filtered_by/equal_rewards"] >= 4
    # In flight never more than the batch's 4 groups plus 2 additional prompts.
    assert max(backend.max_running) <= (4 + 2) * 4
    # Surplus requests were aborted when the batch was full; their prompts are drawn first next step.
    assert backend.aborts
    aborted_groups = sorted({int(rid[1:].split("-")[0]) for _, ids in backend.aborts for rid in ids})
    assert metrics["rollout/aborted_frac"] > 0
    before = len(backend.submits)
    sched.next_batch(2)
    first_after = backend.submits[before][2][0]
    assert int(first_after[1:].split("-")[0]) > aborted_groups[-1]  # redrawn under a new group id


def test_a_user_registered_filter_and_the_fallback_when_every_group_is_filtered() -> None:
    @GROUP_FILTERS.register("test_only_short")
    def only_short(outcome) -> bool:  # noqa: ANN001
        return bool((outcome.response_lengths <= 2).all())

    try:
        backend = FakeBackend(distinct)  # lengths 1..4: every group fails only_short
        sched = scheduler(backend, group_filters=["test_only_short"], max_prompts_per_step=6)
        batch, metrics = sched.next_batch(1)
        assert len(batch) == 16, "filtered groups fill the batch once the prompt budget is spent"
        assert metrics["rollout/fallback_groups"] == 4
        assert metrics["rollout/prompts_per_step"] == 6
    finally:
        GROUP_FILTERS._entries.pop("test_only_short", None)  # noqa: SLF001


def test_a_group_aborted_by_the_engine_is_drawn_again() -> None:
    backend = FakeBackend(distinct)
    sched = scheduler(backend)
    sched._pump(0.0)  # noqa: SLF001 - draw and send nothing yet: not waiting
    real_submit = backend.submit
    calls = []

    def submit_then_abort_first(worker, requests):  # noqa: ANN001
        real_submit(worker, requests)
        if not calls:
            backend.abort(worker, [requests[0].request_id])
        calls.append(len(requests))

    backend.submit = submit_then_abort_first
    batch, metrics = sched.next_batch(1)
    assert len(batch) == 16 and all(reason == "stop" for reason in batch["finish_reason"])
    first_prompts = PromptIterator(prompt_set(64).rows, 4, seed=0).next_indices()
    # The aborted group's prompt was drawn again, under a new group, so it comes last.
    assert [int(s["answer"]) for s in batch["sample"][::4]] == first_prompts[1:] + first_prompts[:1]
    assert metrics["rollout/aborted_frac"] > 0


# ----- asynchronous generation and staleness -----------------------------------------------------------


def test_async_generation_continues_during_training_and_respects_the_staleness_bound() -> None:
    backend = FakeBackend(distinct, num_workers=2)
    sched = scheduler(backend, async_generation_ratio=1, n_prompts=256)
    ahead = []
    try:
        for step in range(1, 7):
            batch, metrics = sched.next_batch(step)
            assert len(batch) == 16
            assert metrics["rollout/staleness_max"] <= 1
            # "Training": the background thread has the next step's 4 groups out (sent before or after
            # this batch was taken) without any next_batch call waiting for them. The deadline only turns
            # a thread that never sends them into a failure: far above its need, on a loaded machine too.
            deadline = time.monotonic() + 60
            while groups_sent(backend) < (step + 1) * 4 and time.monotonic() < deadline:
                time.sleep(0.005)
            ahead.append(groups_sent(backend) - step * 4)
            backend.version = step  # the sync: tokens sampled from now on carry the new version
            sched.set_weights_version(step)
    finally:
        sched.close()
    assert min(ahead) >= 4, f"generation ran ahead while the actor trained: {ahead}"


def groups_sent(backend: FakeBackend) -> int:
    return sum(len(ids) for _, _, ids in backend.submits) // 4


def test_stale_groups_are_aborted_and_redrawn() -> None:
    backend = FakeBackend(distinct)
    sched = scheduler(backend, async_generation_ratio=1)
    with sched._lock:  # noqa: SLF001 - drive the pump by hand: deterministic
        sched._waiting = True  # noqa: SLF001
    sched._pump(0.0)  # noqa: SLF001 - draws and sends batches for now and the next step (version 0)
    sent = len(backend.submits[0][2])
    assert sent == 2 * 16
    sched.set_weights_version(2)  # two updates later, version-0 work is older than the bound of 1
    sched._pump(0.0)  # noqa: SLF001
    aborted = {rid for _, ids in backend.aborts for rid in ids}
    assert len(aborted) == sent
    # Their prompts are drawn again (first) under new groups stamped with version 2.
    assert backend.submits[-1][2][0] == "g8-0"
    sched.close()


# ----- state --------------------------------------------------------------------------------------


def test_state_dict_restores_the_cursor_and_the_prompts_not_yet_trained_on() -> None:
    backend = FakeBackend(distinct)
    sched = scheduler(backend, group_filters=["equal_rewards"])
    sched.next_batch(1)
    with sched._lock:  # noqa: SLF001
        sched._waiting = True  # noqa: SLF001
    sched._pump(0.0)  # noqa: SLF001 - step 2's prompts are drawn and in flight
    state = sched.state_dict()
    assert state["pending_prompts"], "in-flight prompts are part of the state"
    expected, _ = sched.next_batch(2)
    restored = scheduler(FakeBackend(distinct), group_filters=["equal_rewards"])
    restored.load_state_dict(state)
    got, _ = restored.next_batch(2)
    assert got["sample"] == expected["sample"]
    assert torch.equal(got["scores"], expected["scores"])
    with pytest.raises(RuntimeError, match="before the scheduler draws"):
        restored.load_state_dict(state)


def test_a_scheduler_taking_over_workers_ignores_the_results_of_the_one_before() -> None:
    """After a recovery a new scheduler shares rollout workers with a closed one whose aborted requests
    may still come back: with its own id prefix it takes only its own results (an old "g0-0" would
    otherwise be taken for its own), and its batch is the one a fresh scheduler makes."""
    backend = FakeBackend(distinct, num_workers=2)
    for k in range(4):  # what the closed scheduler's aborts left in flight
        backend._push(0.0, "generated", GenerateResult(f"g0-{k}", [], [], "abort"))
    prompts = prompt_set(64)
    new = RolloutScheduler(
        backend,
        prompts,
        PromptIterator(prompts.rows, 4, seed=0),
        SchedulerSpec(rollout_batch_size=4, num_return_sequences=4),
        PARAMS,
        FakeTokenizer(),
        clock=backend.clock,
        id_prefix="s1-",
    )
    batch, _ = new.next_batch(1)
    assert all(rid.startswith("s1-g") for _, _, ids in backend.submits for rid in ids)
    expected, _ = scheduler(FakeBackend(distinct, num_workers=2)).next_batch(1)
    assert batch["scores"].tolist() == expected["scores"].tolist()
    assert batch["sample"] == expected["sample"]


def test_a_lost_worker_in_the_background_thread_surfaces_as_its_own_error() -> None:
    """With async generation the pumping thread meets a dead rollout worker: next_batch raises that
    WorkerError itself (role, rank, method), the type the pipeline's recovery acts on."""

    class DyingBackend(FakeBackend):
        def poll(self, timeout_s: float) -> Events:
            raise WorkerError("rollout", 1, "collect_finished", "the worker process died")

    sched = scheduler(DyingBackend(distinct, num_workers=2), async_generation_ratio=1)
    with pytest.raises(WorkerError, match="rollout rank 1 failed in collect_finished"):
        sched.next_batch(1)
    sched.close()
