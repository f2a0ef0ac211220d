"""Tests for roll.distributed.cluster: Cluster calls over real Ray actors, errors, timeouts, dead ranks.

Workers here are cheap (no models) and every cluster is killed at the end of its test, so actors do not
pile up on a small machine. No test depends on how busy the machine is: work a call must not wait for
sleeps for 10 minutes (and is killed, not waited for) or waits for a file the test creates when it is
done, and the time asserts only tell "cut short" from "waited for the slow work", with a wide margin.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest
import ray

from roll.distributed.cluster import (
    Cluster,
    ClusterFuture,
    WorkerError,
    WorkerTimeoutError,
    kill_actors,
    wait_all,
    wait_any,
)
from roll.distributed.dispatch import Dispatch
from roll.distributed.worker import Worker, register

if TYPE_CHECKING:
    from roll.data.batch import Batch

pytestmark = pytest.mark.usefixtures("ray_session")


# ------------------------------------------------------------------ workers (module level: Ray pickles them)


class EchoWorker(Worker):
    """Answers with its rank so every dispatch mode's routing is visible in the result."""

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self, tag: str) -> dict:
        """Role, rank, world size and the tag this rank received."""
        return {"role": self.role, "rank": self.rank, "world_size": self.world_size, "tag": tag}

    @register(Dispatch.ALL_TO_ALL)
    def scale(self, x: int, factor: int) -> tuple[int, int]:
        return self.rank, x * factor

    @register(Dispatch.DP_COMPUTE)
    def add_rank(self, batch: Batch, offset: int = 0) -> Batch:
        """Adds a column holding this rank and one holding ids + offset."""
        import torch  # here, not at the top: the workers import this module, and need no torch elsewhere

        batch["rank"] = torch.full((len(batch),), self.rank)
        batch["shifted"] = batch["ids"] + offset
        return batch

    @register(Dispatch.DP_COMPUTE)
    def metrics(self) -> dict[str, float]:
        return {"rank": float(self.rank), f"only_rank{self.rank}": 1.0}

    @register(Dispatch.RANK_ZERO)
    def export(self) -> str:
        return f"weights from rank {self.rank}"

    @register(Dispatch.ONE_TO_ALL)
    def timed_sleep(self, seconds: float) -> tuple[float, float]:
        start = time.time()
        time.sleep(seconds)
        return start, time.time()

    @register(Dispatch.ONE_TO_ALL)
    def wait_for_file(self, path: str) -> tuple[float, float]:
        """Busy until the file ``path`` exists (the test creates it); when it waited, like timed_sleep."""
        start = time.time()
        wait_for(path)
        return start, time.time()

    @register(Dispatch.ONE_TO_ALL)
    def meet(self, mine: str, theirs: str) -> bool:
        """Create the file ``mine``, then wait for ``theirs``: whether it came (the other call ran too)."""
        open(mine, "w").close()
        return wait_for(theirs)

    @register(Dispatch.ONE_TO_ALL)
    def getenv(self, name: str) -> str | None:
        return os.environ.get(name)

    def not_registered(self) -> None:
        """Not exposed on the Cluster."""


