"""Supervised fine-tuning: the warm start that makes RL on a weak model possible."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from roll.config.common import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    OptimizerConfig,
    RayConfig,
    TrackingConfig,
)
from roll.config.fields import option


@dataclass
class SFTTrainConfig(OptimizerConfig):
    """Optimisation of the SFT loss (token-mean cross-entropy on response tokens only)."""

    steps: int = option(300, gt=0, help="Optimizer steps.")
    batch_size: int = option(64, gt=0, help="Rows per optimizer step (global, across data-parallel ranks).")
    micro_batch_size: int = option(
        64, gt=0, help="Rows per forward/backward on one rank (gradient accumulation)."
    )
    lr: float = option(1e-3, gt=0, help="Peak learning rate (AdamW).")
    world_size: int | None = option(
        None,
        gt=0,
        help="Data-parallel (FSDP2) training ranks. Unset: one per device of device_mapping, or 1. In an RL "
        "config's sft_warm_start: the actor's.",
    )
    device_mapping: list[int] | None = option(
        None,
        help="Global device indices of the training ranks, a list or 'range(0,4)' (distillation's teacher "
        "scores on them first). Unset: CPU ranks. Not in an RL config's sft_warm_start: the warm start "
        "trains on the actor's devices (actor.device_mapping).",
    )


@dataclass
class SFTConfig:
    """`pipeline: sft` - supervised fine-tuning of a causal LM on prompt/response pairs."""

    pipeline: Literal["sft"] = option("sft", help="Which pipeline runs this config.")
    run_name: str = option("sft", help="Name shown in logs.")
    output_dir: str = option("runs/sft", help="Run directory: metrics, TensorBoard events, final model.")
    seed: int = option(0, help="Seed for data order, sampling and initialisation.")
    imports: list[str] = option(
        [], help="Your modules that register rewards or algorithms (imported in the driver and every worker)."
    )
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "The model to fine-tune."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Training and eval data."})
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig, metadata={"help": "Optimisation."})
    reward: str = option("exact_match", help="Reward function that scores greedy eval answers (0-1).")
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"help": "Held-out evaluation."})
    checkpoint: CheckpointConfig = field(
        default_factory=CheckpointConfig, metadata={"help": "Checkpoints, resume and automatic recovery."}
    )
    tracking: TrackingConfig = field(default_factory=TrackingConfig, metadata={"help": "Metric sinks."})
    ray: RayConfig = field(default_factory=RayConfig, metadata={"help": "Ray connection."})
