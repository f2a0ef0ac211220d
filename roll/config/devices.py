"""Device mappings in a config: parse ``'range(0,4)'`` forms, derive world sizes, check the plan at load.

Which devices each role gets is decided here, before Ray starts; ``roll.distributed.placement`` puts the
workers there. Roles: ``actor`` (the reference model shares its devices), ``critic``, ``rollout``.
"""

from __future__ import annotations

from typing import Any

from roll.config.common import cluster_to_join
from roll.distributed.device_mapping import RoleDevices, parse_device_mapping, role_devices, validate_plan

# Config sections that may carry a device mapping.
MAPPED_SECTIONS = ("actor", "critic", "rollout")


def parse_mapping_strings(raw: Any) -> None:
    """Turn ``device_mapping: 'range(0,4)'`` strings of a raw (OmegaConf) config into lists, in place, so
    the typed schema (a list of ints) accepts them."""
    for section in MAPPED_SECTIONS:
        node = raw.get(section) if hasattr(raw, "get") else None
        value = node.get("device_mapping") if hasattr(node, "get") else None
        if isinstance(value, str):
            node["device_mapping"] = parse_device_mapping(value, f"{section}.device_mapping")


def role_plan(config: Any) -> list[RoleDevices]:
    """The device-holding roles of an RLVR config (raises ValueError naming the key when inconsistent)."""
    roles = []
    for name in MAPPED_SECTIONS:
        section = getattr(config, name, None)
        if section is None:
            continue
        ndpw = getattr(section, "num_devices_per_worker", 1)
        roles.append(role_devices(name, section.device_mapping, section.world_size, ndpw))
    return roles


def resolve_world_sizes(config: Any) -> list[str]:
    """Fill each unset ``world_size`` from its device mapping (or 1); returns the problems found."""
    try:
        roles = role_plan(config)
    except ValueError as e:
        return [str(e)]
    for role in roles:
        getattr(config, role.role).world_size = role.world_size
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
