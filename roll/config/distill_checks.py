"""Cross-field checks of an offline distillation config, run at load before Ray or a model starts."""

from __future__ import annotations

from roll.config.distill import DistillConfig
from roll.config.fields import out_of_bounds
from roll.config.validation import (
    check_common,
    check_data_files,
    check_model_dir,
    check_registry,
    check_reward,
    check_sequence_fits,
    check_sft_train,
    trainer_devices,
)


def resolve_teacher(cfg: DistillConfig) -> list[str]:
    """The teacher scores on the student's ranks when those are device-mapped (its devices are theirs)."""
    teacher, train = cfg.teacher, cfg.train
    if teacher.world_size is None:
        teacher.world_size = train.world_size
    elif train.device_mapping is not None and teacher.world_size != train.world_size:
        return [
            f"teacher.world_size is {teacher.world_size}, but the teacher scores on the student's "
            f"{train.world_size} device-mapped ranks (train.device_mapping); remove it"
        ]
    return []


def validate_distill(cfg: DistillConfig) -> list[str]:
    from roll.algorithms.distillation import DISTILL_OBJECTIVES

    problems = out_of_bounds(cfg) or trainer_devices(cfg) or resolve_teacher(cfg)
    if problems:  # the checks below divide by these
        return problems
    problems = check_common(cfg) + check_data_files(cfg) + check_sft_train(cfg.train, "train", cfg.model)
    problems += check_sequence_fits(cfg.model, cfg.data.max_prompt_length, cfg.eval.max_new_tokens)
    problems += check_reward("reward", cfg.reward)
    problems += check_model_dir("teacher.model_path", cfg.teacher.model_path)
    loss = cfg.distill
    problems += check_registry("distill.objective", loss.objective, DISTILL_OBJECTIVES)
    if loss.objective != "jsd" and loss.beta != 0.5:
        problems.append(
            f"distill.beta is read by objective jsd only (objective is {loss.objective}); unset it"
        )
    if cfg.checkpoint.standby_workers:
        problems.append("checkpoint.standby_workers is not supported by pipeline: distill; remove it")
    return problems
