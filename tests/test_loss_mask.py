"""The loss mask apart from the attention mask: a response holding tokens the policy did not sample (an
environment's observation between two turns) attends to them, but credit, logprobs and the update count
only the trained tokens. Checked against sums done by hand, through the real actor worker (no Ray)."""

from __future__ import annotations

import pytest
import torch

from roll.algorithms.functional import logprobs_from_logits
from roll.config.rlvr import AlgorithmConfig
from roll.data.batch import Batch
from roll.data.masks import last_index, loss_mask
from roll.data.padding import position_ids_from_mask
from roll.models.loading import load_tokenizer
from roll.pipelines.credit import compute_advantages, outcome_token_rewards, token_level_rewards
from roll.strategies.hf_forward import response_logprobs
from roll.workers.actor import ActorSpec, ActorWorker, OptimizerSpec
from roll.workers.base import ModelSpec

# Two turns: the policy's tokens, an observation (not trained), the policy's tokens again, padding.
ATTENDED = torch.tensor(
    [
        [1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0, 0, 0],
    ]
)
TRAINED = torch.tensor(
    [
        [1, 1, 0, 0, 1, 0, 0],  # the episode ends on an observation: the score goes to column 4
        [1, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 1],
        [1, 1, 1, 0, 0, 0, 0],  # a plain single-turn response
    ]
)


def test_last_index_is_found_by_position_not_by_count() -> None:
    assert last_index(
        torch.tensor([[1, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    ).tolist() == [
        4,
        -1,
        0,
    ]
    assert last_index(torch.zeros(2, 0)).tolist() == [-1, -1]


def test_the_outcome_reward_sits_on_the_last_trained_token() -> None:
    rewards = outcome_token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), TRAINED)
    assert rewards.nonzero().tolist() == [[0, 4], [1, 4], [2, 6], [3, 2]]
    assert rewards.sum(dim=1).tolist() == [1.0, 2.0, 3.0, 4.0]  # nothing lost to a hole
    assert torch.equal(rewards, rewards * TRAINED)


def test_a_batch_without_a_loss_mask_trains_on_every_attended_token() -> None:
    batch = Batch(tensors={"response_mask": ATTENDED})
    assert loss_mask(batch) is ATTENDED
    batch["loss_mask"] = TRAINED
    assert loss_mask(batch) is TRAINED


def test_process_rewards_on_observation_tokens_go_to_the_action_before_them() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])
    shaped = scores + 0.5  # a shaping delta of 0.5 on the last trained token
    # One reward per attended token of row 0: columns 0..5, of which 2, 3 and 5 are an observation.
    process = [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], None, None, None]
    rewards = token_level_rewards(scores, shaped, TRAINED, process, response_mask=ATTENDED)
    # 0.3 and 0.4 follow the action at column 1; 0.6 follows the one at column 4.
    assert rewards[0].tolist() == pytest.approx([0.1, 0.2 + 0.3 + 0.4, 0, 0, 0.5 + 0.6 + 0.5, 0, 0])
    assert rewards[0].sum().item() == pytest.approx(sum(process[0]) + 0.5)
    assert rewards[1].tolist() == pytest.approx([0, 0, 0, 0, 0.5, 0, 0])


