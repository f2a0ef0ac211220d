"""The rollout scheduler on Ray with the real engine: rollout workers serving single requests, reward
workers scoring each response as it arrives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from roll.data.dataset import PromptIterator
from roll.data.prompts import PromptSet, render_prompt
from roll.distributed.cluster import Cluster
from roll.pipelines.common import prompt_batch
from roll.rollout.backend import RayBackend, RewardDispatch
from roll.rollout.router import RolloutRouter
from roll.rollout.scheduler import RolloutScheduler, SchedulerSpec
from roll.strategies.requests import SamplingParams
from roll.workers.base import ModelSpec
from roll.workers.reward import RewardWorker
from roll.workers.rollout import RolloutWorker

pytestmark = pytest.mark.usefixtures("ray_session")
PARAMS = SamplingParams(max_new_tokens=4, temperature=1.0)


@dataclasses.dataclass
class Holder:
    model: ModelSpec


@pytest.fixture(scope="module")
def prompts(tokenizer) -> PromptSet:
    rows = [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a in range(1, 9) for b in (2, 7)]
    texts = [render_prompt(tokenizer, r["prompt"], True) for r in rows]
    return PromptSet(rows, texts, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])


def start_rollout(tiny_model_path: str, rollout_workers: int) -> Cluster:
    return Cluster("rollout", RolloutWorker, rollout_workers, Holder(ModelSpec(path=tiny_model_path, seed=3)))


def start(tiny_model_path: str, rollout_workers: int, reward: str = "exact_match") -> tuple[Cluster, Cluster]:
    rollout = start_rollout(tiny_model_path, rollout_workers)
    scorer = Cluster("reward", RewardWorker, 1, reward, plugins=["rollout_test_rewards"])
    rollout.setup()
    return rollout, scorer


def make_scheduler(rollout, scorer, prompts, tokenizer, backend=None, **spec) -> RolloutScheduler:
    spec = SchedulerSpec(**{"rollout_batch_size": 4, "num_return_sequences": 4, **spec})
    order = PromptIterator(prompts.rows, spec.rollout_batch_size, seed=1)
    backend = backend or RayBackend(RolloutRouter(rollout), RewardDispatch(scorer, tokenizer.pad_token_id))
    return RolloutScheduler(backend, prompts, order, spec, PARAMS, tokenizer)


@pytest.mark.slow  # four rollout workers and a reward worker
def test_sync_scheduler_gives_the_batch_of_batch_generation_then_batch_scoring(
    tiny_model_path, prompts, tokenizer
):
    """Today's loop (generate the batch split over the workers, then score it) and the scheduler on fresh
    workers with the same seed sample the same tokens and give the same rewards. Needs two rollout
    clusters started from the same seed; the fast tier keeps the scheduler's other runs on Ray here and
    its logic on fake backends (test_rollout_scheduler)."""
    rollout, scorer = start(tiny_model_path, 2)
    try:
        indices = PromptIterator(prompts.rows, 4, seed=1).next_indices()
        batch = prompt_batch(prompts, indices, tokenizer.pad_token_id).repeat(4, interleave=True)
        batch = batch.union(rollout.generate(batch.select_keys(["prompt_ids", "prompt_mask"]), PARAMS))
        scores = scorer.compute_rewards(batch.select_keys(["prompt_text", "response_text", "sample"]))[
            "scores"
        ]
    finally:
        rollout.kill()
    # Fresh rollout workers (their sampling starts from the seed again); the reward worker keeps no state,
    # so it scores for the scheduler too (a second one took seconds to start).
    rollout = start_rollout(tiny_model_path, 2)
    rollout.setup()
    sched = make_scheduler(rollout, scorer, prompts, tokenizer)
    try:
        got, metrics = sched.next_batch(1)
    finally:
        sched.close()
        for cluster in (rollout, scorer):
            cluster.kill()
    assert got["sample"] == batch["sample"]
    assert torch.equal(got["response_ids"], batch["response_ids"])
    assert torch.equal(got["response_mask"], batch["response_mask"])
    assert torch.allclose(got["rollout_logprobs"], batch["rollout_logprobs"])
    assert got["response_text"] == batch["response_text"]
    assert got["finish_reason"] == batch["finish_reason"]
    assert torch.equal(got["scores"], scores)
    assert metrics["rollout/staleness_max"] == 0 and metrics["rollout/generate_s"] > 0


# That a reward starts as soon as its sample finishes, while others still generate, is proven without a
# race in two halves: the engine hands a short request over while a long one runs
# (test_continuous_batching), and the scheduler scores each result as it comes back (test_rollout_scheduler,
# on a controlled clock). Timing it here on real workers compared two clocks and failed CI once.


@pytest.mark.slow  # rollout and reward workers, two batches
def test_dynamic_sampling_trains_only_on_groups_whose_rewards_differ(tiny_model_path, prompts, tokenizer):
    """Dynamic sampling over real rollout and reward workers: two batches hold only groups whose rewards
    differ, drawing more prompts to fill them. The logic is tested on fakes; this is its Ray wiring."""
    rollout, scorer = start(tiny_model_path, 2, reward="test_even_rows_agree")
    sched = make_scheduler(rollout, scorer, prompts, tokenizer, group_filters=["equal_rewards"])
    try:
        for step in (1, 2):
            batch, metrics = sched.next_batch(step)
            groups = batch["scores"].view(4, 4)
            assert (groups.max(dim=1).values > groups.min(dim=1).values).all()
            assert all(int(s["answer"]) % 2 == 1 for s in batch["sample"])
            assert metrics["rollout/filtered_frac"] > 0
            assert metrics["rollout/prompts_per_step"] > 4
    finally:
        sched.close()
        rollout.kill()
        scorer.kill()
