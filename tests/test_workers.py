"""Model workers on Ray: generation, logprobs agreement after a weight transfer, data-parallel training."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from roll.config.rlvr import AlgorithmConfig
from roll.data.batch import Batch
from roll.distributed.cluster import Cluster, WorkerError
from roll.distributed.weight_sync import sync_weights
from roll.models.loading import load_tokenizer
from roll.pipelines.common import PromptSet, prompt_batch, render_prompt, response_tensors
from roll.strategies.sampling import SamplingParams
from roll.workers.actor import ActorSpec, ActorWorker, OptimizerSpec
from roll.workers.base import ModelSpec
from roll.workers.reward import RewardWorker
from roll.workers.rollout import RolloutWorker

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
        algorithm=AlgorithmConfig(),
    )


def sampled_batch(rollout: Cluster, prompts: PromptSet, pad_id: int, repeats: int = 2) -> Batch:
    batch = prompt_batch(prompts, list(range(len(prompts))), pad_id).repeat(repeats)
    return batch.union(rollout.generate(batch, SamplingParams(max_new_tokens=5)))


def test_generate_returns_masked_responses_and_matching_logprobs(tiny_model_path, prompts):
    tokenizer = load_tokenizer(tiny_model_path)
    rollout = Cluster("rollout", RolloutWorker, 2, Holder(ModelSpec(path=tiny_model_path)))
    try:
        rollout.setup()
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
    finally:
        rollout.kill()


def test_weight_transfer_makes_rollout_match_trainer(tiny_model_path, prompts):
    tokenizer = load_tokenizer(tiny_model_path)
    actor = Cluster("actor", ActorWorker, 1, actor_spec(tiny_model_path))
    rollout = Cluster("rollout", RolloutWorker, 1, Holder(ModelSpec(path=tiny_model_path)))
    try:
        actor.setup()
        rollout.setup()
        batch = sampled_batch(rollout, prompts, tokenizer.pad_token_id)
        batch["group_index"] = torch.arange(len(batch)) // 2
        batch["advantages"] = torch.randn(len(batch), 1).expand_as(batch["rollout_logprobs"]).contiguous()
        before = rollout.compute_logprobs(batch)["logprobs"]
        actor.train_step(batch)
        trained = actor.compute_logprobs(batch)["logprobs"]
        assert not torch.allclose(trained, before, atol=1e-4), "the train step changed nothing"

        sync_weights(actor, rollout, version=1)
        torch.testing.assert_close(rollout.compute_logprobs(batch)["logprobs"], trained, atol=1e-5, rtol=1e-5)
        with pytest.raises(WorkerError, match=r"(?s)rollout rank 0.*not newer"):
            rollout.load_weights(actor.export_weights(), 1)
    finally:
        actor.kill()
        rollout.kill()


def test_two_rank_training_equals_one_rank(tiny_model_path, prompts):
    """Gradients all-reduced over a global token count: 2 ranks x half batch == 1 rank x whole batch."""
    tokenizer = load_tokenizer(tiny_model_path)
    batch = prompt_batch(prompts, list(range(len(prompts))), tokenizer.pad_token_id)
    # Unequal response lengths per rank make a per-rank mean differ from the global token mean.
    answers = ["3", "34", "100", "18"]
    for key, value in response_tensors(tokenizer, answers, length=5).items():
        batch[key] = value

    def train(world_size: int) -> tuple[list[float], torch.Tensor]:
        actor = Cluster("actor", ActorWorker, world_size, actor_spec(tiny_model_path))
        try:
            master = actor.master_address() if world_size > 1 else (None, None)
            actor.setup(master_addr=master[0], master_port=master[1])
            losses = [actor.sft_step(batch)["loss"] for _ in range(3)]
            return losses, actor.compute_logprobs(batch)["logprobs"]
        finally:
            actor.kill()

    one_losses, one_logprobs = train(1)
    two_losses, two_logprobs = train(2)
    assert pytest.approx(one_losses, abs=1e-4) == two_losses
    assert one_losses[-1] < one_losses[0]
    torch.testing.assert_close(one_logprobs, two_logprobs, atol=1e-4, rtol=1e-4)


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
