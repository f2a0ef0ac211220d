"""The role set: roles declared as data; start, standbys, replacement and stop behave the same for every
pipeline (fake clusters, no Ray)."""

from __future__ import annotations

import itertools

from roll.pipelines.roles import Role, RoleSet


class FakeCluster:
    ids = itertools.count()

    def __init__(self, role: Role):
        self.role, self.id = role.name, next(self.ids)
        self.killed = self.warming = False

    def kill(self) -> None:
        self.killed = True

    def warm_up(self, blocking: bool) -> None:
        self.warming = True


ROLES = {
    "actor": Role("actor", object, 2, "actor spec", trainer=True),
    "rollout": Role("rollout", object, 1, "rollout spec", replaceable=True),
    "reward": Role("reward", object, 1, {}, replaceable=True, loads_model=False),
}


def test_start_keeps_running_roles_and_starts_the_rest() -> None:
    made: list[str] = []
    roles = RoleSet(ROLES, lambda role: made.append(role.name) or FakeCluster(role))
    assert roles.start() == {"actor", "rollout", "reward"} and made == ["actor", "rollout", "reward"]
    rollout = roles.get("rollout")
    roles.stop(keep={"rollout"})  # a lost trainer: the stateless workers outlive it
    assert roles.get("actor") is None and roles.get("rollout") is rollout and not rollout.killed
    assert roles.start() == {"actor", "reward"} and roles.get("rollout") is rollout
    assert set(roles.trainers()) == {"actor"} and roles.replaceable() == {"rollout", "reward"}


def test_standbys_are_taken_first_and_refilled() -> None:
    roles = RoleSet(ROLES, FakeCluster, standby=True)
    roles.start()
    roles.fill_standby()
    waiting = roles.standbys
    assert set(waiting) == set(ROLES) and all(c.warming for c in waiting.values())
    lost = roles.get("rollout")
    assert roles.replace("rollout") is waiting["rollout"] and lost.killed
    assert "rollout" not in roles.standbys  # taken ...
    roles.fill_standby()
    assert roles.standbys["rollout"] is not waiting["rollout"]  # ... and a new one waits
    everything = [*roles.live.values(), *roles.standbys.values()]
    roles.shutdown()
    assert all(c.killed for c in everything) and len(everything) == 6
    assert roles.live == {} and roles.standbys == {}


def test_no_standbys_unless_asked() -> None:
    roles = RoleSet(ROLES, FakeCluster)
    roles.fill_standby()
    assert roles.standbys == {}
    roles.start()
    first = roles.get("reward")
    assert roles.replace("reward") is not first and first.killed
