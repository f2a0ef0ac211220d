"""Config sections shared by every pipeline. Pure dataclasses: importing this never imports torch or Ray."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from roll.config.fields import option
from roll.data.columns import DEFAULT_COLUMNS


@dataclass
class OptimizerConfig:
    """The optimizer options of every trained model's section (SFT's and distillation's ``train``, DPO's and
    RL's ``actor``, RL's ``critic``): AdamW, its learning-rate schedule, gradient clipping, what a
    non-finite gradient does, and activation memory. A section sets its own ``lr`` default."""

    lr: float = option(1e-5, gt=0, help="Peak learning rate (AdamW).")
    weight_decay: float = option(0.0, ge=0, help="AdamW weight decay.")
    warmup_steps: int = option(0, ge=0, help="Linear warmup steps.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = option(
        "constant", help="Learning-rate schedule after warmup; linear/cosine decay to 0 at the last step."
    )
    max_grad_norm: float = option(1.0, ge=0, help="Gradient-norm clip (0 disables).")
    nonfinite_grads: Literal["skip", "stop"] = option(
        "skip",
        help="An update whose gradient norm is NaN or infinite: skip it (weights, optimizer and LR schedule "
        "untouched; counted in skipped_frac under the trainer's prefix: sft/, dpo/, distill/, actor/, "
        "critic/) or stop the run with an error naming the step.",
    )
    gradient_checkpointing: bool = option(
        False,
        help="Recompute each transformer block's activations in the backward pass instead of keeping them "
        "(transformers' gradient checkpointing, non-reentrant, applied before FSDP2): activation memory "
        "of one block instead of all, for about one more forward per step.",
    )
    sequence_parallel_size: int = option(
        1,
        gt=0,
        help="Ulysses sequence parallelism: this many consecutive ranks share each packed micro-batch, "
        "each running the model on 1/S of its tokens (attention over all of them through two "
        "all-to-alls), so activation memory per rank drops about S times. They get the same samples; "
        "data parallelism is world_size / S. Needs model.attn_implementation=sdpa_varlen and attention "
        "heads divisible by S (KV heads are repeated when they are not); a reference model on these ranks "
        "splits the same way. Checked before the run starts.",
    )
    freeze_vision_tower: bool = option(
        True,
        help="A vision-language model's vision tower (Qwen2-VL's `visual`: patch embedding, blocks and the "
        "merger into the text model) is not trained, as most recipes do: no gradient or optimizer state "
        "for it. false trains it with the rest. No effect on a text-only model.",
    )


@dataclass
class TinyVisionConfig:
    """The vision tower of a tiny Qwen2-VL: 14-pixel patches, merged 2x2 into one token of the text model."""

    depth: int = option(2, gt=0, help="Number of vision transformer blocks.")
    embed_dim: int = option(
        32, gt=0, help="Width of the vision blocks (the merger projects it to hidden_size)."
    )
    num_heads: int = option(
        2, gt=0, help="Attention heads per vision block (embed_dim / num_heads: a multiple of 4)."
    )
    image_size: int = option(
        56,
        ge=28,
        help="Images are resized by the image processor to at most image_size x image_size pixels and at "
        "least 28x28 (aspect ratio kept, sides multiples of 28); a multiple of 28. 56: at most 4 tokens "
        "an image.",
    )


@dataclass
class TinyModelConfig:
    """A small Qwen2-style model with a character tokenizer, built locally for tests and demos."""

    alphabet: str = option("0123456789+-*=() ", help="Characters the tokenizer knows; each is one token.")
    hidden_size: int = option(128, gt=0, help="Width of the residual stream.")
    num_hidden_layers: int = option(2, gt=0, help="Number of transformer blocks.")
    num_attention_heads: int = option(4, gt=0, help="Query heads per attention layer.")
    num_key_value_heads: int = option(2, gt=0, help="Key/value heads (grouped-query attention).")
    intermediate_size: int = option(512, gt=0, help="Width of the MLP.")
    max_position_embeddings: int = option(64, gt=0, help="Longest sequence (prompt + response) in tokens.")
    seed: int = option(0, help="Seed for the random initial weights.")
    vision: TinyVisionConfig | None = option(
        None,
        help="A vision tower: the tiny model becomes a Qwen2-VL (images in prompts, M-RoPE positions), saved "
        "with its image processor; the tokenizer gains <|vision_start|>, <|vision_end|>, <|image_pad|>.",
    )


@dataclass
class ModelConfig:
    """Where the policy comes from. Actor, reference and rollout workers all start from it."""

    path: str | None = option(None, help="Local directory of a Hugging Face causal LM and its tokenizer.")
    tiny: TinyModelConfig | None = option(
        None, help="Build a tiny model into <output_dir>/tiny_model when `path` is not set (tests, demos)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = option(
        "float32",
        help="The dtype the model computes in. Trained models (actor, critic) keep float32 weights and "
        "optimizer state and reduce gradients in float32 whatever it is: bfloat16 is mixed precision "
        "(FSDP2's MixedPrecisionPolicy), not bfloat16 weights. The reference model and the weights a "
        "run saves (<output_dir>/model) are in this dtype; checkpoints keep the float32 weights. float16 "
        "is refused for training (it needs loss scaling, which ROLL does not do): use bfloat16.",
    )
    inference_dtype: Literal["float32", "bfloat16", "float16"] | None = option(
        None,
        help="The dtype of the weights that only generate or score: rollout workers (weight syncs are "
        "sent in it) and distillation teachers. Unset: model.dtype.",
    )

    attn_implementation: Literal[
        "sdpa", "sdpa_varlen", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"
    ] = option(
        "sdpa",
        help="The attention kernel of every role that loads the model (transformers' "
        "attn_implementation): sdpa (torch's scaled_dot_product_attention), eager, or a FlashAttention "
        "build when installed (flash_attention_2 needs the flash-attn package and a bfloat16/float16 "
        "dtype). sdpa_varlen, flash_attention_2 and flash_attention_3 make the trainers pack "
        "micro-batches without padding; sdpa_varlen needs no package (torch's varlen FlashAttention on "
        "CUDA in bfloat16/float16, one sdpa call per sequence otherwise). Checked before the run starts.",
    )

    def inference(self) -> str:
        """The dtype of the inference-only roles: ``inference_dtype``, else ``dtype``."""
        return self.inference_dtype or self.dtype


@dataclass
class DataConfig:
    """Dataset rows, one prompt each; every field of a row also reaches the reward function."""

    train_path: str | None = option(
        None,
        help="Training rows: a .jsonl, .json, .parquet, .arrow or .csv file, or a directory saved with "
        "datasets' save_to_disk (a DatasetDict: DIR/<split>). Required, except in an RLVR run with "
        "`domains`.",
    )
    eval_path: str | None = option(
        None, help="Held-out rows for greedy evaluation, in any format train_path takes."
    )
    columns: dict[str, str] = option(
        dict(DEFAULT_COLUMNS),
        help="Your column names for the fields ROLL reads, merged over {prompt: prompt, answer: answer}, "
        "e.g. {prompt: question, answer: solution}. prompt: text, or a list of {role, content} messages; "
        "answer: the SFT target and what rewards compare with.",
    )
    apply_chat_template: bool = option(
        True,
        help="Wrap prompts in the tokenizer's chat template (needed for prompts given as message lists).",
    )
    max_prompt_length: int = option(
        64, gt=0, help="Prompts longer than this many tokens are rejected at load."
    )


@dataclass
class RayConfig:
    """How the single controller reaches Ray."""

    address: str | None = option(
        None, help="Existing Ray cluster to join (also read from RAY_ADDRESS); a local one starts if unset."
    )
    num_cpus: int | None = option(None, ge=0, help="CPUs for a locally started Ray; all of them when unset.")
    num_gpus: int | None = option(
        None,
        ge=0,
        help="Devices for a locally started Ray; unset detects the GPUs. On a CPU-only machine a number "
        "declares logical devices, so device_mapping configs run (and place workers) there too.",
    )
    call_timeout_s: float = option(
        900.0,
        gt=0,
        help="Seconds any remote call may take before the driver raises an error naming role and rank.",
    )
    liveness_timeout_s: float = option(
        30.0,
        ge=0,
        help="A worker that answered before and leaves a heartbeat unanswered this long while the driver "
        "waits on it (frozen, stopped, deadlocked) ends the run with an error naming role and rank "
        "(0 disables).",
    )
    progress_every_s: float = option(
        60.0,
        ge=0,
        help="While a remote call runs longer than this, print which ranks it waits on; while agent "
        "programs play (agent:), their runs ended, failed by reason, and playing (0: never).",
    )


def cluster_to_join(ray: RayConfig) -> tuple[str, str] | None:
    """``(setting, address)`` of the Ray cluster a run joins: ``ray.address``, else the ``RAY_ADDRESS``
    environment variable; None when a local Ray starts."""
    if ray.address:
        return "ray.address", ray.address
    address = os.environ.get("RAY_ADDRESS")
    return ("RAY_ADDRESS", address) if address else None


@dataclass
class WandbConfig:
    """Weights & Biases run options, read when tracking.backends has wandb."""

    project: str | None = option(None, help="W&B project (unset: WANDB_PROJECT, else W&B's default).")
    entity: str | None = option(None, help="W&B user or team (unset: WANDB_ENTITY, else your default).")
    mode: Literal["online", "offline"] | None = option(
        None,
        help="offline writes the run under <output_dir>/wandb for a later `wandb sync` (no network); "
        "unset: WANDB_MODE, else online.",
    )
    tags: list[str] = option([], help="Tags of the W&B run.")
    rewind: bool = option(
        True,
        help="On resume, rewind the W&B run to the checkpoint's step so the steps after it hold the resumed "
        "run's values (W&B run rewind, a preview feature of W&B cloud). false, or when the server refuses: "
        "the run continues and the steps W&B already holds keep their first values.",
    )


@dataclass
class MlflowConfig:
    """MLflow run options, read when tracking.backends has mlflow."""

    tracking_uri: str | None = option(
        None,
        help="MLflow tracking server or store, e.g. http://host:5000 or sqlite:///mlflow.db (unset: "
        "MLFLOW_TRACKING_URI, else MLflow's default store in the working directory).",
    )
    experiment: str | None = option(
        None,
        help="MLflow experiment, created when missing (unset: MLFLOW_EXPERIMENT_NAME, else 'Default').",
    )


@dataclass
class TrackingConfig:
    """Where metrics go."""

    backends: list[str] = option(
        ["console", "jsonl", "tensorboard"],
        help="Metric sinks: console, jsonl, tensorboard, wandb (pip install 'roll-rl[wandb]'), mlflow "
        "(pip install 'roll-rl[mlflow]').",
    )
    log_every: int = option(
        1, ge=1, help="Write metrics every N steps (console prints a line every N steps too)."
    )
    samples_every: int = option(
        10,
        ge=0,
        help="Record example generations (prompt, response, reward) every N steps: to samples.jsonl and "
        "as tables in trackers that have them (0: never).",
    )
    samples_per_step: int = option(
        4, ge=1, help="Example generations recorded per step, each from a different prompt group."
    )
    wandb: WandbConfig = option(WandbConfig(), help="Weights & Biases options (backend wandb).")
    mlflow: MlflowConfig = option(MlflowConfig(), help="MLflow options (backend mlflow).")


@dataclass
class EvalConfig:
    """Greedy evaluation on held-out prompts; the score is the mean reward, logged as eval/score."""

    every_steps: int = option(
        50, ge=0, help="Evaluate every N training steps (0: only before and after training)."
    )
    max_prompts: int | None = option(None, ge=1, help="Evaluate on at most this many held-out prompts.")
    max_new_tokens: int = option(16, gt=0, help="Longest greedy answer in tokens.")
    batch_size: int = option(256, gt=0, help="Prompts per generation call during evaluation.")


@dataclass
class CheckpointConfig:
    """Full-state checkpoints under <output_dir>/checkpoints, resume (`roll train CONFIG --resume`,
    `roll resume RUN_DIR`) and automatic recovery when a worker dies."""

    every_steps: int = option(
        100,
        ge=0,
        help="Save the full training state every N steps and at the end (0: never; a dead actor or critic "
        "then restarts the run from its first step).",
    )
    keep_last: int = option(
        2, ge=1, help="Checkpoints kept; older ones are deleted once a newer one is complete."
    )
    max_restarts: int = option(
        3,
        ge=0,
        help="Worker deaths, timeouts and frozen workers recovered from within the running job before it "
        "gives up (0: the first one ends the run). Rollout, reward and reference workers are replaced "
        "without losing a step; a lost actor or critic restarts the trainers from the last checkpoint.",
    )
    standby_workers: bool = option(
        False,
        help="Keep one started, idle process per rank of every role (imports done, no model loaded), so "
        "that a recovery takes it instead of starting a process: about 3 s less per recovery on a 2-core "
        "machine. Costs about 0.5 GB of host memory per rank. RLVR only.",
    )
