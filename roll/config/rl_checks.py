"""Cross-field checks of an RLVR config, and those of the policy training agentic RL shares with it
(algorithm, update batches, LoRA, asynchronous generation, the warm start), run at load before Ray or a
model starts."""

from __future__ import annotations

import re

from roll.config.agentic import AgenticConfig
from roll.config.engine_checks import (
    check_hybrid_engine,
    check_inference_engine,
    roles_sharing_rollout_devices,
)
from roll.config.fields import out_of_bounds
from roll.config.rlvr import ActorConfig, DomainConfig, RLVRConfig, RolloutConfig, off_policy_corrected
from roll.config.validation import (
    check_common,
    check_data_files,
    check_data_path,
    check_divides,
    check_model_dir,
    check_registry,
    check_reward,
    check_sequence_fits,
    check_sequence_parallel,
    check_sft_train,
)
from roll.data.columns import check_columns

# What one RLVR step samples: every batch of responses is split by this count.
SAMPLES_KEY = "rollout.rollout_batch_size x rollout.num_return_sequences"


def check_domains(cfg: RLVRConfig) -> list[str]:
    """A multi-domain run: each domain's files and reward, and no single-dataset key left that the
    domains replace (it would be read by nothing)."""
    from roll.rewards.spec import check_spec, domain_specs

    defaults = RLVRConfig(domains=cfg.domains)
    problems = [
        f"{key} is set, but with `domains` each domain has its own; move it into domains.<name>.{key}"
        for key in ("reward", "eval_reward", "reward_world_size")
        if getattr(cfg, key) != getattr(defaults, key)
    ]
    problems += [
        f"data.{key} is set, but with `domains` each domain has its own; move it into domains.<name>.{key}"
        for key in ("train_path", "eval_path")
        if getattr(cfg.data, key) is not None
    ]
    for name, domain in cfg.domains.items():
        if not _DOMAIN_NAME.fullmatch(name):
            problems.append(
                f"domains: '{name}' cannot name a domain (it is part of metric names such as "
                "reward/<domain>/mean): use letters, digits, '_' and '-'"
            )
        problems += check_domain(f"domains.{name}", domain)
        # The specs exist once exactly one of reward / rewards is set (check_domain reports otherwise);
        # other problems, here or in other domains, must not hide this domain's reward errors.
        if (domain.reward is None) != (not domain.rewards):
            train, held_out = domain_specs(domain)
            problems += check_spec(f"domains.{name}", train)
            if held_out is not train:
                problems += check_spec(f"domains.{name}.eval_reward", held_out)
    if cfg.eval.every_steps > 0 and not any(d.eval_path for d in cfg.domains.values()):
        problems.append(
            "eval.every_steps > 0 needs an eval_path in at least one domain (or set eval.every_steps=0)"
        )
    return problems


_DOMAIN_NAME = re.compile(r"[A-Za-z0-9_-]+")


def check_reward_workers(cfg: RLVRConfig) -> list[str]:
    """``reward_world_size`` above 1 for a domain the controller scores itself (no reward workers, see
    ``roll.rewards.scoring.scored_in_controller``) would be read by nothing."""
    from roll.config.rlvr import run_domains
    from roll.rewards.scoring import DomainRewards, scored_in_controller
    from roll.rewards.spec import domain_specs

    problems = []
    for name, domain in run_domains(cfg).items():
        if (domain.reward is None) == (not domain.rewards):
            continue  # neither or both of reward / rewards: check_domain reports it
        try:
            inline = scored_in_controller(DomainRewards(*domain_specs(domain)))
        except KeyError:
            continue  # an unknown reward: reported by the reward checks
        if inline and domain.reward_world_size != 1:
            key = f"domains.{name}.reward_world_size" if cfg.domains else "reward_world_size"
            problems.append(
                f"{key} is {domain.reward_world_size}, but this domain's rewards are scored in the "
                "controller (pure checks cheaper than a call to a reward worker): it has no reward workers; "
                "remove the key"
            )
    return problems


def check_domain(key: str, domain: DomainConfig) -> list[str]:
    problems = check_data_path(f"{key}.train_path", domain.train_path)
    problems += check_data_path(f"{key}.eval_path", domain.eval_path)
    problems += check_columns(f"{key}.columns", domain.columns)
    if (domain.reward is None) == (not domain.rewards):
        problems.append(
            f"{key}: set exactly one of `reward` (one registry name) and `rewards` (name -> weight)"
        )
    return problems


