"""Benchmark: agentic episodes with a long-tail env latency through the rollout loops, side by side.

What is measured: episodes per second of ``AgenticPipeline.step`` (rollout, train, weight sync; this
recipe needs no logprobs pass) when each step's batch of 8 groups x 4 episodes comes from

1. ``lockstep``: the classic loop of RAGEN / verl-agent, ``BatchEpisodes`` below. The step's episodes
   are reset, then, turn after turn: every live episode's turn is generated as one batch (sent at once
   to the rollout workers, each group to worker ``group % workers`` as the scheduler places it) and the
   loop waits for all of them; then every env is stepped (one call per environment worker) and the loop
   waits for the slowest; until every episode of the step has ended. No episode moves on before the
   slowest one. The batch and metrics are the scheduler's (``trajectory_batch``, ``episode_metrics``);
   it has the scheduler's interface and is swapped in as ``pipeline.scheduler``.
2. ``scheduler``: ``roll.rollout.episodes.EpisodeScheduler`` with the pipeline's spec,
   ``async_generation_ratio=0``: no barrier between episodes (a turn goes out as soon as its episode's
   observation is in; the turns that come back in one poll are stepped together, one call per
   environment worker), nothing plays while the actor trains.
3. ``async``: the same scheduler with ``async_generation_ratio=1``: the next step's episodes keep
   generating and stepping while the actor trains and the weights sync, none more than one weights
   version old.
4. ``async2``: ``async_generation_ratio=2``: two steps' episodes play ahead (none more than two
   versions old), so more episodes are live at once: their env waits overlap and the engine decodes
   more rows per step.

Environment workers serve their calls concurrently (``roll.workers.environment.EnvWorker``): the
scheduler sends many small step calls, and served one at a time each would wait behind every call sent
to its worker before it (docs/agentic.md has what that cost).

The workload: ``examples/agentic_frozenlake.yaml`` (GRPO on whole episodes) with these changes.

- The environment ``long_tail`` (``benchmarks/agentic_env.py``, imported by the driver and the Ray
  workers through the config's ``imports:``): an episode's length is drawn per seed, uniform in 1..12
  turns (``--max-turns``), and the env ends it; each step sleeps a Pareto-distributed time seeded per
  (seed, turn), so every mode meets the same latencies: minimum 20 ms (``--sleep-scale``), shape 1.2
  (``--sleep-shape``), capped at 2 s (``--max-sleep``); median 36 ms, mean 79 ms, one step in 21 over
  250 ms, one in 260 at the cap. The sleep holds no core, as waiting on a tool would not. Every
  observation is ``"k: "`` and 16 random letters and digits (``--obs-chars``), so a turn's context
  grows by about 26 tokens a turn. Any turn text is an action (its reward: the share of vowels in it).
  4 environment workers (``--env-workers``).
- 8 seeds x 4 episodes per step (``--groups``, ``--group-size``); ``actor.micro_batch_tokens=4096``
  (``--micro-batch-tokens``: micro-batches by real tokens, so a short episode is not trained at the
  width of the longest).
- A random model (``model.tiny``: the example's hidden size 128, 2 layers; 0.5M parameters) over a
  character alphabet of lowercase letters, digits, space, ``:`` and ``.``. A turn ends at one of the
  stop ids ``rollout.stop_token_ids`` (the ids of ``.qxzjkvwy``, besides EOS; about 6 tokens a turn) or
  is cut at ``rollout.max_new_tokens`` 32: an untrained model rarely samples EOS, so without stop ids
  every turn would be cut, and a cut turn ends its episode as ``turn_truncated``. The output gives the
  share of episodes the env ended (``env_done``) and of those cut. ``env.max_context_tokens`` 1024.

One pipeline (Ray workers for actor, rollout and environment, on CPU without device mappings: the
disaggregated layout ``check_async_generation`` accepts on a machine without GPUs) serves every mode:
its own scheduler is closed and each mode's is swapped in. The loaded config has
``rollout.async_generation_ratio=1``, so that layout is validated as it would be for an async run. First
``--warmup-steps`` (1) lockstep step on seeds no block plays, untimed (the actor's first step costs
several times a later one). Then ``--rounds`` (3) rounds, each one block of ``--steps`` (3) steps per
mode in turn, so that a change in the machine's load (these machines are shared) hits every mode
alike; block r of every mode draws the same training seeds in the same order (``r x steps x 8`` on
from the first), hence the same episode lengths and latencies, and the first ``--warmup`` (1) step of
each block is left out (async: the first batch has nothing played ahead). Weight versions (the step
numbers) run on across blocks. A block's scheduler is closed after it (async: its turns in flight
aborted, its envs closed) and its open calls on the rollout workers drained before the next block.

Reported per mode: episodes per second over the summed time of all timed steps (what a run averages
to: the headline, and per block) and over the median step time, and the ratio of each to ``lockstep``
(an async run's steps alternate between one that waits for its batch and one whose batch was played
ahead, so its median step says little); where the time goes (medians of ``time/<stage>_s``: rollout =
waiting for ``next_batch``, train, sync, rest = the step less those; lockstep's waits for generation and
for the envs; ``env/step_s``, from sending an episode's step to taking its result); the mean turns of an
episode and its stop reasons; staleness; groups aborted as stale; the rollout worker's prefix-reuse
counters over the mode's blocks (prompt tokens prefilled per turn request, the share reused from kept
KV, hits and misses; the engine empties its store at every weight change); and every step's times
beside two floors the env's latencies alone set for that step's seeds: lockstep waits, turn after turn,
for the slowest live env (sum over turns of the largest sleep), the scheduler at least for its slowest
group (the largest sum of one group's sleeps).

``--prefix`` part (on by default; ``--no-prefix`` skips it), run first, while the rollout workers still
hold the initial weights: the same seeds (``--prefix-groups`` 8 x 4 episodes, seeds no block plays)
played in lockstep twice, through the pipeline's rollout worker (``rollout.prefix_cache_tokens`` at its
default, 65536; each turn's request carries its episode id as ``cache_key``, as the scheduler's do) and
through a second rollout worker started with ``prefix_cache_tokens=0``; the environments run in the
driver (``LocalEnvs``) with their sleeps off (latency does not change what is prefilled). In lockstep
every request of one generation round is turn k of its episode, so the change in the worker's counters
(``RolloutRouter.prefix_stats``: ``prefill_tokens`` computed, ``reused_tokens``) across round k,
divided by its episodes, is the mean prefill of turn k. Printed per turn index: episodes, mean context
tokens, mean tokens prefilled with reuse (and reused), mean prefilled without reuse. Each run samples
its own turns; with the same weights, sampling seed and order of requests the two workers have sampled
the same tokens (the context columns then agree), as a reused prefix must not change what is sampled.

Run from the repository root (the Ray workers import ``benchmarks.agentic_env`` from there)::

    python benchmarks/agentic.py [--rounds 3] [--steps 3] [--warmup 1]
        [--modes lockstep,scheduler,async,async2] [--env-workers 4] [--sleep-scale 0.02]
        [--no-prefix] [--json FILE]

It takes minutes on a CPU (Ray and the workers start once). Ray starts locally unless ``RAY_ADDRESS``
names a cluster to join.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import os
import shutil
import statistics
import string
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "agentic_frozenlake.yaml"
ENV_MODULE = "benchmarks.agentic_env"
MODES = ("lockstep", "scheduler", "async", "async2")

ALPHABET = string.ascii_lowercase + string.digits + " :."
STOP_CHARS = ".qxzjkvwy"  # a turn ends at one of these (or EOS): a few tokens on a random model

# No SFT warm start; no evaluation (the benchmark calls step() alone; eval.seeds only sets where the
# training seeds start).
COMMON_OVERRIDES = ["sft_warm_start=null", "eval.every_steps=0", "eval.seeds=16"]


# --------------------------------------------------------------------------------------------- workload


def env_options(args: argparse.Namespace, sleep: bool = True) -> dict[str, Any]:
    return {
        "min_turns": 1,
        "max_turns": args.max_turns,
        "sleep_scale_s": args.sleep_scale if sleep else 0.0,
        "sleep_shape": args.sleep_shape,
        "max_sleep_s": args.max_sleep,
        "observation_chars": args.obs_chars,
    }


def stop_token_ids() -> list[int]:
    """The ids of ``STOP_CHARS`` in the tiny model's character tokenizer (built here as it will be)."""
    from roll.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(ALPHABET)
    return [int(i) for i in tokenizer.convert_tokens_to_ids(list(STOP_CHARS))]


