"""Weight transfer through shared memory on one node: the path choice (pure), the segment (in-process,
two mappings of one file) and the whole WeightSync between Ray workers, with the collective fallback."""

from __future__ import annotations

import dataclasses
import errno
import glob
import os
import time
from pathlib import Path

import pytest
import ray
import torch

from roll.distributed.dispatch import Dispatch
from roll.distributed.shm_transfer import (
    HEADER_BYTES,
    PREFIX,
    Endpoint,
    SharedWeights,
    SharedWeightsError,
    read_weights,
    segment_layout,
    write_weights,
)
from roll.distributed.weight_buckets import metas_of, plan_buckets
from roll.distributed.weight_sync import COLLECTIVE, SHM, choose_transport
from roll.distributed.worker import register
from roll.workers.rollout import RolloutWorker

GIB = 1 << 30


def endpoint(node: str = "n1", ip: str = "10.0.0.1", device: str = "cpu", free: int = 8 * GIB) -> Endpoint:
    return Endpoint(node_id=node, ip=ip, host="h", device=device, shm_free_bytes=free)


# ---------------------------------------------------------------- pure: which path


def test_one_node_cpu_receivers_take_shared_memory() -> None:
    choice = choose_transport(endpoint(), [endpoint(), endpoint()], nbytes=GIB)
    assert choice.path == SHM and "2 rollout ranks" in choice.reason


def test_another_node_a_gpu_engine_or_a_small_shm_keep_the_collective_path() -> None:
    other_node = choose_transport(endpoint(), [endpoint(), endpoint(node="n2", ip="10.0.0.2")], GIB)
    assert other_node.path == COLLECTIVE and "rollout rank 1 is on node 10.0.0.2" in other_node.reason
    # Same IP but another Ray node (e.g. two raylets on one host): not trusted to share /dev/shm.
    assert choose_transport(endpoint(), [endpoint(node="n2")], GIB).path == COLLECTIVE
    gpu = choose_transport(endpoint(), [endpoint(device="cuda")], GIB)
    assert gpu.path == COLLECTIVE and "rollout rank 0 holds its weights on cuda" in gpu.reason
    small = choose_transport(endpoint(free=GIB), [endpoint()], GIB, headroom_bytes=1 << 20)
    assert small.path == COLLECTIVE and "1024 MiB free" in small.reason and "need 1024 MiB" in small.reason
    assert choose_transport(endpoint(), [endpoint()], GIB, requested="collective").path == COLLECTIVE
    with pytest.raises(ValueError, match="unknown weight transport 'rdma'"):
        choose_transport(endpoint(), [endpoint()], GIB, requested="rdma")


# ---------------------------------------------------------------- the segment, in one process


