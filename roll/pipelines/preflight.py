"""Preflight: everything about a run that can go wrong, checked before anything is written or started.

``load_config`` checks the config on its own. This module checks it against the machine and the data:
the output directory can be created, the Ray cluster to join answers, the device mapping fits the local
GPUs, and every dataset row loads, tokenises and fits. It imports no Ray and builds no model, so a bad
input costs a second, not an SFT warm start; the tokenizer and the tokenised datasets it loads are
handed to the pipeline, which does not load them again.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll.config.common import ModelConfig, RayConfig, cluster_to_join
from roll.config.loader import ConfigError
from roll.data.columns import ANSWER, merged_columns
from roll.data.dataset import DatasetError
from roll.data.prompts import PromptSet, load_datasets, load_prompts
from roll.pipelines.engine_preflight import check_vllm_fits
from roll.utils.registry import Registry

# How long the Ray cluster named by ray.address has to accept a connection.
RAY_CONNECT_TIMEOUT_S = 5.0


@dataclass
class RunInputs:
    """What preflight loaded and checked: the policy's tokenizer and the tokenised datasets."""

    tokenizer: Any
    train: Any  # a PromptSet (a PreferenceSet in DPO); None: the run reads no dataset (agentic)
    eval: Any
    task_eval: PromptSet | None = None  # DPO: held-out task prompts beside the held-out pairs
    vision: Any = None  # a vision-language policy's image processing (roll.data.images.ImagePrompts)


@dataclass(frozen=True)
class DataNeeds:
    """What a pipeline reads from its datasets."""

    train_fields: tuple[str, ...]  # row fields the training rows must have
    eval_fields: tuple[str, ...]  # row fields the held-out rows must have
    sft_targets: bool  # the training rows' answer is trained on
    batches: dict[str, int]  # config key -> training rows one batch of it takes


DATA_NEEDS: Registry[Callable[[Any], DataNeeds]] = Registry("pipeline")


@DATA_NEEDS.register("rlvr")
def rlvr_data_needs(cfg: Any, domain: Any = None) -> DataNeeds:
    """What RLVR reads from the rows of ``domain`` (one of ``run_domains(cfg)``; None: a
    single-dataset run's)."""
    from roll.config.rlvr import run_domains
    from roll.rewards import required_fields
    from roll.rewards.spec import domain_specs

    warm_start = cfg.sft_warm_start
    batches = {"rollout.rollout_batch_size": cfg.rollout.rollout_batch_size}
    if warm_start is not None:
        batches["sft_warm_start.batch_size"] = warm_start.batch_size
    train, held_out = domain_specs(domain or next(iter(run_domains(cfg).values())))
    return DataNeeds(
        train_fields=required_fields(*train.names()) + ((ANSWER,) if warm_start else ()),
        eval_fields=required_fields(*held_out.names()),
        sft_targets=warm_start is not None,
        batches=batches,
    )


@DATA_NEEDS.register("sft")
def sft_data_needs(cfg: Any) -> DataNeeds:
    from roll.rewards import required_fields

    return DataNeeds(
        train_fields=(ANSWER,),
        eval_fields=required_fields(cfg.reward),
        sft_targets=True,
        batches={"train.batch_size": cfg.train.batch_size},
    )


@DATA_NEEDS.register("distill")
def distill_data_needs(cfg: Any) -> DataNeeds:
    from roll.rewards import required_fields

    return DataNeeds(
        train_fields=(ANSWER,),
        # The held-out answers are scored by the reward and also distilled on (eval/teacher_kl).
        eval_fields=tuple(dict.fromkeys((*required_fields(cfg.reward), ANSWER))),
        sft_targets=True,
        batches={"train.batch_size": cfg.train.batch_size},
    )


def teacher_paths(cfg: Any) -> dict[str, str]:
    """Every teacher's model directory by config key: offline distillation's ``teacher``, on-policy
    distillation's ``distill.teachers``."""
    if getattr(cfg, "teacher", None) is not None:
        return {"teacher.model_path": cfg.teacher.model_path}
    teachers = getattr(getattr(cfg, "distill", None), "teachers", None) or {}
    return {f"distill.teachers.{name}.model_path": t.model_path for name, t in teachers.items()}