def load_benchmark_config(args: argparse.Namespace, output_dir: Path, total_steps: int):
    from omegaconf import OmegaConf

    from roll.config.loader import load_config

    # The example's env options (FrozenLake's) would merge into an override: replace them in a copy.
    example = OmegaConf.load(EXAMPLE)
    example.env.options = env_options(args)
    path = output_dir.parent / "benchmark.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(example, path)
    context = 1024
    overrides = [
        *COMMON_OVERRIDES,
        f"output_dir={output_dir}",
        f"steps={total_steps}",
        f"seed={args.seed}",
        f"imports=[{ENV_MODULE}]",
        "env.name=long_tail",
        f"env.world_size={args.env_workers}",
        f"env.max_turns={args.max_turns}",
        f"env.max_context_tokens={context}",
        f"model.tiny.alphabet='{ALPHABET}'",
        f"model.tiny.max_position_embeddings={context}",
        f"model.tiny.hidden_size={args.hidden}",
        f"model.tiny.num_hidden_layers={args.layers}",
        f"model.tiny.intermediate_size={4 * args.hidden}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.stop_token_ids=[{', '.join(map(str, stop_token_ids()))}]",
        f"rollout.rollout_batch_size={args.groups}",
        f"rollout.num_return_sequences={args.group_size}",
        f"rollout.world_size={args.rollout_workers}",
        # Validated as an async run: actor and rollout on CPU workers, apart (no device mappings).
        "rollout.async_generation_ratio=1",
        "actor.lr_scheduler=constant",  # the modes run one after another: the same LR for all
        # Micro-batches by real tokens: a short episode is not trained at the width of the longest.
        f"actor.micro_batch_tokens={args.micro_batch_tokens}",
    ]
    return load_config(path, overrides)


