"""Direct preference optimisation and its relatives (IPO, hinge/SLiC, robust DPO, RPO's SFT term)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from roll.config.common import CheckpointConfig, ModelConfig, OptimizerConfig, RayConfig, TrackingConfig
from roll.config.fields import option
from roll.config.rlvr import LoRAConfig

# The fields a preference row holds, under ROLL's names (``data.columns`` maps the user's onto them).
PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class PreferenceDataConfig:
    """Preference pairs in TRL's formats: ``prompt``/``chosen``/``rejected`` as text (standard) or as
    ``{role, content}`` messages (conversational: the prompt a conversation, each completion the
    assistant's reply)."""

    train_path: str = option(
        help="Training pairs: a .jsonl, .json, .parquet, .arrow or .csv file, or a directory saved with "
        "datasets' save_to_disk."
    )
    eval_path: str | None = option(
        None, help="Held-out pairs, scored by preference accuracy (eval/rewards/accuracies)."
    )
    columns: dict[str, str] = option(
        {name: name for name in PREFERENCE_FIELDS},
        help="Your column names for prompt, chosen and rejected, e.g. {prompt: question, chosen: good}.",
    )
    apply_chat_template: bool = option(
        True,
        help="Render prompt and completions with the tokenizer's chat template (needed for conversational "
        "rows). Off: the text is tokenised as it is, the completion straight after the prompt.",
    )
    max_prompt_length: int = option(
        64, gt=0, help="Prompts longer than this many tokens are rejected at load."
    )
    max_completion_length: int = option(
        64, gt=0, help="Completions (with their end-of-sequence token) longer than this are rejected at load."
    )


@dataclass
class DPOActorConfig(OptimizerConfig):
    """The trained policy: optimisation over batches of preference pairs."""

    world_size: int | None = option(
        None,
        gt=0,
        help="Data-parallel (FSDP2) training ranks. Unset: one per device of device_mapping, or 1.",
    )
    device_mapping: list[int] | None = option(
        None,
        help="Global device indices of the training ranks, a list or 'range(0,4)'; the reference worker "
        "shares them. Unset: CPU ranks.",
    )
    batch_size: int = option(32, gt=0, help="Pairs per optimizer step (global, across ranks).")
    micro_batch_size: int = option(
        32, gt=0, help="Pairs per forward/backward on one rank; each pair is two sequences in one pass."
    )
    lr: float = option(1e-6, gt=0, help="Peak learning rate (AdamW); DPO on real models uses 1e-7 to 1e-6.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = option(
        "linear", help="Learning-rate schedule after warmup; linear/cosine decay to 0 at the last step."
    )
    lora: LoRAConfig | None = option(
        None,
        help="Train a LoRA adapter instead of every weight; reference.source=base_model then scores the "
        "reference with the adapter off (no second model).",
    )


@dataclass
class PreferenceLossConfig:
    """The preference loss: registered terms, each with a weight, summed per pair and averaged over pairs.

    Lists, as TRL's ``loss_type`` and ``loss_weights``: a list in YAML or an override replaces the default
    whole, where a mapping would be merged into it."""

    beta: float = option(
        0.1,
        gt=0,
        help="Inverse temperature of the implicit reward beta * log(pi / pi_ref): how strongly the policy is "
        "held to the reference. Small: it may move far; 0.1 is the usual sigmoid choice. For ipo the "
        "target margin is 1 / (2 beta).",
    )
    losses: list[str] = option(
        ["sigmoid"],
        help="Loss terms (registry names), summed per pair: sigmoid (DPO), ipo, hinge (SLiC), robust, sft "
        "(the chosen completion's NLL per token; [sigmoid, sft] is RPO).",
    )
    loss_weights: list[float] | None = option(
        None, gt=0, help="One weight per entry of losses, e.g. [1.0, 0.5] (unset: 1 each)."
    )
    label_smoothing: float = option(
        0.0,
        ge=0,
        help="sigmoid (cDPO) and robust: the assumed probability that a pair's labels are flipped "
        "(below 0.5).",
    )


@dataclass
class ReferenceConfig:
    """Where the reference policy's log-probabilities come from; the reference is the initial policy."""

    source: Literal["worker", "precomputed", "base_model"] = option(
        "worker",
        help="worker: a reference worker holds the initial model and scores every batch. precomputed: "
        "scored once before training and cached on disk (no reference model while training). base_model: "
        "with actor.lora, the actor itself with its adapter off.",
    )
    cache_dir: str | None = option(
        None,
        help="precomputed: where the cached log-probabilities go, one file per dataset and model "
        "fingerprint (a changed dataset or model is scored again). Unset: <output_dir>/reference_cache; "
        "point several runs at one directory to share it.",
    )


@dataclass
class DPOEvalConfig:
    """Held-out evaluation: preference accuracy on data.eval_path, and the task score where there is one."""

    every_steps: int = option(50, ge=0, help="Evaluate every N steps (0: only before and after training).")
    max_pairs: int | None = option(None, ge=1, help="Score at most this many held-out pairs.")
    prompts_path: str | None = option(
        None,
        help="Held-out task prompts (prompt, answer columns), answered greedily and scored by `reward` as "
        "eval/score. Unset: eval/score is the held-out preference accuracy.",
    )
    max_prompts: int | None = option(None, ge=1, help="Answer at most this many held-out prompts.")
    max_new_tokens: int = option(16, gt=0, help="Longest greedy answer in tokens.")
    batch_size: int = option(256, gt=0, help="Prompts or pairs per call during evaluation.")


@dataclass
class DPOConfig:
    """`pipeline: dpo` - preference optimisation of a causal LM on chosen/rejected pairs."""

    pipeline: Literal["dpo"] = option("dpo", help="Which pipeline runs this config.")
    run_name: str = option("dpo", help="Name shown in logs.")
    output_dir: str = option("runs/dpo", help="Run directory: metrics, checkpoints, final model.")
    seed: int = option(0, help="Seed for data order and initialisation.")
    steps: int = option(200, gt=0, help="Optimizer steps.")
    imports: list[str] = option(
        [], help="Your modules that register losses or rewards (imported in the driver and every worker)."
    )
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "The policy to train."})
    data: PreferenceDataConfig = field(
        default_factory=PreferenceDataConfig, metadata={"help": "Preference pairs."}
    )
    actor: DPOActorConfig = field(default_factory=DPOActorConfig, metadata={"help": "Optimisation."})
    dpo: PreferenceLossConfig = field(default_factory=PreferenceLossConfig, metadata={"help": "The loss."})
    reference: ReferenceConfig = field(
        default_factory=ReferenceConfig, metadata={"help": "The reference log-probabilities."}
    )
    reward: str | None = option(
        None, help="Reward function that scores greedy answers to eval.prompts_path (needs it, and only it)."
    )
    eval: DPOEvalConfig = field(default_factory=DPOEvalConfig, metadata={"help": "Held-out evaluation."})
    checkpoint: CheckpointConfig = field(
        default_factory=CheckpointConfig, metadata={"help": "Checkpoints, resume and automatic recovery."}
    )
    tracking: TrackingConfig = field(default_factory=TrackingConfig, metadata={"help": "Metric sinks."})
    ray: RayConfig = field(default_factory=RayConfig, metadata={"help": "Ray connection."})


def loss_weights(loss: PreferenceLossConfig) -> dict[str, float]:
    """Each loss term's weight, by name."""
    return dict(zip(loss.losses, loss.loss_weights or [1.0] * len(loss.losses), strict=True))
