"""The actor's loss is one object its spec selects (``roll.workers.actor_losses``): one ``train_step`` for
every pipeline. What each loss computes is tested with its pipeline (RL, SFT, DPO, distillation)."""

from __future__ import annotations

import pytest
from in_process_actor import Actor

from roll.data.batch import Batch
from roll.workers.actor_losses import (
    CrossEntropySpec,
    DistillLossSpec,
    PolicyLossSpec,
    PreferenceLossSpec,
    cross_entropy,
    distill_loss,
    loss_function,
    policy_loss,
    preference_loss,
)


def test_each_spec_selects_its_loss_and_a_stranger_is_named() -> None:
    assert loss_function(PolicyLossSpec()) is policy_loss
    assert loss_function(CrossEntropySpec()) is cross_entropy
    assert loss_function(PreferenceLossSpec()) is preference_loss
    assert loss_function(DistillLossSpec()) is distill_loss
    # How each normalises is the loss's own, not an option (only RL's loss_agg_mode is configured).
    assert PreferenceLossSpec().loss_agg_mode == "seq-mean-token-sum"
    assert PolicyLossSpec(loss_agg_mode="seq-mean-token-mean").loss_agg_mode == "seq-mean-token-mean"
    with pytest.raises(TypeError, match="ActorSpec.loss must be one of PolicyLossSpec, CrossEntropySpec"):
        loss_function(object())


def test_a_kl_coefficient_is_refused_by_a_loss_without_a_kl_term(
    tiny_model_path: str, sft_batch: Batch
) -> None:
    with Actor(tiny_model_path, "float32") as actor:
        with pytest.raises(
            ValueError, match="kl_coef is a policy loss's option; this actor trains CrossEntropySpec"
        ):
            actor.train_step(sft_batch, kl_coef=0.1)
        assert actor.train_step(sft_batch)["loss"] > 0  # SFT: the cross-entropy of the answers
