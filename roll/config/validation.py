"""Cross-field checks that run at load time, before Ray or any model starts.

Each check returns human-readable problems that say what to change. Registry names (estimators,
losses, rewards) are checked too; that imports the pure algorithm modules, which is cheap next to Ray.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from pathlib import Path
from typing import Any

from roll.config.agentic import DEFAULT_STOP_POLICY, STOP_POLICIES, AgenticConfig
from roll.config.common import EvalConfig, ModelConfig, TrackingConfig
from roll.config.fields import out_of_bounds
from roll.config.rlvr import ActorConfig, DomainConfig, RLVRConfig, RolloutConfig, off_policy_corrected
from roll.config.sft import SFTConfig, SFTTrainConfig
from roll.data.columns import check_columns
from roll.utils.registry import Registry

# What one RLVR step samples: every batch of responses is split by this count.
SAMPLES_KEY = "rollout.rollout_batch_size x rollout.num_return_sequences"


def check_model(model: ModelConfig) -> list[str]:
    problems = []
    if model.dtype == "float16":
        # Trained in float16, small gradients round to zero and large ones overflow without a loss scale.
        problems.append(
            "model.dtype: float16 training needs loss scaling, which ROLL does not do; use bfloat16 "
            "(same memory, float32's range). model.inference_dtype may be float16"
        )
    from roll.models.loading import attention_problem

    attention = attention_problem(model.attn_implementation, [model.dtype, model.inference()])
    if attention is not None:
        problems.append(f"model.attn_implementation: {attention}")
    if model.path is None and model.tiny is None:
        return [
            *problems,
            "model: set model.path to a local Hugging Face model directory (or model.tiny to build one)",
        ]
    return problems + (check_model_dir("model.path", model.path) if model.path is not None else [])


def check_model_dir(key: str, path: str) -> list[str]:
    from roll.models.loading import ModelPathError, check_model_path

    try:
        check_model_path(path)
    except ModelPathError as e:
        return [f"{key}: {e}"]
    return []


def check_data_path(key: str, path: str | None) -> list[str]:
    """``path`` is a dataset in a format ROLL reads (by its extension, or a saved dataset directory);
    its rows are checked by preflight."""
    from roll.data.dataset import DatasetError
    from roll.data.formats import data_format

    if path is None:
        return []
    if not Path(path).exists():
        return [f"{key}: '{path}' does not exist (paths are relative to the working directory {Path.cwd()})"]
    try:
        data_format(path)
    except DatasetError as e:
        return [f"{key}: {e}"]
    return []


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
    if eval_path is None and eval_cfg.every_steps > 0:
        return ["eval.every_steps > 0 needs data.eval_path (or set eval.every_steps=0)"]
    return []


def check_sft_train(train: SFTTrainConfig, prefix: str) -> list[str]:
    return check_divides(f"{prefix}.world_size", train.world_size, f"{prefix}.batch_size", train.batch_size)


def check_tiny_model(model: ModelConfig) -> list[str]:
    """Attention shapes a tiny Qwen2 cannot be built with (found now, not when the model is built)."""
    tiny = model.tiny
    if tiny is None or model.path is not None:
        return []
    problems = []
    if tiny.hidden_size % tiny.num_attention_heads:
        problems.append(
            f"model.tiny.hidden_size ({tiny.hidden_size}) must be divisible by "
            f"model.tiny.num_attention_heads ({tiny.num_attention_heads})"
        )
    if tiny.num_attention_heads % tiny.num_key_value_heads:
        problems.append(
            f"model.tiny.num_attention_heads ({tiny.num_attention_heads}) must be divisible by "
            f"model.tiny.num_key_value_heads ({tiny.num_key_value_heads})"
        )
    return problems


def check_tracking(tracking: TrackingConfig) -> list[str]:
    import dataclasses

    from roll.tracking import TRACKER_BACKENDS
    from roll.utils.extras import install_hint, is_installed

    problems = []
    for name in tracking.backends:
        found = check_registry("tracking.backends", name, TRACKER_BACKENDS)
        problems += found
        extra = None if found else TRACKER_BACKENDS.traits(name).get("extra")
        # Looked up, not imported: a load stays fast, and the run fails here rather than after Ray starts.
        if extra is not None and not is_installed(extra):
            problems.append(
                f"tracking.backends: '{name}' needs the {extra} package: {install_hint(extra)} "
                f"(or remove {name} from tracking.backends)"
            )
    if "mlflow" in tracking.backends:
        problems += check_mlflow_store(tracking.mlflow.tracking_uri)
    # A backend's own options with the backend off would be read by nothing: most likely a forgotten backend.
    for name in ("wandb", "mlflow"):
        section, defaults = getattr(tracking, name), type(getattr(tracking, name))()
        changed = [
            f"tracking.{name}.{f.name}"
            for f in dataclasses.fields(section)
            if getattr(section, f.name) != getattr(defaults, f.name)
        ]
        if changed and name not in tracking.backends:
            problems.append(
                f"{', '.join(changed)} set, but tracking.backends has no {name}: add {name} to "
                "tracking.backends or remove these keys"
            )
    return problems


def check_mlflow_store(tracking_uri: str | None) -> list[str]:
    """MLflow 3 refuses a file store (``file:///...`` or a plain path) unless ``MLFLOW_ALLOW_FILE_STORE``
    is true: say so before the run starts instead of ending in MLflow's traceback after it has."""
    key = "tracking.mlflow.tracking_uri"
    if tracking_uri is None:
        key, tracking_uri = "MLFLOW_TRACKING_URI", os.environ.get("MLFLOW_TRACKING_URI")
    if not tracking_uri or os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1"):
        return []
    if urllib.parse.urlparse(tracking_uri).scheme not in ("", "file"):  # a database or a server
        return []
    return [
        f"{key}: '{tracking_uri}' is an MLflow file store, which MLflow 3 refuses; use a database store "
        "(e.g. sqlite:///mlflow.db) or a server (http://host:5000), or set MLFLOW_ALLOW_FILE_STORE=true"
    ]


def check_common(cfg: RLVRConfig | SFTConfig) -> list[str]:
    """Checks every pipeline shares: the model, the data files, metric sinks."""
    problems = check_model(cfg.model) + check_tiny_model(cfg.model) + check_tracking(cfg.tracking)
    problems += check_columns("data.columns", cfg.data.columns)
    if isinstance(cfg, RLVRConfig) and cfg.domains:
        return problems + check_domains(cfg)
    if cfg.data.train_path is None:
        return problems + ["data.train_path is required: set it to the dataset of training rows"]
    problems += check_data_path("data.train_path", cfg.data.train_path)
    problems += check_data_path("data.eval_path", cfg.data.eval_path)
    return problems + check_eval(cfg.eval, cfg.data.eval_path)


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


def check_no_inference_roles(model: ModelConfig, pipeline: str) -> list[str]:
    """``model.inference_dtype`` where every model is the trained one or its reference (in model.dtype)."""
    if model.inference_dtype is None:
        return []
    return [
        f"model.inference_dtype: pipeline: {pipeline} has no generate-only or score-only model (its "
        "reference, if any, computes in model.dtype like the trained model); remove it"
    ]


def validate_sft(cfg: SFTConfig) -> list[str]:
    # Bounds first: the cross-field checks below divide by batch sizes and world sizes.
    problems = out_of_bounds(cfg) or trainer_devices(cfg)
    if problems:
        return problems
    problems = check_common(cfg) + check_no_inference_roles(cfg.model, "sft")
    problems += check_sft_train(cfg.train, "train")
    problems += check_sequence_fits(cfg.model, cfg.data.max_prompt_length, cfg.eval.max_new_tokens)
    problems += check_reward("reward", cfg.reward)
    if cfg.checkpoint.standby_workers:
        problems.append(
            "checkpoint.standby_workers is not supported by pipeline: sft (its one trainer restarts from "
            "the last checkpoint when lost); remove it"
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


def check_hybrid_engine(cfg: RLVRConfig) -> list[str]:
    """With ``rollout.hybrid_engine`` the actor's ranks generate: options of separate rollout workers
    would be read by nothing."""
    rollout, hint = cfg.rollout, "set rollout.hybrid_engine=false to use rollout workers"
    problems = []
    if rollout.device_mapping is not None:
        problems.append(
            f"rollout.device_mapping: the hybrid engine generates on the actor's devices; unset it or {hint}"
        )
    if rollout.world_size not in (1, cfg.actor.world_size):
        problems.append(
            f"rollout.world_size: the hybrid engine generates on the actor's {cfg.actor.world_size} rank(s); "
            f"unset it or {hint}"
        )
    if rollout.max_running_requests is not None:
        problems.append(f"rollout.max_running_requests: applies to rollout workers only; unset it or {hint}")
    probe_default = RolloutConfig.__dataclass_fields__["sync_probe_sequences"].default
    if rollout.sync_probe_sequences != probe_default or rollout.sync_probe_tolerance is not None:
        problems.append(
            f"rollout.sync_probe_sequences/sync_probe_tolerance check weight syncs to rollout workers; the "
            f"hybrid engine generates with the trained weights themselves and syncs nothing; unset them or "
            f"{hint}"
        )
    if rollout.prefix_cache_tokens != RolloutConfig.__dataclass_fields__["prefix_cache_tokens"].default:
        problems.append(
            f"rollout.prefix_cache_tokens: rollout workers keep an episode's KV between turns; the hybrid "
            f"engine's batch generation keeps none; unset it or {hint}"
        )
    if cfg.model.inference_dtype is not None and not getattr(getattr(cfg, "distill", None), "teachers", None):
        problems.append(
            f"model.inference_dtype: the hybrid engine generates with the actor's model, in model.dtype; "
            f"unset it or {hint}"
        )
    default_engine = RolloutConfig.__dataclass_fields__["engine"].default
    if rollout.engine != default_engine:
        problems.append(
            f"rollout.engine={rollout.engine}: the hybrid engine generates with the actor's own model "
            f"(Hugging Face generate); unset it or {hint}"
        )
    return problems


def check_inference_engine(cfg: RLVRConfig) -> list[str]:
    """The engine's registry name and the devices it can use per worker."""
    from roll.strategies.infer import INFERENCE_ENGINES

    rollout = cfg.rollout
    problems = check_registry("rollout.engine", rollout.engine, INFERENCE_ENGINES)
    if problems:
        return problems
    problems += check_vllm(cfg)
    usable = INFERENCE_ENGINES.traits(rollout.engine).get("devices_per_worker", 1)
    if rollout.num_devices_per_worker > usable:
        problems.append(
            f"rollout.num_devices_per_worker={rollout.num_devices_per_worker}: the {rollout.engine} engine "
            f"runs each rollout worker on {usable} device(s) and would leave the others idle; set it to "
            f"{usable} (more rollout workers use more devices)"
        )
    return problems


def check_vllm(cfg: RLVRConfig) -> list[str]:
    """What the vllm engine cannot do: installed, no truncated sampling (its logprobs would be those of
    the truncated distribution), and no device shared with another role (vLLM's sleep mode, which
    colocation would need, is not wired in)."""
    import importlib.util

    from roll.strategies.infer.vllm import INSTALL_HINT

    rollout = cfg.rollout
    if rollout.engine != "vllm":
        return ["rollout.vllm is read by rollout.engine=vllm only; remove it"] if rollout.vllm else []
    problems = []
    if importlib.util.find_spec("vllm") is None:
        problems.append(
            f"rollout.engine=vllm: vLLM is not installed; {INSTALL_HINT}; or set rollout.engine=hf"
        )
    if rollout.top_k > 0 or rollout.top_p < 1.0:
        problems.append(
            f"rollout.top_k={rollout.top_k}, rollout.top_p={rollout.top_p}: vLLM's logprobs under top-k "
            "or top-p truncation are those of the truncated distribution, not the trainer's; set "
            "rollout.top_k=0 and rollout.top_p=1.0, or rollout.engine=hf"
        )
    shared = roles_sharing_rollout_devices(cfg)
    if shared:
        problems.append(
            f"rollout.engine=vllm: rollout.device_mapping shares devices with {shared[0]}.device_mapping, "
            "but releasing vLLM's memory between stages (its sleep mode) is not supported yet; give the "
            "rollout devices of its own, or set rollout.engine=hf"
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


def roles_sharing_rollout_devices(cfg: RLVRConfig) -> list[str]:
    """The roles whose device mapping shares a device with the rollout's ([] for a malformed mapping,
    which check_devices reports)."""
    from roll.config.devices import role_plan
    from roll.distributed.device_mapping import is_colocated

    try:
        roles = {role.role: role for role in role_plan(cfg)}
    except ValueError:
        return []
    rollout = roles.pop("rollout")
    return [name for name, role in roles.items() if is_colocated(role, rollout)]


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


def trainer_devices(cfg: Any) -> list[str]:
    """A one-trainer pipeline's world sizes from its mapping (``train``, or DPO's ``actor``), then the
    mapping's problems knowable before Ray starts."""
    from roll.config.devices import check_devices, resolve_world_sizes

    return resolve_world_sizes(cfg) or check_devices(cfg)


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
    if cfg.critic is not None:
        problems += check_update_batches("critic", cfg.critic, samples, rollout.num_return_sequences)
    return problems + check_algorithm(cfg) + check_inference_engine(cfg) + check_lora(cfg)


def validate_rlvr(cfg: RLVRConfig) -> list[str]:
    problems = bounds_and_world_sizes(cfg)
    if problems:
        return problems
    rollout = cfg.rollout
    problems = check_policy_training(cfg) + check_common(cfg)
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
        problems += check_sft_train(cfg.sft_warm_start, "sft_warm_start")
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


def validate_agentic(cfg: AgenticConfig) -> list[str]:
    """The RL sections as RLVR checks them, the environment and its budgets, the expert of the warm
    start, and the rollout options that single-turn sampling has and episodes do not (yet)."""
    from roll.envs import ENVIRONMENTS
    from roll.envs.agents import AGENTS
    from roll.envs.base import check_env
    from roll.rollout.agent_runs import AGENT_ENV

    problems = bounds_and_world_sizes(cfg)
    if problems:
        return problems
    problems = check_policy_training(cfg) + check_async_generation(cfg)
    problems += check_model(cfg.model) + check_tiny_model(cfg.model) + check_tracking(cfg.tracking)
    rollout, env = cfg.rollout, cfg.env
    if env.name == AGENT_ENV:  # a user's agent program (roll.pipelines.agent_programs), not an env
        problems += check_agent_env(cfg)
    else:
        problems += check_env("env", env.name, env.options)
    for reason, rule in env.stop_reasons.items():
        if reason not in DEFAULT_STOP_POLICY:
            problems.append(
                f"env.stop_reasons.{reason}: not a stop reason with a policy (choose from "
                f"{', '.join(DEFAULT_STOP_POLICY)}; env_error, env_timeout and aborted episodes are never "
                "trained)"
            )
        elif rule not in STOP_POLICIES:
            problems.append(f"env.stop_reasons.{reason}={rule}: choose one of {', '.join(STOP_POLICIES)}")
    # A failed step is retried on a fresh instance with the episode replayed: a reset and every earlier
    # turn again, each within the step timeout. The worker's call must be allowed that long.
    worst_call_s = env.step_timeout_s * (env.max_turns + 2)
    if worst_call_s >= cfg.ray.call_timeout_s:
        problems.append(
            f"env.step_timeout_s ({env.step_timeout_s:g}) x (env.max_turns + 2) = {worst_call_s:g} s, the "
            f"longest an env worker's call may take (a retry replays the episode), reaches "
            f"ray.call_timeout_s ({cfg.ray.call_timeout_s:g}): the worker would be taken for lost; lower "
            "env.step_timeout_s or raise ray.call_timeout_s"
        )
    if env.history_turns and env.sample_layout != "step_wise":
        problems.append(
            f"env.history_turns ({env.history_turns}) is read only with env.sample_layout=step_wise (a "
            "trajectory-wise turn sees the whole episode): set env.sample_layout=step_wise or remove it"
        )
    if env.max_context_tokens <= rollout.max_new_tokens:
        problems.append(
            f"env.max_context_tokens ({env.max_context_tokens}) leaves no room for a prompt beside one turn "
            f"of rollout.max_new_tokens ({rollout.max_new_tokens}); raise it"
        )
    if cfg.model.tiny is not None and cfg.model.path is None:
        longest = cfg.model.tiny.max_position_embeddings
        if env.max_context_tokens > longest:
            problems.append(
                f"env.max_context_tokens ({env.max_context_tokens}) exceeds "
                f"model.tiny.max_position_embeddings ({longest}); raise it or lower env.max_context_tokens"
            )
    shaping = cfg.algorithm.reward_shaping
    for key, value in (
        ("rollout.group_filters", rollout.group_filters),
        ("rollout.max_additional_running_prompts", rollout.max_additional_running_prompts),
        ("rollout.max_prompts_per_step", rollout.max_prompts_per_step),
        ("algorithm.reward_shaping.overlong_buffer", shaping.overlong_buffer),
        ("algorithm.reward_shaping.length_penalty_coef", shaping.length_penalty_coef),
    ):
        if value:
            problems.append(
                f"{key} is not supported by pipeline: agentic (episodes are scheduled by seed group; "
                "response-length shaping is for single responses); remove it"
            )
    warm = cfg.sft_warm_start
    if warm is not None:
        problems += check_sft_train(warm, "sft_warm_start")
        problems += check_registry("sft_warm_start.expert", warm.expert, AGENTS)
        if warm.expert in AGENTS:
            problems += check_kwargs(
                "sft_warm_start.expert_options", AGENTS.get(warm.expert), warm.expert_options
            )
    if env.name in ENVIRONMENTS and not problems:
        problems += check_seeds(cfg)
    return problems


def check_agent_env(cfg: AgenticConfig) -> list[str]:
    """``env.name: agent``: its options, the serve extra, and the layout its runs have (one sample each)."""
    from roll.rollout.agent_runs import check_agent_options
    from roll.serving import require_serving

    try:
        require_serving()
    except ImportError as e:
        return [f"env.name: agent: {e}"]
    problems = check_agent_options(cfg.env.options, cfg.eval.seeds)
    if cfg.env.sample_layout != "trajectory":
        problems.append(
            "env.sample_layout: env.name agent trains one sample per run (trajectory); step_wise is not "
            "supported for it yet"
        )
    return problems


def check_kwargs(key: str, cls: type, options: dict) -> list[str]:
    """Options that ``cls``'s constructor does not take (e.g. a misspelt agent option)."""
    import inspect

    from roll.utils.registry import did_you_mean

    known = [p for p in inspect.signature(cls).parameters if p not in ("self", "seed")]
    return [
        f"{key}.{name}: {cls.__name__} has no such option.{did_you_mean(name, known)} It takes: "
        f"{', '.join(known) or 'no options'}"
        for name in options
        if name not in known
    ]


def check_seeds(cfg: AgenticConfig) -> list[str]:
    """Training seeds exist beside the held-out ones (an env with few tasks may have none left)."""
    from roll.envs.base import make_env
    from roll.envs.seeds import training_seeds

    try:
        next(training_seeds(make_env(cfg.env.name, cfg.env.options), cfg.eval.seeds))
    except ValueError as e:
        return [f"eval.seeds: {e}"]
    except Exception as e:  # noqa: BLE001 - the env's own failure, reported with its key
        return [
            f"env.name: {cfg.env.name} with env.options {cfg.env.options} failed: {type(e).__name__}: {e}"
        ]
    return []
