"""Bucket planning and packing (pure), and the bucketed weight broadcast over real gloo groups.

The collective tests run real processes (multiprocessing "forkserver", no Ray) on localhost. Each child
reports its outcomes through a queue; the parent waits with a deadline and terminates leftovers, so a hang
fails the test instead of stalling the suite. Children must also exit with code 0: teardown must not abort.
No test depends on how busy the machine is: groups are joined and happy paths run with minutes to spare,
a peer that must not answer waits (on an event) until the other side is done, and a timeout's time is
only told apart from waiting for that peer, which would be for good.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

from roll.distributed import ports
from roll.distributed.collective import CollectiveError, create_group, destroy_group
from roll.distributed.weight_buckets import (
    ALIGNMENT,
    TensorMeta,
    metas_of,
    pack,
    plan_buckets,
    plan_fingerprint,
    unpack,
)
from roll.distributed.weight_transfer import receive_weights, send_weights

CPU = torch.device("cpu")
BUCKET_BYTES = 4096


def free_port() -> int:
    return ports.free_port("127.0.0.1")


def state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small model-like state dict with awkward members: bfloat16, int64, 0-d and empty tensors."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(37, 16, generator=gen),
        "layer.0.weight": torch.randn(16, 16, generator=gen).to(torch.bfloat16),
        "layer.0.bias": torch.randn(16, generator=gen).to(torch.bfloat16),
        "layer.0.scale": torch.randn((), generator=gen),
        "layer.0.empty": torch.empty(0, 3),
        "counter": torch.randint(-(2**40), 2**40, (5,), generator=gen, dtype=torch.int64),
        "big.weight": torch.randn(40, 40, generator=gen),  # 6400 bytes: larger than a bucket
        "head.weight": torch.randn(16, 37, generator=gen),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# ---------------------------------------------------------------- pure: planning, packing


def test_plan_keeps_order_splits_and_aligns() -> None:
    metas = [
        TensorMeta("a", (3,), torch.float32),  # 12 bytes
        TensorMeta("b", (5,), torch.bfloat16),  # 10 bytes at offset 16
        TensorMeta("c", (8,), torch.int64),  # 64 bytes: 32 + 64 > 80, so a new bucket
        TensorMeta("d", (1,), torch.uint8),
        TensorMeta("huge", (100,), torch.float32),  # 400 bytes > 80: a bucket of its own
        TensorMeta("e", (), torch.float32),
    ]
    plan = plan_buckets(metas, bucket_bytes=80)
    assert [[m.name for m in b.tensors] for b in plan] == [["a", "b"], ["c", "d"], ["huge"], ["e"]]
    assert [b.offsets for b in plan] == [(0, 16), (0, 64), (0,), (0,)]
    assert [b.nbytes for b in plan] == [26, 65, 400, 4]
    assert all(offset % ALIGNMENT == 0 for b in plan for offset in b.offsets)
    assert [m for b in plan for m in b.tensors] == metas
    assert plan_buckets([], 80) == []


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([TensorMeta("a", (1,), torch.float32)], 0)
    with pytest.raises(ValueError, match="'a' appears twice"):
        plan_buckets([TensorMeta("a", (1,), torch.float32)] * 2, 64)


def test_pack_unpack_round_trip_is_bit_identical() -> None:
    tensors = state_dict()
    plan = plan_buckets(metas_of(tensors.items()), BUCKET_BYTES)
    assert len(plan) >= 3
    out = torch.empty(max(b.nbytes for b in plan), dtype=torch.uint8)
    restored: dict[str, torch.Tensor] = {}
    for bucket in plan:
        buffer = pack(bucket, tensors, out=out)
        assert buffer.numel() == bucket.nbytes and buffer.data_ptr() == out.data_ptr()  # reused, no alloc
        views = unpack(bucket, buffer)
        assert all(v.untyped_storage().data_ptr() == out.data_ptr() for v in views.values())  # no copy
        restored.update({name: view.clone() for name, view in views.items()})
    assert restored.keys() == tensors.keys()
    assert all(same_bits(restored[name], tensor) for name, tensor in tensors.items())


def test_pack_handles_non_contiguous_and_allocates_without_out() -> None:
    source = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous view
    (bucket,) = plan_buckets([TensorMeta("t", (4, 3), torch.float32)], 1024)
    buffer = pack(bucket, {"t": source}, out=torch.empty(4, dtype=torch.uint8))  # too small: new buffer
    assert buffer.numel() == 48
    assert torch.equal(unpack(bucket, buffer)["t"], source)


def test_pack_names_the_mismatching_tensor() -> None:
    (bucket,) = plan_buckets([TensorMeta("w", (2, 3), torch.float32)], 1024)
    with pytest.raises(ValueError, match=r"'w' is \(3, 2\) torch.float32.*expects \(2, 3\)"):
        pack(bucket, {"w": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match=r"'w' is \(2, 3\) torch.bfloat16"):
        pack(bucket, {"w": torch.zeros(2, 3, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="'w' of the weight-transfer plan is missing"):
        pack(bucket, {})
    with pytest.raises(ValueError, match="at least that large"):
        unpack(bucket, torch.empty(8, dtype=torch.uint8))


def test_plan_fingerprint_sees_any_difference() -> None:
    metas = metas_of(state_dict().items())
    plan = plan_buckets(metas, BUCKET_BYTES)
    assert plan_fingerprint(plan) == plan_fingerprint(plan_buckets(list(metas), BUCKET_BYTES))
    renamed = [TensorMeta("x" + m.name, m.shape, m.dtype) for m in metas]
    assert plan_fingerprint(plan) != plan_fingerprint(plan_buckets(renamed, BUCKET_BYTES))
    assert plan_fingerprint(plan) != plan_fingerprint(plan_buckets(metas, 512))


# ---------------------------------------------------------------- real processes over gloo


def _child(queue: Any, role: str, body: Callable[..., list[Any]], *args: Any) -> None:
    """Run ``body`` in a spawned child and report ``(role, outcomes)`` or ``(role, crash traceback)``."""
    try:
        queue.put((role, body(*args)))
    except BaseException:  # noqa: B036 - anything unexpected must reach the parent, not vanish
        queue.put((role, ["crash: " + traceback.format_exc()]))


def _outcome(call: Callable[[], Any]) -> Any:
    started = time.monotonic()
    try:
        call()
        return ("ok", time.monotonic() - started)
    except CollectiveError as exc:
        return ("error", str(exc), time.monotonic() - started)


def run_children(bodies: dict[str, tuple], deadline_s: float) -> dict[str, list[Any]]:
    """Run one spawned process per ``role -> (body, *args)``; return each role's outcomes.

    Never hangs: results are awaited until ``deadline_s``, then stragglers are terminated and the test
    fails. Every child must exit with code 0.
    """
    # forkserver, not fork: children must not inherit the test process's threads (Ray, gloo). Unlike spawn,
    # torch and this module are imported once, in the server, instead of once per child: on a busy
    # machine that is seconds per child.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", __name__])
    queue = ctx.Queue()
    processes = {
        role: ctx.Process(target=_child, args=(queue, role, *body), daemon=True)
        for role, body in bodies.items()
    }
    for process in processes.values():
        process.start()
    results: dict[str, list[Any]] = {}
    end = time.monotonic() + deadline_s
    try:
        while len(results) < len(processes):
            try:
                role, outcomes = queue.get(timeout=0.2)
                results[role] = outcomes
                continue
            except queue_module.Empty:
                pass
            silent = {role: p for role, p in processes.items() if role not in results}
            if time.monotonic() > end:
                pytest.fail(f"no result within {deadline_s}s from {sorted(silent)}")
            dead = {role: p.exitcode for role, p in silent.items() if not p.is_alive()}
            if dead and queue.empty():
                time.sleep(0.5)  # a result put just before exiting may still be in flight
                if queue.empty():
                    pytest.fail(f"children died without reporting (exit codes {dead})")
        for process in processes.values():
            process.join(timeout=max(0.1, end - time.monotonic()))
    finally:
        for process in processes.values():
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
    for role, outcomes in results.items():
        crashes = [o for o in outcomes if isinstance(o, str) and o.startswith("crash")]
        assert not crashes, f"{role}: {crashes[0]}"
    assert {role: p.exitcode for role, p in processes.items()} == dict.fromkeys(processes, 0)
    return results


class CountingSource:
    """A ``tensors_for`` counting its calls: with FSDP each call is a gather all trainer ranks must make."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors, self.calls = tensors, 0

    def __call__(self, bucket: Any) -> dict[str, torch.Tensor]:
        self.calls += 1
        return self.tensors