@pytest.fixture(scope="module")
def batch(tiny_model_path: str) -> Batch:
    """Four prompts, each with a response of ``ATTENDED`` tokens of which ``TRAINED`` are the policy's."""
    tokenizer = load_tokenizer(tiny_model_path)
    generator = torch.Generator().manual_seed(3)
    prompts = [
        tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("1+2", "33+4", "5+5", "9+10")
    ]
    width = max(len(p) for p in prompts)
    prompt_ids = torch.full((4, width), tokenizer.pad_token_id)
    prompt_mask = torch.zeros((4, width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        prompt_ids[row, width - len(ids) :] = torch.tensor(ids)
        prompt_mask[row, width - len(ids) :] = 1
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    response_ids = torch.tensor(digits)[torch.randint(0, 10, ATTENDED.shape, generator=generator)]
    response_ids = torch.where(ATTENDED.bool(), response_ids, tokenizer.pad_token_id)
    return Batch(
        tensors={
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": response_ids,
            "response_mask": ATTENDED,
            "loss_mask": TRAINED,
            "group_index": torch.tensor([0, 0, 1, 1]),
            "scores": torch.tensor([1.0, 0.5, 0.25, 2.0]),
        }
    )


def by_hand_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """[B, R] logprobs of every response token from one plain forward pass over the whole width."""
    input_ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    logits = model(
        input_ids=input_ids, attention_mask=attention, position_ids=position_ids_from_mask(attention)
    ).logits.float()
    prompt_width = batch["prompt_ids"].shape[1]
    predicting = logits[:, prompt_width - 1 : -1]
    return logprobs_from_logits(predicting, batch["response_ids"])


@pytest.fixture
def actor(tiny_model_path: str) -> ActorWorker:
    """The real actor worker in this process, its AdamW swapped for plain SGD at lr 1 and no gradient
    clipping, so that one update moves each weight by exactly minus its gradient."""
    spec = ActorSpec(
        model=ModelSpec(path=tiny_model_path),
        optimizer=OptimizerSpec(lr=1.0, total_steps=1, max_grad_norm=0.0),
        micro_batch_size=3,  # two micro-batches: the denominator must span both
    )
    worker = ActorWorker("actor", 0, 1, spec)
    worker.setup()
    worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=1.0)
    worker.scheduler = torch.optim.lr_scheduler.LambdaLR(worker.optimizer, lambda _: 1.0)
    return worker


def test_credit_logprobs_and_the_update_count_only_trained_tokens(actor: ActorWorker, batch: Batch) -> None:
    # Credit: the outcome reward lands on the last trained token; advantages live on trained tokens only.
    rewards = token_level_rewards(batch["scores"], batch["scores"], TRAINED, response_mask=ATTENDED)
    assert last_index(rewards).tolist() == last_index(TRAINED).tolist()
    advantages, _ = compute_advantages(AlgorithmConfig(), rewards, TRAINED, batch["group_index"])
    assert torch.equal(advantages, advantages * TRAINED) and advantages.abs().sum() > 0
    # Whatever lies outside the loss mask must not count, even where an estimator left a value.
    advantages = advantages + 0.7 * (ATTENDED - TRAINED)
    batch = Batch(tensors={**batch.tensors, "advantages": advantages})

    # Logprobs: every attended token, the observation tokens too, as one plain forward pass gives them.
    model = actor.model
    logprobs = actor.compute_logprobs(batch)["logprobs"]
    with torch.no_grad():
        expected = by_hand_logprobs(model, batch) * ATTENDED
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-6)

    # The update: one SGD step of lr 1 moves the weights by minus the gradient of the token-mean PPO loss
    # over the trained tokens alone (on-policy, so the ratio is 1 and its gradient is that of logprobs).
    def by_hand_gradients(mask: torch.Tensor) -> dict[str, torch.Tensor]:
        model.zero_grad()
        (-(by_hand_logprobs(model, batch) * advantages * mask).sum() / mask.sum()).backward()
        gradients = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        model.zero_grad()
        return gradients

    gradients = by_hand_gradients(TRAINED)
    # Counting the observation tokens too would be another update: the check below can tell them apart.
    counting_all = by_hand_gradients(ATTENDED)
    assert any(not torch.allclose(gradients[n], counting_all[n]) for n in gradients)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    metrics = actor.train_step(batch)
    # At ratio 1 the PPO loss's value is -mean(A) over the trained tokens.
    assert metrics["loss"] == pytest.approx(-(advantages * TRAINED).sum().item() / TRAINED.sum().item())
    for name, p in model.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), gradients[name], rtol=1e-4, atol=1e-7)


def test_the_forward_pass_keeps_columns_after_a_hole_in_the_attention_mask(
    actor: ActorWorker, batch: Batch
) -> None:
    # Rows that attend to a few tokens then, after a gap, one more: trimming the response to the most
    # tokens a row attends to (4) would cut column 6.
    holed = torch.tensor([[1, 1, 1, 0, 0, 0, 1], [1, 1, 0, 0, 0, 1, 0]])
    batch = Batch(tensors={**batch.select([2, 3]).tensors, "response_mask": holed})
    with torch.no_grad():
        logprobs, _ = response_logprobs(actor.model, batch)
        expected = by_hand_logprobs(actor.model, batch) * holed
    assert logprobs[0, 6] != 0
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-6)
