"""Cross-field checks of the rollout's inference engine (the hybrid engine, the registry engines,
vLLM, devices shared with other roles), run at load before Ray or a model starts."""

from __future__ import annotations

from roll.config.rlvr import RLVRConfig, RolloutConfig
from roll.config.validation import check_registry


def check_hybrid_engine(cfg: RLVRConfig) -> list[str]:
    """With ``rollout.hybrid_engine`` the actor's ranks generate: options of separate rollout workers
    would be read by nothing."""
    rollout, hint = cfg.rollout, "set rollout.hybrid_engine=false to use rollout workers"
    problems = []
    if rollout.device_mapping is not None:
        problems.append(
            f"rollout.device_mapping: the hybrid engine generates on the actor's devices; unset it or {hint}"
        )
    if rollout.world_size not in (1, cfg.actor.world_size):
        problems.append(
            f"rollout.world_size: the hybrid engine generates on the actor's {cfg.actor.world_size} rank(s); "
            f"unset it or {hint}"
        )
    if rollout.max_running_requests is not None:
        problems.append(f"rollout.max_running_requests: applies to rollout workers only; unset it or {hint}")
    probe_default = RolloutConfig.__dataclass_fields__["sync_probe_sequences"].default
    if rollout.sync_probe_sequences != probe_default or rollout.sync_probe_tolerance is not None:
        problems.append(
            f"rollout.sync_probe_sequences/sync_probe_tolerance check weight syncs to rollout workers; the "
            f"hybrid engine generates with the trained weights themselves and syncs nothing; unset them or "
            f"{hint}"
        )
    if rollout.prefix_cache_tokens != RolloutConfig.__dataclass_fields__["prefix_cache_tokens"].default:
        problems.append(
            f"rollout.prefix_cache_tokens: rollout workers keep an episode's KV between turns; the hybrid "
            f"engine's batch generation keeps none; unset it or {hint}"
        )
    if cfg.model.inference_dtype is not None and not getattr(getattr(cfg, "distill", None), "teachers", None):
        problems.append(
            f"model.inference_dtype: the hybrid engine generates with the actor's model, in model.dtype; "
            f"unset it or {hint}"
        )
    default_engine = RolloutConfig.__dataclass_fields__["engine"].default
    if rollout.engine != default_engine:
        problems.append(
            f"rollout.engine={rollout.engine}: the hybrid engine generates with the actor's own model "
            f"(Hugging Face generate); unset it or {hint}"
        )
    return problems


def check_inference_engine(cfg: RLVRConfig) -> list[str]:
    """The engine's registry name and the devices it can use per worker."""
    from roll.strategies.infer import INFERENCE_ENGINES

    rollout = cfg.rollout
    problems = check_registry("rollout.engine", rollout.engine, INFERENCE_ENGINES)
    if problems:
        return problems
    problems += check_vllm(cfg)
    usable = INFERENCE_ENGINES.traits(rollout.engine).get("devices_per_worker", 1)  # None: any number
    if usable is not None and rollout.num_devices_per_worker > usable:
        problems.append(
            f"rollout.num_devices_per_worker={rollout.num_devices_per_worker}: the {rollout.engine} engine "
            f"runs each rollout worker on {usable} device(s) and would leave the others idle; set it to "
            f"{usable} (more rollout workers use more devices)"
        )
    return problems


def check_vllm(cfg: RLVRConfig) -> list[str]:
    """What the vllm engine cannot do: installed, no truncated sampling (its logprobs would be those of
    the truncated distribution), and a ``max_model_len`` that holds the run's longest sequence. (Its KV
    cache against the model's shape is checked in preflight, which reads the model's config.)"""
    import importlib.util

    from roll.strategies.infer.vllm import INSTALL_HINT

    rollout = cfg.rollout
    if rollout.engine != "vllm":
        return ["rollout.vllm is read by rollout.engine=vllm only; remove it"] if rollout.vllm else []
    problems = []
    if importlib.util.find_spec("vllm") is None:
        problems.append(
            f"rollout.engine=vllm: vLLM is not installed; {INSTALL_HINT}; or set rollout.engine=hf"
        )
    if rollout.top_k > 0 or rollout.top_p < 1.0:
        problems.append(
            f"rollout.top_k={rollout.top_k}, rollout.top_p={rollout.top_p}: vLLM's logprobs under top-k "
            "or top-p truncation are those of the truncated distribution, not the trainer's; set "
            "rollout.top_k=0 and rollout.top_p=1.0, or rollout.engine=hf"
        )
    declared = rollout.vllm.max_model_len if rollout.vllm else None
    needed, source = longest_sequence(cfg)
    if declared is not None and declared < needed:
        problems.append(
            f"rollout.vllm.max_model_len={declared} is shorter than the run's longest sequence, {source} = "
            f"{needed}: vLLM would refuse those requests mid-run; raise it to {needed} or unset it"
        )
    default_store = RolloutConfig.__dataclass_fields__["prefix_cache_tokens"].default
    if getattr(cfg, "env", None) is not None and rollout.prefix_cache_tokens != default_store:
        problems.append(  # (RLVR refuses it for any engine: rl_checks)
            "rollout.prefix_cache_tokens sizes the hf engine's store of episodes' KV; vLLM keeps prefixes "
            "in its own KV cache (rollout.vllm.kv_cache_gb or gpu_memory_utilization): remove it"
        )
    return problems


def longest_sequence(cfg: RLVRConfig) -> tuple[int, str]:
    """The most tokens one rollout request of the run holds (prompt + response), and the keys that set
    it: an agentic episode's context bound, or the longest prompt with the longest response; at least
    the sync probe's sequences."""
    from roll.distributed.sync_probe import PROBE_TOKENS

    env = getattr(cfg, "env", None)
    if env is not None:
        longest, source = env.max_context_tokens, "env.max_context_tokens"
    else:
        longest = cfg.data.max_prompt_length + max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)
        source = "data.max_prompt_length + max(rollout.max_new_tokens, eval.max_new_tokens)"
    probe = PROBE_TOKENS + 1  # vLLM scores a prompt by sampling one token after it
    if cfg.rollout.sync_probe_sequences and probe > longest:
        return probe, "the sync probe's sequences and one token (rollout.sync_probe_sequences)"
    return longest, source


def roles_sharing_rollout_devices(cfg: RLVRConfig) -> list[str]:
    """The roles whose device mapping shares a device with the rollout's ([] for a malformed mapping,
    which check_devices reports)."""
    from roll.config.devices import role_plan
    from roll.distributed.device_mapping import is_colocated

    try:
        roles = {role.role: role for role in role_plan(cfg)}
    except ValueError:
        return []
    rollout = roles.pop("rollout")
    return [name for name, role in roles.items() if is_colocated(role, rollout)]