# For joining groups and for the happy paths: they finish in well under a second, and take seconds on a
# small machine with every core busy; only a hang would come near this.
TIMEOUT_S = 120.0


def _sender_body(port: int, default_port: int, world_size: int) -> list[Any]:
    import torch.distributed as dist

    # The trainer already owns a default group (FSDP): the transfer group must live beside it.
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{default_port}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=30),
    )
    group = create_group("weights", "gloo", "127.0.0.1", port, 0, world_size, TIMEOUT_S)
    tensors = state_dict()
    plan = plan_buckets(metas_of(tensors.items()), BUCKET_BYTES)
    outcomes: list[Any] = []
    for version in (1, 2, 3, 4):  # 2: receiver 2 expects another version; 3: receiver 1 fails to load
        source = CountingSource(tensors)
        result = _outcome(lambda v=version, f=source: send_weights(group, plan, f, v, TIMEOUT_S, CPU))
        outcomes.append((*result, source.calls == len(plan)))
    # The default group still works after all of this, and both tear down without killing the process.
    flag = torch.ones(1)
    dist.all_reduce(flag)
    outcomes.append(flag.item())
    destroy_group(group)
    destroy_group(group)  # twice is harmless
    dist.destroy_process_group()
    return outcomes


def _receiver_body(port: int, rank: int, world_size: int) -> list[Any]:
    group = create_group("weights", "gloo", "127.0.0.1", port, rank, world_size, TIMEOUT_S)
    expected = state_dict()
    plan = plan_buckets(metas_of(expected.items()), BUCKET_BYTES)
    outcomes: list[Any] = []
    for version in (1, 2, 3, 4):
        model = {name: torch.zeros_like(t) for name, t in expected.items()}
        loaded: list[int] = []

        def load(
            views: dict[str, torch.Tensor], model: dict = model, loaded: list = loaded, version: int = version
        ) -> None:
            if version == 3 and rank == 1 and loaded:
                raise RuntimeError("out of memory while loading")
            loaded.append(len(views))
            for name, view in views.items():
                model[name].copy_(view)

        want = version + 100 if version == 2 and rank == 2 else version
        result = _outcome(lambda w=want, f=load: receive_weights(group, plan, w, TIMEOUT_S, CPU, f))
        identical = all(same_bits(model[name], t) for name, t in expected.items())
        outcomes.append((*result, identical, sum(loaded)))
    destroy_group(group)
    return outcomes


