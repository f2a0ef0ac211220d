"""Mixed precision on two ranks: one bfloat16 optimizer step of the real actor worker on 2 gloo ranks (FSDP2,
``roll.strategies.fsdp.shard_model``) against the same step on one rank, and the gradient reduction between
the ranks done in float32 (``MixedPrecisionPolicy(reduce_dtype=float32)``), not in bfloat16.

The two ranks are real processes (multiprocessing "forkserver", no Ray), each an ``ActorWorker`` joined to
the other over gloo on localhost; they write what they saw to files and the parent compares it with
one-rank workers run in its own process (as test_mixed_precision does). Every process computes on the CPU
with one thread, so a rank and the one-rank worker given the same rows compute the same bits.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch
from in_process_actor import Actor

from roll.data.batch import Batch
from roll.distributed import ports
from roll.strategies.fsdp import full_tensor
from roll.workers.actor import ActorWorker

DTYPE = "bfloat16"
WORLD_SIZE = 2
# The ranks finish in seconds; only a hang (a rank that never joins its peer) would come near this.
DEADLINE_S = 300.0


def cpu_only() -> torch.device:
    return torch.device("cpu")


def capture_step(worker: ActorWorker, apply: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """Make ``worker``'s optimizer steps record the gradients they apply: whole (gathered) float32
    tensors, by name, before clipping. ``apply=False``: record them, then drop them and leave the weights,
    optimizer and schedule as they were (the step only measures the gradient of the rows it was given)."""
    seen: dict[str, dict[str, torch.Tensor]] = {}
    step = type(worker)._optimizer_step.__get__(worker)  # the class's, not an earlier capture's

    def recording_step() -> dict[str, float]:
        seen["grads"] = {n: full_tensor(p.grad).detach().clone() for n, p in worker.model.named_parameters()}
        if apply:
            return step()
        worker.optimizer.zero_grad(set_to_none=True)
        return {}

    worker._optimizer_step = recording_step
    return seen


def whole_weights(worker: ActorWorker) -> dict[str, torch.Tensor]:
    """Every weight whole (a collective when sharded: every rank calls it)."""
    return {name: full_tensor(p).detach().clone() for name, p in worker.model.named_parameters()}


def _rank_main(rank: int, port: int, model_path: str, shard_file: str, out: str) -> None:
    """One of the two trainer ranks: set up, one train step on its shard (saved in ``shard_file``), write
    what it saw to ``out``."""
    import roll.workers.base

    os.environ["ROLL_CPU_THREADS"] = str(WORLD_SIZE)  # the two ranks share two threads: one each
    roll.workers.base.pick_device = cpu_only  # the one-rank references below run on the CPU too
    worker = ActorWorker("actor", rank, WORLD_SIZE, Actor(model_path, DTYPE).worker.config)
    worker.setup("127.0.0.1", port)
    seen = capture_step(worker)
    metrics = worker.train_step(torch.load(shard_file, weights_only=False))
    weights = whole_weights(worker)
    worker.shutdown()
    torch.save({"metrics": metrics, "grads": seen["grads"], "weights": weights}, out)


def start_ranks(model_path: str, batch: Batch, directory: Path) -> tuple[list, list[Path]]:
    """The two ranks, started, each on its half of ``batch`` (as the trainer's dispatch splits it), and
    the files they will write."""
    # forkserver, not fork: children must not inherit this process's threads (Ray, gloo, OpenMP).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", __name__])
    port = ports.free_port("127.0.0.1")
    # Tensors go to the ranks and back in files: as process arguments they would travel in shared memory.
    processes, outs = [], []
    for rank, shard in enumerate(batch.chunk(WORLD_SIZE)):
        torch.save(shard, directory / f"shard_{rank}.pt")
        outs.append(directory / f"rank_{rank}.pt")
        args = (rank, port, model_path, str(directory / f"shard_{rank}.pt"), str(outs[rank]))
        processes.append(ctx.Process(target=_rank_main, args=args, daemon=True))
    for process in processes:
        process.start()
    return processes, outs


def results_of(processes: list, outs: list[Path]) -> list[dict]:
    """What each rank wrote, once both have exited with code 0. Never hangs: the wait ends at
    ``DEADLINE_S``, or as soon as a rank fails (its traceback is in the test's captured output; its peer,
    left waiting in a collective, is terminated by ``stop``)."""
    end = time.monotonic() + DEADLINE_S
    while any(p.is_alive() for p in processes) and time.monotonic() < end:
        if any(p.exitcode not in (None, 0) for p in processes):
            break
        time.sleep(0.05)
    codes = [p.exitcode for p in processes]
    assert codes == [0] * WORLD_SIZE, f"exit codes {codes} (None: still running after {DEADLINE_S:.0f} s)"
    return [torch.load(out) for out in outs]


def stop(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
        process.join(timeout=5)


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for _, t in sorted(tensors.items())])


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """||got - want|| / ||want|| over every tensor together."""
    assert got.keys() == want.keys()
    return float((flat(got) - flat(want)).norm() / flat(want).norm())


def max_relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest elementwise |got - want|, relative to the largest |want| of its tensor."""
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in want)