def check_teacher_tokenizer(cfg: Any, tokenizer: Any) -> list[str]:
    """A teacher's distributions are over its own token ids: distilling needs the student's ids to mean
    the same tokens."""
    from roll.models.loading import load_tokenizer

    problems = []
    top_k = getattr(getattr(cfg, "distill", None), "top_k", 0)
    if top_k > len(tokenizer):
        problems.append(
            f"distill.top_k ({top_k}) is more than the {len(tokenizer)} tokens of the "
            f"vocabulary; lower it to at most {len(tokenizer)}"
        )
    for key, path in teacher_paths(cfg).items():
        theirs = load_tokenizer(path)
        if theirs.get_vocab() != tokenizer.get_vocab():
            problems.append(
                f"{key}: the teacher's tokenizer ({len(theirs)} tokens) differs from the student's "
                f"({len(tokenizer)} tokens); distillation compares distributions token id by token id, so "
                "both must share one tokenizer"
            )
    return problems


def check_distill_routes(cfg: Any, train: PromptSet) -> None:
    """On-policy distillation with ``route_by``: every training row names one of the teachers."""
    distill = getattr(cfg, "distill", None)
    if distill is None or not hasattr(distill, "route_by"):
        return
    from roll.pipelines.onpolicy_distill import unrouted

    found = unrouted(train.rows, [train.domain_of(i) for i in range(len(train))], distill)
    if found is not None:
        index, tag = found
        raise DatasetError(
            f"training row {index + 1} has {distill.route_by} '{tag}', which names no teacher of "
            f"distill.teachers ({', '.join(distill.teachers)}); add a teacher of that name or fix the row"
        )


def preflight(cfg: Any) -> RunInputs:
    """Check ``cfg`` against this machine and its data; raise ConfigError or DatasetError naming the key,
    file or line to fix. Writes nothing: a run that fails here leaves no trace."""
    problems = check_output_dir(cfg.output_dir)
    problems += check_tiny_model_dir(cfg.model, cfg.output_dir)
    problems += check_ray_address(cfg.ray)
    problems += check_local_devices(cfg)
    _refuse(problems)
    tokenizer = load_run_tokenizer(cfg.model)
    vision = load_run_vision(cfg.model, tokenizer)
    _refuse(
        check_stop_token_ids(cfg, tokenizer)
        + check_lora_targets(cfg, tokenizer)
        + check_teacher_tokenizer(cfg, tokenizer)
        + check_vllm_fits(cfg, local_gpu_count())
        + check_vision_pipeline(cfg, vision)
    )
    if cfg.pipeline == "agentic":  # no dataset: episodes come from the environment
        _refuse(check_chat_template(cfg, tokenizer) + check_env_pictures(cfg, vision))
        return RunInputs(tokenizer, None, None, vision=vision)
    if getattr(cfg, "domains", None):
        inputs = RunInputs(tokenizer, *load_domains(cfg, tokenizer, vision))
        check_distill_routes(cfg, inputs.train)
        return inputs
    if cfg.pipeline == "dpo":
        return load_preference_inputs(cfg, tokenizer)
    needs = DATA_NEEDS.get(cfg.pipeline)(cfg)
    train, held_out = load_datasets(
        cfg.data,
        tokenizer,
        needs.train_fields,
        needs.eval_fields,
        sft_targets=needs.sft_targets,
        vision=vision,
    )
    for key, size in needs.batches.items():
        if size > len(train):
            raise DatasetError(
                f"data.train_path '{cfg.data.train_path}' has {len(train)} rows, fewer than one batch of "
                f"{key}={size}; lower {key} to at most {len(train)} or add rows"
            )
    check_distill_routes(cfg, train)
    return RunInputs(tokenizer, train, held_out)


def load_preference_inputs(cfg: Any, tokenizer: Any) -> RunInputs:
    """A DPO run's training and held-out pairs, and its held-out task prompts (``eval.prompts_path``)."""
    from roll.config.common import DataConfig
    from roll.data.preferences import load_preferences
    from roll.rewards import required_fields

    data = cfg.data
    options = (data.columns, data.apply_chat_template, data.max_prompt_length, data.max_completion_length)
    train = load_preferences(data.train_path, tokenizer, *options)
    if cfg.actor.batch_size > len(train):
        raise DatasetError(
            f"data.train_path '{data.train_path}' has {len(train)} pairs, fewer than one batch of "
            f"actor.batch_size={cfg.actor.batch_size}; lower it to at most {len(train)} or add pairs"
        )
    held_out = load_preferences(data.eval_path, tokenizer, *options) if data.eval_path else None
    task = None
    if cfg.eval.prompts_path:
        prompts = DataConfig(
            apply_chat_template=data.apply_chat_template, max_prompt_length=data.max_prompt_length
        )
        task = load_prompts(cfg.eval.prompts_path, tokenizer, prompts, required_fields(cfg.reward))
    return RunInputs(tokenizer, train, held_out, task)