def test_broadcast_to_two_receivers_beside_a_default_group() -> None:
    port, default_port = free_port(), free_port()
    results = run_children(
        {
            "sender": (_sender_body, port, default_port, 3),
            "receiver1": (_receiver_body, port, 1, 3),
            "receiver2": (_receiver_body, port, 2, 3),
        },
        deadline_s=600,
    )
    sender, first, second = results["sender"], results["receiver1"], results["receiver2"]
    count = len(state_dict())

    # Version 1: every receiver holds bit-identical weights, over several buckets.
    assert sender[0][0] == "ok"
    assert first[0][0] == second[0][0] == "ok" and first[0][2:] == second[0][2:] == (True, count)

    # Version 2: receiver 2 expects version 102; it says expected vs got, and nobody waits for a timeout
    # (of 120 s).
    assert sender[1][0] == "error" and "receiver rank(s) [2] rejected version 2" in sender[1][1]
    assert second[1][0] == "error" and "expected version 102" in second[1][1]
    assert "sender offers version 2" in second[1][1]
    assert first[1][0] == "error" and "rejected version 2" in first[1][1]
    assert max(sender[1][2], first[1][2], second[1][2]) < TIMEOUT_S / 2
    assert first[1][3] == 0 and second[1][3] == 0  # nothing was loaded

    # Version 3: receiver 1 fails in load; the sender learns it, receiver 2 still gets everything.
    assert sender[2][0] == "error" and "receiver rank(s) [1] failed to load version 3" in sender[2][1]
    assert first[2][0] == "error" and "group rank 1 failed to load bucket 2/" in first[2][1]
    assert "of version 3" in first[2][1] and "out of memory" in first[2][1]
    assert second[2][0] == "ok" and second[2][2:] == (True, count)

    # Version 4: the group is still in step after both failures.
    assert sender[3][0] == "ok" and first[3][0] == second[3][0] == "ok"
    assert first[3][2] and second[3][2]
    assert sender[4] == 1.0  # the default group was untouched
    # Failed or not, the sender asked for every bucket once, as FSDP peers gathering them would.
    assert all(outcome[-1] for outcome in sender[:4])


