"""Device mappings in a config: parse ``'range(0,4)'`` forms, derive world sizes, check the plan at load.

Which devices each role gets is decided here, before Ray starts; ``roll.distributed.placement`` puts the
workers there. Roles: ``actor`` (the reference model shares its devices; the RL warm start trains on
them), ``critic``, ``rollout``, on-policy distillation's teachers, and ``train`` (SFT and offline
distillation: the teacher scores on the student's devices).
"""

from __future__ import annotations

from typing import Any

from roll.config.common import cluster_to_join
from roll.distributed.device_mapping import RoleDevices, parse_device_mapping, role_devices, validate_plan

# Config sections that may carry a device mapping (``train``: SFT's and offline distillation's trainer).
MAPPED_SECTIONS = ("actor", "critic", "rollout", "train")


TEACHER_PREFIX = "teacher_"  # role name of on-policy distillation's teacher <name>: teacher_<name>


def _raw_sections(raw: Any) -> list[tuple[str, Any]]:
    get = lambda node, key: node.get(key) if hasattr(node, "get") else None  # noqa: E731
    sections = [(name, get(raw, name)) for name in MAPPED_SECTIONS]
    teachers = get(get(raw, "distill"), "teachers")
    if hasattr(teachers, "items"):
        sections += [(f"distill.teachers.{name}", node) for name, node in teachers.items()]
    return sections


def parse_mapping_strings(raw: Any) -> None:
    """Turn ``device_mapping: 'range(0,4)'`` strings of a raw (OmegaConf) config into lists, in place, so
    the typed schema (a list of ints) accepts them."""
    for key, node in _raw_sections(raw):
        value = node.get("device_mapping") if hasattr(node, "get") else None
        if isinstance(value, str):
            node["device_mapping"] = parse_device_mapping(value, f"{key}.device_mapping")


def mapped_sections(config: Any) -> list[tuple[str, Any]]:
    """(role, config section) of every role that may hold devices: actor, critic, rollout, and on-policy
    distillation's teachers (``teacher_<name>``)."""
    sections = [(name, getattr(config, name, None)) for name in MAPPED_SECTIONS]
    teachers = getattr(getattr(config, "distill", None), "teachers", None) or {}
    sections += [(f"{TEACHER_PREFIX}{name}", teacher) for name, teacher in teachers.items()]
    # An offline-distillation teacher or an RL warm start has no mapping of its own (the trainer's).
    return [(name, s) for name, s in sections if s is not None and hasattr(s, "device_mapping")]


def role_plan(config: Any) -> list[RoleDevices]:
    """The device-holding roles of a config (raises ValueError naming the key when inconsistent)."""
    roles = []
    for name, section in mapped_sections(config):
        ndpw = getattr(section, "num_devices_per_worker", 1)
        roles.append(role_devices(name, section.device_mapping, section.world_size, ndpw))
    return roles


def resolve_world_sizes(config: Any) -> list[str]:
    """Fill each unset ``world_size`` from its device mapping (or 1); returns the problems found."""
    try:
        roles = role_plan(config)
    except ValueError as e:
        return [str(e)]
    sections = dict(mapped_sections(config))
    for role in roles:
        sections[role.role].world_size = role.world_size
    return []


def check_devices(config: Any) -> list[str]:
    """Mapping problems knowable before Ray starts: malformed or inconsistent mappings, and indices beyond
    ``ray.num_gpus`` when a local Ray will be started with that many devices."""
    try:
        roles = role_plan(config)
    except ValueError as e:
        return [str(e)]
    # The same rule as init_ray: joining a running cluster, its device count is only known once joined.
    joining = cluster_to_join(config.ray) is not None
    return validate_plan(roles, None if joining else config.ray.num_gpus)
