"""Every ``actor``, ``critic`` and ``rollout`` option reaches what the workers receive (no Ray).

An option no code reads is a bug: each one is changed in turn and the worker plan must change.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from roll.config.rlvr import ActorConfig, CriticConfig, RLVRConfig, RolloutConfig
from roll.pipelines.worker_specs import RLVRWorkerPlan, from_section, plan_workers
from roll.workers.actor import ActorSpec, OptimizerSpec
from roll.workers.base import ModelSpec
from roll.workers.rollout import RolloutSpec

# A valid other value for options whose type alone does not give one.
OTHER_VALUES = {
    "device_mapping": [0, 1],
    "model_path": "/models/value",
    "num_devices_per_worker": 2,
    "group_filters": ["equal_rewards"],
}
# Options that only mean something together with another, set in both the plans compared.
COMPANIONS = {"num_devices_per_worker": {"device_mapping": [0, 1, 2, 3]}}


def other_value(cls: type, name: str, value: object) -> object:
    """A different valid value for option ``name`` of section ``cls`` (what a user would write instead)."""
    if name in OTHER_VALUES:
        return OTHER_VALUES[name]
    kind = typing.get_type_hints(cls)[name]
    if typing.get_origin(kind) is typing.Literal:
        return next(choice for choice in typing.get_args(kind) if choice != value)
    types = set(typing.get_args(kind)) or {kind}
    if bool in types:
        return not value
    if int in types:
        return 2 if value is None else value + 1
    if float in types:
        return 0.5 if value in (None, 0.0, 1.0) else value / 2
    raise AssertionError(f"no other value known for {name}: {kind}; add one to OTHER_VALUES")


SECTIONS = {"actor": ActorConfig, "critic": CriticConfig, "rollout": RolloutConfig}


def base_config() -> RLVRConfig:
    cfg = RLVRConfig(critic=CriticConfig())
    cfg.rollout.rollout_batch_size, cfg.rollout.num_return_sequences = 4, 4
    return cfg


def plan_of(cfg: RLVRConfig) -> RLVRWorkerPlan:
    return plan_workers(cfg, "/models/policy")


@pytest.mark.parametrize(
    ("section", "field"),
    [
        (section, field)
        for section, cls in SECTIONS.items()
        for field in (f.name for f in dataclasses.fields(cls))
    ],
)
def test_every_option_changes_what_the_workers_receive(section: str, field: str) -> None:
    cfg = base_config()
    options = getattr(cfg, section)
    for name, value in COMPANIONS.get(field, {}).items():
        setattr(options, name, value)
    before = plan_of(cfg)
    setattr(options, field, other_value(SECTIONS[section], field, getattr(options, field)))
    assert plan_of(cfg) != before, f"{section}.{field} is read by no worker: wire it or delete it"


def test_micro_batch_tokens_reaches_the_trainer() -> None:
    """The option that once was validated, documented and dropped."""
    cfg = base_config()
    cfg.actor.micro_batch_tokens = 512
    cfg.critic.micro_batch_tokens = 256
    plan = plan_of(cfg)
    assert plan.actor.micro_batch_tokens == 512 and plan.critic.micro_batch_tokens == 256


def test_rollout_options_reach_the_engine_and_the_sampler() -> None:
    cfg = base_config()
    cfg.rollout.max_running_requests, cfg.rollout.top_k, cfg.rollout.max_new_tokens = 3, 5, 7
    plan = plan_of(cfg)
    assert plan.rollout == RolloutSpec(model=plan.actor.model, max_running_requests=3)
    assert (plan.sampling.top_k, plan.sampling.max_new_tokens, plan.sampling.greedy) == (5, 7, False)
    assert plan.eval_sampling.greedy and plan.eval_sampling.max_new_tokens == cfg.eval.max_new_tokens


def test_from_section_copies_same_named_fields_and_takes_computed_ones() -> None:
    section = ActorConfig(micro_batch_size=3, ppo_epochs=2, lr=0.5)
    spec = from_section(
        ActorSpec, section, model=ModelSpec(path="m"), optimizer=OptimizerSpec(lr=1.0, total_steps=1)
    )
    assert (spec.micro_batch_size, spec.ppo_epochs, spec.optimizer.lr) == (3, 2, 1.0)
    assert spec.collective_timeout_s == ActorSpec.__dataclass_fields__["collective_timeout_s"].default