def wait_for(path: str, timeout_s: float = 600.0) -> bool:
    """Whether the file ``path`` appears within ``timeout_s``: far longer than any test waits for it (a
    rank still waiting when its test ends is killed)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class FaultyWorker(Worker):
    """Fails in the ways a real rank fails: an exception, a hang, a dead process."""

    @register(Dispatch.ONE_TO_ALL)
    def fail_on_rank_one(self) -> int:
        if self.rank == 1:
            raise ValueError("boom")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def die_on_rank_one(self) -> int:
        if self.rank == 1:
            os._exit(1)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def wait_for_file(self, path: str) -> int:
        wait_for(path)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def hang_on_rank_zero_fail_on_rank_one(self, hang_s: float) -> int:
        if self.rank == 1:
            raise ValueError("rank 1 gave up")
        time.sleep(hang_s)
        return self.rank


# ------------------------------------------------------------------ fixtures


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., Cluster]]:
    """Build clusters for one test and kill them all when it ends, whatever happened."""
    clusters: list[Cluster] = []

    def make(role: str, worker_cls: type[Worker], world_size: int = 2, **kwargs) -> Cluster:
        cluster = Cluster(role, worker_cls, world_size, config=None, **kwargs)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        kill_without_asking(cluster)


def kill_without_asking(cluster: Cluster) -> None:
    """End the cluster's actors and wait until they are gone. Not ``Cluster.kill()`` (tested by
    test_kill_ends_the_actors), which first asks every rank to shut down: a rank a test left sleeping or
    hanging answers only when it wakes, seconds per test, and these workers hold nothing to release."""
    kill_actors(cluster.workers)


@pytest.fixture(scope="module")
def echo_pair(ray_session: None) -> Iterator[Cluster]:
    """One two-rank EchoWorker cluster shared by the tests that only call it (routing and futures; its
    workers keep no state between calls): starting one per test would add a cluster's start to each."""
    # A caller's CUDA_VISIBLE_DEVICES does not reach a CPU role (test_a_cpu_role_sees_no_gpu).
    cluster = Cluster("echo", EchoWorker, 2, config=None, env={"CUDA_VISIBLE_DEVICES": "0", "ROLL_X": "1"})
    yield cluster
    cluster.kill()


@pytest.fixture(scope="module")
def echo_trio(ray_session: None) -> Iterator[Cluster]:
    """A three-rank EchoWorker cluster for the tests that only call it with rank-dependent answers."""
    cluster = Cluster("echo", EchoWorker, 3, config=None)
    yield cluster
    cluster.kill()


def test_a_cpu_role_sees_no_gpu(echo_pair):
    """Ray leaves an actor that asks for no GPU every GPU of its node (the session's Ray declares 4), and a
    rank that saw them would put itself on cuda:0: unplaced ranks get an empty CUDA_VISIBLE_DEVICES."""
    assert [ping["cuda_visible_devices"] for ping in echo_pair.ping()] == ["", ""]
    assert echo_pair.getenv("ROLL_X") == ["1", "1"]  # the rest of the caller's env arrives


def make_batch(n: int) -> Batch:
    import torch

    from roll.data.batch import Batch

    return Batch(tensors={"ids": torch.arange(n)}, non_tensors={"text": [f"t{i}" for i in range(n)]})


# ------------------------------------------------------------------ dispatch modes over actors


def test_one_to_all_returns_one_result_per_rank_in_rank_order(echo_trio):
    cluster = echo_trio
    assert cluster.whoami("hi") == [
        {"role": "echo", "rank": rank, "world_size": 3, "tag": "hi"} for rank in range(3)
    ]
    pings = cluster.ping()
    assert [p["rank"] for p in pings] == [0, 1, 2]
    assert len({p["pid"] for p in pings}) == 3  # one process per rank


def test_all_to_all_sends_item_i_to_rank_i(echo_pair):
    cluster = echo_pair
    assert cluster.scale([1, 2], factor=[10, 100]) == [(0, 10), (1, 200)]
    with pytest.raises(ValueError, match="one list of 2 items"):
        cluster.scale([1, 2, 3], factor=[1, 1, 1])


def test_dp_compute_splits_the_batch_and_concatenates_results_in_order(echo_pair):
    cluster = echo_pair
    result = cluster.add_rank(make_batch(6), offset=100)
    from roll.data.batch import Batch

    assert isinstance(result, Batch)
    assert result["ids"].tolist() == [0, 1, 2, 3, 4, 5]
    assert result["rank"].tolist() == [0, 0, 0, 1, 1, 1]
    assert result["shifted"].tolist() == [100, 101, 102, 103, 104, 105]  # non-Batch args reach every rank
    assert result["text"] == [f"t{i}" for i in range(6)]
    assert cluster.metrics() == {"rank": 0.5, "only_rank0": 1.0, "only_rank1": 1.0}
    with pytest.raises(ValueError, match="cannot be split evenly"):
        cluster.add_rank(make_batch(5))


