"""Cross-field checks that run at load time, before Ray or any model starts.

Each check returns human-readable problems that say what to change. Registry names (estimators,
losses, rewards) are checked too; that imports the pure algorithm modules, which is cheap next to Ray.
"""

from __future__ import annotations

from pathlib import Path

from roll.config.common import EvalConfig, ModelConfig
from roll.config.rlvr import RLVRConfig
from roll.config.sft import SFTConfig, SFTTrainConfig


def check_model(model: ModelConfig) -> list[str]:
    if model.path is None and model.tiny is None:
        return ["model: set model.path to a local Hugging Face model directory (or model.tiny to build one)"]
    if model.path is not None:
        from roll.models.loading import ModelPathError, check_model_path

        try:
            check_model_path(model.path)
        except ModelPathError as e:
            return [f"model.path: {e}"]
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


def check_registry(key: str, name: str, registry_module: str, registry_attr: str) -> list[str]:
    import importlib

    registry = getattr(importlib.import_module(registry_module), registry_attr)
    try:
        registry.get(name)
    except KeyError as e:
        return [f"{key}: {e.args[0]}"]
    return []


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
    problems += check_registry("reward", cfg.reward, "roll.rewards", "REWARD_FUNCTIONS")
    return problems


def validate_rlvr(cfg: RLVRConfig) -> list[str]:
    rollout, actor, algo = cfg.rollout, cfg.actor, cfg.algorithm
    problems = check_model(cfg.model)
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
            "actor.world_size": actor.world_size,
            "actor.lr": actor.lr,
            "actor.ppo_epochs": actor.ppo_epochs,
            "actor.micro_batch_size": actor.micro_batch_size,
            "reward_world_size": cfg.reward_world_size,
        }
    )
    if problems:
        return problems
    samples = rollout.rollout_batch_size * rollout.num_return_sequences
    samples_key = "rollout.rollout_batch_size x rollout.num_return_sequences"
    problems += check_divides(
        "rollout.world_size", rollout.world_size, "rollout.rollout_batch_size", rollout.rollout_batch_size
    )
    if actor.mini_batch_size is None:
        problems += check_divides("actor.world_size", actor.world_size, samples_key, samples)
    else:
        mini = actor.mini_batch_size
        if mini % rollout.num_return_sequences != 0:
            problems.append(
                f"actor.mini_batch_size ({mini}) must be a multiple of rollout.num_return_sequences "
                f"({rollout.num_return_sequences}) so every group stays in one update"
            )
        problems += check_divides("actor.mini_batch_size", mini, samples_key, samples)
        problems += check_divides("actor.world_size", actor.world_size, "actor.mini_batch_size", mini)
    if algo.advantage_estimator == "grpo" and rollout.num_return_sequences < 2:
        problems.append(
            "algorithm.advantage_estimator=grpo compares samples within a group: "
            "set rollout.num_return_sequences >= 2"
        )
    if algo.kl_coef < 0 or algo.entropy_coef < 0:
        problems.append("algorithm.kl_coef and algorithm.entropy_coef must be >= 0")
    problems += check_registry(
        "algorithm.advantage_estimator", algo.advantage_estimator, "roll.algorithms", "ADVANTAGE_ESTIMATORS"
    )
    problems += check_registry("algorithm.policy_loss", algo.policy_loss, "roll.algorithms", "POLICY_LOSSES")
    problems += check_registry(
        "algorithm.loss_agg_mode", algo.loss_agg_mode, "roll.algorithms", "LOSS_AGGREGATIONS"
    )
    problems += check_registry(
        "algorithm.kl_estimator", algo.kl_estimator, "roll.algorithms", "KL_ESTIMATORS"
    )
    problems += check_registry("reward", cfg.reward, "roll.rewards", "REWARD_FUNCTIONS")
    if cfg.eval_reward is not None:
        problems += check_registry("eval_reward", cfg.eval_reward, "roll.rewards", "REWARD_FUNCTIONS")
    problems += check_eval(cfg.eval, cfg.data.eval_path)
    problems += check_sequence_fits(
        cfg.model, cfg.data.max_prompt_length, max(rollout.max_new_tokens, cfg.eval.max_new_tokens)
    )
    if cfg.sft_warm_start is not None:
        problems += check_sft_train(cfg.sft_warm_start, "sft_warm_start")
    return problems