def _refuse(problems: list[str]) -> None:
    """Raise one ConfigError listing ``problems``, if there are any."""
    if problems:
        raise ConfigError("cannot start the run:\n" + "\n".join(f"  - {p}" for p in problems))


def load_domains(cfg: Any, tokenizer: Any, vision: Any = None) -> tuple[PromptSet, PromptSet | None]:
    """Every domain's training and held-out rows, each set tagged with its domain, as one training set
    and one held-out set (None when no domain has one)."""
    train, held_out = {}, {}
    for name, domain in cfg.domains.items():
        needs = rlvr_data_needs(cfg, domain)
        target = ANSWER if needs.sft_targets else None
        columns = merged_columns(cfg.data.columns, domain.columns)
        key = f"domains.{name}.columns"
        train[name] = load_prompts(
            domain.train_path, tokenizer, cfg.data, needs.train_fields, target, columns, key, vision
        )
        if domain.eval_path:
            held_out[name] = load_prompts(
                domain.eval_path, tokenizer, cfg.data, needs.eval_fields, None, columns, key, vision
            )
    mixed = PromptSet.concat(train)
    for key, size in rlvr_data_needs(cfg).batches.items():
        if size > len(mixed):
            raise DatasetError(
                f"the domains have {len(mixed)} training rows in all, fewer than one batch of {key}={size}; "
                f"lower {key} to at most {len(mixed)} or add rows"
            )
    return mixed, PromptSet.concat(held_out) if held_out else None


def check_chat_template(cfg: Any, tokenizer: Any) -> list[str]:
    """An agentic run builds episodes turn by turn with the policy's chat template: one that rewrites
    earlier turns (Qwen3's strips earlier reasoning) or closes no assistant turn with a stop token would
    break token-in-token-out. Other pipelines render each prompt once, so any template serves them."""
    from roll.data.chat_turns import ChatTemplateError, ChatTurns
    from roll.data.template_history import history_rewrite

    if not getattr(tokenizer, "chat_template", None):
        return [
            f"model: {_model_name(cfg.model)} has no chat template; an agentic run needs one to build turns"
        ]
    try:
        chat = ChatTurns(
            tokenizer, [tokenizer.eos_token_id, *cfg.rollout.stop_token_ids], cfg.env.system_prompt
        )
        chat.observation_ids("x")
    except ChatTemplateError as e:
        return [f"model: {e}"]
    rewrite = history_rewrite(tokenizer, cfg.env.system_prompt, _model_name(cfg.model))
    return [f"model: {rewrite}"] if rewrite else []


def _model_name(model: ModelConfig) -> str:
    return model.path or "the tiny model"


def load_run_tokenizer(model: ModelConfig) -> Any:
    """The policy's tokenizer: from ``model.path``, or for a tiny model built in memory, the same one
    the model directory will hold (nothing is written yet)."""
    if model.path is not None:
        from roll.models.loading import load_tokenizer

        return load_tokenizer(model.path)
    from roll.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer(
        model.tiny.alphabet,
        model_max_length=model.tiny.max_position_embeddings,
        vision=model.tiny.vision is not None,
    )


def load_run_vision(model: ModelConfig, tokenizer: Any) -> Any:
    """A vision-language policy's image processing (``roll.data.images.ImagePrompts``: placeholders and
    pixel values), from ``model.path`` or as the tiny model will be saved; None for a text-only policy."""
    from roll.data.images import ImagePrompts

    if model.path is not None:
        from roll.models.loading import load_image_processor

        processor = load_image_processor(model.path)
    elif model.tiny.vision is not None:
        from roll.models.tiny import build_tiny_image_processor

        processor = build_tiny_image_processor(model.tiny.vision)
    else:
        processor = None
    return None if processor is None else ImagePrompts(processor, tokenizer)