def test_two_bf16_ranks_step_like_one_and_reduce_gradients_in_float32(
    tiny_model_path, sft_batch, tmp_path, monkeypatch
) -> None:
    """2 bf16 ranks x half batch == 1 bf16 rank x whole batch (gradients, loss, norm, updated float32
    weights) within bf16 rounding, and the ranks' gradients summed in float32: exactly the float32 sum of
    what each rank's rows give one rank alone (a bfloat16 reduction misses it by 3e-3)."""
    monkeypatch.setenv("ROLL_CPU_THREADS", "1")  # the one-rank worker: one thread, as each rank has
    monkeypatch.setattr("roll.workers.base.pick_device", cpu_only)
    threads = torch.get_num_threads()
    batch = sft_batch
    processes, outs = start_ranks(tiny_model_path, batch, tmp_path)
    try:
        # While the ranks run: one bf16 rank in this process. First the gradient of each rank's rows alone,
        # normalised by the whole batch's token count as the two-rank step normalises them (no update),
        # then the real step on the whole batch.
        with Actor(tiny_model_path, DTYPE) as one:
            start = whole_weights(one)
            denominator = one.global_denominator(batch, one.config.loss.loss_agg_mode)
            one.global_denominator = lambda *_: denominator
            local_grads = []
            for shard in batch.chunk(WORLD_SIZE):
                seen = capture_step(one, apply=False)
                one.train_step(shard)
                local_grads.append(seen["grads"])
            del one.global_denominator
            seen = capture_step(one)
            one_metrics = one.train_step(batch)
            one_weights = whole_weights(one)
        one_grads = seen["grads"]
        ranks = results_of(processes, outs)
    finally:
        torch.set_num_threads(threads)
        stop(processes)
    two = ranks[0]  # rank 1 gathered the same gradients and weights

    # 1. The float32 reduction. Each rank's own gradient is bfloat16 arithmetic (every value a bf16
    # number), and the ranks' reduced gradient is the float32 sum of the two, to float32 rounding (measured:
    # equal). Reduced in bfloat16, the sum is rounded to 8 bits: 3e-3 here.
    for grads in local_grads:
        assert all(torch.equal(g, g.bfloat16().float()) for g in grads.values())
    summed = {name: local_grads[0][name] + local_grads[1][name] for name in one_grads}
    reduce_error = max_relative_error(two["grads"], summed)
    assert reduce_error < 1e-5, f"the ranks' gradients were not reduced in float32 ({reduce_error:.2e})"

    # 2. The two-rank step is the one-rank step on the same batch, within bf16 rounding (each side rounds
    # its rows' contributions in its own order; measured 3e-3), with the same loss and global norm.
    grad_error = relative_error(two["grads"], one_grads)
    assert grad_error < 1e-2, grad_error
    assert two["metrics"]["loss"] == pytest.approx(one_metrics["loss"], rel=1e-3)
    assert two["metrics"]["grad_norm"] == pytest.approx(one_metrics["grad_norm"], rel=1e-2)
    # AdamW's first step moves each float32 weight by lr times the sign of its gradient: alike on both,
    # but for the few weights whose gradient is within rounding of zero (measured: 0.3%, by at most lr).
    lr = one_metrics["lr"]
    differs = (flat(two["weights"]) - flat(one_weights)).abs()
    assert float(differs.max()) <= 2.01 * lr
    assert float((differs > 1e-3 * lr).float().mean()) < 0.01
    assert not torch.equal(flat(two["weights"]), flat(start))