def test_rank_zero_returns_only_rank_zeros_result(echo_pair):
    cluster = echo_pair
    assert cluster.export() == "weights from rank 0"


# ------------------------------------------------------------------ futures


def test_non_blocking_call_returns_a_future_with_the_same_result(echo_pair):
    cluster = echo_pair
    future = cluster.whoami("x", blocking=False)
    assert isinstance(future, ClusterFuture)
    assert future.get() == cluster.whoami("x")


def test_calls_on_two_clusters_run_concurrently(make_cluster, tmp_path):
    first = make_cluster("first", EchoWorker, world_size=1)
    second = make_cluster("second", EchoWorker, world_size=1)
    wait_all(first.ping(blocking=False), second.ping(blocking=False))  # both actors up
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    # Each call leaves a file and waits for the other's: both return True only if the second call was
    # sent while the first still ran, however slowly either actor starts or runs.
    assert wait_all(first.meet(a, b, blocking=False), second.meet(b, a, blocking=False)) == [[True], [True]]


# ------------------------------------------------------------------ one rank, and whichever answers first


def test_call_rank_calls_one_rank_blocking_or_not(echo_trio):
    cluster = echo_trio
    assert cluster.call_rank(1, "whoami", "hi") == {"role": "echo", "rank": 1, "world_size": 3, "tag": "hi"}
    # Any public method, registered or not; keyword arguments reach the worker.
    assert cluster.call_rank(2, "not_registered") is None
    future = cluster.call_rank(2, "whoami", tag="later", blocking=False)
    assert isinstance(future, ClusterFuture) and future.ranks == [2]
    assert future.get() == {"role": "echo", "rank": 2, "world_size": 3, "tag": "later"}  # not a list
    for rank in (3, -1):
        with pytest.raises(ValueError, match=f"rank {rank} is out of range for world_size 3"):
            cluster.call_rank(rank, "whoami", "x")
    for method in ("no_such_method", "_private"):
        with pytest.raises(AttributeError, match=f"EchoWorker .*{method}"):
            cluster.call_rank(0, method)


def test_call_rank_errors_and_timeouts_name_the_rank_called(make_cluster):
    cluster = make_cluster("faulty", FaultyWorker)
    assert cluster.call_rank(0, "fail_on_rank_one") == 0
    with pytest.raises(WorkerError) as info:
        cluster.call_rank(1, "fail_on_rank_one")
    assert (info.value.role, info.value.rank, info.value.method) == ("faulty", 1, "fail_on_rank_one")
    assert "faulty rank 1" in str(info.value) and "boom" in str(info.value)
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as timeout:
        cluster.call_rank(1, "sleep", 600, timeout_s=0.5)  # the fixture kills the sleeping rank
    assert 0.5 <= time.monotonic() - start < 60  # the timeout cut it short: no wait for the sleep
    assert (timeout.value.rank, timeout.value.method) == (1, "sleep")


def test_wait_any_returns_the_ready_futures_in_order_and_nothing_on_timeout(make_cluster, tmp_path):
    cluster = make_cluster("echo", EchoWorker)
    cluster.ping()  # both actors up before timing
    gate = tmp_path / "gate"
    slow = cluster.call_rank(0, "wait_for_file", str(gate), blocking=False)  # runs until the gate opens
    quick = cluster.call_rank(1, "timed_sleep", 0.0, blocking=False)
    start = time.monotonic()
    assert wait_any([slow, quick], timeout_s=120) == [quick]
    assert time.monotonic() - start < 60, "wait_any waited for the slow call"
    assert len(quick.get()) == 2  # ready: get() returns that rank's (start, end) at once
    # A call on every rank is ready only once all of them answered: rank 0 is still busy.
    everyone = cluster.whoami("all", blocking=False)
    start = time.monotonic()
    assert wait_any([everyone, slow], timeout_s=0.3) == []
    assert 0.3 <= time.monotonic() - start < 60  # the timeout ended the wait: nothing could be ready
    gate.touch()
    # Rank 0 answers `everyone` only after `slow`, so once `everyone` is ready both are (waiting on
    # both at once may return in the instant between the end of `slow` and `whoami`'s).
    assert wait_any([everyone], timeout_s=120) == [everyone]
    assert wait_any([everyone, slow], timeout_s=120) == [everyone, slow]  # both ready, in the given order
    assert [answer["rank"] for answer in everyone.get()] == [0, 1]
    assert wait_any([], timeout_s=10) == []