# What a vision-language policy runs in: the RLVR and SFT pipelines on the hf engine (docs/vlm.md).
VISION_PIPELINES = ("rlvr", "sft", "agentic")


def check_vision_pipeline(cfg: Any, vision: Any) -> list[str]:
    """A vision-language policy in a pipeline or engine that does not pass images yet."""
    if vision is None:
        return []
    name = _model_name(cfg.model)
    if cfg.pipeline not in VISION_PIPELINES:
        return [
            f"pipeline: {cfg.pipeline} does not take a vision-language model ({name}) yet; the RLVR, SFT "
            "and agentic pipelines do (docs/vlm.md)"
        ]
    if cfg.pipeline == "agentic" and cfg.agent is not None:
        return [
            f"agent: agent programs get no pictures through the endpoint yet: train {name} on an "
            "environment (docs/vlm.md)"
        ]
    rollout = getattr(cfg, "rollout", None)
    if getattr(rollout, "engine", "hf") == "vllm" and importlib.util.find_spec("torchvision") is None:
        return [
            f"rollout.engine: vllm cannot read the images of {name} here: vLLM's Qwen2-VL needs torchvision "
            "(install the build that matches your torch; this project's CPU torch has none); use "
            "rollout.engine=hf (docs/vlm.md)"
        ]
    problems = []
    if getattr(cfg, "critic", None) is not None:
        problems.append(
            f"critic: a value model of {name} is not built yet; use a critic-free estimator (grpo)"
        )
    for section in ("actor", "train"):
        if getattr(getattr(cfg, section, None), "sequence_parallel_size", 1) > 1:
            problems.append(
                f"{section}.sequence_parallel_size: image prompts are not split across ranks yet; set 1"
            )
    return problems


def check_env_pictures(cfg: Any, vision: Any) -> list[str]:
    """An environment that shows pictures needs a vision-language policy (its first observation tells)."""
    from roll.envs.base import ImageObservation, make_env

    if vision is not None or cfg.agent is not None:
        return []
    env = make_env(cfg.env.name, cfg.env.options)
    try:
        observation, _ = env.reset(0)
    finally:
        env.close()
    if not isinstance(observation, ImageObservation):
        return []
    return [
        f"env: {cfg.env.name} shows pictures, and {_model_name(cfg.model)} is a text-only model; train a "
        "vision-language model (model.path, or model.tiny.vision) or render the environment as text"
    ]


def check_stop_token_ids(cfg: Any, tokenizer: Any) -> list[str]:
    """``rollout.stop_token_ids`` name tokens of the policy's vocabulary (an id past it never stops)."""
    stop_ids = getattr(getattr(cfg, "rollout", None), "stop_token_ids", [])
    unknown = [i for i in stop_ids if i >= len(tokenizer)]
    if not unknown:
        return []
    return [
        f"rollout.stop_token_ids: {unknown} are not token ids of the policy's tokenizer ({len(tokenizer)} "
        "tokens), so no response could stop at them; use ids below that, e.g. "
        "tokenizer.convert_tokens_to_ids('<|im_end|>')"
    ]


def check_lora_targets(cfg: Any, tokenizer: Any) -> list[str]:
    """``actor.lora.target_modules`` name linear layers of the policy's transformer blocks. The model is
    built on the meta device from its config: layer names without loading (or allocating) a weight."""
    lora = getattr(getattr(cfg, "actor", None), "lora", None)
    if lora is None:
        return []
    from roll.strategies.lora import block_linear_names, target_problem

    problem = target_problem(lora.target_modules, block_linear_names(meta_model(cfg.model, tokenizer)))
    return [] if problem is None else [f"actor.lora.target_modules: {problem}"]


def meta_model(model: ModelConfig, tokenizer: Any) -> Any:
    """The policy's module tree on the meta device (shapes, no storage): from ``model.path``'s config, or
    the tiny model ``model.tiny`` describes."""
    import torch

    with torch.device("meta"):
        if model.path is None:
            from roll.models.tiny import build_tiny_model

            return build_tiny_model(model.tiny, tokenizer)
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model.path, local_files_only=True)
        return AutoModelForCausalLM.from_config(config)


