"""Colocation (roll.distributed.colocation): which roles offload and reload before each stage, in what
order, and the metrics it reports. Fake clusters stand in for Ray ones: no Ray, no model."""

from __future__ import annotations

import pytest

from roll.distributed.colocation import Colocation


class FakeCluster:
    """Records ``(role, "offload" | "reload")`` into a shared log; every rank reports its bytes and time."""

    def __init__(self, role: str, log: list[tuple[str, str]], ranks: list[tuple[int, float]]):
        self.role, self.log, self.ranks = role, log, ranks

    def _per_rank(self) -> list[dict[str, float]]:
        return [{"bytes": b, "seconds": s} for b, s in self.ranks]

    def offload_states(self) -> list[dict[str, float]]:
        self.log.append((self.role, "offload"))
        return self._per_rank()

    def reload_states(self) -> list[dict[str, float]]:
        self.log.append((self.role, "reload"))
        return self._per_rank()


# Two ranks each; the slowest rank of a move sets its time.
RANKS = {
    "actor": [(100, 0.5), (200, 1.5)],
    "reference": [(10, 0.25), (30, 0.125)],
    "rollout": [(1000, 2.0), (3000, 1.0)],
    "critic": [(7, 0.0625), (7, 0.0625)],
}


@pytest.fixture
def log() -> list[tuple[str, str]]:
    return []


def clusters(log: list[tuple[str, str]], roles=("actor", "reference", "rollout", "critic")) -> dict:
    return {role: FakeCluster(role, log, RANKS[role]) for role in roles}


def colocated(log: list[tuple[str, str]]) -> Colocation:
    """Actor, reference and rollout share devices; the critic is alone on its own."""
    return Colocation(clusters(log), [["actor", "reference", "rollout"], ["critic"]])


# --------------------------------------------------------------------------- use(...)


def test_use_rollout_offloads_the_colocated_trainers(log) -> None:
    colo = colocated(log)
    metrics = colo.use("rollout")
    assert log == [("actor", "offload"), ("reference", "offload")]
    assert metrics == {
        "offload/actor_bytes": 300.0,
        "offload/reference_bytes": 40.0,
        "time/offload_s": pytest.approx(1.5 + 0.25),
    }
    assert colo.on_device == {"actor": False, "reference": False, "rollout": True}


def test_use_reloads_an_offloaded_role_after_offloading_the_others(log) -> None:
    colo = colocated(log)
    colo.use("rollout")
    log.clear()
    metrics = colo.use("actor")
    # Devices are freed before anything comes back.
    assert log == [("rollout", "offload"), ("actor", "reload")]
    assert metrics == {
        "offload/rollout_bytes": 4000.0,
        "offload/actor_bytes": 300.0,
        "time/offload_s": pytest.approx(2.0 + 1.5),
    }
    # The reference was not asked for, so it stays offloaded.
    assert colo.on_device == {"actor": True, "reference": False, "rollout": False}


def test_use_again_moves_nothing(log) -> None:
    colo = colocated(log)
    colo.use("rollout")
    log.clear()
    assert colo.use("rollout") == {}
    assert log == []


def test_use_two_roles_keeps_both_resident(log) -> None:
    colo = colocated(log)
    metrics = colo.use("actor", "rollout")
    assert log == [("reference", "offload")]
    assert set(metrics) == {"offload/reference_bytes", "time/offload_s"}
    assert colo.on_device == {"actor": True, "reference": False, "rollout": True}


def test_use_two_roles_reloads_both_after_offloads(log) -> None:
    colo = colocated(log)
    colo.use("reference")  # actor and rollout offloaded
    log.clear()
    metrics = colo.use("actor", "rollout")
    assert log == [("reference", "offload"), ("actor", "reload"), ("rollout", "reload")]
    assert metrics["offload/actor_bytes"] == 300.0
    assert metrics["offload/rollout_bytes"] == 4000.0
    assert metrics["offload/reference_bytes"] == 40.0
    assert metrics["time/offload_s"] == pytest.approx(0.25 + 1.5 + 2.0)
    assert colo.on_device == {"actor": True, "reference": False, "rollout": True}


