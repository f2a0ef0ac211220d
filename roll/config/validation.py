"""Cross-field checks that run at load time, before Ray or any model starts.

Each check returns human-readable problems that say what to change. Registry names (estimators,
losses, rewards) are checked too; that imports the pure algorithm modules, which is cheap next to Ray.
"""

from __future__ import annotations

from pathlib import Path

from roll.config.common import EvalConfig, ModelConfig
from roll.config.rlvr import ActorConfig, RLVRConfig
from roll.config.sft import SFTConfig, SFTTrainConfig
from roll.utils.registry import Registry


def check_model(model: ModelConfig) -> list[str]:
    if model.path is None and model.tiny is None:
        return ["model: set model.path to a local Hugging Face model directory (or model.tiny to build one)"]
    return check_model_dir("model.path", model.path) if model.path is not None else []


def check_model_dir(key: str, path: str) -> list[str]:
    from roll.models.loading import ModelPathError, check_model_path

    try:
        check_model_path(path)
    except ModelPathError as e:
        return [f"{key}: {e}"]
    return []


def check_file(key: str, path: str | None) -> list[str]:
    if path is not None and not Path(path).is_file():
        return [
            f"{key}: file '{path}' does not exist (paths are relative to the working directory {Path.cwd()})"
        ]
    return []


def check_positive(**values: float) -> list[str]:
    return [f"{key} must be > 0 (got {value})" for key, value in values.items() if not value > 0]


def check_divides(divisor_key: str, divisor: int, total_key: str, total: int) -> list[str]:
    if divisor > 0 and total % divisor != 0:
        return [f"{total_key} ({total}) must be divisible by {divisor_key} ({divisor})"]
    return []


def check_registry(key: str, name: str, registry: Registry) -> list[str]:
    try:
        registry.get(name)
    except KeyError as e:
        return [f"{key}: {e.args[0]}"]
    return []


def check_reward(key: str, name: str) -> list[str]:
    from roll.rewards import REWARD_FUNCTIONS

    return check_registry(key, name, REWARD_FUNCTIONS)


def check_eval(eval_cfg: EvalConfig, eval_path: str | None) -> list[str]:
    problems = check_positive(
        **{"eval.max_new_tokens": eval_cfg.max_new_tokens, "eval.batch_size": eval_cfg.batch_size}
    )
    if eval_cfg.every_steps < 0:
        problems.append(f"eval.every_steps must be >= 0 (got {eval_cfg.every_steps})")
    if eval_path is None and eval_cfg.every_steps > 0:
        problems.append("eval.every_steps > 0 needs data.eval_path (or set eval.every_steps=0)")
    return problems


def check_sft_train(train: SFTTrainConfig, prefix: str) -> list[str]:
    problems = check_positive(
        **{
            f"{prefix}.steps": train.steps,
            f"{prefix}.batch_size": train.batch_size,
            f"{prefix}.micro_batch_size": train.micro_batch_size,
            f"{prefix}.lr": train.lr,
            f"{prefix}.world_size": train.world_size,
        }
    )
    if not problems:
        problems += check_divides(
            f"{prefix}.world_size", train.world_size, f"{prefix}.batch_size", train.batch_size
        )
    return problems


def check_sequence_fits(model: ModelConfig, max_prompt_length: int, max_new_tokens: int) -> list[str]:
    if model.tiny is None or model.path is not None:
        return []
    longest = max_prompt_length + max_new_tokens
    if longest > model.tiny.max_position_embeddings:
        return [
            f"data.max_prompt_length + max_new_tokens = {longest} exceeds "
            f"model.tiny.max_position_embeddings ({model.tiny.max_position_embeddings}); "
            "raise it or shorten them"
        ]
    return []


def validate_sft(cfg: SFTConfig) -> list[str]:
    problems = check_model(cfg.model)
    problems += check_file("data.train_path", cfg.data.train_path)
    problems += check_file("data.eval_path", cfg.data.eval_path)
    problems += check_sft_train(cfg.train, "train")
    problems += check_eval(cfg.eval, cfg.data.eval_path)
    problems += check_sequence_fits(cfg.model, cfg.data.max_prompt_length, cfg.eval.max_new_tokens)
    problems += check_reward("reward", cfg.reward)
    return problems


def check_update_batches(prefix: str, section: ActorConfig, samples: int, group_size: int) -> list[str]:
    """The rollout batch must split evenly into ``section``'s mini-batches and its ranks."""
    samples_key = "rollout.rollout_batch_size x rollout.num_return_sequences"
    if section.mini_batch_size is None:
        return check_divides(f"{prefix}.world_size", section.world_size, samples_key, samples)
    mini = section.mini_batch_size
    problems = []
    if mini % group_size != 0:
        problems.append(
            f"{prefix}.mini_batch_size ({mini}) must be a multiple of rollout.num_return_sequences "
            f"({group_size}) so every group stays in one update"
        )
    problems += check_divides(f"{prefix}.mini_batch_size", mini, samples_key, samples)
    problems += check_divides(f"{prefix}.world_size", section.world_size, f"{prefix}.mini_batch_size", mini)
    return problems