STALL_TIMEOUT_S = 2.0
# Longer than any test runs: a step given it that is not refused at once waits for good.
FOR_GOOD_S = 600.0


def _stalling_sender_body(port_a: int, port_b: int, sender_done: Any, receiver_done: Any) -> list[Any]:
    group_a = create_group("a", "gloo", "127.0.0.1", port_a, 0, 2, TIMEOUT_S)
    group_b = create_group("b", "gloo", "127.0.0.1", port_b, 0, 2, TIMEOUT_S)
    tensors = state_dict()
    plan = plan_buckets(metas_of(tensors.items()), BUCKET_BYTES)
    # Group a: never send, so the receiver waits in vain. Group b: send to a receiver that never listens.
    sources = CountingSource(tensors), CountingSource(tensors)
    outcome = _outcome(lambda: send_weights(group_b, plan, sources[0], 7, STALL_TIMEOUT_S, CPU))
    broken = _outcome(lambda: send_weights(group_b, plan, sources[1], 8, FOR_GOOD_S, CPU))
    sender_done.set()
    assert receiver_done.wait(FOR_GOOD_S), "the receiver never gave up on group a"
    destroy_group(group_b)
    destroy_group(group_a)
    return [(*outcome, sources[0].calls == len(plan)), (*broken, sources[1].calls == len(plan))]


def _stalling_receiver_body(port_a: int, port_b: int, sender_done: Any, receiver_done: Any) -> list[Any]:
    group_a = create_group("a", "gloo", "127.0.0.1", port_a, 1, 2, TIMEOUT_S)
    group_b = create_group("b", "gloo", "127.0.0.1", port_b, 1, 2, TIMEOUT_S)
    plan = plan_buckets(metas_of(state_dict().items()), BUCKET_BYTES)
    outcome = _outcome(lambda: receive_weights(group_a, plan, 7, STALL_TIMEOUT_S, CPU, lambda views: None))
    receiver_done.set()
    # Not listening on group b, nor leaving it, until the sender has given up there.
    assert sender_done.wait(FOR_GOOD_S), "the sender never gave up on group b"
    destroy_group(group_a)
    destroy_group(group_b)
    return [outcome]