def state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(37, 16, generator=gen),
        "layer.weight": torch.randn(16, 16, generator=gen).to(torch.bfloat16),
        "layer.t": torch.randn(16, 8, generator=gen).t(),  # non-contiguous: the generic pack path
        "scale": torch.randn((), generator=gen),
        "empty": torch.empty(0, 3),
        "counter": torch.randint(-(2**40), 2**40, (5,), generator=gen, dtype=torch.int64),
        "big.weight": torch.randn(40, 40, generator=gen),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class Counting:
    """A ``tensors_for`` counting its calls (with FSDP, each is a gather all trainer ranks make)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors, self.calls = tensors, 0

    def __call__(self, bucket: object) -> dict[str, torch.Tensor]:
        self.calls += 1
        return self.tensors


def test_segment_round_trip_is_bit_identical_and_leaves_no_file(tmp_path: Path) -> None:
    tensors = state_dict()
    plan = plan_buckets(metas_of(tensors.items()), bucket_bytes=4096)
    offsets, nbytes = segment_layout(plan)
    assert len(plan) >= 2 and offsets[0] == HEADER_BYTES and all(o % 4096 == 0 for o in offsets)
    sender = SharedWeights.create(plan, str(tmp_path))
    assert os.path.getsize(sender.info.path) == nbytes
    receiver = SharedWeights.open(sender.info, plan)
    sender.unlink()
    assert list(tmp_path.iterdir()) == []  # the name is gone, the mappings still work
    for version in (1, 2):
        model = {name: torch.zeros_like(t) for name, t in tensors.items()}

        def load(views: dict[str, torch.Tensor], model: dict = model) -> None:
            for name, view in views.items():
                model[name].copy_(view)

        source = Counting({k: v + version if v.is_floating_point() else v for k, v in tensors.items()})
        write_weights(sender, plan, source, version)
        stats = read_weights(receiver, version, load)
        assert source.calls == len(plan) and stats["buckets"] == len(plan)
        assert all(same_bits(model[name], t) for name, t in source.tensors.items())
    with pytest.raises(SharedWeightsError, match="expected version 3 .* found version 2"):
        read_weights(receiver, 3, lambda views: None)
    receiver.close()
    sender.close()
    sender.close()  # twice is harmless
    assert list(tmp_path.iterdir()) == []


def test_open_refuses_another_plan_a_missing_file_or_another_run(tmp_path: Path) -> None:
    tensors = state_dict()
    plan = plan_buckets(metas_of(tensors.items()), bucket_bytes=4096)
    sender = SharedWeights.create(plan, str(tmp_path))
    try:
        with pytest.raises(SharedWeightsError, match="weight plan here differs"):
            SharedWeights.open(sender.info, plan_buckets(metas_of(tensors.items()), bucket_bytes=1024))
        with pytest.raises(SharedWeightsError, match="not the weight segment of this run"):
            SharedWeights.open(dataclasses.replace(sender.info, nonce=sender.info.nonce + 1), plan)
        with pytest.raises(SharedWeightsError, match="not finished writing"):
            read_weights(SharedWeights.open(sender.info, plan), 1, lambda views: None)
        sender.unlink()
        with pytest.raises(SharedWeightsError, match="is not on this host"):
            SharedWeights.open(sender.info, plan)
    finally:
        sender.close()


def test_a_full_shm_is_an_oserror_with_no_file_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    plan = plan_buckets(metas_of(state_dict().items()), bucket_bytes=4096)
    with pytest.raises(OSError, match="No space"):
        SharedWeights.create(plan, str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_write_keeps_trainer_ranks_in_step_when_it_fails(tmp_path: Path) -> None:
    tensors = state_dict()
    plan = plan_buckets(metas_of(tensors.items()), bucket_bytes=4096)
    helper = Counting(tensors)
    assert write_weights(None, plan, helper, 1)["bytes"] == sum(b.nbytes for b in plan)
    assert helper.calls == len(plan)
    sender = SharedWeights.create(plan, str(tmp_path))
    try:
        wrong = Counting({**tensors, "big.weight": torch.zeros(3)})
        with pytest.raises(SharedWeightsError, match=r"writing bucket \d+/\d+ of version 2.*'big.weight'"):
            write_weights(sender, plan, wrong, 2)
        assert wrong.calls == len(plan)  # every bucket still gathered
    finally:
        sender.close()


# ---------------------------------------------------------------- WeightSync between Ray workers


def logprob_batch(model_path: str):
    """Two prompts with fixed responses: enough for the logprobs to tell weights apart."""
    from roll.data.prompts import PromptSet, render_prompt
    from roll.models.loading import load_tokenizer
    from roll.pipelines.common import prompt_batch, response_tensors

    tokenizer = load_tokenizer(model_path)
    texts = [render_prompt(tokenizer, p, True) for p in ("1+2", "30+4")]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    prompts = PromptSet([{"prompt": "1+2", "answer": "3"}, {"prompt": "30+4", "answer": "34"}], texts, ids)
    batch = prompt_batch(prompts, [0, 1], tokenizer.pad_token_id)
    for key, value in response_tensors(tokenizer, ["3", "34"], length=4).items():
        batch[key] = value
    return batch


def _our_segments() -> set[str]:
    return set(glob.glob(f"/dev/shm/{PREFIX}*"))


@pytest.mark.slow  # a trainer and a rollout worker of its own
@pytest.mark.usefixtures("ray_session")
def test_weight_sync_on_one_node_goes_through_shared_memory_or_falls_back(tiny_model_path, tmp_path):
    """Actor and rollout workers on one node exchange weights through shared memory, or over the collective
    when the shared-memory folder is missing, and the rollout then matches the trainer: needs both
    roles' worker processes."""
    from types import SimpleNamespace

    from roll.distributed.cluster import Cluster, wait_all
    from roll.distributed.weight_sync import WeightSync
    from roll.models.loading import load_causal_lm
    from roll.workers.actor import ActorSpec, ActorWorker, OptimizerSpec
    from roll.workers.base import ModelSpec

    before = _our_segments()
    model = ModelSpec(path=tiny_model_path)
    actor = Cluster(
        "actor", ActorWorker, 1, ActorSpec(model=model, optimizer=OptimizerSpec(lr=1e-2, total_steps=1))
    )
    rollout = Cluster("rollout", RolloutWorker, 2, SimpleNamespace(model=model))
    try:
        wait_all(actor.setup(blocking=False), rollout.setup(blocking=False))
        shm = WeightSync(actor, rollout, bucket_bytes=4096, timeout_s=120)
        shm.connect()
        assert shm.path == SHM and shm.path_name == "shm"
        assert _our_segments() == before, "the segment's name must be gone once every end mapped it"
        # Zero the engines' weights, so that only a sync that carried every byte restores their logprobs.
        batch = logprob_batch(tiny_model_path)
        expected = actor.compute_logprobs(batch)["logprobs"]
        # The engines' own logprobs of the weights they started with (the actor's, untrained): a sync that
        # carried every byte gives them back bit for bit. (The trainer splits the batch otherwise, and a
        # matmul's rounding may follow the rows it is given: equal to it within float32 rounding.)
        original = rollout.compute_logprobs(batch)["logprobs"]
        zeros = {
            name: torch.zeros_like(t) for name, t in load_causal_lm(tiny_model_path).state_dict().items()
        }
        rollout.load_weights(zeros, 1)
        assert not torch.allclose(rollout.compute_logprobs(batch)["logprobs"], expected)
        stats = shm.sync(version=2)
        synced = rollout.compute_logprobs(batch)["logprobs"]
        torch.testing.assert_close(synced, original, atol=0, rtol=0)
        torch.testing.assert_close(synced, expected, atol=1e-6, rtol=1e-6)
        assert stats["path"] == "shm" and stats["bytes"] > 0 and stats["gb_per_s"] > 0
        assert {"write_s", "read_s"} <= stats.keys()
        with pytest.raises(ValueError, match="not newer"):
            shm.sync(version=2)

        # A shared-memory directory that is not there has no room: the collective path, with the reason.
        nowhere = str(tmp_path / "none")
        fallback = WeightSync(actor, rollout, bucket_bytes=4096, timeout_s=120, shm_dir=nowhere)
        fallback.connect()
        assert fallback.path == COLLECTIVE and "0 MiB free" in fallback.reason
        assert fallback.sync(version=3)["path"] == "gloo"
        # Versions keep moving forward across both paths.
        assert shm.sync(version=4)["path"] == "shm"
        assert rollout.ping()  # still alive
        shm.close()
        shm.close()
    finally:
        actor.kill()
        rollout.kill()
    assert _our_segments() == before