def seed_order(config, skip: int):
    """The training seeds in order, the first ``skip`` passed over."""
    from roll.envs.base import make_env
    from roll.envs.seeds import SeedOrder

    order = SeedOrder(make_env(config.env.name, config.env.options), config.eval.seeds)
    for _ in range(skip):
        order.next()
    return order


def env_floors(seeds: Sequence[int], args: argparse.Namespace) -> tuple[float, float]:
    """What the env's latencies alone cost one step of these seeds' groups: lockstep waits each turn for
    the slowest live env (sum over turns of the largest sleep); the scheduler at least for its slowest
    group (the largest sum of one group's sleeps)."""
    from benchmarks.agentic_env import episode_length, step_sleep

    sleeps = []
    for seed in seeds:
        length = episode_length(seed, 1, args.max_turns)
        sleeps.append(
            [step_sleep(seed, k, args.sleep_scale, args.sleep_shape, args.max_sleep) for k in range(length)]
        )
    longest = max(map(len, sleeps))
    lockstep = sum(max((s[k] for s in sleeps if k < len(s)), default=0.0) for k in range(longest))
    return lockstep, max(map(sum, sleeps))


# ------------------------------------------------------------------------------------- the lockstep loop


_LOCKSTEP_CALLS = itertools.count()  # episode ids stay unique across BatchEpisodes objects


