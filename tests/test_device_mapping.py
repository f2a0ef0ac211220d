"""Tests for roll.distributed.device_mapping: parsing, per-role checks, colocation and plan validation.

Pure functions only (no Ray): every mistake must be reported under the config key that holds it.
"""

from __future__ import annotations

import pytest

from roll.distributed.device_mapping import (
    RoleDevices,
    colocation_groups,
    is_colocated,
    parse_device_mapping,
    role_devices,
    validate_plan,
)

KEY = "actor.device_mapping"

# ------------------------------------------------------------------ parse_device_mapping


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ([0, 1, 2], [0, 1, 2]),
        ((3, 1), [3, 1]),
        ("range(0,8)", list(range(8))),
        ("range(4)", [0, 1, 2, 3]),
        ("range(0,8,2)", [0, 2, 4, 6]),
        (" range( 2, 4 ) ", [2, 3]),
        ("0,1,2,3", [0, 1, 2, 3]),
        ("[0, 1]", [0, 1]),
        ("5", [5]),
    ],
)
def test_parse_accepts_lists_ranges_and_comma_strings(value, expected):
    assert parse_device_mapping(value, KEY) == expected


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ([0, -1], "must be >= 0"),
        ("range(-2, 2)", "must be >= 0"),
        ([0, 1, 1], r"device\(s\) \[1\] listed more than once"),
        ("0,0", "more than once"),
        ([], "names no devices"),
        ("[]", "names no devices"),
        ("range(0)", "names no devices"),
        ([0, True], "not a device index"),
        ([0, 1.0], "not an integer device index"),
        (["0"], "not an integer device index"),
        ("0,a", "'a' in '0,a' is not an integer"),
        ("0,,1", "is not an integer"),
        ("range(1,2,3,4)", "range.. takes 1 to 3 integers"),
        ("range(0,4,0)", "step must not be zero"),
        ("__import__('os').system('true')", "is not an integer"),
        (3, "expected a list"),
        ({0: 1}, "expected a list"),
    ],
)
def test_parse_rejects_bad_values_naming_the_key(value, problem):
    with pytest.raises(ValueError, match=problem) as info:
        parse_device_mapping(value, KEY)
    assert str(info.value).startswith(f"{KEY}: ")


def test_parse_error_lists_the_accepted_forms():
    with pytest.raises(ValueError) as info:
        parse_device_mapping("gpus 0-3", KEY)
    assert '"range(0,8)"' in str(info.value) and '"0,1,2,3"' in str(info.value)


# ------------------------------------------------------------------ role_devices / RoleDevices


def test_world_size_is_derived_from_the_mapping():
    role = role_devices("actor", "range(4)", None, num_devices_per_worker=2)
    assert role == RoleDevices("actor", (0, 1, 2, 3), 2, 2)
    assert role.devices_of(0) == [0, 1]
    assert role.devices_of(1) == [2, 3]
    assert RoleDevices.create("actor", [4, 6]).world_size == 2


def test_explicit_world_size_must_match_the_mapping():
    assert role_devices("rollout", [2, 3], 2).devices_of(1) == [3]
    with pytest.raises(ValueError, match=r"make 2 worker\(s\), but rollout.world_size is 3") as info:
        role_devices("rollout", [2, 3], 3)
    assert str(info.value).startswith("rollout.device_mapping: ")


def test_mapping_must_split_evenly_into_workers():
    with pytest.raises(ValueError, match="3 devices cannot be split .*num_devices_per_worker=2") as info:
        role_devices("actor", [0, 1, 2], None, num_devices_per_worker=2)
    assert str(info.value).startswith("actor.device_mapping: ")


def test_cpu_only_role_needs_world_size_and_one_device_per_worker():
    role = role_devices("reward", None, 3)
    assert role.device_mapping is None and role.world_size == 3
    assert role.devices_of(2) == [] and role.devices == frozenset()
    assert role_devices("reward", None).world_size == 1
    with pytest.raises(ValueError, match=r"^reward.world_size: must be an integer >= 1, got 0"):
        role_devices("reward", None, 0)
    with pytest.raises(ValueError, match=r"^reward.num_devices_per_worker: is 2 .*runs on CPU only"):
        role_devices("reward", None, 1, num_devices_per_worker=2)
    with pytest.raises(ValueError, match=r"^actor.num_devices_per_worker: must be an integer >= 1"):
        role_devices("actor", [0], None, num_devices_per_worker=0)


def test_role_devices_is_frozen_and_checked_on_direct_construction():
    role = RoleDevices("actor", [0, 1], 2)
    assert role.device_mapping == (0, 1)  # stored as a tuple: hashable, cannot change under a plan
    assert hash(role) == hash(RoleDevices("actor", (0, 1), 2))
    with pytest.raises(ValueError, match="actor.device_mapping"):
        RoleDevices("actor", (0, 1), 3)
    with pytest.raises(IndexError, match="rank 2 out of range"):
        role.devices_of(2)


# ------------------------------------------------------------------ colocation


def test_colocation_groups_are_transitive_and_skip_cpu_roles():
    roles = [
        role_devices("actor", [0, 1]),
        role_devices("rollout", [4, 5]),
        role_devices("reference", [1, 2]),
        role_devices("critic", [2, 3]),
        role_devices("reward", None, 2),
        role_devices("judge", [6]),
    ]
    assert colocation_groups(roles) == [["actor", "reference", "critic"], ["rollout"], ["judge"]]
    assert is_colocated(roles[0], roles[2])
    assert not is_colocated(roles[0], roles[3])  # same group, through reference, but no shared device
    assert not is_colocated(roles[0], roles[4])
    assert colocation_groups([]) == []


def test_same_list_is_one_group_disjoint_lists_are_two():
    actor, rollout = role_devices("actor", "range(4)"), role_devices("rollout", "0,1,2,3")
    assert colocation_groups([actor, rollout]) == [["actor", "rollout"]]
    rollout = role_devices("rollout", "range(4,8)")
    assert colocation_groups([actor, rollout]) == [["actor"], ["rollout"]]


# ------------------------------------------------------------------ validate_plan


def test_valid_plans_have_no_problems():
    colocated = [role_devices("actor", [0, 1]), role_devices("rollout", [1, 2]), role_devices("reward", None)]
    assert validate_plan(colocated, num_devices=4) == []
    assert validate_plan(colocated, num_devices=None) == []  # unknown device count: not checked
    disaggregated = [role_devices("actor", [0, 1]), role_devices("rollout", [2, 3])]
    assert validate_plan(disaggregated, num_devices=4) == []


def test_device_beyond_the_cluster_is_reported_with_the_valid_range():
    roles = [role_devices("actor", [0, 1]), role_devices("rollout", [4, 5])]
    problems = validate_plan(roles, num_devices=4)
    assert problems == [
        "rollout.device_mapping: names devices [4, 5] but the cluster has 4 devices (0-3); "
        "use indices below 4"
    ]
    (one,) = validate_plan([role_devices("critic", [5])], num_devices=4)
    assert one.startswith("critic.device_mapping: names device 5 but the cluster has 4 devices (0-3); ")


def test_no_devices_suggests_declaring_logical_ones_or_world_size():
    (problem,) = validate_plan([role_devices("actor", [0, 1]), role_devices("reward", None)], num_devices=0)
    assert problem.startswith("actor.device_mapping: names devices [0, 1] but the cluster has no devices")
    assert "ray.num_gpus: N" in problem and "actor.world_size" in problem
