"""Cross-field checks of an agentic RL config (the environment or agent program, its budgets, the
warm start's expert), run at load before Ray or a model starts."""

from __future__ import annotations

import dataclasses

from roll.config.agentic import AGENT_ENV_KEYS, DEFAULT_STOP_POLICY, STOP_POLICIES, AgenticConfig, EnvConfig
from roll.config.rl_checks import bounds_and_world_sizes, check_async_generation, check_policy_training
from roll.config.validation import (
    check_model,
    check_registry,
    check_sft_train,
    check_tiny_model,
    check_tracking,
)


def validate_agentic(cfg: AgenticConfig) -> list[str]:
    """The RL sections as RLVR checks them, the environment and its budgets, the expert of the warm
    start, and the rollout options that single-turn sampling has and episodes do not (yet)."""
    from roll.envs import ENVIRONMENTS
    from roll.envs.agents import AGENTS
    from roll.envs.base import check_env

    problems = bounds_and_world_sizes(cfg)
    if problems:
        return problems
    problems = check_policy_training(cfg) + check_async_generation(cfg)
    problems += check_model(cfg.model) + check_tiny_model(cfg.model) + check_tracking(cfg.tracking)
    rollout, env = cfg.rollout, cfg.env
    if cfg.agent is not None:  # a user's agent program (roll.pipelines.agent_programs), not an env
        problems += check_agent_env(cfg)
    elif env.name == "agent":
        problems.append(
            "env.name: agent: agent programs are configured in an agent: section now (agent.entrypoint, "
            "agent.tasks, ...); drop env.name and env.options (docs/agents.md)"
        )
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
    if worst_call_s >= cfg.ray.call_timeout_s and cfg.agent is None:
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
        problems += check_sft_train(warm, "sft_warm_start", cfg.model)
        problems += check_registry("sft_warm_start.expert", warm.expert, AGENTS)
        if warm.expert in AGENTS:
            problems += check_kwargs(
                "sft_warm_start.expert_options", AGENTS.get(warm.expert), warm.expert_options
            )
    if cfg.agent is None and env.name in ENVIRONMENTS and not problems:
        problems += check_seeds(cfg)
    return problems


def check_agent_env(cfg: AgenticConfig) -> list[str]:
    """``agent:``: the program, its tasks and reward, the serve extra, an estimator that can count a run
    once whatever its branches, and no env key set that only environments read."""
    from roll.rollout.agent_runs import check_agent
    from roll.serving import require_serving

    try:
        require_serving()
    except ImportError as e:
        return [f"agent: {e}"]
    assert cfg.agent is not None
    problems = check_agent(cfg.agent, cfg.eval.seeds)
    defaults = EnvConfig()
    problems += [
        f"env.{key}: not read for agent programs (agent:), whose env section gives only "
        f"{', '.join(AGENT_ENV_KEYS)}; remove it"
        for key in (f.name for f in dataclasses.fields(EnvConfig))
        if key not in AGENT_ENV_KEYS and getattr(cfg.env, key) != getattr(defaults, key)
    ]
    if cfg.agent.train_branches == "all":
        from roll.algorithms import ADVANTAGE_ESTIMATORS

        estimator = cfg.algorithm.advantage_estimator
        able = [n for n in ADVANTAGE_ESTIMATORS.names() if _counts_runs(ADVANTAGE_ESTIMATORS.get(n))]
        if estimator in ADVANTAGE_ESTIMATORS.names() and estimator not in able:
            problems.append(
                f"agent.train_branches: all trains several rows per run, and {estimator} would count a run "
                f"once per branch in its baseline; use one that counts runs ({', '.join(able)}) or "
                "train_branches: longest"
            )
    return problems


def _counts_runs(estimator: object) -> bool:
    """Whether an advantage estimator reads ``episode_index`` (each episode once in its statistics)."""
    import inspect

    return "episode_index" in inspect.signature(estimator).parameters  # type: ignore[arg-type]


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