def check_lora(cfg: RLVRConfig | AgenticConfig) -> list[str]:
    """``actor.lora`` on its own; its targets are checked against the model in preflight."""
    problems = []
    lora = cfg.actor.lora
    if lora is not None and lora.dropout >= 1:
        problems.append(f"actor.lora.dropout must be below 1 (got {lora.dropout}); 0 is the usual choice")
    if lora is not None and not lora.target_modules:
        problems.append(
            "actor.lora.target_modules is empty, so nothing would train; name the linear layers to adapt, "
            "e.g. [q_proj, v_proj]"
        )
    return problems


def check_update_batches(prefix: str, section: ActorConfig, samples: int, group_size: int) -> list[str]:
    """The rollout batch must split evenly into ``section``'s mini-batches and its ranks."""
    if section.mini_batch_size is None:
        return check_divides(f"{prefix}.world_size", section.world_size, SAMPLES_KEY, samples)
    mini = section.mini_batch_size
    problems = []
    if mini % group_size != 0:
        problems.append(
            f"{prefix}.mini_batch_size ({mini}) must be a multiple of rollout.num_return_sequences "
            f"({group_size}) so every group stays in one update"
        )
    problems += check_divides(f"{prefix}.mini_batch_size", mini, SAMPLES_KEY, samples)
    problems += check_divides(f"{prefix}.world_size", section.world_size, f"{prefix}.mini_batch_size", mini)
    return problems


def check_algorithm(cfg: RLVRConfig) -> list[str]:
    """Registry names, and combinations of estimator, loss, KL and critic that cannot work."""
    from roll.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES

    algo, shaping = cfg.algorithm, cfg.algorithm.reward_shaping
    problems = []
    for key, registry in (
        ("advantage_estimator", ADVANTAGE_ESTIMATORS),
        ("policy_loss", POLICY_LOSSES),
        ("loss_agg_mode", LOSS_AGGREGATIONS),
        ("kl_estimator", KL_ESTIMATORS),
    ):
        problems += check_registry(f"algorithm.{key}", getattr(algo, key), registry)
    if problems:
        return problems
    estimator, traits = algo.advantage_estimator, ADVANTAGE_ESTIMATORS.traits(algo.advantage_estimator)
    if traits.get("needs_groups") and cfg.rollout.num_return_sequences < 2:
        problems.append(
            f"algorithm.advantage_estimator={estimator} compares samples within a group: "
            "set rollout.num_return_sequences >= 2"
        )
    if traits.get("needs_values") and cfg.critic is None:
        problems.append(
            f"algorithm.advantage_estimator={estimator} needs a value model: add a `critic:` section "
            "(e.g. `critic: {lr: 1.0e-4}`) or pick an estimator without one, such as grpo"
        )
    if not traits.get("needs_values") and cfg.critic is not None:
        problems.append(
            f"a `critic:` section is set but algorithm.advantage_estimator={estimator} does not use values: "
            "remove the critic section, or use advantage_estimator=gae"
        )
    problems += check_turn_credit(cfg)
    if not 0 < algo.clip_ratio_low < 1:
        problems.append(f"algorithm.clip_ratio_low must be in (0, 1) (got {algo.clip_ratio_low})")
    if algo.policy_loss == "dual_clip" and not algo.clip_ratio_c > 1:
        problems.append(f"algorithm.clip_ratio_c must be > 1 for dual_clip (got {algo.clip_ratio_c})")
    if algo.kl_coef == 0 and (algo.kl_penalty == "reward" or algo.kl_target is not None):
        problems.append(
            "algorithm.kl_penalty=reward and algorithm.kl_target need a reference model: "
            "set algorithm.kl_coef > 0 (the starting coefficient)"
        )
    if algo.tis_cap is not None and not off_policy_corrected(cfg):
        problems.append(
            f"algorithm.tis_cap={algo.tis_cap} is read only when an off-policy correction is made, and "
            f"algorithm.off_policy_correction={algo.off_policy_correction} makes none here: set "
            "algorithm.off_policy_correction=tis (truncated importance sampling) or unset tis_cap"
        )
    if shaping.overlong_buffer and not 0 < shaping.overlong_buffer <= cfg.rollout.max_new_tokens:
        problems.append(
            f"algorithm.reward_shaping.overlong_buffer ({shaping.overlong_buffer}) must be in "
            f"[1, rollout.max_new_tokens={cfg.rollout.max_new_tokens}] (0 disables it)"
        )
    return problems


