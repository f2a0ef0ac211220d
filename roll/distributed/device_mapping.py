"""Per-role device maps: parse, validate and group them, before any Ray or torch is involved.

A role's ``device_mapping`` lists the global device indices its workers use. Roles whose lists share
devices are *colocated*: they time-share those devices, and the pipeline offloads one role's state
before the next stage runs. Roles with disjoint lists are *disaggregated* and run at the same time,
which asynchronous training requires of generation and training. A role without a mapping is CPU-only
and sized by ``world_size``.

Everything here is pure so that a config can be checked (and its mistakes reported under the config
key that holds them) in milliseconds, without starting Ray. ``roll.distributed.placement`` turns a
checked ``RoleDevices`` into Ray placement.
"""

from __future__ import annotations

import operator
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

ACCEPTED_FORMS = (
    'a list of device indices ([0, 1, 2, 3]) or a string: "range(0,8)", "range(4)", "range(0,8,2)", '
    '"0,1,2,3" or "[0, 1]"'
)
_RANGE = re.compile(r"range\(\s*([^)]*)\)")
_INT = re.compile(r"[+-]?\d+")


def parse_device_mapping(value: str | Sequence[int] | None, key: str) -> list[int] | None:
    """The device indices that ``value`` names, or None when it names none (a CPU-only role).

    ``key`` is the config key holding ``value`` (e.g. ``"actor.device_mapping"``); every error is a
    ``ValueError`` whose message starts with it. Strings are parsed, never evaluated, so a config
    cannot run code. Negative, duplicate and non-integer indices (bools included) and empty lists are
    rejected.
    """
    if value is None:
        return None
    if isinstance(value, str):
        indices = _parse_string(value, key)
    elif isinstance(value, (bytes, bytearray)) or not isinstance(value, Sequence):
        raise ValueError(f"{key}: expected {ACCEPTED_FORMS}; got {type(value).__name__} {value!r}")
    else:
        indices = [_as_index(item, key, value) for item in value]
    return _checked(indices, key, value)


def _parse_string(text: str, key: str) -> list[int]:
    stripped = text.strip()
    match = _RANGE.fullmatch(stripped)
    if match:
        args = [_parse_int(part, key, text) for part in match.group(1).split(",")]
        if not 1 <= len(args) <= 3:
            raise ValueError(f"{key}: range() takes 1 to 3 integers, got {text!r}; expected {ACCEPTED_FORMS}")
        if len(args) == 3 and args[2] == 0:
            raise ValueError(f"{key}: range() step must not be zero in {text!r}")
        return list(range(*args))
    if stripped.startswith("[") and stripped.endswith("]"):
        stripped = stripped[1:-1]
    if not stripped.strip():
        raise ValueError(f"{key}: names no devices ({text!r}); expected {ACCEPTED_FORMS}")
    return [_parse_int(part, key, text) for part in stripped.split(",")]


def _parse_int(part: str, key: str, text: str) -> int:
    part = part.strip()
    if not _INT.fullmatch(part):
        raise ValueError(f"{key}: {part!r} in {text!r} is not an integer; expected {ACCEPTED_FORMS}")
    return int(part)


def _as_index(item: object, key: str, value: object) -> int:
    # bool is an int subclass, but `True` in a device list is a typo, not device 1.
    if isinstance(item, bool):
        raise ValueError(f"{key}: {item!r} in {value!r} is not a device index; expected {ACCEPTED_FORMS}")
    try:
        # operator.index accepts ints and int-like scalars (numpy) but not floats or strings.
        return operator.index(item)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"{key}: {item!r} in {value!r} is not an integer device index; expected {ACCEPTED_FORMS}"
        ) from None


def _checked(indices: list[int], key: str, value: object) -> list[int]:
    if not indices:
        raise ValueError(
            f"{key}: names no devices ({value!r}); leave it unset for a CPU-only role, "
            f"or give {ACCEPTED_FORMS}"
        )
    negative = [i for i in indices if i < 0]
    if negative:
        raise ValueError(f"{key}: device indices must be >= 0, got {negative} in {value!r}")
    duplicates = sorted(i for i, count in Counter(indices).items() if count > 1)
    if duplicates:
        raise ValueError(f"{key}: device(s) {duplicates} listed more than once in {value!r}")
    return indices


