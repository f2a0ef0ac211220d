"""The value model and the critic worker: loading with a fresh head, per-token values, training on
returns, and data-parallel training equal to one rank."""

from __future__ import annotations

import pytest
import torch

from roll.data.batch import Batch
from roll.data.prompts import PromptSet, render_prompt
from roll.distributed.cluster import Cluster
from roll.models.loading import load_tokenizer, load_value_model
from roll.pipelines.common import prompt_batch, response_tensors
from roll.strategies.hf_forward import response_values
from roll.workers.base import ModelSpec
from roll.workers.critic import CriticSpec, CriticWorker
from roll.workers.trainer import OptimizerSpec


@pytest.fixture(scope="module")
def batch(tiny_model_path) -> Batch:
    """Four prompts with responses of different lengths; returns are each response's target value."""
    tokenizer = load_tokenizer(tiny_model_path)
    rows = [{"prompt": f"{a}+{b}"} for a, b in [(1, 2), (30, 4), (55, 45), (9, 9)]]
    texts = [render_prompt(tokenizer, r["prompt"], True) for r in rows]
    prompts = PromptSet(rows, texts, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])
    batch = prompt_batch(prompts, [0, 1, 2, 3], tokenizer.pad_token_id)
    for key, value in response_tensors(tokenizer, ["3", "34", "100", "18"], length=5).items():
        batch[key] = value
    mask = batch["response_mask"].float()
    batch["returns"] = torch.tensor([[1.0], [0.0], [1.0], [0.5]]) * mask
    return batch


def test_value_model_starts_at_zero_and_saves_its_head(tiny_model_path, batch, tmp_path):
    model = load_value_model(tiny_model_path)
    values = response_values(model, batch)
    assert values.shape == batch["response_ids"].shape
    assert torch.count_nonzero(values) == 0, "a fresh zero-initialised head gives zero values"
    with torch.no_grad():
        model.score.bias.fill_(0.5)
    model.save_pretrained(tmp_path / "critic")
    load_tokenizer(tiny_model_path).save_pretrained(tmp_path / "critic")
    reloaded = response_values(load_value_model(tmp_path / "critic"), batch)
    mask = batch["response_mask"].bool()
    assert torch.allclose(reloaded[mask], torch.full_like(reloaded[mask], 0.5), atol=1e-6)
    assert torch.count_nonzero(reloaded[~mask]) == 0, "values past the response are 0"


def critic_spec(tiny_model_path: str) -> CriticSpec:
    return CriticSpec(
        model=ModelSpec(path=tiny_model_path),
        optimizer=OptimizerSpec(lr=3e-2, total_steps=100),
        micro_batch_size=2,
        value_clip=0.0,
    )


def train_critic(
    tiny_model_path: str, batch: Batch, world_size: int, steps: int, loads: list | None = None
) -> tuple[list[dict], torch.Tensor]:
    critic = Cluster("critic", CriticWorker, world_size, critic_spec(tiny_model_path))
    try:
        master = critic.master_address() if world_size > 1 else (None, None)
        critic.setup(master_addr=master[0], master_port=master[1])
        if loads is not None:
            loads.extend(critic.loaded())
        history = []
        for _ in range(steps):
            batch["values"] = critic.compute_values(batch)["values"]
            history.append(critic.train_step(batch))
        return history, critic.compute_values(batch)["values"]
    finally:
        critic.kill()


@pytest.mark.usefixtures("ray_session")
def test_critic_learns_the_returns(tiny_model_path, batch):
    history, values = train_critic(tiny_model_path, batch, world_size=1, steps=30)
    losses = [row["loss"] for row in history]
    assert losses[-1] < 0.1 * losses[0], losses
    mask = batch["response_mask"].bool()
    assert torch.allclose(values[mask], batch["returns"][mask], atol=0.15)
    assert history[-1]["explained_variance"] > 0.8


@pytest.mark.slow  # two FSDP2 ranks; the fast suite keeps the one-rank critic tests
@pytest.mark.usefixtures("ray_session")
def test_two_rank_critic_equals_one_rank(tiny_model_path, batch):
    """Two FSDP2 critic ranks over gloo train exactly as one: needs two worker processes and a collective,
    which the one-rank critic tests cannot show. The two load by shards: each reads half the weights
    from the policy's files, and the head the files lack starts at zero, as a whole load's does."""
    loads: list[dict] = []
    one, one_values = train_critic(tiny_model_path, batch, world_size=1, steps=3, loads=loads)
    two, two_values = train_critic(tiny_model_path, batch, world_size=2, steps=3, loads=loads)
    assert loads[0]["how"] == "whole" and [load["how"] for load in loads[1:]] == ["sharded", "sharded"]
    assert all(load["bytes_read"] <= 0.6 * loads[0]["bytes_read"] for load in loads[1:]), loads
    assert pytest.approx([r["loss"] for r in one], abs=1e-5) == [r["loss"] for r in two]
    torch.testing.assert_close(one_values, two_values, atol=1e-4, rtol=1e-4)
