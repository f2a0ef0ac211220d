"""RL with verifiable rewards (GRPO and friends)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from roll.config.common import DataConfig, EvalConfig, ModelConfig, RayConfig, TrackingConfig
from roll.config.fields import option
from roll.config.sft import SFTTrainConfig


@dataclass
class RolloutConfig:
    """Sampling from the policy with the inference engine."""

    world_size: int = option(1, help="Rollout (inference) workers; prompts are split across them.")
    rollout_batch_size: int = option(8, help="Prompts per training step.")
    num_return_sequences: int = option(8, help="Samples per prompt: the group size for group baselines.")
    max_new_tokens: int = option(16, help="Longest sampled response in tokens.")
    temperature: float = option(1.0, help="Sampling temperature (keep near 1 for exploration).")
    top_p: float = option(1.0, help="Nucleus sampling mass (1 disables).")
    top_k: int = option(0, help="Sample among the k most likely tokens (0 disables).")


@dataclass
class ActorConfig:
    """The trained policy: PPO-style updates on the rollout batch."""

    world_size: int = option(1, help="Data-parallel training ranks.")
    lr: float = option(1e-5, help="Peak learning rate (AdamW); RL wants 10-100x less than SFT.")
    weight_decay: float = option(0.0, help="AdamW weight decay.")
    warmup_steps: int = option(0, help="Linear warmup steps.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = option(
        "constant", help="Learning-rate schedule after warmup; linear/cosine decay to 0 at the last step."
    )
    max_grad_norm: float = option(1.0, help="Gradient-norm clip (0 disables).")
    ppo_epochs: int = option(1, help="Passes over each rollout batch.")
    mini_batch_size: int | None = option(
        None, help="Samples per optimizer step; unset means the whole rollout batch (one step per epoch)."
    )
    micro_batch_size: int = option(
        64, help="Samples per forward/backward on one rank (gradient accumulation)."
    )


@dataclass
class AlgorithmConfig:
    """Advantage estimator, policy loss and regularisers, each selected by registry name."""

    advantage_estimator: str = option("grpo", help="Advantage estimator (registry name).")
    norm_adv_by_std: bool = option(True, help="GRPO: divide group-centred rewards by the group std.")
    policy_loss: str = option("ppo_clip", help="Policy loss (registry name).")
    clip_ratio_low: float = option(0.2, help="PPO clip: lower bound is 1 - clip_ratio_low.")
    clip_ratio_high: float = option(0.2, help="PPO clip: upper bound is 1 + clip_ratio_high.")
    loss_agg_mode: str = option("token-mean", help="How token losses become one scalar (registry name).")
    kl_coef: float = option(0.0, help="Weight of the KL-to-reference loss; 0 skips the reference model.")
    kl_estimator: str = option("k3", help="KL estimator (registry name).")
    entropy_coef: float = option(0.0, help="Entropy bonus weight (0 disables).")


@dataclass
class RLVRConfig:
    """`pipeline: rlvr` - sample, score with a verifiable reward, update the policy."""

    pipeline: Literal["rlvr"] = option("rlvr", help="Which pipeline runs this config.")
    run_name: str = option("rlvr", help="Name shown in logs.")
    output_dir: str = option("runs/rlvr", help="Run directory: metrics, TensorBoard events, final model.")
    seed: int = option(0, help="Seed for data order, sampling and initialisation.")
    imports: list[str] = option(
        [], help="Your modules that register rewards or algorithms (imported in the driver and every worker)."
    )
    steps: int = option(100, help="RL training steps (one rollout batch each).")
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "The initial policy."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Prompt data."})
    sft_warm_start: SFTTrainConfig | None = field(
        default=None, metadata={"help": "Run SFT on data.train_path before RL (a weak start learns faster)."}
    )
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata={"help": "Sampling."})
    actor: ActorConfig = field(default_factory=ActorConfig, metadata={"help": "Policy optimisation."})
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig, metadata={"help": "RL algorithm."})
    reward: str = option("exact_match", help="Reward function (registry name) scoring each response.")
    eval_reward: str | None = option(
        None,
        help="Reward function for eval/score; unset uses `reward` (train on partial credit, eval exact).",
    )
    reward_world_size: int = option(1, help="Reward workers; responses are split across them.")
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"help": "Held-out evaluation."})
    tracking: TrackingConfig = field(default_factory=TrackingConfig, metadata={"help": "Metric sinks."})
    ray: RayConfig = field(default_factory=RayConfig, metadata={"help": "Ray connection."})