def test_wait_any_raises_for_an_overdue_call_naming_its_rank(make_cluster, tmp_path):
    cluster = make_cluster("sleepy", FaultyWorker)
    cluster.ping()
    gate = str(tmp_path / "gate")  # both calls run until it exists
    overdue = cluster.call_rank(1, "wait_for_file", gate, blocking=False, timeout_s=0.5)
    on_time = cluster.call_rank(0, "wait_for_file", gate, blocking=False)
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as info:
        wait_any([on_time, overdue], timeout_s=120)
    # Neither call can end before the gate opens: only the overdue call's deadline ends this wait.
    assert time.monotonic() - start < 60, "the overdue call was reported after its deadline plus much more"
    assert (info.value.role, info.value.rank, info.value.method) == ("sleepy", 1, "wait_for_file")
    assert "sleepy rank 1" in str(info.value)
    (tmp_path / "gate").touch()
    # A failed rank makes its future ready; get() then raises naming it.
    failed = cluster.call_rank(1, "fail_on_rank_one", blocking=False)
    assert wait_any([failed], timeout_s=120) == [failed]
    with pytest.raises(WorkerError, match="sleepy rank 1 failed in fail_on_rank_one"):
        failed.get()


def test_discard_waits_up_to_its_timeout_and_drops_results_and_errors(echo_pair, tmp_path):
    gate = tmp_path / "gate"
    blocked = echo_pair.call_rank(0, "wait_for_file", str(gate), blocking=False)
    start = time.monotonic()
    echo_pair.discard([blocked], timeout_s=0.3)
    assert time.monotonic() - start >= 0.3  # the timeout ended the wait: the call cannot end first
    gate.touch()
    failing = echo_pair.call_rank(1, "scale", "x", None, blocking=False)  # "x" * None raises on rank 1
    echo_pair.discard([blocked, failing], timeout_s=120)  # the failure is dropped, not raised
    # Both calls had ended: rank 0 is free again for the module's other tests.
    refs = [*blocked.refs, *failing.refs]
    assert len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == 2
    echo_pair.discard([], timeout_s=10)


# ------------------------------------------------------------------ failures surface with role and rank


def test_exception_on_one_rank_names_role_rank_method_and_remote_traceback(make_cluster):
    cluster = make_cluster("faulty", FaultyWorker)
    with pytest.raises(WorkerError) as info:
        cluster.fail_on_rank_one()
    error = info.value
    message = str(error)
    assert "faulty" in message
    assert "rank 1" in message
    assert "fail_on_rank_one" in message
    assert "boom" in message
    # The remote traceback travels with the error: the failing line of the worker's source.
    assert "test_cluster.py" in message and 'raise ValueError("boom")' in message
    assert (error.role, error.rank, error.method) == ("faulty", 1, "fail_on_rank_one")
    assert not isinstance(error, WorkerTimeoutError)


def test_call_slower_than_the_timeout_raises_promptly_naming_role_and_rank(make_cluster):
    cluster = make_cluster("sleepy", FaultyWorker, world_size=1, timeout_s=1)
    # Starting the actor takes longer than 1 s (minutes on a busy machine); wait for it so the timeout
    # measures only the call.
    ray.get([worker.ping.remote() for worker in cluster.workers], timeout=900)
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as info:
        cluster.sleep(600)  # the fixture kills the sleeping rank
    elapsed = time.monotonic() - start
    assert 1 <= elapsed < 60, f"timeout took {elapsed:.1f} s: the driver waited for the sleep instead"
    error = info.value
    assert isinstance(error, TimeoutError) and isinstance(error, WorkerError)
    assert "sleepy" in str(error) and "rank 0" in str(error) and "sleep" in str(error)
    assert (error.role, error.rank) == ("sleepy", 0)