def check_turn_credit(cfg: RLVRConfig | AgenticConfig) -> list[str]:
    """Per-turn estimators (gigpo, step_reinforce) need step-wise samples and step-wise samples need
    them; their options are read by them alone."""
    from roll.algorithms import ADVANTAGE_ESTIMATORS

    algo = cfg.algorithm
    estimator = algo.advantage_estimator
    per_turn = bool(ADVANTAGE_ESTIMATORS.traits(estimator).get("per_turn"))
    env = getattr(cfg, "env", None)
    step_wise = env is not None and env.sample_layout == "step_wise"
    names = ADVANTAGE_ESTIMATORS.names()
    per_turn_names = [n for n in names if ADVANTAGE_ESTIMATORS.traits(n).get("per_turn")]
    problems = []
    if per_turn and not step_wise:
        where = "set env.sample_layout=step_wise" if env is not None else "use it with pipeline: agentic"
        problems.append(
            f"algorithm.advantage_estimator={estimator} credits each turn of an episode and needs one "
            f"sample per turn: {where}, or pick an estimator for whole samples (grpo, ...)"
        )
    if step_wise and not per_turn:
        problems.append(
            f"env.sample_layout=step_wise makes one sample per turn, which "
            f"algorithm.advantage_estimator={estimator} would treat as whole episodes (its group statistics "
            f"would count long episodes once per turn): use {' or '.join(per_turn_names)}, or "
            "env.sample_layout=trajectory"
        )
    if algo.step_advantage_weight != 1.0 and estimator != "gigpo":
        problems.append(
            f"algorithm.step_advantage_weight is read only by advantage_estimator=gigpo (not {estimator}): "
            "remove it"
        )
    if algo.step_norm != "mean_norm" and not per_turn:
        problems.append(
            f"algorithm.step_norm is read only by {' and '.join(per_turn_names)} (not {estimator}): remove it"
        )
    if step_wise and per_turn:
        shaping = algo.reward_shaping
        if algo.kl_penalty == "reward" and algo.kl_coef > 0:
            problems.append(
                "algorithm.kl_penalty=reward: per-turn estimators credit the env's turn rewards, not token "
                "rewards, so a KL in the reward would be ignored; use algorithm.kl_penalty=loss"
            )
        if shaping.normalize or shaping.clip is not None:
            problems.append(
                "algorithm.reward_shaping.normalize/clip shape sequence scores, which per-turn estimators "
                "do not read (they credit the env's turn rewards); remove them"
            )
    return problems


def check_dynamic_sampling(cfg: RLVRConfig) -> list[str]:
    """Group filter names, and filter settings under which no step could ever fill its batch."""
    from roll.algorithms import GROUP_FILTERS

    rollout = cfg.rollout
    problems = []
    for name in rollout.group_filters:
        problems += check_registry("rollout.group_filters", name, GROUP_FILTERS)
    if "equal_rewards" in rollout.group_filters and rollout.num_return_sequences == 1:
        problems.append(
            "rollout.group_filters: equal_rewards drops every group of one sample (its rewards are all "
            "equal), so no group would ever be kept: set rollout.num_return_sequences >= 2 or remove "
            "equal_rewards"
        )
    most = rollout.max_prompts_per_step
    if most is not None and most < rollout.rollout_batch_size:
        problems.append(
            f"rollout.max_prompts_per_step ({most}) is below rollout.rollout_batch_size "
            f"({rollout.rollout_batch_size}), so no step could draw its batch: raise it to at least "
            f"{rollout.rollout_batch_size} or unset it (8 x rollout_batch_size)"
        )
    return problems


def check_async_generation(cfg: RLVRConfig) -> list[str]:
    """``rollout.async_generation_ratio > 0`` generates while the step's other stages run (the actor and
    critic train, teachers score), so the rollout must not share processes with the actor (hybrid
    engine) or devices with any role (colocation time-shares them, one stage at a time: the rollout
    would be offloaded under its own background generation)."""
    ratio = cfg.rollout.async_generation_ratio
    if ratio == 0:
        return []
    key = f"rollout.async_generation_ratio={ratio}"
    if cfg.rollout.hybrid_engine:
        return [
            f"{key} generates while the actor trains, but with rollout.hybrid_engine the actor itself "
            "generates and cannot do both at once: set rollout.hybrid_engine=false or "
            "rollout.async_generation_ratio=0"
        ]
    return [
        f"{key} generates while the other roles work, but rollout.device_mapping shares devices with "
        f"{name}.device_mapping, so the two take turns: give the rollout a device_mapping disjoint from "
        f"the {name}'s, or leave both unset (CPU workers), or set rollout.async_generation_ratio=0"
        for name in roles_sharing_rollout_devices(cfg)
    ]


def bounds_and_world_sizes(cfg: RLVRConfig | AgenticConfig) -> list[str]:
    """Bounds first: the cross-field checks divide by batch sizes and world sizes. Then the unset world
    sizes, from the device mappings: every batch-size check needs them."""
    from roll.config.devices import resolve_world_sizes

    return out_of_bounds(cfg) or resolve_world_sizes(cfg) or resolve_warm_start(cfg)


