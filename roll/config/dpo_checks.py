"""Cross-field checks of a DPO config, run at load before Ray or a model starts."""

from __future__ import annotations

from roll.config.dpo import PREFERENCE_FIELDS, DPOConfig
from roll.config.fields import out_of_bounds
from roll.config.validation import (
    check_data_path,
    check_divides,
    check_model,
    check_no_inference_roles,
    check_registry,
    check_reward,
    check_sequence_fits,
    check_sequence_parallel,
    check_tiny_model,
    check_tracking,
    trainer_devices,
)
from roll.data.columns import check_columns


def validate_dpo(cfg: DPOConfig) -> list[str]:
    problems = out_of_bounds(cfg) or trainer_devices(cfg)
    if problems:  # the checks below divide by these
        return problems
    problems = check_model(cfg.model) + check_tiny_model(cfg.model) + check_tracking(cfg.tracking)
    problems += check_no_inference_roles(cfg.model, "dpo")
    problems += check_columns("data.columns", cfg.data.columns)
    problems += [
        f"data.columns.{name}: a preference row has no field '{name}'; map {', '.join(PREFERENCE_FIELDS)}"
        for name in cfg.data.columns
        if name not in PREFERENCE_FIELDS
    ]
    problems += check_data_path("data.train_path", cfg.data.train_path)
    problems += check_data_path("data.eval_path", cfg.data.eval_path)
    problems += check_data_path("eval.prompts_path", cfg.eval.prompts_path)
    problems += check_divides(
        "actor.world_size", cfg.actor.world_size, "actor.batch_size", cfg.actor.batch_size
    )
    problems += check_sequence_parallel("actor", cfg.actor, cfg.model)
    problems += check_sequence_fits(cfg.model, cfg.data.max_prompt_length, cfg.data.max_completion_length)
    if cfg.eval.prompts_path:
        problems += check_sequence_fits(cfg.model, cfg.data.max_prompt_length, cfg.eval.max_new_tokens)
    problems += check_losses(cfg)
    problems += check_reference(cfg)
    problems += check_dpo_eval(cfg)
    if cfg.checkpoint.standby_workers:
        problems.append("checkpoint.standby_workers is not supported by pipeline: dpo; remove it")
    if cfg.actor.lora is not None and not cfg.actor.lora.target_modules:
        problems.append(
            "actor.lora.target_modules is empty, so nothing would train; name the layers to adapt"
        )
    return problems


def check_losses(cfg: DPOConfig) -> list[str]:
    from roll.algorithms.preference import PREFERENCE_LOSSES

    losses, weights = cfg.dpo.losses, cfg.dpo.loss_weights
    if not losses:
        return ["dpo.losses is empty; name at least one loss, e.g. [sigmoid]"]
    if len(set(losses)) != len(losses):
        return [
            f"dpo.losses names a loss twice ({losses}); give each once, with its weight in dpo.loss_weights"
        ]
    if weights is not None and len(weights) != len(losses):
        return [f"dpo.loss_weights has {len(weights)} weights for {len(losses)} losses; give one per loss"]
    problems = []
    for name in losses:
        problems += check_registry("dpo.losses", name, PREFERENCE_LOSSES)
    if cfg.dpo.label_smoothing >= 0.5:
        problems.append(
            f"dpo.label_smoothing must be below 0.5 (got {cfg.dpo.label_smoothing}): at 0.5 a pair's labels "
            "carry no information"
        )
    elif cfg.dpo.label_smoothing and not {"sigmoid", "robust"} & set(losses):
        problems.append(
            "dpo.label_smoothing is read by the sigmoid and robust losses only; add one or unset it"
        )
    if set(losses) == {"sft"}:
        problems.append("dpo.losses has only sft, which ignores the rejected completions; use pipeline: sft")
    return problems


def check_reference(cfg: DPOConfig) -> list[str]:
    ref = cfg.reference
    problems = []
    if ref.source == "base_model" and cfg.actor.lora is None:
        problems.append(
            "reference.source=base_model needs actor.lora (the base weights under the adapter are the "
            "reference); set actor.lora or use reference.source=worker or precomputed"
        )
    if ref.cache_dir is not None and ref.source != "precomputed":
        problems.append(
            f"reference.cache_dir is read only with reference.source=precomputed (it is {ref.source})"
        )
    return problems


def check_dpo_eval(cfg: DPOConfig) -> list[str]:
    ev, problems = cfg.eval, []
    if ev.every_steps > 0 and cfg.data.eval_path is None and ev.prompts_path is None:
        problems.append(
            "eval.every_steps > 0 needs data.eval_path or eval.prompts_path (or eval.every_steps=0)"
        )
    if (ev.prompts_path is None) != (cfg.reward is None):
        problems.append(
            "eval.prompts_path and reward go together: the reward scores the greedy answers to those "
            "prompts; set both or neither"
        )
    if cfg.reward is not None:
        problems += check_reward("reward", cfg.reward)
    if ev.max_pairs is not None and cfg.data.eval_path is None:
        problems.append("eval.max_pairs is set but there is no data.eval_path to take pairs from")
    if ev.max_prompts is not None and ev.prompts_path is None:
        problems.append("eval.max_prompts is set but there is no eval.prompts_path to take prompts from")
    return problems
