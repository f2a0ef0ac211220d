"""Model workers on Ray: generation, logprobs agreement after a weight transfer, data-parallel training."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import ray
import torch

from roll.data.batch import Batch
from roll.data.micro_batches import row_tokens
from roll.data.prompts import PromptSet, render_prompt
from roll.distributed.cluster import Cluster, WorkerError, wait_all
from roll.distributed.dispatch import Dispatch
from roll.distributed.weight_sync import WeightSync, WeightSyncError
from roll.distributed.worker import register
from roll.models.loading import load_tokenizer
from roll.pipelines.common import prompt_batch, response_tensors, setup_with_rendezvous
from roll.strategies.requests import GenerateRequest, GenerateResult, SamplingParams
from roll.workers.actor import ActorSpec, ActorWorker, CrossEntropySpec, OptimizerSpec
from roll.workers.base import ModelSpec
from roll.workers.reward import RewardWorker
from roll.workers.rollout import RolloutSpec, RolloutWorker

pytestmark = pytest.mark.usefixtures("ray_session")


@dataclasses.dataclass
class Holder:
    model: ModelSpec


@pytest.fixture(scope="module")
def prompts(tiny_model_path) -> PromptSet:
    tokenizer = load_tokenizer(tiny_model_path)
    rows = [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a, b in [(1, 2), (30, 4), (55, 45), (9, 9)]]
    texts = [render_prompt(tokenizer, r["prompt"], True) for r in rows]
    return PromptSet(rows, texts, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])


def actor_spec(tiny_model_path: str, lr: float = 1e-2) -> ActorSpec:
    return ActorSpec(
        model=ModelSpec(path=tiny_model_path),
        optimizer=OptimizerSpec(lr=lr, total_steps=10),
        micro_batch_size=4,
    )


def sampled_batch(rollout: Cluster, prompts: PromptSet, pad_id: int, repeats: int = 2) -> Batch:
    batch = prompt_batch(prompts, list(range(len(prompts))), pad_id).repeat(repeats)
    return batch.union(rollout.generate(batch, SamplingParams(max_new_tokens=5)))


@pytest.fixture(scope="module")
def one_slot_rollout(tiny_model_path):
    """Two rollout workers that decode one request at a time, shared by the module's tests (each start of
    two model workers costs seconds of imports); the weight-transfer test, which moves their weights, comes
    after the tests that read weights version 0."""
    spec = RolloutSpec(model=ModelSpec(path=tiny_model_path), max_running_requests=1)
    rollout = Cluster("rollout", RolloutWorker, 2, spec)
    try:
        rollout.setup()
        yield rollout
    finally:
        rollout.kill()


def test_generate_returns_masked_responses_and_matching_logprobs(one_slot_rollout, tiny_model_path, prompts):
    tokenizer = load_tokenizer(tiny_model_path)
    rollout = one_slot_rollout
    batch = sampled_batch(rollout, prompts, tokenizer.pad_token_id)
    assert batch["response_ids"].shape == (8, 5)
    mask = batch["response_mask"]
    # The mask is a prefix of ones, ending at the first EOS when the response stopped.
    assert torch.all(mask[:, 1:] <= mask[:, :-1])
    for ids, m, reason in zip(batch["response_ids"], mask, batch["finish_reason"]):
        kept = ids[m.bool()].tolist()
        assert (reason == "stop") == (tokenizer.eos_token_id in kept)
        assert torch.all(ids[~m.bool()] == tokenizer.pad_token_id)
    # The sampler's logprobs are the trainer's logprobs of the same tokens.
    recomputed = rollout.compute_logprobs(batch)["logprobs"]
    torch.testing.assert_close(recomputed, batch["rollout_logprobs"], atol=1e-4, rtol=1e-4)


def collect_from(rollout: Cluster, rank: int, count: int) -> dict[str, GenerateResult]:
    """``collect_finished`` on one rank until ``count`` results are in, none of them twice."""
    results: dict[str, GenerateResult] = {}
    deadline = time.monotonic() + 300
    while len(results) < count and time.monotonic() < deadline:
        for result in rollout.call_rank(rank, "collect_finished", 5.0, timeout_s=120):
            assert result.request_id not in results, f"{result.request_id} delivered twice"
            results[result.request_id] = result
    assert len(results) == count, f"only {sorted(results)} finished"
    return results


def test_rollout_worker_serves_groups_on_one_rank_with_version_zero(one_slot_rollout, prompts):
    """The rollout scheduler's path: a group in with submit_many on one rank, results out with
    collect_finished, aborts with abort_many; tokens before any sync carry weights version 0."""
    rollout = one_slot_rollout
    greedy = SamplingParams(max_new_tokens=4, greedy=True)
    group = [GenerateRequest(f"group-{i}", prompts.token_ids[0], greedy) for i in range(3)]
    rollout.call_rank(1, "submit_many", group)
    results = collect_from(rollout, 1, 3)
    assert rollout.call_rank(0, "collect_finished", 0.0) == []  # the group went to rank 1 only
    tokens = {tuple(result.token_ids) for result in results.values()}
    assert len(tokens) == 1, "greedy samples of one prompt differ"
    for result in results.values():
        assert result.weight_versions == [0] * len(result.token_ids) and result.token_ids

    # One slot: "running" decodes while "waiting" is queued behind it. Greedy, this prompt meets no
    # EOS, so "running" would go on for 100,000 steps (many minutes), far longer than the aborts take
    # to arrive however busy the machine.
    long = SamplingParams(max_new_tokens=100_000, greedy=True)
    prefilled = rollout.call_rank(0, "prefix_stats")["prefill_tokens"]
    rollout.call_rank(
        0,
        "submit_many",
        [GenerateRequest(name, prompts.token_ids[1], long) for name in ("running", "waiting")],
    )
    # Once its prompt is prefilled "running" is in the batch: aborted from then on, it keeps the
    # token of the step in progress (aborted before, it would end with none, like "waiting").
    deadline = time.monotonic() + 300
    while rollout.call_rank(0, "prefix_stats")["prefill_tokens"] == prefilled:
        assert time.monotonic() < deadline, '"running" was never admitted'
        time.sleep(0.01)
    assert rollout.call_rank(0, "abort_many", ["waiting", "never-submitted"]) == [True, False]
    aborted_running = rollout.call_rank(0, "abort_many", ["running"])
    results = collect_from(rollout, 0, 2)
    assert results["waiting"] == GenerateResult("waiting", [], [], "abort")
    running = results["running"]
    assert aborted_running == [True] and running.finish_reason == "abort"
    assert 0 < len(running.token_ids) < long.max_new_tokens
    assert set(running.weight_versions) == {0}


@pytest.mark.slow  # two FSDP2 trainer ranks
def test_weight_transfer_makes_rollout_match_trainer(one_slot_rollout, tiny_model_path, prompts):
    """Two FSDP2 trainer ranks send to the module's two rollout workers in small buckets; afterwards the
    engines' logprobs equal the trainer's (tolerance 1e-5: the same fp32 weights, bit for bit). It moves
    those workers to weights version 1, so it comes after the tests that read version 0."""
    tokenizer = load_tokenizer(tiny_model_path)
    actor = Cluster("actor", ActorWorker, 2, actor_spec(tiny_model_path))
    rollout = one_slot_rollout
    sync = WeightSync(actor, rollout, bucket_bytes=4096, timeout_s=120)
    try:
        setup_with_rendezvous(actor)
        sync.connect()
        assert len(sync.plan) > 3, "small buckets: the transfer must span several"
        batch = sampled_batch(rollout, prompts, tokenizer.pad_token_id)
        batch["group_index"] = torch.arange(len(batch)) // 2
        batch["advantages"] = torch.randn(len(batch), 1).expand_as(batch["rollout_logprobs"]).contiguous()
        before = rollout.compute_logprobs(batch)["logprobs"]
        actor.train_step(batch)
        trained = actor.compute_logprobs(batch)["logprobs"]
        assert not torch.allclose(trained, before, atol=1e-4), "the train step changed nothing"

        stats = sync.sync(version=1)
        assert stats["bytes"] > 0 and stats["buckets"] == len(sync.plan)
        torch.testing.assert_close(rollout.compute_logprobs(batch)["logprobs"], trained, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="not newer"):
            sync.sync(version=1)
    finally:
        sync.close()
        actor.kill()


class StuckRolloutWorker(RolloutWorker):
    """Rank 1 stops answering in the middle of a weight transfer."""

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self, plan: list, version: int, timeout_s: float) -> dict[str, float]:
        if self.rank == 1:
            time.sleep(600)  # for good: the test kills this rank
        return super().receive_weights(plan, version, timeout_s)


@pytest.mark.slow  # waits out the transfer timeout
def test_stuck_rollout_worker_makes_weight_transfer_time_out(tiny_model_path):
    """A rollout rank stuck in its gloo receive makes the collective weight transfer time out naming the
    rank: needs real worker processes in a transfer group, one of them stuck."""
    actor = Cluster("actor", ActorWorker, 1, actor_spec(tiny_model_path))
    rollout = Cluster("rollout", StuckRolloutWorker, 2, Holder(ModelSpec(path=tiny_model_path)))
    try:
        wait_all(actor.setup(blocking=False), rollout.setup(blocking=False))
        # The collective path: this worker is stuck in its gloo receive (test_shm_weight_sync.py covers
        # the shared-memory one, which same-node workers take by default).
        # Joining the group with a roomy timeout (every rank must arrive, however busy the machine); only
        # the transfer under test gets the short one.
        sync = WeightSync(actor, rollout, bucket_bytes=1 << 20, timeout_s=120, transport="collective")
        sync.connect()
        sync.timeout_s = 2
        start = time.monotonic()
        with pytest.raises(WeightSyncError) as error:
            sync.sync(version=1)
        # The transfer gives up within about 1.5 x 2 s + 10 s: far below rank 1's 600 s sleep.
        assert time.monotonic() - start < 60, "the timeout must end the transfer, not a hang"
        message = str(error.value)
        assert "version 1" in message and "from actor rank 0" in message
        assert "rollout rank 1 did not answer" in message
    finally:
        # Rank 1 sleeps on purpose: asked to shut down, it would hold kill() up for the full 10 s bound.
        ray.kill(rollout.workers[1])
        actor.kill()
        rollout.kill()


@pytest.mark.slow  # two FSDP2 ranks against one
def test_two_rank_fsdp_training_equals_one_rank(tiny_model_path, prompts, tmp_path):
    """2 FSDP2 ranks x half batch == 1 rank x whole batch, losses within 1e-4 over 3 steps, also with
    dynamic micro-batches (a token budget that gives the two ranks different micro-batch counts); the
    checkpoint the two ranks save together is the trained model in plain HF format."""
    from roll.models.loading import load_causal_lm
    from roll.strategies.hf_forward import response_logprobs

    tokenizer = load_tokenizer(tiny_model_path)
    batch = prompt_batch(prompts, list(range(len(prompts))), tokenizer.pad_token_id)
    # Unequal response lengths per rank make a per-rank mean differ from the global token mean.
    answers = ["3", "34", "100", "18"]
    for key, value in response_tensors(tokenizer, answers, length=5).items():
        batch[key] = value

    def train(world_size: int, **spec_changes) -> tuple[list[float], torch.Tensor]:
        spec = dataclasses.replace(actor_spec(tiny_model_path), loss=CrossEntropySpec(), **spec_changes)
        actor = Cluster("actor", ActorWorker, world_size, spec)
        try:
            setup_with_rendezvous(actor)
            loads.extend(actor.loaded())
            losses = [actor.train_step(batch)["loss"] for _ in range(3)]
            if world_size > 1:
                actor.save_pretrained(str(tmp_path / "saved"))
            return losses, actor.compute_logprobs(batch)["logprobs"]
        finally:
            actor.kill()

    loads: list[dict] = []
    one_losses, one_logprobs = train(1)
    # Rank 0's rows hold 7 and 9 real tokens, rank 1's 11 and 8: a 16-token budget packs rank 0 into one
    # micro-batch and rank 1 into two, so rank 0 must split its rows to keep in lockstep.
    assert row_tokens(batch) == [7, 9, 11, 8]
    two_losses, two_logprobs = train(2, micro_batch_tokens=16)
    assert pytest.approx(one_losses, abs=1e-4) == two_losses
    assert one_losses[-1] < one_losses[0]
    torch.testing.assert_close(one_logprobs, two_logprobs, atol=1e-4, rtol=1e-4)
    # Sharded loading: each of the two ranks read only its shard from the files, never the whole model.
    whole = sum(p.numel() * 4 for p in load_causal_lm(tiny_model_path).parameters())
    assert loads[0] == {"how": "whole", "bytes_read": whole, "reason": "one float32 rank"}
    assert [load["how"] for load in loads[1:]] == ["sharded", "sharded"]
    assert all(load["bytes_read"] <= 0.6 * whole for load in loads[1:]), (loads, whole)

    saved = load_causal_lm(str(tmp_path / "saved"))
    with torch.no_grad():
        reloaded, _ = response_logprobs(saved, batch)
    torch.testing.assert_close(reloaded, one_logprobs, atol=1e-4, rtol=1e-4)
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]


def test_a_reference_on_two_ranks_holds_half_the_weights_and_scores_as_one(tiny_model_path, prompts):
    """A reference's ranks shard its weights (FSDP2, no optimizer): each reads half of them from the
    files, and its logprobs and a teacher's top-k are those of one whole replica."""
    from roll.workers.reference import ReferenceSpec, ReferenceWorker

    tokenizer = load_tokenizer(tiny_model_path)
    batch = prompt_batch(prompts, list(range(len(prompts))), tokenizer.pad_token_id)
    for key, value in response_tensors(tokenizer, ["3", "34", "100", "18"], length=5).items():
        batch[key] = value
    spec = ReferenceSpec(ModelSpec(tiny_model_path))
    one = ReferenceWorker("reference", 0, 1, spec)  # one whole replica, in this process
    one.setup()
    one_load, one_logprobs = one.loaded(), one.compute_logprobs(batch)["logprobs"]
    one_topk = one.topk_logprobs(batch, k=4, tail="extra_class")
    reference = Cluster("reference", ReferenceWorker, 2, spec)
    try:
        setup_with_rendezvous(reference)
        two_loads, two_logprobs = reference.loaded(), reference.compute_logprobs(batch)["logprobs"]
        two_topk = reference.topk_logprobs(batch, k=4, tail="extra_class")
    finally:
        reference.kill()
    assert one_load["how"] == "whole" and [load["how"] for load in two_loads] == ["sharded", "sharded"]
    assert all(load["bytes_read"] <= 0.6 * one_load["bytes_read"] for load in two_loads), two_loads
    torch.testing.assert_close(two_logprobs, one_logprobs, atol=1e-5, rtol=1e-5)
    assert two_topk["teacher_indices"].dtype == torch.long
    assert torch.equal(two_topk["teacher_indices"], one_topk["teacher_indices"])
    torch.testing.assert_close(
        two_topk["teacher_logprobs"], one_topk["teacher_logprobs"], atol=1e-5, rtol=1e-5
    )


def test_reward_worker_error_names_role_and_rank():
    reward = Cluster("reward", RewardWorker, 1, "exact_match")
    try:
        batch = Batch(
            non_tensors={"prompt_text": ["1+1"], "response_text": ["2"], "sample": [{"prompt": "1+1"}]}
        )
        with pytest.raises(WorkerError, match=r"(?s)reward rank 0 failed in compute_rewards.*answer"):
            reward.compute_rewards(batch)
        batch["sample"] = [{"answer": "2"}]
        assert reward.compute_rewards(batch)["scores"].tolist() == [1.0]
    finally:
        reward.kill()