def test_every_offload_comes_before_every_reload(log) -> None:
    colo = Colocation(clusters(log), [["actor", "reference", "rollout", "critic"]])
    colo.use("actor", "reference")  # rollout and critic off
    log.clear()
    colo.use("rollout", "critic")
    actions = [action for _, action in log]
    assert sorted(log) == sorted(
        [("actor", "offload"), ("reference", "offload"), ("rollout", "reload"), ("critic", "reload")]
    )
    assert actions == ["offload", "offload", "reload", "reload"]


def test_roles_outside_the_group_are_never_called(log) -> None:
    colo = colocated(log)
    for roles in (("rollout",), ("actor",), ("reference",), ("actor", "rollout"), ("critic",)):
        colo.use(*roles)
    assert "critic" not in {role for role, _ in log}
    assert "critic" not in colo.on_device


def test_use_only_touches_the_group_of_the_named_roles(log) -> None:
    colo = Colocation(clusters(log), [["actor", "rollout"], ["reference", "critic"]])
    colo.use("rollout")
    assert log == [("actor", "offload")]
    log.clear()
    colo.use("critic")
    assert log == [("reference", "offload")]
    assert colo.on_device == {"actor": False, "rollout": True, "reference": False, "critic": True}


def test_use_of_a_role_in_no_group_moves_nothing(log) -> None:
    colo = colocated(log)
    assert colo.use("critic") == {}
    assert colo.use("reward") == {}
    assert log == []


# --------------------------------------------------------------------------- which groups count


def test_groups_of_one_role_are_ignored(log) -> None:
    colo = Colocation(clusters(log), [["actor"], ["rollout"], ["critic"]])
    assert not colo.active
    assert colo.groups == []
    assert colo.use("rollout") == {} and colo.use("actor") == {}
    assert log == []


def test_roles_without_a_cluster_drop_out_of_their_group(log) -> None:
    # No reference cluster (kl_coef 0): the actor and the rollout still time-share their devices.
    colo = Colocation(clusters(log, roles=("actor", "rollout")), [["actor", "reference", "rollout"]])
    assert colo.active and colo.groups == [["actor", "rollout"]]
    assert colo.use("rollout") == {"offload/actor_bytes": 300.0, "time/offload_s": 1.5}
    assert log == [("actor", "offload")]


def test_active(log) -> None:
    assert colocated(log).active
    assert not Colocation(clusters(log), []).active
    assert not Colocation({}, [["actor", "rollout"]]).active
    assert Colocation(clusters(log), [["actor"], ["actor", "rollout"]]).active


def test_every_colocated_role_starts_on_device(log) -> None:
    colo = Colocation(clusters(log), [["actor", "rollout"], ["critic"]])
    assert colo.groups == [["actor", "rollout"]]
    assert colo.on_device == {"actor": True, "rollout": True}
    assert log == []  # constructing moves nothing


# --------------------------------------------------------------------------- start-up


class FakeFuture:
    def __init__(self, role: str, log: list[tuple[str, str]]):
        self.role, self.log = role, log
        log.append((role, "setup started"))

    def get(self) -> None:
        self.log.append((self.role, "setup done"))


def test_start_loads_colocated_roles_one_at_a_time(log) -> None:
    colo = colocated(log)  # actor, reference and rollout share devices; the critic has its own
    setups = {
        role: (lambda role=role: FakeFuture(role, log))
        for role in ("actor", "rollout", "reference", "critic")
    }
    colo.start(setups)
    # Wave 1: the critic (alone) and the group's first role; each grouped role is offloaded before the
    # next one of its group starts, and the last stays on its devices.
    assert log == [
        ("critic", "setup started"),
        ("actor", "setup started"),
        ("critic", "setup done"),
        ("actor", "setup done"),
        ("actor", "offload"),
        ("reference", "setup started"),
        ("reference", "setup done"),
        ("reference", "offload"),
        ("rollout", "setup started"),
        ("rollout", "setup done"),
    ]
    assert colo.on_device == {"actor": False, "reference": False, "rollout": True}
    log.clear()
    colo.use("actor")
    assert log == [("rollout", "offload"), ("actor", "reload")]