def test_a_peer_that_never_takes_part_is_a_timeout_error_not_a_hang() -> None:
    port_a, port_b = free_port(), free_port()
    # Each side leaves the groups only once the other is done with them: until then its peer's steps
    # cannot succeed, nor fail for any reason but their own timeout.
    ctx = mp.get_context("forkserver")
    done = ctx.Event(), ctx.Event()
    results = run_children(
        {
            "sender": (_stalling_sender_body, port_a, port_b, *done),
            "receiver": (_stalling_receiver_body, port_a, port_b, *done),
        },
        deadline_s=900,
    )
    (sent, retried), (received,) = results["sender"], results["receiver"]
    # Each step waited for its 2 s timeout, and no longer than far below waiting for good.
    assert sent[0] == "error" and STALL_TIMEOUT_S * 0.9 < sent[2] < 60
    assert "group 'b' rank 0/2" in sent[1] and "timeout 2s" in sent[1]
    assert received[0] == "error" and STALL_TIMEOUT_S * 0.9 < received[2] < 60
    assert "waiting for the header of version 7" in received[1] and "group 'a' rank 1/2" in received[1]
    # Once failed, the group refuses further work at once rather than pairing up with stale operations
    # (the retry has 600 s, and its peer listens only after it ended).
    assert retried[0] == "error" and "broken" in retried[1] and retried[2] < 60
    assert sent[-1] and retried[-1]  # every bucket was still gathered, keeping trainer ranks in step


def test_joining_a_group_whose_peers_never_come_times_out() -> None:
    port = free_port()
    started = time.monotonic()
    # A receiver whose sender (the rendezvous host) never comes; torch retries with backoff, up to ~2x.
    with pytest.raises(
        CollectiveError, match=rf"group 'w' \(gloo\) as rank 1/2 with master 127.0.0.1:{port}"
    ):
        create_group("w", "gloo", "127.0.0.1", port, 1, 2, timeout_s=0.5)
    # The peers never come: without the timeout this would wait for good.
    assert 0.5 <= time.monotonic() - started < 60
    # A sender whose receivers never come.
    started = time.monotonic()
    with pytest.raises(CollectiveError, match="rank 0/2 with master"):
        create_group("w", "gloo", "127.0.0.1", free_port(), 0, 2, timeout_s=0.5)
    assert 0.5 <= time.monotonic() - started < 60


def test_create_group_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown collective backend 'mpi'"):
        create_group("w", "mpi", "127.0.0.1", 1, 0, 1, 1.0)
    with pytest.raises(ValueError, match="rank 2 is not in a group of world size 2"):
        create_group("w", "gloo", "127.0.0.1", 1, 2, 2, 1.0)


def test_trainer_ranks_other_than_the_sender_only_gather() -> None:
    tensors = state_dict()
    plan = plan_buckets(metas_of(tensors.items()), BUCKET_BYTES)
    source = CountingSource(tensors)
    stats = send_weights(None, plan, source, version=5, timeout_s=1.0, device=CPU)
    assert source.calls == len(plan)
    assert stats["buckets"] == len(plan) and stats["bytes"] == sum(b.nbytes for b in plan)


def test_transfer_backend_is_nccl_only_between_disjoint_gpus() -> None:
    from roll.distributed.weight_sync import transfer_backend

    assert transfer_backend({"cuda"}, colocated=False) == "nccl"
    assert transfer_backend({"cuda"}, colocated=True) == "gloo"
    assert transfer_backend({"cuda", "cpu"}, colocated=False) == "gloo"
    assert transfer_backend({"cpu"}, colocated=False) == "gloo"


def test_a_rendezvous_port_is_free_and_below_the_kernels_ephemeral_range(monkeypatch) -> None:
    """Outgoing connections take their local ports from the ephemeral range: a port picked there can be
    gone by the time a store binds it (this test file failed CI once on that)."""
    port = ports.free_port("127.0.0.1")
    assert ports.LOWEST <= port < ports.ephemeral_start()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # free indeed
    # A range that leaves no room below it: the kernel's choice.
    monkeypatch.setattr(ports, "ephemeral_start", lambda: ports.LOWEST)
    assert ports.free_port("127.0.0.1") > 0
