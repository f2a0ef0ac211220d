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


class Done:
    def get(self) -> None:
        return None


class ModelCluster(FakeCluster):
    """A fake cluster that loads a model: it sets up, offloads and reloads (3 bytes, in 0.5 s and 0.25 s)."""

    def __init__(self, role: Role):
        super().__init__(role)
        self.world_size, self.log = role.world_size, []

    def master_address(self) -> tuple[str, int]:  # a trainer's ranks agree on rank 0's before setup
        return "127.0.0.1", 29500

    def setup(self, blocking: bool = True, **rendezvous: object) -> Done:
        self.log.append("setup")
        return Done()

    def offload_states(self) -> list[dict[str, float]]:
        self.log.append("offload")
        return [{"bytes": 3.0, "seconds": 0.5}]

    def reload_states(self) -> list[dict[str, float]]:
        self.log.append("reload")
        return [{"bytes": 3.0, "seconds": 0.25}]


def test_colocated_roles_take_turns_and_each_stage_sums_what_moved() -> None:
    from roll.distributed.device_mapping import role_devices

    roles = RoleSet(ROLES, ModelCluster)
    roles.devices = {"actor": role_devices("actor", [0, 1]), "rollout": role_devices("rollout", [1])}
    roles.set_up(roles.start())
    actor, rollout, reward = (roles.get(name) for name in ("actor", "rollout", "reward"))
    # Loaded one after the other, the first offloaded before the next loads; the reward worker at once.
    assert actor.log == ["setup", "offload"] and rollout.log == ["setup"] and reward.log == ["setup"]
    metrics = {"offload/actor_bytes": 1.0}
    with roles.on_device("actor", metrics=metrics):
        assert rollout.log[-1] == "offload" and actor.log[-1] == "reload"
    assert metrics == {"offload/actor_bytes": 4.0, "offload/rollout_bytes": 3.0, "time/offload_s": 0.75}
    with roles.on_device("actor", metrics=metrics):  # already resident: nothing moves
        pass
    assert metrics["time/offload_s"] == 0.75
    renewed = roles.renew("rollout")  # a lost one's replacement takes its turns on the devices
    assert rollout.killed and renewed.log == ["setup"] and roles.colocation.clusters["rollout"] is renewed
    assert list(roles.clusters()) == ["actor", "rollout", "reward"]


def test_a_role_loading_beside_running_ones_waits_for_them_to_offload_and_a_retired_one_hands_back() -> None:
    """A teacher started after the student (or a trainer restarted beside surviving workers) loads only
    once the roles already on its devices have moved off; retired, it stops taking turns and the role
    left alone comes back to the devices."""
    from roll.distributed.device_mapping import role_devices

    roles = RoleSet({"actor": ROLES["actor"]}, ModelCluster)
    roles.devices = {name: role_devices(name, [0, 1]) for name in ("actor", "teacher")}
    roles.set_up(roles.start())
    actor = roles.get("actor")
    assert actor.log == ["setup"]  # alone: nothing to take turns with
    roles.roles = {**roles.roles, "teacher": Role("teacher", object, 2, "teacher spec")}
    moved = roles.set_up(roles.start())
    teacher = roles.get("teacher")
    assert actor.log == ["setup", "offload"] and teacher.log == ["setup"]
    assert moved == {"offload/actor_bytes": 3.0, "time/offload_s": 0.5}
    back = roles.retire("teacher")
    assert teacher.killed and roles.get("teacher") is None and "teacher" not in roles.roles
    assert actor.log[-1] == "reload" and back == {"offload/actor_bytes": 3.0, "time/offload_s": 0.25}
    assert not roles.colocation.active  # nothing shares the devices any more
