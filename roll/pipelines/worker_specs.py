"""What each worker of an RL run (RLVR or agentic) receives, built from the config in one place.

A worker spec field takes the config section's field of the same name (``from_section``): an option
reaches its worker by being declared in both, with no copying code to forget (``actor.
micro_batch_tokens`` was once validated, documented and never passed on). What the pipeline computes
(the model to load, the length of the LR schedule, timeouts) is passed explicitly. The pipeline reads
everything it hands to workers from ``WorkerPlan``, and a test changes every ``actor``, ``critic``
and ``rollout`` option in turn and checks that the plan changes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from roll.config.common import ModelConfig
from roll.config.devices import role_plan
from roll.config.engine_checks import roles_sharing_rollout_devices
from roll.config.rlvr import RLVRConfig, VLLMConfig, tis_cap
from roll.distributed.device_mapping import RoleDevices
from roll.distributed.sync_probe import ProbeSpec, default_tolerance
from roll.pipelines.engine_preflight import vllm_max_model_len
from roll.pipelines.onpolicy_distill import onpolicy_teachers, teacher_role
from roll.pipelines.roles import Role
from roll.rollout.scheduler import SchedulerSpec
from roll.strategies.requests import SamplingParams
from roll.workers.actor import ActorSpec, ActorWorker, LoraSpec, OptimizerSpec, PolicyLossSpec
from roll.workers.base import ModelSpec
from roll.workers.critic import CriticSpec, CriticWorker
from roll.workers.reference import ReferenceSpec, ReferenceWorker
from roll.workers.rollout import RolloutSpec, RolloutWorker

__all__ = [
    "WorkerPlan",
    "device_roles",
    "from_section",
    "lora_spec",
    "mini_batches_per_epoch",
    "plan_workers",
    "policy_roles",
    "reference_workers",
    "updates_per_step",
]

SpecT = TypeVar("SpecT")


def from_section(spec_cls: type[SpecT], section: Any, **computed: Any) -> SpecT:
    """``spec_cls`` with each field taken from ``section``'s field of the same name, unless given in
    ``computed``; fields neither has keep their defaults."""
    names = [f.name for f in dataclasses.fields(spec_cls)]  # type: ignore[arg-type]
    copied = {
        name: getattr(section, name) for name in names if name not in computed and hasattr(section, name)
    }
    return spec_cls(**copied, **computed)


def lora_spec(section: Any) -> LoraSpec | None:
    """The trainer's LoRA spec from an ``actor.lora`` section (None: full fine-tuning)."""
    if section is None:
        return None
    return from_section(LoraSpec, section, target_modules=tuple(section.target_modules))


def engine_options(cfg: RLVRConfig) -> dict[str, Any]:
    """The rollout engine's own options: for the vllm engine ``rollout.vllm`` (its defaults when unset)
    with ``max_model_len`` resolved to what the run needs, whether the rollout shares its devices with
    another role (then vLLM sleeps between generations on CUDA), and the devices each worker shards the
    model over (vLLM's tensor parallelism)."""
    rollout = cfg.rollout
    if rollout.engine != "vllm":
        return {}
    options = dataclasses.asdict(rollout.vllm or VLLMConfig())
    options["max_model_len"] = vllm_max_model_len(cfg)
    options["colocated"] = bool(roles_sharing_rollout_devices(cfg))
    options["tensor_parallel_size"] = rollout.num_devices_per_worker
    return options


def probe_spec(rollout: Any, model: ModelConfig) -> ProbeSpec | None:
    """The weight-sync probe of a ``rollout`` section. Its tolerance defaults by the coarser of the two
    dtypes it compares: the trainer computes in ``model.dtype``, the engine in the inference dtype."""
    if rollout.sync_probe_sequences == 0:
        return None
    tolerance = max(default_tolerance(model.dtype), default_tolerance(model.inference()))
    return ProbeSpec(rollout.sync_probe_sequences, rollout.sync_probe_tolerance or tolerance)


def device_roles(cfg: RLVRConfig) -> list[RoleDevices]:
    """The device-holding roles that start workers: no rollout role with ``rollout.hybrid_engine``; the
    reference model, when the run starts one, on the actor's devices."""
    roles = [role for role in role_plan(cfg) if not (cfg.rollout.hybrid_engine and role.role == "rollout")]
    if reference_workers(cfg):
        roles.append(dataclasses.replace(next(r for r in roles if r.role == "actor"), role="reference"))
    return roles


def reference_workers(cfg: Any) -> bool:
    """Whether the run starts reference workers: a KL term needs the initial policy, which with LoRA is the
    actor's own base weights (``ActorWorker.compute_reference_logprobs``), so no second copy is loaded."""
    return cfg.algorithm.kl_coef > 0 and cfg.actor.lora is None