class BatchEpisodes:
    """The classic synchronous episode loop (RAGEN, verl-agent) behind the episode scheduler's interface
    (``next_batch``, ``set_weights_version``, ``state_dict``, ``close``, ``backend``).

    ``next_batch``: draw ``groups_per_step`` seeds, reset their ``group_size`` episodes each (one call
    per environment worker), then until every episode has ended: generate the turn of every live
    episode as one batch (each group's requests to rollout worker ``group % workers``) and wait for all;
    step every env that got an action (one call per environment worker) and wait for all. The batch and
    the episode metrics are the scheduler's (``trajectory_batch``, ``episode_metrics``), plus the time
    spent waiting for generation (``rollout/generate_wait_s``) and for the envs
    (``rollout/env_wait_s``).

    ``reuse_prefixes``: each request carries its episode id as ``cache_key`` (as the scheduler's do),
    so the engine may prefill only a turn's new tokens. ``on_round(turn, context_lengths)`` is called
    once the round of turn ``turn`` has been generated (the prefix part reads the counters there).
    """

    def __init__(
        self,
        backend,
        envs,
        chat,
        spec,
        params,
        seeds,
        pad_id: int,
        id_prefix: str = "",
        reuse_prefixes: bool = True,
        on_round: Callable[[int, list[int]], None] | None = None,
        poll_s: float = 0.02,
    ):
        if spec.history_turns is not None:
            raise ValueError("BatchEpisodes plays trajectory-wise episodes only")
        self.backend, self.envs, self.chat, self.spec = backend, envs, chat, spec
        self.params, self.seeds, self.pad_id, self.id_prefix = params, seeds, pad_id, id_prefix
        self.reuse_prefixes, self.on_round, self.poll_s = reuse_prefixes, on_round, poll_s
        self.weights_version = 0

    def next_batch(self, step: int):
        from roll.envs.pool import OK
        from roll.rollout.episode import Episode
        from roll.rollout.episode_batch import trajectory_batch
        from roll.rollout.episodes import episode_metrics
        from roll.strategies.requests import GenerateRequest

        spec, workers = self.spec, self.backend.num_workers
        call = next(_LOCKSTEP_CALLS)
        episodes: dict[str, Episode] = {}
        worker_of: dict[str, int] = {}
        group_index: list[int] = []
        for g in range(spec.groups_per_step):
            seed = self.seeds.next()
            for k in range(spec.group_size):
                eid = f"{self.id_prefix}L{call}g{g}e{k}"
                episodes[eid] = Episode(None, seed, self.chat, spec.budget)
                worker_of[eid] = g % workers
                group_index.append(g)
        self.envs.send_resets([(eid, e.seed) for eid, e in episodes.items()])
        started = []
        while len(started) < len(episodes):
            started += self.envs.poll(self.poll_s)
        for result in started:
            if result.status != OK:
                raise RuntimeError(f"reset of {result.episode_id} failed: {result.error}")
            episodes[result.episode_id].start(result.observation)
        generate_s = env_s = 0.0
        env_calls: list[float] = []
        turn = 0
        while live := [eid for eid, e in episodes.items() if not e.done]:
            # Every live episode's turn, as one batch; wait for all of them.
            start = time.perf_counter()
            requests: dict[int, list] = collections.defaultdict(list)
            waiting: dict[str, str] = {}
            contexts = []
            for eid in live:
                context, room = episodes[eid].next_request()
                params = self.params
                if room < params.max_new_tokens:
                    params = dataclasses.replace(params, max_new_tokens=room)
                request_id = f"{eid}t{turn}"
                key = eid if self.reuse_prefixes else None
                requests[worker_of[eid]].append(GenerateRequest(request_id, context, params, cache_key=key))
                waiting[request_id] = eid
                contexts.append(len(context))
            for worker, batch in requests.items():
                self.backend.submit(worker, batch)
            results = {}
            while waiting:
                for result in self.backend.poll(self.poll_s).generated:
                    eid = waiting.pop(result.request_id, None)
                    if eid is not None:  # else a stray result of an earlier block's aborted turn
                        results[eid] = result
            generate_s += time.perf_counter() - start
            if self.on_round is not None:
                self.on_round(turn, contexts)
            actions = []
            for eid in live:
                result = results[eid]
                versions = result.weight_versions or [self.weights_version] * len(result.token_ids)
                action = episodes[eid].add_turn(
                    result.token_ids, result.logprobs, versions, result.finish_reason
                )
                if action is not None:
                    actions.append((eid, action))
            # Every env that got an action, stepped; wait for the slowest.
            start = time.perf_counter()
            if actions:
                self.envs.send(actions)
                stepped = []
                while len(stepped) < len(actions):
                    stepped += self.envs.poll(self.poll_s)
                for result in stepped:
                    if result.status != OK:
                        raise RuntimeError(f"step of {result.episode_id} failed: {result.error}")
                    episodes[result.episode_id].observe(
                        result.observation, result.reward, result.terminated, result.truncated, result.info
                    )
                env_calls.append(time.perf_counter() - start)
            env_s += time.perf_counter() - start
            ended = collections.defaultdict(list)
            for eid in live:
                if episodes[eid].done:
                    ended[worker_of[eid]].append(eid)
            for worker, eids in ended.items():  # the KV the engine kept for their next turn
                self.backend.release_prefixes(worker, eids)
            turn += 1
        self.envs.close(list(episodes))
        played = list(episodes.values())
        batch = trajectory_batch(played, group_index, list(episodes), spec.stop_policy, self.pad_id)
        metrics = episode_metrics(played, "episode")
        oldest = [min((v for v in e.versions if v >= 0), default=self.weights_version) for e in played]
        staleness = [self.weights_version - v for v in oldest]
        metrics.update(
            {
                "env/step_s": sum(env_calls) / max(len(env_calls), 1),
                "rollout/generate_wait_s": generate_s,
                "rollout/env_wait_s": env_s,
                "rollout/rounds": float(turn),
                "rollout/dropped_groups": 0.0,
                "rollout/aborted_episodes": 0.0,
                "rollout/stale_groups": 0.0,
                "rollout/staleness_mean": sum(staleness) / len(staleness),
                "rollout/staleness_max": float(max(staleness)),
            }
        )
        return batch, metrics

    def set_weights_version(self, version: int) -> None:
        self.weights_version = version

    def state_dict(self) -> dict[str, Any]:
        return self.seeds.state_dict()

    def close(self) -> None:
        pass  # nothing plays between two next_batch calls


