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
from roll.distributed.cluster import Cluster, WorkerTimeoutError, WorkerUnresponsiveError
from roll.distributed.dispatch import Dispatch
from roll.distributed.liveness import HEALTH_GROUP, Liveness, RankHealth, RankWatch, WatchedRank
from roll.distributed.worker import Worker, register
from roll.models.loading import load_tokenizer
from roll.pipelines.common import prompt_batch
from roll.strategies.sampling import SamplingParams
from roll.workers.base import ModelSpec
from roll.workers.rollout import RolloutWorker

pytestmark = pytest.mark.usefixtures("ray_session")


class NappingWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


@dataclasses.dataclass
class Holder:
    model: ModelSpec


def worker_pid(cluster: Cluster, rank: int = 0) -> int:
    return cluster.ping()[rank]["pid"]


@pytest.mark.slow  # waits out a liveness bound
def test_a_frozen_rollout_worker_fails_the_call_within_the_liveness_bound(tiny_model_path: str) -> None:
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
        timeout_s=300,
        liveness=Liveness(timeout_s=3, progress_every_s=0),
    )
    rollout.setup()
    pid = worker_pid(rollout)
    try:
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerUnresponsiveError) as caught:
            rollout.generate(batch, SamplingParams(max_new_tokens=4))
        elapsed = time.monotonic() - start
        # The bound: the first heartbeat goes out after a third of the timeout (1 s) and is declared
        # lost 3 s later, noticed within a poll; nowhere near the call's 300 s.
        assert 4 <= elapsed < 4 + 3, elapsed
        assert (caught.value.role, caught.value.rank, caught.value.method) == ("rollout", 0, "generate")
        message = str(caught.value)
        assert "stopped answering: a heartbeat went unanswered for 3 s (ray.liveness_timeout_s=3)" in message
        assert rollout.health[0].frozen
    finally:
        kill_start = time.monotonic()
        rollout.kill()  # a frozen rank is not asked to shut down: nobody waits for its answer
        assert time.monotonic() - kill_start < 8
    assert process_ends(pid)


def process_ends(pid: int, within_s: float = 10.0) -> bool:
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


def test_with_liveness_off_a_frozen_worker_is_only_caught_by_the_call_timeout() -> None:
    cluster = Cluster("napper", NappingWorker, 1, None, timeout_s=4, liveness=Liveness(0, 0))
    cluster.nap(0)
    pid = worker_pid(cluster)
    try:
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match="no answer after 4 s"):
            cluster.nap(0)
        assert time.monotonic() - start >= 4
    finally:
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
    monkeypatch.setattr(napper, "liveness", Liveness(timeout_s=2, progress_every_s=1))
    with caplog.at_level(logging.WARNING, logger="roll"):
        assert napper.nap(5) == [0, 1]  # more than twice the liveness timeout, and no error
    lines = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert any("napper rank 1 in nap() after" in line for line in lines), lines
    assert any("(answering heartbeats: busy, not frozen)" in line for line in lines), lines


@pytest.mark.parametrize("progress_every_s", [1.0, 0.0])
def test_long_calls_log_what_they_wait_for(
    napper: Cluster,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    progress_every_s: float,
) -> None:
    monkeypatch.setattr(napper, "liveness", Liveness(30, progress_every_s))
    with caplog.at_level(logging.WARNING, logger="roll"):
        napper.nap(2.5)
    lines = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    if progress_every_s:
        assert lines[:2] == [
            "roll: still waiting for napper rank 0 in nap() after 1 s",
            "roll: still waiting for napper rank 1 in nap() after 1 s",
        ]
        assert "roll: still waiting for napper rank 0 in nap() after 2 s" in lines
    else:
        assert lines == []


def test_a_rank_that_never_answered_is_starting_not_frozen(caplog: pytest.LogCaptureFixture) -> None:
    # An actor that cannot be placed (it asks for a resource no node has) answers nothing, like one
    # waiting for a busy cluster to free resources: that is progress to report, not a frozen worker.
    pending = ray.remote(concurrency_groups={HEALTH_GROUP: 1}, resources={"no-such-resource": 1})(
        NappingWorker
    ).remote("pending", 0, 1, None)
    watch = RankWatch([WatchedRank("pending", 0, "setup", pending, RankHealth())], Liveness(1, 1))
    try:
        with caplog.at_level(logging.WARNING, logger="roll"):
            deadline = time.monotonic() + 3.5
            while time.monotonic() < deadline:
                watch.poll([("pending", 0)])
                time.sleep(0.2)
        assert any("not answered yet: still starting" in r.getMessage() for r in caplog.records)
    finally:
        ray.kill(pending)


def test_the_ray_section_sets_the_liveness_of_every_cluster(repo_root, monkeypatch) -> None:
    monkeypatch.chdir(repo_root)
    cfg = load_config("examples/quickstart.yaml", ["ray.liveness_timeout_s=7", "ray.progress_every_s=3"])
    assert Liveness.from_config(cfg.ray) == Liveness(timeout_s=7, progress_every_s=3)