def policy_roles(cfg: RLVRConfig, plan: WorkerPlan, extra: dict[str, Role]) -> dict[str, Role]:
    """An RL run's roles: the actor; a critic only when configured; rollout workers unless the actor
    generates (hybrid engine); the pipeline's ``extra`` roles; on-policy distillation's teachers; a
    reference only with a KL term and no LoRA (with LoRA the actor's base weights are the initial policy)."""
    roles = [Role("actor", ActorWorker, cfg.actor.world_size, plan.actor, trainer=True)]
    if plan.critic is not None:
        roles.append(Role("critic", CriticWorker, cfg.critic.world_size, plan.critic, trainer=True))
    if not plan.hybrid_engine:
        roles.append(Role("rollout", RolloutWorker, cfg.rollout.world_size, plan.rollout, replaceable=True))
    roles += extra.values()
    for name, teacher in onpolicy_teachers(cfg).items():
        model = dataclasses.replace(plan.rollout.model, path=teacher.model_path)  # inference dtype
        spec = ReferenceSpec(model, collective_timeout_s=cfg.ray.call_timeout_s)
        roles.append(Role(teacher_role(name), ReferenceWorker, teacher.world_size, spec, replaceable=True))
    if reference_workers(cfg):
        spec = ReferenceSpec(
            plan.actor.model,
            collective_timeout_s=cfg.ray.call_timeout_s,
            sequence_parallel_size=plan.actor.sequence_parallel_size,  # on the actor's ranks
        )
        roles.append(Role("reference", ReferenceWorker, cfg.actor.world_size, spec, replaceable=True))
    return {role.name: role for role in roles}


def updates_per_step(section: Any, samples: int) -> int:
    """Optimizer steps an ``actor``/``critic`` section makes on one rollout batch of ``samples``."""
    return section.ppo_epochs * mini_batches_per_epoch(section, samples)


def mini_batches_per_epoch(section: Any, samples: int) -> int:
    """Mini-batches (optimizer steps) per epoch over one rollout batch of ``samples``."""
    return samples // (section.mini_batch_size or samples)


@dataclass(frozen=True)
class WorkerPlan:
    """Everything an RL run (RLVR or agentic) gives its workers, derived from the config alone."""

    actor: ActorSpec
    critic: CriticSpec | None
    rollout: RolloutSpec
    scheduler: SchedulerSpec
    sampling: SamplingParams
    eval_sampling: SamplingParams
    prompts_per_step: int
    samples_per_prompt: int
    weight_bucket_bytes: int
    sync_probe: ProbeSpec | None  # the check after every weight sync; None: off
    hybrid_engine: bool  # the actor generates (no rollout workers, no weight sync)
    roles: tuple[RoleDevices, ...]  # devices and world size of each device-holding role
    # With one optimizer step per rollout batch the "old" policy is the current one: its logprobs come
    # free inside the train step, so the extra forward pass is skipped. A KL in the reward needs them
    # before the update, so it keeps the pass.
    needs_old_logprobs: bool


def plan_workers(cfg: RLVRConfig, model_path: str, rows_vary: bool = False) -> WorkerPlan:
    """The plan for a run whose initial policy is at ``model_path`` (after any warm start).

    ``rows_vary``: a step's batch has as many rows as its episodes have turns (step-wise agentic), not
    ``rollout_batch_size x num_return_sequences``. ``mini_batch_size`` then counts episodes, and the
    trainers split every batch into the same number of mini-batches (``mini_batches_per_epoch``), so the
    LR schedule spans exactly the optimizer steps taken, whatever the episodes' lengths."""
    rollout = cfg.rollout
    model = from_section(ModelSpec, cfg.model, path=model_path, seed=cfg.seed)
    inference_model = dataclasses.replace(model, dtype=cfg.model.inference())
    samples = rollout.rollout_batch_size * rollout.num_return_sequences
    timeout = cfg.ray.call_timeout_s

    def trainer_fields(section: Any) -> dict[str, Any]:
        # The LR schedule spans every optimizer step of the run.
        total = cfg.steps * updates_per_step(section, samples)
        fields = {
            "optimizer": from_section(OptimizerSpec, section, total_steps=total),
            "collective_timeout_s": timeout,
        }
        if rows_vary:
            fields["mini_batches_per_epoch"] = mini_batches_per_epoch(section, samples)
        return fields

    actor = from_section(
        ActorSpec,
        cfg.actor,
        model=model,
        loss=from_section(PolicyLossSpec, cfg.algorithm, tis_cap=tis_cap(cfg)),
        temperature=rollout.temperature,
        lora=lora_spec(cfg.actor.lora),
        sync_dtype=cfg.model.inference(),
        **trainer_fields(cfg.actor),
    )
    critic = None
    if cfg.critic is not None:
        critic_model = dataclasses.replace(model, path=cfg.critic.model_path or model.path)
        critic = from_section(CriticSpec, cfg.critic, model=critic_model, **trainer_fields(cfg.critic))
    # A tuple: sampling params are hashable (the engine groups requests by them).
    sampling = from_section(SamplingParams, rollout, stop_token_ids=tuple(rollout.stop_token_ids))
    return WorkerPlan(
        actor=actor,
        critic=critic,
        rollout=from_section(RolloutSpec, rollout, model=inference_model, engine_options=engine_options(cfg)),
        scheduler=from_section(SchedulerSpec, rollout),
        sampling=sampling,
        # An agentic run's greedy turns keep the training turns' budget (its eval section has none).
        eval_sampling=sampling.as_greedy(getattr(cfg.eval, "max_new_tokens", rollout.max_new_tokens)),
        prompts_per_step=rollout.rollout_batch_size,
        samples_per_prompt=rollout.num_return_sequences,
        weight_bucket_bytes=rollout.weight_bucket_mb << 20,
        sync_probe=probe_spec(rollout, cfg.model),
        hybrid_engine=rollout.hybrid_engine,
        roles=tuple(device_roles(cfg)),
        needs_old_logprobs=updates_per_step(cfg.actor, samples) > 1
        or (cfg.algorithm.kl_coef > 0 and cfg.algorithm.kl_penalty == "reward"),
    )
