"""Nothing hangs silently: a frozen worker fails the call within the liveness bound (not the call's long
timeout), a busy one is told apart from a frozen one, and long calls say what they wait for."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from roll.config import load_config
from roll.data.prompts import PromptSet, render_prompt
from roll.distributed import cluster as cluster_module
from roll.distributed import liveness as liveness_module
from roll.distributed.cluster import Cluster, WorkerTimeoutError, WorkerUnresponsiveError
from roll.distributed.dispatch import Dispatch
from roll.distributed.liveness import HEALTH_GROUP, Liveness, RankHealth, RankWatch, WatchedRank
from roll.distributed.worker import Worker, register
from roll.models.loading import load_tokenizer
from roll.pipelines.common import prompt_batch
from roll.strategies.requests import SamplingParams
from roll.workers.base import ModelSpec
from roll.workers.rollout import RolloutWorker

pytestmark = pytest.mark.usefixtures("ray_session")


class NappingWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def nap_until(self, gate: str) -> int:
        """Busy until the file ``gate`` exists: the test ends the call when it has seen what it needs."""
        deadline = time.monotonic() + 600  # only a failed test leaves a rank waiting that long
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.rank


class SteppedClock:
    """A clock for watches (``liveness.clock``) that moves ``step`` seconds at each reading (a watch
    reads it at its start and at each poll) up to ``stop_at``, where it stops and creates ``gate``: a
    call waiting on ``nap_until(gate)`` sees exactly the polls at 0, step, ... stop_at, and then ends,
    however slow the machine."""

    def __init__(self, step: float, stop_at: float, gate: Path | None = None):
        self.now, self.step, self.stop_at, self.gate = 0.0, step, stop_at, gate

    def __call__(self) -> float:
        now = self.now
        if now >= self.stop_at:
            if self.gate is not None:
                self.gate.touch()
        else:
            self.now = min(now + self.step, self.stop_at)
        return now


@dataclasses.dataclass
class Holder:
    model: ModelSpec


def worker_pid(cluster: Cluster, rank: int = 0) -> int:
    return cluster.ping()[rank]["pid"]


@pytest.mark.slow  # waits out a liveness bound
def test_a_frozen_rollout_worker_fails_the_call_within_the_liveness_bound(
    tiny_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real rollout worker frozen with SIGSTOP mid-call fails the call at the liveness bound, not the
    call's timeout, and is killed without being asked to shut down: needs a worker process to freeze and
    a bound to wait out."""
    tokenizer = load_tokenizer(tiny_model_path)
    rows = [{"prompt": "1+2"}, {"prompt": "3+4"}]
    texts = [render_prompt(tokenizer, r["prompt"], True) for r in rows]
    prompts = PromptSet(rows, texts, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])
    batch = prompt_batch(prompts, [0, 1], tokenizer.pad_token_id)
    rollout = Cluster(
        "rollout",
        RolloutWorker,
        1,
        Holder(ModelSpec(path=tiny_model_path)),
        timeout_s=900,
        # While it starts and loads the model the worker is busy, not frozen: a bound far above any
        # heartbeat's answer on a loaded machine. The call under test gets the short one below.
        liveness=Liveness(timeout_s=120, progress_every_s=0),
    )
    rollout.setup()
    pid = worker_pid(rollout)
    rollout.liveness = Liveness(timeout_s=3, progress_every_s=0)
    # Which ranks Cluster.kill() asks to shut down (and waits for): the frozen one must not be among them.
    shutdowns_asked: list[list[int]] = []
    real_wait_for_ranks = cluster_module.wait_for_ranks

    def recording_wait_for_ranks(refs, role, method, timeout_s, ranks=None, watch=None):  # noqa: ANN001
        if method == "shutdown":
            shutdowns_asked.append(list(ranks))
        return real_wait_for_ranks(refs, role, method, timeout_s, ranks, watch)

    monkeypatch.setattr(cluster_module, "wait_for_ranks", recording_wait_for_ranks)
    try:
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerUnresponsiveError) as caught:
            rollout.generate(batch, SamplingParams(max_new_tokens=4))
        elapsed = time.monotonic() - start
        # The bound: the first heartbeat goes out after a third of the timeout (1 s) and is declared
        # lost 3 s later, noticed at a poll: at least 4 s, and far below the call's own 900 s.
        assert 4 <= elapsed < 60, elapsed
        assert (caught.value.role, caught.value.rank, caught.value.method) == ("rollout", 0, "generate")
        message = str(caught.value)
        assert "stopped answering: a heartbeat went unanswered for 3 s (ray.liveness_timeout_s=3)" in message
        assert rollout.health[0].frozen
    finally:
        rollout.kill()
    assert shutdowns_asked == [[]]  # a frozen rank is not asked to shut down: nobody waits for its answer
    assert process_ends(pid)


