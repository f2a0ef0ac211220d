"""`pipeline: agentic` - multi-turn RL in an environment: one training sample per episode, or per turn."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from roll.config.common import CheckpointConfig, ModelConfig, RayConfig, TrackingConfig
from roll.config.fields import option
from roll.config.health import HealthConfig
from roll.config.rlvr import ActorConfig, AlgorithmConfig, CriticConfig, RolloutConfig
from roll.config.sft import SFTTrainConfig

# What the scheduler does with an episode that ended for each reason (env_error and env_timeout always
# drop the episode: its group completes from the others or is dropped).
STOP_POLICIES = ("train", "mask", "zero")
DEFAULT_STOP_POLICY: dict[str, str] = {
    "env_done": "train",
    "max_turns": "train",
    "context_limit": "train",
    "turn_truncated": "train",
}


@dataclass
class EnvConfig:
    """The environment, the environment workers that host it, and each episode's budgets."""

    name: str = option("frozen_lake", help="Registered environment (roll.envs.ENVIRONMENTS).")
    options: dict[str, Any] = option({}, help="The environment's options (its constructor's arguments).")
    world_size: int = option(
        1, gt=0, help="Environment workers: processes that each host many env instances, stepped per call."
    )
    step_timeout_s: float = option(
        30.0,
        gt=0,
        help="Longest reset or step of one env; one that hangs longer is retried once, then dropped.",
    )
    max_turns: int = option(
        8, gt=0, help="Turns per episode (rollout.max_new_tokens is the tokens per turn)."
    )
    max_context_tokens: int = option(
        512, gt=0, help="Prompt and response of an episode together, observations included."
    )
    system_prompt: str | None = option(None, help="System message at the start of every episode.")
    max_tool_failure_frac: float | None = option(
        0.5,
        gt=0,
        le=1,
        help="Stop the run when more than this share of the tool calls of the last 5 steps failed (the tool "
        "raised, timed out or its sandbox failed; judged from 20 calls on), quoting what the failed calls "
        "returned. Only environments with tools report calls. null: never stop.",
    )
    sample_layout: Literal["trajectory", "step_wise"] = option(
        "trajectory",
        help="trajectory: one training sample per episode (every turn and observation, the return as its "
        "score). step_wise: one sample per turn, each turn generated from the current observation and "
        "env.history_turns earlier turns (for per-turn credit: algorithm.advantage_estimator gigpo or "
        "step_reinforce).",
    )
    history_turns: int = option(
        0,
        ge=0,
        help="step_wise: earlier turns (their actions and observations) a turn sees besides the current "
        "observation; 0 for a Markov env such as a gridworld.",
    )
    group_size_redundancy: int = option(
        0,
        ge=0,
        help="Extra episodes started per group, standing in for episodes whose env fails (or times out): "
        "a group is its first rollout.num_return_sequences episodes in start order that did not fail, "
        "and the rest are aborted once those have ended. Not the first to end, which would bias every "
        "group towards short episodes.",
    )
    stop_reasons: dict[str, str] = option(
        {},
        help="What to do with an episode per stop reason (env_done, max_turns, context_limit, "
        "turn_truncated): train (its return as is), mask (in its group's baseline, no tokens trained) or "
        "zero (trained with return 0). Merged over train for every reason. Agent runs (agent:): "
        "env_done is a run its agent ended; max_turns and context_limit a run out of its budget; "
        "turn_truncated a run whose agent failed on a reply cut at rollout.max_new_tokens (scored 0).",
    )

    def stop_policy(self) -> dict[str, str]:
        return {**DEFAULT_STOP_POLICY, **self.stop_reasons}


@dataclass
class AgentConfig:
    """A user's agent program, trained through the endpoint instead of an environment (docs/agents.md)."""

    entrypoint: str = option(
        help="Your agent program, module:function or file.py:function: async def run(client, task) -> "
        "float | None (or a plain function taking an openai.OpenAI).",
    )
    tasks: str = option(
        help="A dataset file of tasks (any format roll train reads), one per row, each handed to the agent "
        "as a dict; the first eval.seeds are held out.",
    )
    timeout_s: float = option(
        300.0, gt=0, help="A run's wall-time bound; a run past it is dropped as agent_timeout."
    )
    reward: str | None = option(
        None,
        help="A registered reward function (exact_match, math_verify, yours) that scores the run's last "
        "reply against its task, for agents that return None; unset: the agent's own reward.",
    )
    spare_groups: int = option(
        0,
        ge=0,
        help="Tasks played beyond a step's rollout_batch_size, so that a slow or hung run holds up only its "
        "own group: a batch takes the first groups to finish, in draw order. Synchronously those it passes "
        "over are dropped once the weights move and their tasks drawn again first; asynchronously they go "
        "into a later batch. 0: a batch waits for its groups in draw order (a hung run holds a synchronous "
        "step up to timeout_s).",
    )
    concurrency: int | None = option(
        None,
        ge=1,
        help="Runs playing at once, at most (an agent's own tools, sandboxes or rate limits may need a "
        "cap); the rest wait their turn in start order, their timeout_s counting from their start. Unset: "
        "every run a step draws plays at once.",
    )
    train_branches: Literal["longest", "all"] = option(
        "longest",
        help="Which contexts of a run train: longest, the branch with the most sampled tokens; all, every "
        "branch with sampled tokens (a sub-agent's, a summariser's), each a row with the run's reward, "
        "counted once per run in its group's baseline.",
    )