# ------------------------------------------------------------------------------------------------ runs


@dataclass
class ModeResult:
    mode: str
    episodes_per_step: int
    metrics: list[dict[str, float]] = field(default_factory=list)
    timed_steps: list[bool] = field(default_factory=list)  # False: a warm-up step of its block
    floors: list[tuple[float, float]] = field(default_factory=list)  # per step: lockstep, scheduler
    prefix: dict[str, int] = field(default_factory=lambda: collections.Counter())  # counters over blocks

    def timed(self, key: str) -> list[float]:
        return [m[key] for m, timed in zip(self.metrics, self.timed_steps) if timed and key in m]

    def median(self, key: str) -> float:
        values = self.timed(key)
        return statistics.median(values) if values else float("nan")

    def mean(self, key: str) -> float:
        values = self.timed(key)
        return statistics.mean(values) if values else float("nan")

    def episodes_per_s(self) -> float:
        return self.episodes_per_step / self.median("time/step_s")

    def episodes_per_s_total(self) -> float:
        steps = self.timed("time/step_s")
        return self.episodes_per_step * len(steps) / sum(steps) if steps else float("nan")

    def per_block(self, steps: int) -> list[float]:
        """Episodes per second over each block's summed timed steps."""
        out = []
        for start in range(0, len(self.metrics), steps):
            block = zip(self.metrics[start : start + steps], self.timed_steps[start : start + steps])
            times = [m["time/step_s"] for m, timed in block if timed]
            if times:
                out.append(self.episodes_per_step * len(times) / sum(times))
        return out


def prefix_totals(router) -> collections.Counter:
    """The rollout workers' prefix counters, summed over workers."""
    total: collections.Counter = collections.Counter()
    for stats in router.prefix_stats():
        total.update({k: v for k, v in stats.items() if k not in ("entries", "tokens_held")})
    return total


def run_modes(pipeline, args: argparse.Namespace) -> list[ModeResult]:
    """``args.rounds`` rounds of one block of ``args.steps`` steps per mode; block ``r`` of every mode
    draws the same seeds (``r * steps * groups`` on from the first training seed)."""
    from roll.rollout.backend import RayBackend
    from roll.rollout.env_clients import RayEnvs
    from roll.rollout.episodes import EpisodeScheduler
    from roll.rollout.router import RolloutRouter

    config = pipeline.config
    own = pipeline.scheduler
    spec, chat, params, pad_id = own.spec, own.chat, own.params, own.pad_id
    own.close()  # the pipeline's own; each block brings its own
    pipeline.scheduler = None
    groups = spec.groups_per_step
    results = {mode: ModeResult(mode, groups * spec.group_size) for mode in args.modes}
    step = 0

    def block(mode: str, seeds, steps: int, id_prefix: str, result: ModeResult | None) -> None:
        """``steps`` steps of ``mode``'s loop on ``seeds``; then its scheduler closed and drained."""
        nonlocal step
        backend = RayBackend(RolloutRouter(pipeline.rollout), pipeline.reward_dispatch())
        envs = RayEnvs(pipeline.role_set.get("environment"))
        if mode == "lockstep":
            scheduler = BatchEpisodes(backend, envs, chat, spec, params, seeds, pad_id, id_prefix)
        else:
            ratio = int(mode.removeprefix("async") or 1) if mode.startswith("async") else 0
            mode_spec = dataclasses.replace(spec, async_generation_ratio=ratio)
            scheduler = EpisodeScheduler(backend, envs, chat, mode_spec, params, seeds, pad_id, id_prefix)
        scheduler.set_weights_version(step)  # what the rollout workers hold now
        pipeline.scheduler = scheduler
        before = prefix_totals(backend.router)
        try:
            for i in range(steps):
                step += 1
                metrics = pipeline.step(step)
                stages = ("rollout", "logprobs", "train", "sync")
                metrics["time/rest_s"] = metrics["time/step_s"] - sum(
                    metrics.get(f"time/{stage}_s", 0.0) for stage in stages
                )
                if result is not None:
                    result.metrics.append(metrics)
                    result.timed_steps.append(i >= args.warmup)
                print(f" {metrics['time/step_s']:.2f}s", end="", flush=True)
            print(flush=True)
        finally:
            scheduler.close()  # async: its turns in flight aborted, its envs closed
            pipeline.scheduler = None
            backend.drain(5.0)  # no open collect may take the next block's results
        if result is not None:
            after = prefix_totals(RolloutRouter(pipeline.rollout))
            result.prefix.update({k: after[k] - before[k] for k in after})

    if args.warmup_steps:
        # Seeds no block plays: the actor's first steps are slow (allocations, first shapes).
        print("[warm-up, lockstep]", end="", flush=True)
        block("lockstep", seed_order(config, 100_000), args.warmup_steps, "w-", None)
    index = itertools.count()
    for round_ in range(args.rounds):
        for mode in args.modes:
            print(f"[round {round_ + 1}: {mode}]", end="", flush=True)
            first = round_ * args.steps * groups
            block(mode, seed_order(config, first), args.steps, f"b{next(index)}-", results[mode])
            again = seed_order(config, first)
            for _ in range(args.steps):
                results[mode].floors.append(env_floors([again.next() for _ in range(groups)], args))
    return list(results.values())