class StuckSharedRolloutWorker(RolloutWorker):
    """Rank 1 stops answering while it should load weights from the shared segment."""

    @register(Dispatch.ONE_TO_ALL)
    def load_shared_weights(self, version: int) -> dict[str, float]:
        if self.rank == 1:
            time.sleep(600)  # for good: the test kills this rank
        return super().load_shared_weights(version)


@pytest.mark.slow  # waits out the transfer timeout
@pytest.mark.usefixtures("ray_session")
def test_a_stuck_receiver_is_a_timeout_naming_it_not_a_hang(tiny_model_path):
    """A rollout rank that never loads its shared-memory weights makes the transfer time out naming it,
    instead of hanging: needs real worker processes, one of them stuck."""
    from types import SimpleNamespace

    from roll.distributed.cluster import Cluster, wait_all
    from roll.distributed.weight_sync import WeightSync, WeightSyncError
    from roll.workers.actor import ActorSpec, ActorWorker, OptimizerSpec
    from roll.workers.base import ModelSpec

    model = ModelSpec(path=tiny_model_path)
    spec = ActorSpec(model=model, optimizer=OptimizerSpec(lr=1e-2, total_steps=1))
    actor = Cluster("actor", ActorWorker, 1, spec)
    rollout = Cluster("rollout", StuckSharedRolloutWorker, 2, SimpleNamespace(model=model))
    try:
        wait_all(actor.setup(blocking=False), rollout.setup(blocking=False))
        # Connecting with a roomy timeout (every rank must map the segment, however busy the machine);
        # only the transfer under test gets the short one.
        sync = WeightSync(actor, rollout, bucket_bytes=1 << 20, timeout_s=120)
        sync.connect()
        assert sync.path == SHM
        sync.timeout_s = 2
        start = time.monotonic()
        with pytest.raises(WeightSyncError) as error:
            sync.sync(version=1)
        # The transfer gives up within about 1.5 x 2 s + 10 s: far below rank 1's 600 s sleep.
        assert time.monotonic() - start < 60, "the timeout must end the transfer, not a hang"
        message = str(error.value)
        assert "loading weights version 1 from shared memory" in message and "from actor rank 0" in message
        assert "rollout rank 1 did not answer" in message and "(shared memory)" in message
    finally:
        # Rank 1 sleeps on purpose: asked to shut down, it would hold kill() up for the full 10 s bound.
        ray.kill(rollout.workers[1])
        actor.kill()
        rollout.kill()
