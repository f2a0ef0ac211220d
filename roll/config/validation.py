"""Cross-field checks that run at load time, before Ray or any model starts: the checks several
pipelines share, and SFT's. Each other pipeline's own checks are in its module: ``rl_checks`` (RLVR, and
the policy training agentic RL shares with it), ``engine_checks`` (the rollout inference engine),
``agentic_checks``, ``dpo_checks`` and ``distill_checks``.

Each check returns human-readable problems that say what to change. Registry names (estimators,
losses, rewards) are checked too; that imports the pure algorithm modules, which is cheap next to Ray.
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path
from typing import Any

from roll.config.common import EvalConfig, ModelConfig, TinyModelConfig, TinyVisionConfig, TrackingConfig
from roll.config.fields import out_of_bounds
from roll.config.rlvr import RLVRConfig
from roll.config.sft import SFTConfig, SFTTrainConfig
from roll.data.columns import check_columns
from roll.utils.registry import Registry


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


def check_sft_train(train: SFTTrainConfig, prefix: str, model: ModelConfig) -> list[str]:
    problems = check_divides(
        f"{prefix}.world_size", train.world_size, f"{prefix}.batch_size", train.batch_size
    )
    return problems + check_sequence_parallel(prefix, train, model)


def check_sequence_parallel(
    prefix: str, section: Any, model: ModelConfig, path: str | None = None
) -> list[str]:
    """``<prefix>.sequence_parallel_size`` against the section's world size, the attention kernel and the
    heads of the model it trains (``path``, else ``model``'s)."""
    size = getattr(section, "sequence_parallel_size", 1)
    if size == 1:
        return []
    import json
    import types

    from roll.strategies.sequence_parallel import sequence_parallel_problem

    path = path or model.path
    if path is not None:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            return []  # check_model_dir names the missing model
        config = json.loads(config_file.read_text(), object_hook=lambda d: types.SimpleNamespace(**d))
    else:
        config = types.SimpleNamespace(num_attention_heads=model.tiny.num_attention_heads)
    world_size = section.world_size or 1
    problem = sequence_parallel_problem(size, world_size, config, model.attn_implementation)
    return [f"{prefix}.sequence_parallel_size is {size}, but {problem}"] if problem else []


def check_tiny_model(model: ModelConfig) -> list[str]:
    """Attention shapes a tiny Qwen2 (or Qwen2-VL) cannot be built with (found now, not when the model is
    built)."""
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
    if tiny.vision is not None:
        problems += check_tiny_vision(tiny, tiny.vision)
    return problems


def check_tiny_vision(tiny: TinyModelConfig, vision: TinyVisionConfig) -> list[str]:
    """A tiny Qwen2-VL's shapes: M-RoPE splits each text head's rotary frequencies in three (temporal,
    height, width), the vision blocks' 2-D rotary embedding splits theirs in four, and images are cut in
    2x2 groups of 14-pixel patches."""
    from roll.models.tiny import IMAGE_SIDE_FACTOR

    problems = []
    head_dim, remainder = divmod(tiny.hidden_size, tiny.num_attention_heads)
    if not remainder and (head_dim % 2 or head_dim < 6):
        problems.append(
            f"model.tiny.vision: the text heads' width, model.tiny.hidden_size / num_attention_heads "
            f"({head_dim}), must be even and at least 6 for M-RoPE's three parts"
        )
    if vision.embed_dim % vision.num_heads:
        problems.append(
            f"model.tiny.vision.embed_dim ({vision.embed_dim}) must be divisible by "
            f"model.tiny.vision.num_heads ({vision.num_heads})"
        )
    elif (vision.embed_dim // vision.num_heads) % 4:
        problems.append(
            f"model.tiny.vision: the vision heads' width, embed_dim / num_heads "
            f"({vision.embed_dim // vision.num_heads}), must be a multiple of 4 (its rotary embedding "
            "covers height and width)"
        )
    if vision.image_size % IMAGE_SIDE_FACTOR:
        problems.append(
            f"model.tiny.vision.image_size ({vision.image_size}) must be a multiple of {IMAGE_SIDE_FACTOR} "
            f"(2x2 patches of 14 pixels make one image token), e.g. "
            f"{max(1, round(vision.image_size / IMAGE_SIDE_FACTOR)) * IMAGE_SIDE_FACTOR}"
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
    """Checks every pipeline shares: the model, metric sinks, the dataset's column names."""
    problems = check_model(cfg.model) + check_tiny_model(cfg.model) + check_tracking(cfg.tracking)
    return problems + check_columns("data.columns", cfg.data.columns)


def check_data_files(cfg: RLVRConfig | SFTConfig) -> list[str]:
    """``data.train_path`` (required) and ``data.eval_path``, and the evaluation they allow (a run with
    ``domains`` names its files per domain instead)."""
    if cfg.data.train_path is None:
        return ["data.train_path is required: set it to the dataset of training rows"]
    problems = check_data_path("data.train_path", cfg.data.train_path)
    problems += check_data_path("data.eval_path", cfg.data.eval_path)
    return problems + check_eval(cfg.eval, cfg.data.eval_path)


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
    problems = check_common(cfg) + check_data_files(cfg) + check_no_inference_roles(cfg.model, "sft")
    problems += check_sft_train(cfg.train, "train", cfg.model)
    problems += check_sequence_fits(cfg.model, cfg.data.max_prompt_length, cfg.eval.max_new_tokens)
    problems += check_reward("reward", cfg.reward)
    if cfg.checkpoint.standby_workers:
        problems.append(
            "checkpoint.standby_workers is not supported by pipeline: sft (its one trainer restarts from "
            "the last checkpoint when lost); remove it"
        )
    return problems


def trainer_devices(cfg: Any) -> list[str]:
    """A one-trainer pipeline's world sizes from its mapping (``train``, or DPO's ``actor``), then the
    mapping's problems knowable before Ray starts."""
    from roll.config.devices import check_devices, resolve_world_sizes

    return resolve_world_sizes(cfg) or check_devices(cfg)
