"""Ulysses sequence parallelism (``roll.strategies.sequence_parallel``): two gloo ranks of one sequence
group compute what one rank computes on the same rows.

The two ranks are real processes (forkserver, no Ray, as in test_two_rank_bf16), each the real actor
worker and then the real critic worker with ``sequence_parallel_size: 2``, both given the whole batch (as
the dispatch gives a sequence group's ranks the same rows). The parent runs one-rank workers on the same
batch in its own process and compares logprobs, values, the losses and entropy they report, and every
gradient, in float32. The actor checkpoints its blocks' activations (the recomputation goes through the
all-to-alls again); its model has fewer KV heads than ranks (the KV heads are repeated), the critic's as
many as ranks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch
from test_two_rank_bf16 import capture_step, cpu_only, results_of, stop

from roll.config.common import TinyModelConfig
from roll.data.batch import Batch
from roll.distributed import ports
from roll.distributed.dispatch import Dispatch, dispatch_mode
from roll.models.tiny import save_tiny_model
from roll.strategies.sequence_parallel import SequenceGroup, split_pack
from roll.workers.actor import ActorSpec, ActorWorker, OptimizerSpec, PolicyLossSpec
from roll.workers.base import ModelSpec
from roll.workers.critic import CriticSpec, CriticWorker

SIZE = 2


def actor_spec(path: str, size: int) -> ActorSpec:
    return ActorSpec(
        model=ModelSpec(path=path, attn_implementation="sdpa_varlen"),
        optimizer=OptimizerSpec(lr=1e-3, total_steps=4),
        micro_batch_size=2,  # two micro-batches: accumulation across them too
        loss=PolicyLossSpec(entropy_coef=0.01),
        gradient_checkpointing=size > 1,
        sequence_parallel_size=size,
    )


def critic_spec(path: str, size: int) -> CriticSpec:
    return CriticSpec(
        model=ModelSpec(path=path, attn_implementation="sdpa_varlen"),
        optimizer=OptimizerSpec(lr=1e-3, total_steps=4),
        micro_batch_size=4,
        sequence_parallel_size=size,
    )


def run_actor(worker: ActorWorker, batch: Batch) -> dict:
    logprobs = worker.compute_logprobs(batch)["logprobs"]
    seen = capture_step(worker)
    metrics = worker.train_step(batch)
    return {"logprobs": logprobs, "metrics": metrics, "grads": seen["grads"]}


def run_critic(worker: CriticWorker, batch: Batch) -> dict:
    values = worker.compute_values(batch)["values"]
    seen = capture_step(worker)
    metrics = worker.train_step(batch)
    return {"values": values, "metrics": metrics, "grads": seen["grads"]}


def _rank_main(rank: int, ports_: tuple[int, int], paths: tuple[str, str], batch_file: str, out: str) -> None:
    import roll.workers.base

    os.environ["ROLL_CPU_THREADS"] = str(SIZE)
    roll.workers.base.pick_device = cpu_only
    batch = torch.load(batch_file, weights_only=False)
    actor = ActorWorker("actor", rank, SIZE, actor_spec(paths[0], SIZE))
    actor.setup("127.0.0.1", ports_[0])
    actor_seen = run_actor(actor, batch)
    actor.shutdown()
    critic = CriticWorker("critic", rank, SIZE, critic_spec(paths[1], SIZE))
    critic.setup("127.0.0.1", ports_[1])
    critic_seen = run_critic(critic, batch)
    critic.shutdown()
    torch.save({"actor": actor_seen, "critic": critic_seen}, out)


@pytest.fixture(scope="module")
def critic_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Two blocks, four query heads and two KV heads: as many KV heads as ranks."""
    cfg = TinyModelConfig(
        alphabet="0123456789+",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return str(save_tiny_model(cfg, tmp_path_factory.mktemp("models") / "four_heads"))


def rl_batch(sft_batch: Batch) -> Batch:
    """The SFT rows as RL samples: advantages, old logprobs off the current ones (the ratio is clipped
    somewhere), values and returns for the critic."""
    generator = torch.Generator().manual_seed(0)
    batch = sft_batch.select_keys(sft_batch.tensors)
    shape = batch["response_ids"].shape
    batch["advantages"] = torch.randn(shape, generator=generator)
    batch["old_logprobs"] = -2.5 + 0.5 * torch.randn(shape, generator=generator)
    batch["values"] = 0.1 * torch.randn(shape, generator=generator)
    batch["returns"] = torch.randn(shape, generator=generator)
    return batch


def test_two_sequence_parallel_ranks_compute_what_one_rank_does(
    tiny_model_path: str, critic_model_path: str, sft_batch: Batch, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("ROLL_CPU_THREADS", "1")
    monkeypatch.setattr("roll.workers.base.pick_device", cpu_only)
    threads = torch.get_num_threads()
    batch = rl_batch(sft_batch)
    torch.save(batch, tmp_path / "batch.pt")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", __name__])
    rendezvous = (ports.free_port("127.0.0.1"), ports.free_port("127.0.0.1"))
    paths = (tiny_model_path, critic_model_path)
    outs = [tmp_path / f"rank_{rank}.pt" for rank in range(SIZE)]
    processes = [
        ctx.Process(target=_rank_main, args=(rank, rendezvous, paths, str(tmp_path / "batch.pt"), str(out)))
        for rank, out in enumerate(outs)
    ]
    for process in processes:
        process.start()
    try:
        actor = ActorWorker("actor", 0, 1, actor_spec(tiny_model_path, 1))
        actor.setup()
        one_actor = run_actor(actor, batch)
        actor.shutdown()
        critic = CriticWorker("critic", 0, 1, critic_spec(critic_model_path, 1))
        critic.setup()
        one_critic = run_critic(critic, batch)
        critic.shutdown()
        ranks = results_of(processes, outs)
    finally:
        torch.set_num_threads(threads)
        stop(processes)

    close = {"atol": 1e-6, "rtol": 1e-5}  # float32 rounding: the ranks sum the heads' parts in another order
    for rank in ranks:  # both ranks hold the whole batch's results and the same reduced gradients
        torch.testing.assert_close(rank["actor"]["logprobs"], one_actor["logprobs"], **close)
        torch.testing.assert_close(rank["critic"]["values"], one_critic["values"], **close)
        for role, one in (("actor", one_actor), ("critic", one_critic)):
            seen = rank[role]
            for key in ("loss", "entropy", "vf_loss", "grad_norm", "clipfrac", "pg_clipfrac"):
                if key in one["metrics"]:
                    assert seen["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), (role, key)
            assert seen["grads"].keys() == one["grads"].keys()
            for name, grad in one["grads"].items():
                torch.testing.assert_close(seen["grads"][name], grad, **close, msg=f"{role} {name}")
    # The step trained: a gradient that is zero everywhere would pass the comparisons above.
    assert all(g.abs().sum() > 0 for g in one_actor["grads"].values())
    assert one_actor["metrics"]["loss"] != 0 and 0 < one_actor["metrics"]["entropy"]


def test_a_pack_is_split_into_equal_slices_that_keep_their_positions() -> None:
    """Seven tokens over two ranks: padded to eight with a sequence of its own; each rank's kept positions
    are those in its slice, relative to it."""
    ids = torch.arange(10, 17)[None]
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    kept = torch.tensor([1, 2, 3, 5])
    slices = [split_pack(SequenceGroup(2, rank, None), ids, positions, kept) for rank in range(2)]
    (ids0, pos0, kept0, here0, shard), (ids1, pos1, kept1, here1, _) = slices
    assert ids0.tolist() == [[10, 11, 12, 13]] and ids1.tolist() == [[14, 15, 16, 0]]
    assert pos0.tolist() == [[0, 1, 2, 3]] and pos1.tolist() == [[0, 1, 2, 0]]
    assert shard.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert kept0.tolist() == [1, 2, 3] and kept1.tolist() == [1]
    assert here0.tolist() == [True, True, True, False] and here1.tolist() == [False, False, False, True]
    assert shard.kept_counts == (3, 1)


def test_data_parallel_dispatch_gives_a_sequence_group_one_shard() -> None:
    """Four ranks in groups of two: two shards, each to both ranks of its group; the results of a group's
    first rank are kept."""
    batch = Batch(tensors={"x": torch.arange(8)[:, None]})
    mode = dispatch_mode(Dispatch.DP_COMPUTE, replicas=2)
    per_rank = mode.split(4, (batch,), {})
    shards = [args[0]["x"].flatten().tolist() for args, _ in per_rank]
    assert shards == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
    results = [Batch(tensors={"y": torch.tensor([[rank]])}) for rank in range(4)]
    assert mode.collect(results)["y"].flatten().tolist() == [0, 2]


@pytest.mark.slow  # two short RLVR runs on Ray
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_a_sequence_parallel_run_logs_what_the_data_parallel_one_does(tmp_path: Path) -> None:
    """The quickstart without its warm start (16 samples a step), two steps on two actor ranks with a KL
    term (so a reference scores on those ranks too): as two sequence-parallel ranks, the same rewards,
    losses, KL, entropy and gradient norms as two data-parallel ones."""
    from test_pipelines_cli import metrics, train_in_process

    runs = {}
    for size in (1, 2):
        out = tmp_path / f"sp{size}"
        train_in_process(
            "examples/quickstart.yaml",
            f"output_dir={out}",
            "sft_warm_start=null",
            "steps=2",
            "eval.every_steps=0",
            "rollout.rollout_batch_size=4",
            "rollout.num_return_sequences=4",
            "tracking.backends=[jsonl]",
            "model.attn_implementation=sdpa_varlen",
            "actor.world_size=2",
            f"actor.sequence_parallel_size={size}",
            "algorithm.kl_coef=0.05",
        )
        runs[size] = [row for row in metrics(out) if "actor/loss" in row]
    one, two = runs[1], runs[2]
    assert len(one) == len(two) == 2
    for row_one, row_two in zip(one, two):
        for key in ("reward/mean", "actor/loss", "actor/kl", "actor/entropy", "actor/grad_norm"):
            assert row_two[key] == pytest.approx(row_one[key], rel=1e-4, abs=1e-6), key