def check_trainer(prefix: str, section: ActorConfig) -> list[str]:
    if section.micro_batch_tokens is not None and section.micro_batch_tokens < 1:
        return [f"{prefix}.micro_batch_tokens must be >= 1 or unset (got {section.micro_batch_tokens})"]
    return check_positive(
        **{
            f"{prefix}.world_size": section.world_size,
            f"{prefix}.lr": section.lr,
            f"{prefix}.ppo_epochs": section.ppo_epochs,
            f"{prefix}.micro_batch_size": section.micro_batch_size,
        }
    )


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
    if not 0 < algo.clip_ratio_low < 1 or not algo.clip_ratio_high > 0:
        problems.append(
            f"algorithm.clip_ratio_low must be in (0, 1) and clip_ratio_high > 0 "
            f"(got {algo.clip_ratio_low}, {algo.clip_ratio_high})"
        )
    if algo.policy_loss == "dual_clip" and not algo.clip_ratio_c > 1:
        problems.append(f"algorithm.clip_ratio_c must be > 1 for dual_clip (got {algo.clip_ratio_c})")
    if algo.tis_cap is not None and not algo.tis_cap >= 1:
        problems.append(f"algorithm.tis_cap must be >= 1 (got {algo.tis_cap}); 2 is a common choice")
    if not 0 < algo.gamma <= 1 or not 0 <= algo.lam <= 1:
        problems.append(f"algorithm.gamma must be in (0, 1] and lam in [0, 1] (got {algo.gamma}, {algo.lam})")
    if algo.advantage_clip is not None and not algo.advantage_clip > 0:
        problems.append(f"algorithm.advantage_clip must be > 0 (got {algo.advantage_clip})")
    if algo.kl_coef < 0 or algo.entropy_coef < 0:
        problems.append("algorithm.kl_coef and algorithm.entropy_coef must be >= 0")
    if algo.kl_coef == 0 and (algo.kl_penalty == "reward" or algo.kl_target is not None):
        problems.append(
            "algorithm.kl_penalty=reward and algorithm.kl_target need a reference model: "
            "set algorithm.kl_coef > 0 (the starting coefficient)"
        )
    if algo.kl_target is not None and not (algo.kl_target > 0 and algo.kl_horizon > 0):
        problems.append("algorithm.kl_target and algorithm.kl_horizon must be > 0")
    if shaping.overlong_buffer and not 0 < shaping.overlong_buffer <= cfg.rollout.max_new_tokens:
        problems.append(
            f"algorithm.reward_shaping.overlong_buffer ({shaping.overlong_buffer}) must be in "
            f"[1, rollout.max_new_tokens={cfg.rollout.max_new_tokens}] (0 disables it)"
        )
    if shaping.clip is not None and not shaping.clip > 0:
        problems.append(f"algorithm.reward_shaping.clip must be > 0 (got {shaping.clip})")
    return problems


def validate_rlvr(cfg: RLVRConfig) -> list[str]:
    from roll.config.devices import check_devices, resolve_world_sizes

    # Unset world sizes come from the device mappings; every batch-size check below needs them.
    problems = resolve_world_sizes(cfg)
    if problems:
        return problems
    problems += check_devices(cfg)
    rollout = cfg.rollout
    problems += check_model(cfg.model)
    problems += check_file("data.train_path", cfg.data.train_path)
    problems += check_file("data.eval_path", cfg.data.eval_path)
    problems += check_positive(
        **{
            "steps": cfg.steps,
            "rollout.rollout_batch_size": rollout.rollout_batch_size,
            "rollout.num_return_sequences": rollout.num_return_sequences,
            "rollout.max_new_tokens": rollout.max_new_tokens,
            "rollout.world_size": rollout.world_size,
            "rollout.temperature": rollout.temperature,
            "reward_world_size": cfg.reward_world_size,
        }
    )
    problems += check_trainer("actor", cfg.actor)
    if cfg.critic is not None:
        problems += check_trainer("critic", cfg.critic)
        if cfg.critic.model_path is not None:
            problems += check_model_dir("critic.model_path", cfg.critic.model_path)
    if problems:
        return problems
    samples = rollout.rollout_batch_size * rollout.num_return_sequences
    problems += check_divides(
        "rollout.world_size", rollout.world_size, "rollout.rollout_batch_size", rollout.rollout_batch_size
    )
    problems += check_update_batches("actor", cfg.actor, samples, rollout.num_return_sequences)
    if cfg.critic is not None:
        problems += check_update_batches("critic", cfg.critic, samples, rollout.num_return_sequences)
    problems += check_algorithm(cfg)
    problems += check_reward("reward", cfg.reward)
    if cfg.eval_reward is not None:
        problems += check_reward("eval_reward", cfg.eval_reward)
    problems += check_eval(cfg.eval, cfg.data.eval_path)
    problems += check_sequence_fits(
        cfg.model, cfg.data.max_prompt_length, max(rollout.max_new_tokens, cfg.eval.max_new_tokens)
    )
    if cfg.sft_warm_start is not None:
        problems += check_sft_train(cfg.sft_warm_start, "sft_warm_start")
    return problems
