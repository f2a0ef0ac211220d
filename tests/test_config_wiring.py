"""Every ``actor``, ``critic``, ``rollout`` and ``algorithm`` option reaches what reads it (no Ray).

An option no code reads is a bug: each one is changed in turn and what the workers receive (their specs,
exactly as the pipeline hands them over) must change. ``algorithm`` options the driver reads instead
(credit assignment, the KL controller) must change what the driver computes.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from roll.config.rlvr import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    LoRAConfig,
    RewardShapingConfig,
    RLVRConfig,
    RolloutConfig,
    VLLMConfig,
)
from roll.pipelines.credit import compute_advantages, shape_scores
from roll.pipelines.worker_specs import WorkerPlan, from_section, plan_workers
from roll.workers.actor import ActorSpec, OptimizerSpec, PolicyLossSpec
from roll.workers.base import ModelSpec
from roll.workers.rollout import RolloutSpec

# A valid other value for options whose type alone does not give one.
OTHER_VALUES = {
    "device_mapping": [0, 1],
    "model_path": "/models/value",
    "num_devices_per_worker": 2,
    "group_filters": ["equal_rewards"],
    "engine": "my_engine",
    "stop_token_ids": [7],
    "advantage_estimator": "rloo",
    "policy_loss": "cispo",
    "loss_agg_mode": "seq-mean-token-sum",
    "kl_estimator": "k1",
    "clip": 0.5,
    "lora": LoRAConfig(),
    "vllm": VLLMConfig(kv_cache_gb=1.0),
}
# Options that only mean something together with another, set in both the plans compared.
COMPANIONS = {
    "num_devices_per_worker": {"device_mapping": [0, 1, 2, 3]},
    "vllm": {"engine": "vllm"},
    "tis_cap": {"off_policy_correction": "tis"},
    "gamma": {"advantage_estimator": "gae"},
    "lam": {"advantage_estimator": "gae"},
    "overlong_penalty_factor": {"overlong_buffer": 2},
    "step_advantage_weight": {"advantage_estimator": "gigpo"},
    "step_norm": {"advantage_estimator": "gigpo"},
}
# ``algorithm`` options the driver reads, not a worker: credit assignment (``roll.pipelines.credit``,
# tested below) and the RLVR loop's KL controller and reference role (run end to end by
# tests/test_recipes_cli.py::test_algorithm_knobs_reach_the_workers).
CREDIT_OPTIONS = (
    "advantage_estimator",
    "norm_adv_by_std",
    "gamma",
    "lam",
    "whiten_advantages",
    "advantage_clip",
    "step_advantage_weight",
    "step_norm",
)
KL_CONTROLLER_OPTIONS = ("kl_coef", "kl_penalty", "kl_target", "kl_horizon")


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
        return 1.5 if name == "tis_cap" else 0.5 if value in (None, 0.0, 1.0) else value / 2
    raise AssertionError(f"no other value known for {name}: {kind}; add one to OTHER_VALUES")


SECTIONS = {"actor": ActorConfig, "critic": CriticConfig, "rollout": RolloutConfig}


def base_config() -> RLVRConfig:
    cfg = RLVRConfig(critic=CriticConfig())
    cfg.rollout.rollout_batch_size, cfg.rollout.num_return_sequences = 4, 4
    return cfg


def plan_of(cfg: RLVRConfig) -> WorkerPlan:
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


def test_sequence_parallel_size_reaches_the_trainers_the_reference_and_their_dispatch() -> None:
    """The actor's and critic's own, and the reference's from the actor's (it scores on the actor's ranks);
    each role's clusters split their rows over sequence groups (``Role.sequence_parallel_size``)."""
    from roll.pipelines.worker_specs import policy_roles

    cfg = base_config()
    cfg.actor.sequence_parallel_size, cfg.critic.sequence_parallel_size = 2, 4
    cfg.algorithm.kl_coef = 0.1
    plan = plan_of(cfg)
    roles = policy_roles(cfg, plan, {})
    sizes = {name: role.sequence_parallel_size for name, role in roles.items()}
    assert sizes == {"actor": 2, "critic": 4, "rollout": 1, "reference": 2}


def test_rollout_options_reach_the_engine_and_the_sampler() -> None:
    cfg = base_config()
    cfg.rollout.max_running_requests, cfg.rollout.top_k, cfg.rollout.max_new_tokens = 3, 5, 7
    plan = plan_of(cfg)
    assert plan.rollout == RolloutSpec(model=plan.actor.model, max_running_requests=3)
    assert (plan.sampling.top_k, plan.sampling.max_new_tokens, plan.sampling.greedy) == (5, 7, False)
    assert plan.eval_sampling.greedy and plan.eval_sampling.max_new_tokens == cfg.eval.max_new_tokens


def vllm_engine_arguments(
    cfg: RLVRConfig, device: str, monkeypatch: pytest.MonkeyPatch
) -> dict[str, typing.Any]:
    """The keyword arguments the vllm engine's factory gives ``VLLMEngine`` for ``cfg`` on ``device`` (the
    class replaced by a recorder: nothing starts)."""
    from roll.strategies.infer import INFERENCE_ENGINES
    from roll.strategies.infer import vllm as vllm_engine

    received: dict[str, typing.Any] = {}

    def record(model_path: str, tokenizer: object, **kwargs: typing.Any) -> None:
        received.update(kwargs, model_path=model_path)

    monkeypatch.setattr(vllm_engine, "VLLMEngine", record)
    INFERENCE_ENGINES.get("vllm")(plan_of(cfg).rollout, None, torch.device(device))
    return received


# Each option of rollout.vllm and the VLLMEngine argument it must set (value of the option -> argument).
VLLM_ARGUMENTS = {
    "gpu_memory_utilization": ("gpu_memory_utilization", lambda value: value),
    "kv_cache_gb": ("kv_cache_bytes", lambda value: int(value * (1 << 30))),
    "max_model_len": ("max_model_len", lambda value: value),
    "enforce_eager": ("enforce_eager", lambda value: value),
}


def test_every_vllm_option_has_its_engine_argument() -> None:
    assert set(VLLM_ARGUMENTS) == {f.name for f in dataclasses.fields(VLLMConfig)}


@pytest.mark.parametrize("field", sorted(VLLM_ARGUMENTS))
def test_every_vllm_option_reaches_the_engines_constructor(
    field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = base_config()
    cfg.rollout.engine, cfg.rollout.vllm = "vllm", VLLMConfig()
    value = other_value(VLLMConfig, field, getattr(cfg.rollout.vllm, field))
    setattr(cfg.rollout.vllm, field, value)
    argument, expected = VLLM_ARGUMENTS[field]
    assert vllm_engine_arguments(cfg, "cuda", monkeypatch)[argument] == expected(value)
    cfg.rollout.engine = "hf"
    assert plan_of(cfg).rollout.engine_options == {}  # the hf engine has none


def test_the_vllm_engines_defaults_follow_its_device_and_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset options: on CUDA the KV cache is what gpu_memory_utilization leaves and CUDA graphs are on; on
    a CPU a 0.25 GiB cache, eager; max_model_len is the run's longest sequence; a rollout sharing the
    actor's devices sleeps on CUDA (with a smaller share of the GPU) and stays resident on a CPU; the
    devices of a worker are vLLM's tensor-parallel size."""
    cfg = base_config()
    cfg.rollout.engine = "vllm"
    longest = cfg.data.max_prompt_length + max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)
    cuda = vllm_engine_arguments(cfg, "cuda", monkeypatch)
    assert (cuda["kv_cache_bytes"], cuda["enforce_eager"], cuda["gpu_memory_utilization"]) == (
        None,
        False,
        0.85,
    )
    assert (cuda["max_model_len"], cuda["sleeps"], cuda["tensor_parallel_size"]) == (longest, False, 1)
    cpu = vllm_engine_arguments(cfg, "cpu", monkeypatch)
    assert (cpu["kv_cache_bytes"], cpu["enforce_eager"], cpu["sleeps"]) == (256 << 20, True, False)
    cfg.actor.device_mapping = cfg.rollout.device_mapping = [0, 1]
    cfg.rollout.num_devices_per_worker = 2
    colocated = vllm_engine_arguments(cfg, "cuda", monkeypatch)
    assert (colocated["sleeps"], colocated["gpu_memory_utilization"]) == (True, 0.5)
    assert colocated["tensor_parallel_size"] == 2
    assert (
        vllm_engine_arguments(cfg, "cpu", monkeypatch)["sleeps"] is False
    )  # resident: the stages take turns


def test_from_section_copies_same_named_fields_and_takes_computed_ones() -> None:
    section = ActorConfig(micro_batch_size=3, ppo_epochs=2, lr=0.5)
    spec = from_section(
        ActorSpec, section, model=ModelSpec(path="m"), optimizer=OptimizerSpec(lr=1.0, total_steps=1)
    )
    assert (spec.micro_batch_size, spec.ppo_epochs, spec.optimizer.lr) == (3, 2, 1.0)
    assert spec.collective_timeout_s == ActorSpec.__dataclass_fields__["collective_timeout_s"].default


def test_algorithm_options_are_each_read_by_the_actor_or_by_the_driver() -> None:
    actor_side = {f.name for f in dataclasses.fields(PolicyLossSpec)} | {"off_policy_correction"}
    driver_side = {*CREDIT_OPTIONS, *KL_CONTROLLER_OPTIONS, "reward_shaping"}
    assert actor_side.isdisjoint(driver_side)
    assert {f.name for f in dataclasses.fields(AlgorithmConfig)} == actor_side | driver_side


@pytest.mark.parametrize(
    "field",
    [f.name for f in dataclasses.fields(PolicyLossSpec)] + ["off_policy_correction"],
)
def test_every_policy_loss_option_reaches_the_actor(field: str) -> None:
    cfg = base_config()
    for name, value in COMPANIONS.get(field, {}).items():
        setattr(cfg.algorithm, name, value)
    before = plan_of(cfg).actor
    setattr(cfg.algorithm, field, other_value(AlgorithmConfig, field, getattr(cfg.algorithm, field)))
    after = plan_of(cfg).actor
    assert after.loss != before.loss, f"algorithm.{field} does not reach the actor: wire it or delete it"


def test_the_actor_receives_its_loss_options_and_no_pipeline_config() -> None:
    cfg = base_config()
    cfg.algorithm.policy_loss, cfg.algorithm.clip_ratio_high = "dual_clip", 0.28
    actor = plan_of(cfg).actor
    assert actor.loss == PolicyLossSpec(policy_loss="dual_clip", clip_ratio_high=0.28, tis_cap=None)
    for spec_field in dataclasses.fields(actor):
        value = getattr(actor, spec_field.name)
        assert not isinstance(value, (AlgorithmConfig, RLVRConfig)), spec_field.name


def test_the_off_policy_correction_resolves_by_the_rollout_mode() -> None:
    cfg = base_config()
    assert plan_of(cfg).actor.loss.tis_cap is None  # synchronous: on-policy up to engine mismatch
    cfg.rollout.async_generation_ratio = 1
    assert plan_of(cfg).actor.loss.tis_cap == 2.0  # auto: on, at the default cap
    cfg.algorithm.tis_cap = 3.0
    assert plan_of(cfg).actor.loss.tis_cap == 3.0
    cfg.algorithm.off_policy_correction, cfg.algorithm.tis_cap = "none", None
    assert plan_of(cfg).actor.loss.tis_cap is None
    cfg.rollout.async_generation_ratio, cfg.algorithm.off_policy_correction = 0, "tis"
    assert plan_of(cfg).actor.loss.tis_cap == 2.0


def _credit(algo: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns of a fixed batch (groups of 2, a loss mask with holes, critic values; for
    the per-turn estimators, rows are two turns of 4 episodes, two episodes per group)."""
    generator = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]] * 2)
    rewards = torch.rand(mask.shape, generator=generator) * 4 - 1
    values = torch.rand(mask.shape, generator=generator)
    per_turn = {
        "episode_index": torch.arange(8) // 2,
        "turn_index": torch.arange(8) % 2,
        "turn_rewards": (rewards * mask).sum(dim=1),
        "anchor_index": torch.tensor([0, 1, 0, 2, 3, 4, 3, 5]),  # both episodes of a group start alike
    }
    return compute_advantages(algo, rewards * mask, mask, torch.arange(8) // 4, values, per_turn)


@pytest.mark.parametrize("field", CREDIT_OPTIONS)
def test_every_credit_option_changes_the_advantages(field: str) -> None:
    algo = AlgorithmConfig()
    for name, value in COMPANIONS.get(field, {}).items():
        setattr(algo, name, value)
    before = _credit(algo)
    setattr(algo, field, other_value(AlgorithmConfig, field, getattr(algo, field)))
    after = _credit(algo)
    assert not all(torch.equal(a, b) for a, b in zip(before, after)), f"algorithm.{field} changes nothing"


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(RewardShapingConfig)])
def test_every_reward_shaping_option_changes_the_scores(field: str) -> None:
    shaping = RewardShapingConfig()
    for name, value in COMPANIONS.get(field, {}).items():
        setattr(shaping, name, value)
    scores, lengths = torch.tensor([1.0, 0.0, 2.0, -1.0]), torch.tensor([16, 3, 15, 8])
    before = shape_scores(scores, lengths, shaping, max_new_tokens=16)
    setattr(shaping, field, other_value(RewardShapingConfig, field, getattr(shaping, field)))
    after = shape_scores(scores, lengths, shaping, max_new_tokens=16)
    assert not torch.equal(before, after), f"algorithm.reward_shaping.{field} changes nothing"