@dataclass(frozen=True)
class RoleDevices:
    """One role's devices: ``world_size`` ranks, each using ``num_devices_per_worker`` consecutive
    entries of ``device_mapping`` (None for a CPU-only role). Build it with ``role_devices``, which
    parses the mapping and derives a missing world size; direct construction is checked too."""

    role: str
    device_mapping: tuple[int, ...] | None
    world_size: int
    num_devices_per_worker: int = 1

    def __post_init__(self) -> None:
        if self.device_mapping is not None:
            # Frozen and hashable whatever sequence the caller passed.
            object.__setattr__(self, "device_mapping", tuple(self.device_mapping))
        _check_shape(self.role, self.device_mapping, self.world_size, self.num_devices_per_worker)

    @classmethod
    def create(
        cls,
        role: str,
        device_mapping: str | Sequence[int] | None,
        world_size: int | None = None,
        num_devices_per_worker: int = 1,
    ) -> RoleDevices:
        """Same as ``role_devices``."""
        return role_devices(role, device_mapping, world_size, num_devices_per_worker)

    @property
    def devices(self) -> frozenset[int]:
        """All devices of the role (empty for a CPU-only role)."""
        return frozenset(self.device_mapping or ())

    def devices_of(self, rank: int) -> list[int]:
        """The devices of ``rank`` (empty for a CPU-only role)."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"{self.role}: rank {rank} out of range for world_size {self.world_size}")
        if self.device_mapping is None:
            return []
        n = self.num_devices_per_worker
        return list(self.device_mapping[rank * n : (rank + 1) * n])


def _check_shape(role: str, mapping: Sequence[int] | None, world_size: int, per_worker: int) -> None:
    if isinstance(per_worker, bool) or not isinstance(per_worker, int) or per_worker < 1:
        raise ValueError(f"{role}.num_devices_per_worker: must be an integer >= 1, got {per_worker!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{role}.world_size: must be an integer >= 1, got {world_size!r}")
    if mapping is None:
        if per_worker != 1:
            raise ValueError(
                f"{role}.num_devices_per_worker: is {per_worker} but {role}.device_mapping is unset, "
                f"so the role runs on CPU only; set {role}.device_mapping to give it devices"
            )
        return
    if len(mapping) % per_worker:
        raise ValueError(
            f"{role}.device_mapping: {len(mapping)} devices cannot be split into workers of "
            f"{role}.num_devices_per_worker={per_worker}; list a multiple of {per_worker} devices"
        )
    derived = len(mapping) // per_worker
    if world_size != derived:
        raise ValueError(
            f"{role}.device_mapping: {len(mapping)} devices at {per_worker} per worker make {derived} "
            f"worker(s), but {role}.world_size is {world_size}; leave {role}.world_size unset "
            "(it is derived from the mapping) or make the two agree"
        )


def role_devices(
    role: str,
    device_mapping: str | Sequence[int] | None,
    world_size: int | None = None,
    num_devices_per_worker: int = 1,
) -> RoleDevices:
    """Parse and check one role's device settings. ``world_size=None`` means: derived from the
    mapping (``len(mapping) // num_devices_per_worker``), or 1 for a CPU-only role."""
    mapping = parse_device_mapping(device_mapping, f"{role}.device_mapping")
    if world_size is None:
        if mapping is None:
            world_size = 1
        elif isinstance(num_devices_per_worker, int) and num_devices_per_worker >= 1:
            # An uneven split is reported by _check_shape before the world size is compared.
            world_size = max(len(mapping) // num_devices_per_worker, 1)
        else:
            world_size = 1  # the bad num_devices_per_worker is reported by _check_shape
    return RoleDevices(
        role, tuple(mapping) if mapping is not None else None, world_size, num_devices_per_worker
    )


def is_colocated(a: RoleDevices, b: RoleDevices) -> bool:
    """Whether two roles share at least one device (and so must time-share it)."""
    return bool(a.devices & b.devices)


def colocation_groups(roles: Sequence[RoleDevices]) -> list[list[str]]:
    """Role names grouped by shared devices, transitively: actor [0,1], reference [1,2] and critic
    [2,3] are one group even though actor and critic share nothing, because all three must be
    scheduled as one time-shared unit. Roles alone on their devices form a group of one; CPU-only
    roles are in no group. Groups and the names in them follow the order of ``roles``."""
    gpu_roles = [r for r in roles if r.device_mapping is not None]
    parent = list(range(len(gpu_roles)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}  # device -> index of the first role seen on it
    for i, role in enumerate(gpu_roles):
        for device in role.device_mapping or ():
            if device in owner:
                parent[find(i)] = find(owner[device])
            else:
                owner[device] = i
    groups: dict[int, list[str]] = {}
    for i, role in enumerate(gpu_roles):
        groups.setdefault(find(i), []).append(role.role)
    return list(groups.values())


def validate_plan(roles: Sequence[RoleDevices], num_devices: int | None) -> list[str]:
    """Problems with the roles' devices taken together, each naming the config key to change; empty
    when the plan is fine. ``num_devices`` is the cluster's device count (None: unknown, not checked).

    Colocation, even partial, is allowed: colocated roles time-share devices (asynchronous generation
    cannot, ``roll.config.rl_checks.check_async_generation``)."""
    problems: list[str] = []
    if num_devices is not None:
        for role in roles:
            out_of_range = sorted(d for d in role.devices if d >= num_devices)
            if out_of_range:
                problems.append(_out_of_range_message(role.role, out_of_range, num_devices))
    return problems


def _out_of_range_message(role: str, out_of_range: list[int], num_devices: int) -> str:
    key = f"{role}.device_mapping"
    names = f"device {out_of_range[0]}" if len(out_of_range) == 1 else f"devices {out_of_range}"
    if num_devices == 0:
        return (
            f"{key}: names {names} but the cluster has no devices; on a CPU-only machine declare "
            f"logical devices with `ray.num_gpus: N` (N > {max(out_of_range)}), or drop {key} and set "
            f"{role}.world_size to run the role on CPU"
        )
    return (
        f"{key}: names {names} but the cluster has {num_devices} devices (0-{num_devices - 1}); "
        f"use indices below {num_devices}"
    )