def test_dead_worker_process_raises_worker_error_naming_the_rank(make_cluster):
    cluster = make_cluster("mortal", FaultyWorker)
    with pytest.raises(WorkerError) as info:
        cluster.die_on_rank_one()
    assert info.value.rank == 1
    assert "mortal rank 1" in str(info.value)
    assert "died" in str(info.value)


def test_rank_that_fails_fast_is_reported_without_waiting_for_a_hanging_rank(make_cluster):
    cluster = make_cluster("mixed", FaultyWorker, timeout_s=300)
    cluster.ping()
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        cluster.hang_on_rank_zero_fail_on_rank_one(600)  # the fixture kills the hanging rank
    elapsed = time.monotonic() - start
    assert elapsed < 60, f"the failing rank was reported after {elapsed:.1f} s: the driver waited for another"
    assert info.value.rank == 1
    assert "rank 1 gave up" in str(info.value)
    assert not isinstance(info.value, WorkerTimeoutError)


# ------------------------------------------------------------------ lifecycle and introspection


def test_kill_ends_the_actors(make_cluster):
    cluster = make_cluster("short_lived", EchoWorker)
    assert [p["rank"] for p in cluster.ping()] == [0, 1]
    cluster.kill()
    with pytest.raises(WorkerError, match="short_lived rank"):
        cluster.ping()
    cluster.kill()  # killing twice (here and in the fixture) is harmless


def test_a_rank_found_silent_is_killed_without_being_asked_to_shut_down(make_cluster, monkeypatch):
    """A rank that leaves ``lost_ranks``' heartbeat unanswered (here stopped with SIGSTOP) is frozen:
    ``kill`` asks only the others to shut down (the frozen one would make it wait for its answer), and
    ends every actor."""
    import signal

    from roll.distributed import cluster as cluster_module

    cluster = make_cluster("stoppable", EchoWorker)
    pids = {info["rank"]: info["pid"] for info in cluster.ping()}
    asked = []
    wait = cluster_module.wait_for_ranks

    def recording(refs, role, method, timeout_s, ranks=None, watch=None):
        if method == "shutdown":
            asked.extend(ranks)
        return wait(refs, role, method, timeout_s, ranks, watch)

    monkeypatch.setattr(cluster_module, "wait_for_ranks", recording)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        # Rank 0 answers too, unless the machine is too busy to answer within 5 s: then it is not asked.
        assert 1 in cluster.lost_ranks() and cluster.health[1].frozen
        cluster.kill()
        assert 1 not in asked and asked == [r for r in (0, 1) if not cluster.health[r].frozen]
        with pytest.raises(WorkerError, match="stoppable rank"):
            cluster.ping()
    finally:
        try:
            os.kill(pids[1], signal.SIGCONT)
        except ProcessLookupError:
            pass  # Ray ended it


def test_repr_and_help_describe_the_registered_methods(echo_trio):
    cluster = echo_trio
    text = repr(cluster)
    assert "echo" in text and "world_size=3" in text
    for name in ("add_rank", "export", "metrics", "ping", "scale", "setup", "whoami"):
        assert f"'{name}'" in text
    assert "not_registered" not in text
    assert not hasattr(cluster, "not_registered")
    # The caller carries the worker class's own docstring and signature (without self), plus `blocking`.
    assert cluster.whoami.__name__ == "whoami"
    assert "Role, rank, world size and the tag" in cluster.whoami.__doc__
    assert "Adds a column holding this rank" in cluster.add_rank.__doc__
    assert "Load models and state" in cluster.setup.__doc__  # inherited from Worker
    signature = inspect.signature(cluster.add_rank)
    assert list(signature.parameters) == ["batch", "offset", "blocking"]
    assert signature.parameters["blocking"].kind is inspect.Parameter.KEYWORD_ONLY