def check_output_dir(output_dir: str) -> list[str]:
    """``output_dir`` is, or can be made, a writable directory: not a file, not under a file."""
    path = Path(output_dir).absolute()
    if path.exists() and not path.is_dir():
        return [f"output_dir: '{output_dir}' is a file, not a directory; choose another output_dir"]
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return [
            f"output_dir: '{output_dir}' cannot be created because '{existing}' is a file; "
            "choose another output_dir"
        ]
    try:
        # Creating (and removing) a directory is the one test that also holds for root, read-only
        # mounts and ACLs, where permission bits alone would mislead.
        os.rmdir(tempfile.mkdtemp(prefix=".roll-write-check-", dir=existing))
    except OSError as e:
        return [
            f"output_dir: '{output_dir}' cannot be written: '{existing}' refuses new entries "
            f"({e.strerror}); choose a directory you can write to"
        ]
    return []


def check_tiny_model_dir(model: ModelConfig, output_dir: str) -> list[str]:
    """The directory a tiny model is built into holds nothing the build would refuse to replace."""
    if model.path is not None:
        return []
    from roll.models.tiny import TINY_MODEL_DIR, check_replaceable

    try:
        check_replaceable(Path(output_dir) / TINY_MODEL_DIR)
    except FileExistsError as e:
        return [f"output_dir: {e}"]
    return []


def check_ray_address(ray_cfg: RayConfig) -> list[str]:
    """The Ray cluster to join accepts connections: ``ray.init`` against a dead address retries for
    minutes with nothing but Ray's own log lines to show for it."""
    joined = cluster_to_join(ray_cfg)
    if joined is None or joined[1] in ("auto", "local"):  # Ray resolves these itself, and fails fast
        return []
    key, address = joined
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return [
            f"{key}: '{address}' is not an address; expected host:port (the GCS address that "
            "`ray start --head` prints, e.g. 10.0.0.1:6379), ray://host:port or auto"
        ]
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        return [
            f"{key}: nothing answers at {host}:{port} ({reason}); start the cluster there (`ray start "
            f"--head`), fix the address, or unset {key} to start a local Ray"
        ]
    return []


def check_local_devices(cfg: Any) -> list[str]:
    """Device mappings fit the GPUs of this machine when a local Ray will start without ``ray.num_gpus``
    (a joined cluster's devices are checked as soon as it is joined, before any model loads); and on a
    machine with GPUs, a real model's role without a mapping is refused rather than left to run on the
    CPU unasked (``ray.num_gpus: 0`` asks for the CPU)."""
    from roll.config.devices import role_plan
    from roll.distributed.device_mapping import validate_plan

    if cluster_to_join(cfg.ray) is not None or cfg.ray.num_gpus is not None:
        return []
    roles = role_plan(cfg)
    count = local_gpu_count()
    if count is None:
        return []
    problems = validate_plan(roles, count) if any(r.device_mapping is not None for r in roles) else []
    return problems + (unmapped_model_roles(cfg, roles, count) if count else [])


def unmapped_model_roles(cfg: Any, roles: list[Any], gpus: int) -> list[str]:
    """A role holding a real model (``model.path``) with no ``device_mapping`` on a machine with ``gpus``
    GPUs: it would run on the CPU, a 7B model for days, without a word. A tiny model is left on the CPU."""
    if cfg.model.path is None:
        return []
    rollout = getattr(cfg, "rollout", None)
    skipped = {"rollout"} if rollout is not None and rollout.hybrid_engine else set()
    from roll.config.devices import TEACHER_PREFIX

    keys = [
        r.role.replace(TEACHER_PREFIX, "distill.teachers.", 1)
        for r in roles
        if r.device_mapping is None and r.role not in skipped
    ]
    return [
        f"{key}.device_mapping is unset on a machine with {gpus} GPU(s): its model would run on the CPU; "
        f"set {key}.device_mapping (e.g. [0]) or, to run on the CPU on purpose, ray.num_gpus=0"
        for key in keys
    ]


def local_gpu_count() -> int | None:
    """The GPUs a local Ray would find here, without starting it: ``CUDA_VISIBLE_DEVICES`` when set,
    else the NVIDIA driver's list. None when it cannot tell (an AMD ROCm machine)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    nvidia = Path("/proc/driver/nvidia/gpus")
    if nvidia.is_dir():
        return len(list(nvidia.iterdir()))
    return None if Path("/dev/kfd").exists() else 0