def process_ends(pid: int, within_s: float = 120.0) -> bool:
    """Whether ``pid`` exits (or is a zombie waiting to be reaped) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def test_with_liveness_off_a_frozen_worker_is_only_caught_by_the_call_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster = Cluster("napper", NappingWorker, 1, None, liveness=Liveness(0, 0))
    pid = None
    try:
        # Starting the actor takes minutes on a busy machine: wait for it with the default 900 s, so
        # that the short timeout below measures only the call under test.
        cluster.nap(0)
        pid = worker_pid(cluster)
        monkeypatch.setattr(cluster, "timeout_s", 4)
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match="no answer after 4 s"):
            cluster.nap(0)
        assert time.monotonic() - start >= 4
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        cluster.kill()


@pytest.fixture(scope="module")
def napper() -> Iterator[Cluster]:
    """Two napping ranks, started once; each test sets the liveness it needs."""
    cluster = Cluster("napper", NappingWorker, 2, None)
    cluster.nap(0)  # the actors have started and answered
    yield cluster
    cluster.kill()


def test_a_busy_worker_answers_heartbeats_and_is_not_called_frozen(
    napper: Cluster, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A heartbeat is answered in milliseconds, even with every core taken (benchmarks/busy_machine.py): a
    # 4 s bound is far above that, yet short enough to nap past.
    monkeypatch.setattr(napper, "liveness", Liveness(timeout_s=4, progress_every_s=1))
    with caplog.at_level(logging.WARNING, logger="roll"):
        assert napper.nap(9) == [0, 1]  # more than twice the liveness timeout, and no error
    lines = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert any("napper rank 1 in nap() after" in line for line in lines), lines
    assert any("(answering heartbeats: busy, not frozen)" in line for line in lines), lines


@pytest.mark.parametrize("progress_every_s", [1.0, 0.0])
def test_long_calls_log_what_they_wait_for(
    napper: Cluster,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    progress_every_s: float,
) -> None:
    # The watch's clock moves 1 s per poll and stops at 2 s, when the ranks are let go: the lines logged
    # are those of a call of a little over 2 s, whatever the load. Real polls come every 50 ms.
    gate = tmp_path / "gate"
    monkeypatch.setattr(liveness_module, "clock", SteppedClock(step=1.0, stop_at=2.0, gate=gate))
    monkeypatch.setattr(liveness_module, "POLL_S", 0.05)
    monkeypatch.setattr(napper, "liveness", Liveness(30, progress_every_s))
    with caplog.at_level(logging.WARNING, logger="roll"):
        assert napper.nap_until(str(gate)) == [0, 1]
    lines = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    if progress_every_s:
        assert lines == [
            "roll: still waiting for napper rank 0 in nap_until() after 1 s",
            "roll: still waiting for napper rank 1 in nap_until() after 1 s",
            "roll: still waiting for napper rank 0 in nap_until() after 2 s",
            "roll: still waiting for napper rank 1 in nap_until() after 2 s",
        ]
    else:
        assert lines == []


def test_a_rank_that_never_answered_is_starting_not_frozen(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An actor that cannot be placed (it asks for a resource no node has) answers nothing, like one
    # waiting for a busy cluster to free resources: that is progress to report, not a frozen worker.
    pending = ray.remote(concurrency_groups={HEALTH_GROUP: 1}, resources={"no-such-resource": 1})(
        NappingWorker
    ).remote("pending", 0, 1, None)
    # 3.5 s of polls every 0.25 s on the watch's clock: heartbeats go out, stay unanswered for more
    # than the 1 s bound, and progress is logged.
    monkeypatch.setattr(liveness_module, "clock", SteppedClock(step=0.25, stop_at=3.5))
    watched = WatchedRank("pending", 0, "setup", pending, RankHealth())
    watch = RankWatch([watched], Liveness(1, 1))
    try:
        with caplog.at_level(logging.WARNING, logger="roll"):
            for _ in range(14):
                watch.poll([("pending", 0)])
        assert watched.beat is not None and 3.5 - watched.beat_sent > 1  # a heartbeat long unanswered
        assert not watched.health.frozen
        assert any("not answered yet: still starting" in r.getMessage() for r in caplog.records)
    finally:
        ray.kill(pending)


def test_the_ray_section_sets_the_liveness_of_every_cluster(repo_root, monkeypatch) -> None:
    monkeypatch.chdir(repo_root)
    cfg = load_config("examples/quickstart.yaml", ["ray.liveness_timeout_s=7", "ray.progress_every_s=3"])
    assert Liveness.from_config(cfg.ray) == Liveness(timeout_s=7, progress_every_s=3)