@dataclass
class TurnPrefill:
    episodes: int
    context: float  # mean tokens the turn's request carried
    computed: float  # mean prompt tokens prefilled by the model
    reused: float  # mean prompt tokens whose KV came from the kept prefix


def prefix_part(pipeline, args: argparse.Namespace) -> dict[str, dict[int, TurnPrefill]]:
    """The same seeds played in lockstep with reuse (the pipeline's rollout worker, prefix_cache_tokens
    at its default) and without (a second rollout worker with prefix_cache_tokens 0); per turn index,
    the counters' difference across its generation round."""
    from roll.distributed.cluster import Cluster
    from roll.envs.pool import EnvPool
    from roll.rollout.backend import RayBackend
    from roll.rollout.env_clients import LocalEnvs
    from roll.rollout.router import RolloutRouter
    from roll.workers.rollout import RolloutWorker

    config, own = pipeline.config, pipeline.scheduler
    spec = dataclasses.replace(own.spec, groups_per_step=args.prefix_groups)
    # Its own worker, as the pipeline's were made, keeping no KV between turns.
    no_reuse = Cluster(
        "rollout-no-prefix-reuse",
        RolloutWorker,
        1,
        dataclasses.replace(pipeline.plan.rollout, prefix_cache_tokens=0),
        timeout_s=config.ray.call_timeout_s,
        plugins=config.imports,
    )
    out: dict[str, dict[int, TurnPrefill]] = {}
    try:
        no_reuse.setup()
        for label, cluster in (("reuse", pipeline.rollout), ("no reuse", no_reuse)):
            router = RolloutRouter(cluster)
            backend = RayBackend(router, pipeline.reward_dispatch())
            pool = EnvPool(config.env.name, env_options(args, sleep=False), config.env.step_timeout_s)
            rounds: dict[int, TurnPrefill] = {}
            last = [prefix_totals(router)]

            def on_round(turn: int, contexts: list[int], rounds=rounds, last=last, router=router) -> None:
                now = prefix_totals(router)
                n = len(contexts)
                rounds[turn] = TurnPrefill(
                    n,
                    sum(contexts) / n,
                    (now["prefill_tokens"] - last[0]["prefill_tokens"]) / n,
                    (now["reused_tokens"] - last[0]["reused_tokens"]) / n,
                )
                last[0] = now

            player = BatchEpisodes(
                backend,
                LocalEnvs(pool),
                own.chat,
                spec,
                own.params,
                seed_order(config, 200_000),
                own.pad_id,
                f"p{len(out)}-",
                on_round=on_round,
            )
            player.next_batch(0)
            backend.drain(5.0)
            pool.shutdown()
            out[label] = rounds
    finally:
        no_reuse.kill()
    return out


# --------------------------------------------------------------------------------------------- report


def fmt(value: float, digits: int = 2) -> str:
    return "-" if value != value else f"{value:.{digits}f}"


STAGES = ["time/step_s", "time/rollout_s", "time/train_s", "time/sync_s", "time/rest_s"]