# The env keys agent programs read (budgets and what a run's stop reason does); the rest belong to
# environments and are refused when set beside an agent: section.
AGENT_ENV_KEYS = ("max_turns", "max_context_tokens", "stop_reasons", "group_size_redundancy")


@dataclass
class AgenticEvalConfig:
    """Held-out episodes on seeds training never plays (nor their maps): greedy and sampled."""

    every_steps: int = option(
        50, ge=0, help="Evaluate every N training steps (0: only before and after training)."
    )
    seeds: int = option(
        100,
        gt=0,
        help="Held-out seeds 0..N-1: one episode each, greedy, and one sampled (rollout.temperature).",
    )
    score: Literal["greedy", "sampled"] = option(
        "sampled",
        help="Which success rate is eval/score (both are logged: eval/greedy/success, eval/sampled/success).",
    )


@dataclass
class ExpertWarmStartConfig(SFTTrainConfig):
    """SFT on a scripted expert's episodes, in exactly the token format RL trains on."""

    expert: str = option("frozen_lake_expert", help="Registered agent (roll.envs.agents.AGENTS) to imitate.")
    expert_options: dict[str, Any] = option(
        {}, help="The agent's options, e.g. {noise: 0.3} for an expert that moves at random 30% of the time."
    )
    episodes: int = option(2000, gt=0, help="Expert episodes played on training seeds.")


@dataclass
class AgenticConfig:
    """`pipeline: agentic` - RL on multi-turn episodes of an environment (trajectory- or step-wise)."""

    pipeline: Literal["agentic"] = option("agentic", help="Which pipeline runs this config.")
    run_name: str = option("agentic", help="Name shown in logs.")
    output_dir: str = option("runs/agentic", help="Run directory: metrics, TensorBoard events, final model.")
    seed: int = option(0, help="Seed for sampling, initialisation and the expert's episodes.")
    imports: list[str] = option(
        [],
        help="Your modules that register envs, agents or algorithms (imported by the driver and workers).",
    )
    steps: int = option(100, gt=0, help="RL training steps (one batch of episode groups each).")
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "The initial policy."})
    env: EnvConfig = field(default_factory=EnvConfig, metadata={"help": "Environment and episode budgets."})
    agent: AgentConfig | None = field(
        default=None,
        metadata={
            "help": "Train your agent program through the endpoint instead of an environment (env then "
            "gives only its budgets: max_turns, max_context_tokens, stop_reasons, group_size_redundancy)."
        },
    )
    sft_warm_start: ExpertWarmStartConfig | None = field(
        default=None,
        metadata={"help": "Imitate a scripted expert before RL (unset: RL from the model as is)."},
    )
    rollout: RolloutConfig = field(
        default_factory=RolloutConfig,
        metadata={
            "help": "Sampling: rollout_batch_size seeds per step, num_return_sequences episodes per seed, "
            "max_new_tokens per turn."
        },
    )
    actor: ActorConfig = field(default_factory=ActorConfig, metadata={"help": "Policy optimisation."})
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig, metadata={"help": "RL algorithm."})
    critic: CriticConfig | None = field(
        default=None, metadata={"help": "Value model for advantage_estimator=gae (PPO); unset otherwise."}
    )
    eval: AgenticEvalConfig = field(
        default_factory=AgenticEvalConfig, metadata={"help": "Held-out episodes."}
    )
    checkpoint: CheckpointConfig = field(
        default_factory=CheckpointConfig, metadata={"help": "Checkpoints, resume and automatic recovery."}
    )
    tracking: TrackingConfig = field(default_factory=TrackingConfig, metadata={"help": "Metric sinks."})
    health: HealthConfig = field(
        default_factory=HealthConfig, metadata={"help": "Run-health monitors (docs/health.md)."}
    )
    ray: RayConfig = field(default_factory=RayConfig, metadata={"help": "Ray connection."})


def migrate_agent_env(raw: Any) -> str | None:
    """An old config's ``env.name: agent`` with the program in ``env.options``, rewritten in place as an
    ``agent:`` section (``raw``: the YAML mapping before the schema). Returns the deprecation message, or
    None when there was nothing to rewrite."""
    env = raw.get("env") if hasattr(raw, "get") else None
    if not hasattr(env, "get") or env.get("name") != "agent" or raw.get("agent") is not None:
        return None
    raw["agent"] = env.pop("options", None) or {}
    env.pop("name")
    return (
        "env.name: agent with the program in env.options is deprecated: write an agent: section "
        "(agent.entrypoint, agent.tasks, agent.timeout_s, agent.reward) and drop env.name and env.options; "
        "this config is read as if it did"
    )
