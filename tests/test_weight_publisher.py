"""The driver's one count of the rollout workers' weights version (``WeightPublisher``), on a fake transfer:
what each event (a step's publish, a checkpoint load, new or replacement rollout workers) does to it, what
it sends, and what the scheduler is told. The real transfer runs in test_workers and every RL run."""

from __future__ import annotations

from roll.pipelines.weight_publisher import WeightPublisher


class FakeSync:
    def __init__(self, log: list[str]):
        self.log = log

    def connect(self) -> None:
        self.log.append("connect")

    def sync(self, version: int) -> dict[str, object]:
        self.log.append(f"send {version}")
        return {"bytes": 1, "gb_per_s": 0.5}

    def close(self) -> None:
        self.log.append("close")


def publisher() -> tuple[WeightPublisher, list[int], list[str]]:
    told: list[int] = []
    log: list[str] = []
    return WeightPublisher(told.append, lambda: log.append("on devices")), told, log


def test_each_publish_sends_the_next_version_and_tells_the_scheduler() -> None:
    pub, told, log = publisher()
    pub.connect(FakeSync(log))
    assert pub.sends and pub.publish() == {"sync/bytes": 1.0, "sync/gb_per_s": 0.5} and pub.publish()
    assert pub.version == 2 and told == [1, 2]
    assert log == ["connect", "on devices", "send 1", "on devices", "send 2"]


def test_without_rollout_workers_nothing_travels_but_the_version_counts_the_updates() -> None:
    pub, told, log = publisher()
    assert not pub.sends and pub.publish() == {}
    assert pub.version == 1 and told == [1] and log == []


def test_replacement_workers_get_the_trained_weights_under_the_lost_ones_version() -> None:
    pub, told, log = publisher()
    pub.connect(FakeSync(log))
    pub.publish()
    pub.publish()
    log.clear()
    pub.reconnect(FakeSync(log))
    assert pub.version == 2 and log == ["close", "connect", "on devices", "send 2"]
    assert told == [1, 2]  # the scheduler's new instance reads the version itself


def test_new_rollout_workers_start_from_version_zero_and_a_checkpoint_moves_it_on() -> None:
    pub, told, log = publisher()
    pub.connect(FakeSync(log))
    pub.publish()
    pub.reset()  # every worker started again from the initial model
    assert pub.version == 0
    log.clear()
    pub.restore(step=4)  # the checkpoint of step 4: the workers get its weights as version 4
    assert pub.version == 4 and told[-1] == 4 and log == ["on devices", "send 4"]


def test_workers_that_outlived_a_lost_trainer_count_on_from_their_version() -> None:
    pub, told, log = publisher()
    pub.connect(FakeSync(log))
    for _ in range(6):  # steps 5 and 6 are abandoned when the trainer is lost after step 6
        pub.publish()
    pub.restore(step=4)  # version 4 is older than the one they hold: the next one is 7
    assert pub.version == 7 and told[-1] == 7
    pub.restore(step=0)  # nothing saved: no weights travel, the scheduler is told the version
    assert pub.version == 7 and told[-1] == 7 and log[-1] == "send 7"
