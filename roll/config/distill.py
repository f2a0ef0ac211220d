"""Offline knowledge distillation: a student trained on a teacher's next-token distributions over a
dataset's completions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from roll.config.common import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    RayConfig,
    TrackingConfig,
)
from roll.config.fields import option
from roll.config.sft import SFTTrainConfig


@dataclass
class TeacherConfig:
    """The teacher: a model sharing the student's tokenizer (same vocabulary, same ids)."""

    model_path: str = option(help="Local directory of the teacher, a Hugging Face causal LM.")
    world_size: int | None = option(
        None,
        gt=0,
        help="Teacher workers that score the dataset before training (stopped once it is cached). Unset: "
        "the student's (train.world_size); with train.device_mapping it must be, the teacher scoring on "
        "the student's devices.",
    )


@dataclass
class DistillLossConfig:
    """What the student matches of the teacher, and how."""

    objective: str = option(
        "forward_kl",
        help="Divergence per token (registry name): forward_kl (KL(teacher || student), classic KD), "
        "reverse_kl (KL(student || teacher)), jsd (generalized JSD, between the two by beta).",
    )
    beta: float = option(
        0.5,
        ge=0,
        le=1,
        help="jsd: 0 is forward KL, 1 reverse KL; scaled so both limits are exact (docs/distill.md).",
    )
    top_k: int = option(
        32, gt=0, help="Teacher tokens kept per position (the cache holds k ids and k log-probabilities)."
    )
    tail: Literal["extra_class", "renormalize"] = option(
        "extra_class",
        help="The teacher's mass outside its top k: extra_class keeps it as one more class (no mass lost; "
        "k = vocabulary size is the dense divergence), renormalize drops it and renormalises both "
        "distributions over the k tokens.",
    )
    ce_weight: float = option(
        0.0,
        ge=0,
        help="Weight of the cross-entropy on the dataset's completion added to the divergence (0: none).",
    )
    cache_dir: str | None = option(
        None,
        help="Where the teacher's top-k outputs are cached, one file per dataset, teacher, k and tail. "
        "Unset: <output_dir>/teacher_cache.",
    )


@dataclass
class DistillConfig:
    """`pipeline: distill` - a student trained on a teacher's top-k distributions over prompt/answer rows."""

    pipeline: Literal["distill"] = option("distill", help="Which pipeline runs this config.")
    run_name: str = option("distill", help="Name shown in logs.")
    output_dir: str = option("runs/distill", help="Run directory: metrics, checkpoints, final model.")
    seed: int = option(0, help="Seed for data order and initialisation.")
    imports: list[str] = option(
        [], help="Your modules that register objectives or rewards (imported in the driver and every worker)."
    )
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "The student."})
    teacher: TeacherConfig = field(default_factory=TeacherConfig, metadata={"help": "The teacher."})
    data: DataConfig = field(
        default_factory=DataConfig, metadata={"help": "Prompt/answer rows; the answers are distilled on."}
    )
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig, metadata={"help": "Optimisation."})
    distill: DistillLossConfig = field(default_factory=DistillLossConfig, metadata={"help": "The loss."})
    reward: str = option("exact_match", help="Reward function that scores greedy eval answers (0-1).")
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"help": "Held-out evaluation."})
    checkpoint: CheckpointConfig = field(
        default_factory=CheckpointConfig, metadata={"help": "Checkpoints, resume and automatic recovery."}
    )
    tracking: TrackingConfig = field(default_factory=TrackingConfig, metadata={"help": "Metric sinks."})
    ray: RayConfig = field(default_factory=RayConfig, metadata={"help": "Ray connection."})