def report(results: list[ModeResult], args: argparse.Namespace) -> str:
    first = results[0]
    timed = (
        f"{len(first.timed('time/step_s'))} steps per mode ({args.rounds} rounds x {args.steps} steps, "
        f"the first {args.warmup} of each block left out)"
    )
    lines = [
        f"### agentic rollout loops, real engine (HF, CPU): {args.groups} seeds x {args.group_size} episodes "
        f"per step, episode length uniform 1..{args.max_turns} turns per seed, env step sleep "
        f"Pareto(shape {args.sleep_shape:g}, min {args.sleep_scale * 1000:g} ms, cap {args.max_sleep:g} s) "
        f"per (seed, turn), {args.env_workers} env workers, {args.rollout_workers} rollout worker(s), model "
        f"{args.params / 1e6:.2f}M params (hidden {args.hidden}, {args.layers} layers); medians of {timed}",
        "",
        f"| mode | episodes/s (all timed steps) | x {first.mode} | episodes/s (median step) | x {first.mode} "
        "| per block (its timed steps) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    base, base_total = first.episodes_per_s(), first.episodes_per_s_total()
    for r in results:
        blocks = ", ".join(f"{v:.1f}" for v in r.per_block(args.steps))
        lines.append(
            f"| {r.mode} | {r.episodes_per_s_total():.1f} | {r.episodes_per_s_total() / base_total:.2f} "
            f"| {r.episodes_per_s():.1f} | {r.episodes_per_s() / base:.2f} | {blocks} |"
        )
    lines += [
        "",
        "where the time goes (s, medians of timed steps): rollout = waiting for next_batch, rest = the step "
        "less rollout, train and sync; lockstep's rollout split into its waits for generation and for the "
        "envs; env call: mean time from sending an episode's env step to taking its result (env/step_s)",
        "",
        "| mode | "
        + " | ".join(k.split("/")[1][:-2] for k in STAGES)
        + " | gen wait | env wait | env call |",
        "| --- " * (len(STAGES) + 4) + "|",
    ]
    for r in results:
        cells = [fmt(r.median(k)) for k in [*STAGES, "rollout/generate_wait_s", "rollout/env_wait_s"]]
        lines.append(f"| {r.mode} | " + " | ".join(cells) + f" | {fmt(r.median('env/step_s'), 3)} |")
    lines += [
        "",
        "what the episodes did (means over timed steps): turns per episode, stop reasons, staleness "
        "(weights versions behind; max), groups aborted as stale, episodes aborted; and the rollout "
        "workers' prefix counters over the mode's blocks: prompt tokens prefilled per turn request, the "
        "share of prompt tokens reused from kept KV, hits / misses",
        "",
        "| mode | turns | env_done | turn_truncated | staleness | stale groups | aborted episodes "
        "| prefill/turn | reused | hits / misses |",
        "| --- " * 10 + "|",
    ]
    for r in results:
        p = r.prefix
        requests = p["hits"] + p["misses"]
        computed, reused = p["prefill_tokens"], p["reused_tokens"]
        stale_max = max(r.timed("rollout/staleness_max"), default=0)
        lines.append(
            f"| {r.mode} | {fmt(r.mean('episode/turns'))} | {r.mean('episode/stop/env_done'):.1%}"
            f" | {r.mean('episode/stop/turn_truncated'):.1%}"
            f" | {fmt(r.mean('rollout/staleness_mean'))} ({stale_max:g})"
            f" | {sum(r.timed('rollout/stale_groups')):g} | {sum(r.timed('rollout/aborted_episodes')):g}"
            f" | {computed / max(requests, 1):.1f} | {reused / max(computed + reused, 1):.0%}"
            f" | {p['hits']} / {p['misses']} |"
        )
    lines += [
        "",
        "every step in run order, (left out), times in s; floor: what the env's sleeps alone cost the "
        "step's seeds in lockstep (sum over turns of the slowest live env) and at best in the scheduler "
        "(the slowest group's sum)",
        "",
    ]

    def row(label: str, cells: list[str], timed_steps: list[bool]) -> str:
        shown = [cell if timed else f"({cell})" for cell, timed in zip(cells, timed_steps)]
        return f"  {label:20s}" + " ".join(f"{cell:>7s}" for cell in shown)

    lines.append(row("floor lockstep", [f"{f[0]:.2f}" for f in first.floors], first.timed_steps))
    lines.append(row("floor scheduler", [f"{f[1]:.2f}" for f in first.floors], first.timed_steps))
    for r in results:
        for key in ("step", "rollout", "train"):
            cells = [f"{m[f'time/{key}_s']:.2f}" for m in r.metrics]
            lines.append(row(f"{r.mode} {key}", cells, r.timed_steps))
    return "\n".join(lines)


def prefix_report(rounds: dict[str, dict[int, TurnPrefill]], args: argparse.Namespace) -> str:
    reuse, none = rounds["reuse"], rounds["no reuse"]
    lines = [
        f"### prefill per turn: {args.prefix_groups} seeds x {args.group_size} episodes in lockstep, "
        "the rollout worker's counters across each turn's generation round (means per episode, tokens)",
        "",
        "| turn k | episodes | context (reuse) | prefilled with reuse | reused | context (no reuse) "
        "| prefilled without reuse | without / with |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k in sorted(set(reuse) | set(none)):
        a, b = reuse.get(k), none.get(k)
        cells = [
            str(a.episodes if a else b.episodes),
            fmt(a.context, 1) if a else "-",
            fmt(a.computed, 1) if a else "-",
            fmt(a.reused, 1) if a else "-",
            fmt(b.context, 1) if b else "-",
            fmt(b.computed, 1) if b else "-",
            fmt(b.computed / a.computed, 1) if a and b and a.computed else "-",
        ]
        lines.append(f"| {k + 1} | " + " | ".join(cells) + " |")
    total_a = sum(t.computed * t.episodes for t in reuse.values())
    total_b = sum(t.computed * t.episodes for t in none.values())
    lines += [
        "",
        f"all turns: {total_a:.0f} tokens prefilled with reuse, {total_b:.0f} without "
        f"({total_b / max(total_a, 1):.1f}x)",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated, in order: " + ", ".join(MODES)
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of one block per mode, in turn")
    parser.add_argument("--steps", type=int, default=3, help="steps per block (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="leading steps of each block left out")
    parser.add_argument(
        "--warmup-steps", type=int, default=1, help="untimed lockstep steps before the blocks"
    )
    parser.add_argument("--groups", type=int, default=8, help="seeds (groups) per step")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per seed")
    parser.add_argument("--max-turns", type=int, default=12, help="episode lengths: uniform 1..this")
    parser.add_argument("--sleep-scale", type=float, default=0.02, help="env step sleep: Pareto minimum, s")
    parser.add_argument("--sleep-shape", type=float, default=1.2, help="env step sleep: Pareto shape")
    parser.add_argument("--max-sleep", type=float, default=2.0, help="env step sleep: cap, s")
    parser.add_argument("--obs-chars", type=int, default=16, help="characters of an observation")
    parser.add_argument(
        "--max-new-tokens", type=int, default=32, help="tokens per turn (rollout.max_new_tokens)"
    )
    parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="actor.micro_batch_tokens")
    parser.add_argument("--hidden", type=int, default=128, help="model width (MLP: 4x)")
    parser.add_argument("--layers", type=int, default=2, help="model depth")
    parser.add_argument("--env-workers", type=int, default=4)
    parser.add_argument("--rollout-workers", type=int, default=1)
    parser.add_argument("--prefix", action=argparse.BooleanOptionalAction, default=True, help="prefill part")
    parser.add_argument("--prefix-groups", type=int, default=8, help="prefix part: seeds (x group size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output-dir", default=None, help="where the run writes (default: a temp dir, removed)"
    )
    parser.add_argument("--json", default=None, help="also write every step's metrics to this file")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        parser.error(f"--modes: choose from {', '.join(MODES)}")
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be below --steps")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(REPO)  # the Ray workers import benchmarks.agentic_env from the driver's directory
    # Ray's workers inherit it: transformers' deprecation notices from the engine would break up the output.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import ray

    from benchmarks.rollout import count_parameters, machine_note  # the RLVR benchmark's, shared
    from roll.pipelines.agentic import AgenticPipeline

    root = Path(args.output_dir or tempfile.mkdtemp(prefix="roll-agentic-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    prefill = None
    try:
        total = args.warmup_steps + args.rounds * len(args.modes) * args.steps
        config = load_benchmark_config(args, root / "run", total)
        start = time.perf_counter()
        pipeline = AgenticPipeline(config)
        args.params = count_parameters(pipeline.model_path)
        print(f"pipeline ready in {time.perf_counter() - start:.1f} s", flush=True)
        try:
            if args.prefix:
                start = time.perf_counter()
                prefill = prefix_part(pipeline, args)
                print(f"prefix part in {time.perf_counter() - start:.1f} s", flush=True)
            results = run_modes(pipeline, args)
        finally:
            pipeline.shutdown()
            ray.shutdown()
    finally:
        if args.output_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(machine_note())
    print()
    print(report(results, args))
    if prefill is not None:
        print()
        print(prefix_report(prefill, args))
    if args.json:
        dump = {
            "modes": {
                r.mode: {"metrics": r.metrics, "timed": r.timed_steps, "floors": r.floors, "prefix": r.prefix}
                for r in results
            },
            "prefill_per_turn": {
                label: {k + 1: dataclasses.asdict(t) for k, t in rounds.items()}
                for label, rounds in (prefill or {}).items()
            },
        }
        Path(args.json).write_text(json.dumps(dump, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
