"""Device mappings in pipeline configs: YAML and override forms, derived world sizes, load-time checks.

No Ray and no model: everything here is decided by ``load_config`` before anything expensive starts.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml
from test_config import QUICKSTART, REPO_ROOT, load_error

from roll.config import ConfigError, RLVRConfig, load_config, to_yaml
from roll.config.devices import role_plan
from roll.distributed.device_mapping import colocation_groups

pytestmark = pytest.mark.usefixtures("at_repo_root")

COLOCATED = "examples/colocated.yaml"
DISAGGREGATED = "examples/disaggregated.yaml"


def write_config(tmp_path: Path, body: str) -> str:
    """A config file that states only how it differs from the quickstart (its data paths stay relative to
    the repository root, the working directory of these tests)."""
    path = tmp_path / "devices.yaml"
    path.write_text(f"base: {REPO_ROOT / QUICKSTART}\n" + textwrap.dedent(body))
    return str(path)


def groups_of(cfg: RLVRConfig) -> list[list[str]]:
    return colocation_groups(role_plan(cfg))


# --------------------------------------------------------------------------- accepted forms


@pytest.mark.parametrize(
    "mapping",
    ["range(0,2)", "'range(0, 2)'", "[0, 1]", '"0,1"'],
    ids=["range_string", "quoted_range_string", "list", "comma_string"],
)
def test_yaml_device_mapping_forms(tmp_path: Path, mapping: str) -> None:
    cfg = load_config(
        write_config(
            tmp_path,
            f"""\
            actor:
              device_mapping: {mapping}
            """,
        )
    )
    assert cfg.actor.device_mapping == [0, 1]
    assert cfg.actor.world_size == 2  # derived: one rank per device
    # Untouched roles stay CPU-only with one worker.
    assert cfg.rollout.device_mapping is None
    assert cfg.rollout.world_size == 1


def test_cli_override_forms() -> None:
    cfg = load_config(QUICKSTART, ["actor.device_mapping=range(0,2)", "rollout.device_mapping=[2,3]"])
    assert cfg.actor.device_mapping == [0, 1]
    assert cfg.rollout.device_mapping == [2, 3]
    assert (cfg.actor.world_size, cfg.rollout.world_size) == (2, 2)


def test_override_replaces_the_yaml_mapping(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        """\
        actor:
          device_mapping: range(0,4)
        """,
    )
    cfg = load_config(path, ["actor.device_mapping=range(2,4)"])
    assert cfg.actor.device_mapping == [2, 3]
    assert cfg.actor.world_size == 2


def test_no_mapping_keeps_cpu_defaults() -> None:
    cfg = load_config(QUICKSTART)
    assert cfg.actor.device_mapping is None and cfg.rollout.device_mapping is None
    assert cfg.actor.world_size == 1 and cfg.rollout.world_size == 1
    assert groups_of(cfg) == []


def test_explicit_world_size_without_mapping_is_kept() -> None:
    cfg = load_config(QUICKSTART, ["actor.world_size=2", "rollout.world_size=2"])
    assert (cfg.actor.world_size, cfg.rollout.world_size) == (2, 2)


# --------------------------------------------------------------------------- world sizes


def test_matching_explicit_world_size_is_accepted() -> None:
    cfg = load_config(QUICKSTART, ["actor.device_mapping=[0,1]", "actor.world_size=2"])
    assert cfg.actor.world_size == 2


def test_conflicting_world_size_is_rejected() -> None:
    message = load_error(["actor.device_mapping=range(0,2)", "actor.world_size=4"])
    assert "actor.device_mapping" in message
    assert "actor.world_size is 4" in message
    assert "leave actor.world_size unset" in message


def test_devices_per_worker_the_engine_cannot_use_are_rejected() -> None:
    # The hf engine runs a worker on one device: a second one per worker would sit idle, reserved.
    message = load_error(["rollout.device_mapping=range(0,4)", "rollout.num_devices_per_worker=2"])
    assert "rollout.num_devices_per_worker=2: the hf engine runs each rollout worker on 1 device" in message
    cfg = load_config(QUICKSTART, ["rollout.device_mapping=range(0,4)", "rollout.num_devices_per_worker=1"])
    assert cfg.rollout.world_size == 4 and cfg.actor.world_size == 1


def test_uneven_num_devices_per_worker_is_rejected() -> None:
    message = load_error(["rollout.device_mapping=[0,1,2]", "rollout.num_devices_per_worker=2"])
    assert "rollout.device_mapping" in message
    assert "rollout.num_devices_per_worker=2" in message


def test_critic_world_size_is_derived() -> None:
    cfg = load_config(
        QUICKSTART,
        ["algorithm.advantage_estimator=gae", "critic.lr=1e-4", "critic.device_mapping=range(2,4)"],
    )
    assert cfg.critic is not None
    assert cfg.critic.world_size == 2
    assert groups_of(cfg) == [["critic"]]


# --------------------------------------------------------------------------- malformed and impossible


def test_malformed_string_names_the_key(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        """\
        actor:
          device_mapping: range(0
        """,
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "actor.device_mapping" in str(info.value)
    assert "range(0" in str(info.value)


def test_malformed_override_names_the_key() -> None:
    message = load_error(["rollout.device_mapping=range(0"])
    assert "rollout.device_mapping" in message


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("[0,0]", "more than once"), ("[0,-1]", "must be >= 0"), ("range(0)", "names no devices")],
)
def test_bad_indices_name_the_key(value: str, fragment: str) -> None:
    message = load_error([f"actor.device_mapping={value}"])
    assert "actor.device_mapping" in message and fragment in message


def test_device_beyond_num_gpus_is_rejected_at_load() -> None:
    message = load_error(["ray.num_gpus=2", "actor.device_mapping=[0,3]"])
    assert "actor.device_mapping" in message
    assert "device 3" in message
    assert "use indices below 2" in message


def test_device_within_num_gpus_is_accepted() -> None:
    cfg = load_config(QUICKSTART, ["ray.num_gpus=2", "actor.device_mapping=[0,1]"])
    assert cfg.ray.num_gpus == 2 and cfg.actor.world_size == 2


def test_joining_a_cluster_skips_the_device_count() -> None:
    # The joined cluster's devices are unknown until Ray starts; placement checks them then.
    cfg = load_config(QUICKSTART, ["ray.address=auto", "ray.num_gpus=2", "actor.device_mapping=[0,3]"])
    assert cfg.ray.address == "auto"
    assert cfg.actor.device_mapping == [0, 3]


@pytest.mark.parametrize("value", [0, -1])
def test_nonpositive_micro_batch_tokens_is_rejected(value: int) -> None:
    message = load_error([f"actor.micro_batch_tokens={value}"])
    assert f"actor.micro_batch_tokens must be >= 1 (got {value})" in message


def test_micro_batch_tokens_is_accepted() -> None:
    cfg = load_config(QUICKSTART, ["actor.micro_batch_tokens=256"])
    assert cfg.actor.micro_batch_tokens == 256


# --------------------------------------------------------------------------- the examples


def test_colocated_example() -> None:
    cfg = load_config(COLOCATED)
    assert cfg.ray.num_gpus == 2
    assert cfg.actor.device_mapping == [0, 1] and cfg.rollout.device_mapping == [0, 1]
    assert (cfg.actor.world_size, cfg.rollout.world_size) == (2, 2)
    assert groups_of(cfg) == [["actor", "rollout"]]


def test_disaggregated_example() -> None:
    cfg = load_config(DISAGGREGATED)
    assert cfg.ray.num_gpus == 4
    assert cfg.actor.device_mapping == [0, 1] and cfg.rollout.device_mapping == [2, 3]
    assert (cfg.actor.world_size, cfg.rollout.world_size) == (2, 2)
    assert groups_of(cfg) == [["actor"], ["rollout"]]


def test_colocated_example_rejects_a_third_device() -> None:
    message = load_error(["rollout.device_mapping=range(0,3)"], path=COLOCATED)
    assert "rollout.device_mapping" in message and "use indices below 2" in message


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("path", [COLOCATED, DISAGGREGATED])
def test_resolved_config_round_trips(tmp_path: Path, path: str) -> None:
    cfg = load_config(path)
    text = to_yaml(cfg)
    printed = yaml.safe_load(text)
    for role in ("actor", "rollout"):
        # The derived world sizes are written out, next to the parsed mapping.
        assert printed[role]["world_size"] == 2
        assert printed[role]["device_mapping"] == getattr(cfg, role).device_mapping
    again_path = tmp_path / "printed.yaml"
    again_path.write_text(text)
    again = load_config(str(again_path))
    assert again == cfg
    assert groups_of(again) == groups_of(cfg)


# --------------------------------------------------------------------------- one-trainer pipelines


def test_the_sft_trainer_takes_a_mapping_and_its_world_size_follows() -> None:
    cfg = load_config("examples/sft.yaml", ["train.device_mapping='range(0,2)'"])
    assert cfg.train.device_mapping == [0, 1] and cfg.train.world_size == 2
    assert load_config("examples/sft.yaml", []).train.world_size == 1  # unmapped: one CPU rank
    message = load_error(["train.device_mapping=[0,5]", "ray.num_gpus=2"], "examples/sft.yaml")
    assert "train.device_mapping" in message and "device 5" in message


def test_the_rl_warm_start_trains_on_the_actors_ranks() -> None:
    cfg = load_config(QUICKSTART, ["actor.device_mapping=[0,1]"])
    assert cfg.sft_warm_start.world_size == cfg.actor.world_size == 2
    assert load_config(QUICKSTART, []).sft_warm_start.world_size == 1
    assert "sft_warm_start.device_mapping: the warm start trains on the actor's devices" in load_error(
        ["sft_warm_start.device_mapping=[2,3]"]
    )
    assert "sft_warm_start.world_size is 1" in load_error(
        ["actor.device_mapping=[0,1]", "sft_warm_start.world_size=1"]
    )
