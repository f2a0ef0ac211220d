"""Trainer state for checkpoints: ``save_state`` / ``load_state`` continue training exactly (one rank and
two FSDP ranks), weights holding NaN are never saved, and ``nonfinite_grads`` skips or stops an update
whose gradient norm is NaN."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from roll.data.batch import Batch
from roll.distributed.cluster import Cluster, WorkerError
from roll.distributed.dispatch import Dispatch
from roll.distributed.worker import register
from roll.pipelines.common import setup_with_rendezvous
from roll.workers.actor import ActorSpec, ActorWorker, CrossEntropySpec, OptimizerSpec
from roll.workers.base import ModelSpec

pytestmark = pytest.mark.usefixtures("ray_session")


class PoisonableActor(ActorWorker):
    """An actor whose next gradients, or whose weights, a test can turn into NaN."""

    @register(Dispatch.ONE_TO_ALL)
    def poison_next_gradients(self) -> None:
        param = next(self.model.parameters())
        handle = param.register_hook(lambda grad: grad * float("nan"))
        self._poison = handle

    @register(Dispatch.ONE_TO_ALL)
    def heal(self) -> None:
        self._poison.remove()

    @register(Dispatch.ONE_TO_ALL)
    def poison_weights(self) -> None:
        with torch.no_grad():
            next(self.model.parameters()).fill_(float("nan"))

    @register(Dispatch.ONE_TO_ALL)
    def lr_step(self) -> int:
        return self.scheduler.last_epoch

    @register(Dispatch.ONE_TO_ALL)
    def set_nonfinite_grads(self, choice: str) -> None:
        """As if the actor had been started with ``nonfinite_grads=choice`` (one start instead of two)."""
        self.config = dataclasses.replace(self.config, nonfinite_grads=choice)


@pytest.fixture
def batch(sft_batch: Batch) -> Batch:
    return sft_batch


def start(tiny_model_path: str, world_size: int = 1, **changes: object) -> Cluster:
    spec = ActorSpec(
        model=ModelSpec(path=tiny_model_path),
        optimizer=OptimizerSpec(lr=1e-2, total_steps=10, warmup_steps=2, lr_scheduler="cosine"),
        micro_batch_size=4,
        loss=CrossEntropySpec(),
    )
    actor = Cluster("actor", PoisonableActor, world_size, dataclasses.replace(spec, **changes))
    setup_with_rendezvous(actor)
    return actor


# Two ranks start a two-process cluster: the fast suite keeps one.
@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_loaded_state_trains_on_exactly_like_the_saved_one(
    tiny_model_path: str, batch: Batch, tmp_path: Path, world_size: int
) -> None:
    """Weights, AdamW moments and the LR schedule (warmup + cosine) come back: the steps after a load
    give the losses the original went on to give."""
    actor = start(tiny_model_path, world_size)
    try:
        # The first step's loss is a fresh start's (same model, same batch): what a loaded state must
        # not give (a second fresh cluster took seconds to say the same).
        first_fresh = actor.train_step(batch)["loss"]
        for _ in range(2):
            actor.train_step(batch)
        actor.save_state(str(tmp_path / "state"))
        expected = [actor.train_step(batch)["loss"] for _ in range(2)]
    finally:
        actor.kill()
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [
        "dcp",
        *(f"rank_{r}.pt" for r in range(world_size)),
    ]
    fresh = start(tiny_model_path, world_size)
    try:
        fresh.load_state(str(tmp_path / "state"))
        assert fresh.lr_step() == [3] * world_size
        got = [fresh.train_step(batch)["loss"] for _ in range(2)]
    finally:
        fresh.kill()
    assert got == pytest.approx(expected, abs=1e-6)
    assert abs(got[0] - first_fresh) > 1e-3  # the loaded state is not the initial one


def test_nonfinite_gradients_skip_the_update_or_stop_and_nonfinite_weights_are_never_saved(
    tiny_model_path: str, batch: Batch, tmp_path: Path
) -> None:
    """``skip``: a NaN gradient norm leaves weights and LR schedule as they were and counts the skip;
    the next finite step trains as usual. ``stop``: the error names the role, the rank and the option.
    Weights holding NaN are refused at save, and nothing is written. One actor plays all three (each
    start costs seconds)."""
    actor = start(tiny_model_path)
    try:
        before = actor.compute_logprobs(batch)["logprobs"]
        actor.poison_next_gradients()
        skipped = actor.train_step(batch)
        assert skipped["skipped_frac"] == 1.0 and actor.lr_step() == [0]
        torch.testing.assert_close(actor.compute_logprobs(batch)["logprobs"], before, rtol=0, atol=0)
        actor.heal()
        assert actor.train_step(batch)["skipped_frac"] == 0.0 and actor.lr_step() == [1]

        actor.set_nonfinite_grads("stop")
        actor.poison_next_gradients()
        with pytest.raises(WorkerError, match="gradient norm is nan.*actor.nonfinite_grads=skip"):
            actor.train_step(batch)

        actor.poison_weights()
        with pytest.raises(WorkerError, match="NaN or infinity.*not written"):
            actor.save_state(str(tmp_path / "state"))
    finally:
        actor.kill()
    assert not (tmp_path / "state" / "dcp").exists()