def resolve_warm_start(cfg: RLVRConfig | AgenticConfig) -> list[str]:
    """The RL warm start trains on the actor's devices, with the actor's ranks: no mapping of its own."""
    warm, actor = cfg.sft_warm_start, cfg.actor
    if warm is None:
        return []
    if warm.device_mapping is not None:
        return [
            "sft_warm_start.device_mapping: the warm start trains on the actor's devices; remove it and set "
            "actor.device_mapping"
        ]
    if warm.world_size is None:
        warm.world_size = actor.world_size if actor.device_mapping is not None else 1
    elif actor.device_mapping is not None and warm.world_size != actor.world_size:
        return [
            f"sft_warm_start.world_size is {warm.world_size}, but the warm start trains on the actor's "
            f"{actor.world_size} device-mapped ranks; remove it"
        ]
    return []


def check_policy_training(cfg: RLVRConfig | AgenticConfig) -> list[str]:
    """What every pipeline that trains a policy on its samples (RLVR, agentic) checks alike: devices, the
    critic's model, the hybrid engine, update batches, the algorithm, the inference engine and the
    health monitors."""
    from roll.config.devices import check_devices
    from roll.config.health import check_health

    rollout = cfg.rollout
    problems = check_devices(cfg) + check_health(cfg.health)
    if cfg.critic is not None and cfg.critic.model_path is not None:
        problems += check_model_dir("critic.model_path", cfg.critic.model_path)
    samples = rollout.rollout_batch_size * rollout.num_return_sequences
    if rollout.hybrid_engine:
        problems += check_hybrid_engine(cfg)
    problems += check_update_batches("actor", cfg.actor, samples, rollout.num_return_sequences)
    problems += check_sequence_parallel("actor", cfg.actor, cfg.model)
    if cfg.critic is not None:
        problems += check_update_batches("critic", cfg.critic, samples, rollout.num_return_sequences)
        problems += check_sequence_parallel("critic", cfg.critic, cfg.model, cfg.critic.model_path)
    return problems + check_algorithm(cfg) + check_inference_engine(cfg) + check_lora(cfg)


def validate_rlvr(cfg: RLVRConfig) -> list[str]:
    problems = bounds_and_world_sizes(cfg)
    if problems:
        return problems
    rollout = cfg.rollout
    problems = check_policy_training(cfg) + check_common(cfg)
    problems += check_domains(cfg) if cfg.domains else check_data_files(cfg)
    problems += check_divides(
        "rollout.world_size", rollout.world_size, "rollout.rollout_batch_size", rollout.rollout_batch_size
    )
    problems += check_dynamic_sampling(cfg)
    problems += check_async_generation(cfg)
    if rollout.prefix_cache_tokens != RolloutConfig.__dataclass_fields__["prefix_cache_tokens"].default:
        problems.append(
            "rollout.prefix_cache_tokens is read by pipeline: agentic (an episode's turns extend one "
            "another); an RLVR response is a single request: remove it"
        )
    if not cfg.domains:
        problems += check_reward("reward", cfg.reward)
        if cfg.eval_reward is not None:
            problems += check_reward("eval_reward", cfg.eval_reward)
    problems += check_reward_workers(cfg)
    problems += check_sequence_fits(
        cfg.model, cfg.data.max_prompt_length, max(rollout.max_new_tokens, cfg.eval.max_new_tokens)
    )
    if cfg.sft_warm_start is not None:
        problems += check_sft_train(cfg.sft_warm_start, "sft_warm_start", cfg.model)
    return problems + check_onpolicy_distill(cfg)


def check_onpolicy_distill(cfg: RLVRConfig) -> list[str]:
    """``distill``: its teachers, how a sample finds its teacher, and what it cannot be combined with."""
    distill = cfg.distill
    if distill is None:
        return []
    if not distill.teachers:
        return ["distill.teachers is empty; name at least one teacher, e.g. {main: {model_path: DIR}}"]
    problems = []
    for name, teacher in distill.teachers.items():
        problems += check_model_dir(f"distill.teachers.{name}.model_path", teacher.model_path)
    if distill.route_by is None and len(distill.teachers) > 1:
        problems.append(
            f"distill.teachers has {len(distill.teachers)} teachers but no distill.route_by to pick one per "
            "sample; set it to a row field (or domain) whose values name the teachers"
        )
    if cfg.critic is not None:
        problems.append(
            "distill with a critic: the distillation advantage is per token and replaces (or adds to) the "
            "estimator's, so no value model is trained on it; remove critic"
        )
    return problems
