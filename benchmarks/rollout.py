"""Benchmark: a long-tail RLVR workload through three rollout loops, side by side in one run.

What is measured: training samples per second of ``RLVRPipeline.step`` (rollout, logprobs, train,
weight sync) when each step's batch comes from

1. ``batch``: the loop before the rollout scheduler. Every request of the step is sent at once, split
   contiguously over the rollout workers as batch generation splits a batch (worker 0 takes the first
   share of the prompts), and the step waits for all of them; then the whole batch is scored in one
   reward call (one share per reward worker); then the actor trains and the weights are synced.
   ``BatchRollout`` below, with the scheduler's ``next_batch`` / ``set_weights_version`` / ``close``
   and the batch fields of ``RolloutScheduler._assemble``, swapped in as ``pipeline.scheduler``.
2. ``scheduler``: ``roll.rollout.scheduler.RolloutScheduler``, synchronous
   (``rollout.async_generation_ratio=0``): each response is scored as soon as it is generated, while the
   rest still generate.
3. ``async``: the same scheduler with ``rollout.async_generation_ratio=1``: the next batch generates
   (and is scored) while the actor trains on this one, samples at most one weight version old.

The workload: ``examples/quickstart.yaml`` (8 prompts x 8 samples per step, GRPO, no SFT warm start, no
evaluation) with these changes.

- Long-tail token budgets: every dataset row (the quickstart's addition prompts, the first ``--rows``
  512, written with a ``budget`` field to a JSONL file in a temporary directory) carries its own
  ``max_new_tokens``, drawn from a Pareto distribution (``--pareto-shape`` 1.2, minimum ``--min-tokens``
  16, capped at ``--max-tokens`` 128, seeded): the median row wants about 28 tokens, one in twelve
  the cap; four batches in five hold a prompt that wants 64 or more, half of them one at the cap. The
  scheduler gets the budgets through ``params_for``; all 8 samples of a prompt share its budget. (With
  the minimum at 4 most responses are a handful of tokens and the 20 ms reward, not generation, is most
  of the rollout: ``--min-tokens 4`` shows it.)
- A random model whose responses run to their budget and whose decoding is latency-bound: the
  quickstart's hidden size 128 with 6 layers (``--hidden``, ``--layers``; MLP 4x; 1.6M parameters),
  and a character alphabet widened by 1000 CJK characters, so that the model samples EOS about once in
  a thousand tokens (the quickstart's 11 characters would end most responses within 20 tokens).
  ``rollout.max_new_tokens`` is the cap; ``actor.micro_batch_tokens=1024`` (``--micro-batch-tokens``)
  trains in micro-batches of real tokens, so a short response is not trained at the width of the
  longest one.
- A slow reward: ``benchmarks/rollout_reward.py`` sleeps 20 ms per response (as a sandboxed code
  reward waits on its sandbox; the sleep holds no core), registered as ``slow_digits`` and imported by
  the Ray workers through the config's ``imports:``; 2 reward workers (``--reward-workers``), 1
  rollout worker (``--rollout-workers``).

One pipeline (Ray workers for actor, rollout and reward, all on CPU without device mappings: the
disaggregated layout ``check_async_generation`` accepts on a machine without GPUs) serves every mode:
its own scheduler is closed and each mode's is swapped in. The loaded config has
``rollout.async_generation_ratio=1``, so that layout is validated as it would be for an async run.
First ``--warmup-steps`` (2) steps with every response at the cap, untimed: the actor's first long
batch costs it several times what later ones do. Then ``--rounds`` (3) rounds, each one block of
``--steps`` (5) steps per mode in turn (batch, scheduler, async), so that a change in the machine's
load (these machines are shared) hits every mode alike; block r of every mode trains on the same
prompts, hence the same budgets, in the same order (batches ``r * steps`` onwards of the seeded
dataset order), and the first ``--warmup`` (1) step of each block is left out (async: the first batch
has nothing generated ahead). Weight versions (the step numbers) run on across blocks. An async block
leaves requests in flight when it closes; they are aborted and awaited before the next block starts.

Reported per mode: samples per second (samples per step over the median step time; also over the
summed time of all timed steps, which is what an async run averages to) and the ratio of each to
``batch``; where the time goes (medians): the pipeline's ``time/<stage>_s`` (rollout = waiting for
``next_batch``, train, sync; rest = the step less those and the logprobs pass, which this recipe
skips) and the rollout's per-sample stage times ``rollout/queue_s`` (waiting for a worker),
``rollout/generate_s`` (sent to generated; in ``batch`` mode until the whole batch is generated, when
batch generation hands results on), ``rollout/reward_s`` (sent to a reward worker to scored) and
``rollout/ready_wait_s`` (scored to handed to the trainer); response lengths, staleness, the share of
requests aborted and the groups dropped as stale; and every step's times, with each step's longest
budget.

``--fake``: the same three modes with a latency-simulating fake engine in place of the rollout
workers' generation (``FakeEngineBackend``; "fake engine" in the output). Each request takes
``--fake-token-ms`` (default 10, about what the real engine takes per decode step on a CPU) per token of
its budget in real time, however many run at once (a GPU decoding a small batch), holds no core and
returns random characters; an abort returns the tokens made so far; each token carries the weights
version in force when it was sampled. Rewards, training, weight sync (to the idle real rollout worker)
and the warm-up steps stay real. With no core shared between generation and training, it shows what
the loops gain where generation has hardware of its own.

Run from the repository root (the Ray workers import ``benchmarks.rollout_reward`` from there)::

    python benchmarks/rollout.py [--fake] [--rounds 3] [--steps 5] [--warmup 1]
        [--modes batch,scheduler,async] [--reward-workers 2] [--min-tokens 16] [--json FILE]

It takes minutes on a CPU (Ray and the workers start once). Ray starts locally unless
``RAY_ADDRESS`` names a cluster to join.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import heapq
import itertools
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from roll.distributed.cluster import wait_any
from roll.rollout.backend import Events, RewardDispatch, RolloutBackend, ScoreJob
from roll.rollout.lifecycle import Sample, SampleState, stage_seconds
from roll.strategies.requests import GenerateRequest, GenerateResult

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "examples" / "quickstart.yaml"
TRAIN_ROWS = REPO / "examples" / "data" / "addition" / "train.jsonl"
REWARD_MODULE = "benchmarks.rollout_reward"
REWARD_NAME = "slow_digits"  # benchmarks/rollout_reward.py
MODES = ("batch", "scheduler", "async")

# The quickstart's alphabet plus 1000 CJK characters: a random model then samples EOS about once in a
# thousand tokens, so responses run to their budget.
ALPHABET = "0123456789+" + "".join(chr(0x4E00 + i) for i in range(1000))

# No SFT warm start, no evaluation (and no held-out set to load).
COMMON_OVERRIDES = ["sft_warm_start=null", "eval.every_steps=0", "data.eval_path=null"]


# --------------------------------------------------------------------------------------------- workload


def pareto_budgets(count: int, shape: float, minimum: int, cap: int, seed: int) -> list[int]:
    """``count`` token budgets: Pareto(``shape``) scaled to ``minimum``, floored, capped at ``cap``."""
    rng = random.Random(f"benchmarks.rollout:{seed}")
    return [min(cap, int(minimum * (1.0 - rng.random()) ** (-1.0 / shape))) for _ in range(count)]


def write_dataset(path: Path, args: argparse.Namespace) -> list[int]:
    """The quickstart's addition rows, each with a ``budget`` field, as JSONL at ``path``."""
    rows = [json.loads(line) for line in TRAIN_ROWS.read_text().splitlines() if line.strip()]
    rows = rows[: args.rows]
    budgets = pareto_budgets(len(rows), args.pareto_shape, args.min_tokens, args.max_tokens, args.seed)
    path.write_text("".join(json.dumps({**row, "budget": b}) + "\n" for row, b in zip(rows, budgets)))
    return budgets


def load_benchmark_config(args: argparse.Namespace, data_path: Path, output_dir: Path, total_steps: int):
    from roll.config.loader import load_config

    prompt_tokens = 10  # the quickstart's data.max_prompt_length
    overrides = [
        *COMMON_OVERRIDES,
        f"output_dir={output_dir}",
        f"steps={total_steps}",
        f"seed={args.seed}",
        f"imports=[{REWARD_MODULE}]",
        f"reward={REWARD_NAME}",
        f"data.train_path={data_path}",
        f"data.max_prompt_length={prompt_tokens}",
        f"model.tiny.alphabet={ALPHABET}",
        f"model.tiny.max_position_embeddings={prompt_tokens + args.max_tokens}",
        f"model.tiny.hidden_size={args.hidden}",
        f"model.tiny.num_hidden_layers={args.layers}",
        f"model.tiny.intermediate_size={4 * args.hidden}",
        f"rollout.max_new_tokens={args.max_tokens}",
        f"rollout.rollout_batch_size={args.prompts}",
        f"rollout.num_return_sequences={args.group_size}",
        f"rollout.world_size={args.rollout_workers}",
        f"reward_world_size={args.reward_workers}",
        # Validated as an async run: actor and rollout on CPU workers, apart (no device mappings).
        "rollout.async_generation_ratio=1",
        "actor.lr_scheduler=constant",  # the modes run one after another: the same LR for all
        # Micro-batches by real tokens: a long response's group is not trained at the width of the rest.
        f"actor.micro_batch_tokens={args.micro_batch_tokens}",
    ]
    return load_config(QUICKSTART, overrides)


# ------------------------------------------------------------------------------------ the batch loop


_BATCH_CALLS = itertools.count()  # request ids stay unique across BatchRollout objects


@dataclass
class _Group:
    prompt_index: int
    params: Any  # SamplingParams
    samples: list = field(default_factory=list)  # roll.rollout.lifecycle.Sample


class BatchRollout:
    """The rollout loop before the scheduler, behind the scheduler's interface.

    ``next_batch``: draw ``rollout_batch_size`` prompts, send every request at once (the prompts split
    contiguously over the rollout workers, as batch generation splits a batch), wait for all; score
    every response in one reward call (``backend.score`` sends one share per reward worker), wait;
    then the batch, laid out as ``RolloutScheduler._assemble`` lays it out, and the same rollout
    metrics. Samples go through the same lifecycle states, so ``rollout/generate_s`` is, as batch
    generation hands results on, the time until the whole batch is generated.
    """

    def __init__(self, backend, prompts, prompt_order, spec, params, tokenizer, params_for=None, poll_s=0.02):
        self.backend, self.prompts, self.prompt_order = backend, prompts, prompt_order
        self.spec, self.params, self.tokenizer = spec, params, tokenizer
        self.params_for = params_for or (lambda row: params)
        self.pad_id = tokenizer.pad_token_id
        self.poll_s = poll_s
        self.weights_version = 0

    def next_batch(self, step: int):
        S = SampleState
        call = next(_BATCH_CALLS)
        groups = []
        for g, index in enumerate(self.prompt_order.next_indices()):
            group = _Group(index, self.params_for(self.prompts.rows[index]))
            group.samples = [
                Sample(f"batch{call}-{g}-{k}", g, k) for k in range(self.spec.num_return_sequences)
            ]
            groups.append(group)
        workers = self.backend.num_workers
        start = time.monotonic()
        per_worker: dict[int, list] = defaultdict(list)
        for g, group in enumerate(groups):
            worker = g * workers // len(groups)  # contiguous shares, worker 0 first
            ids = self.prompts.token_ids[group.prompt_index]
            for sample in group.samples:
                sample.times[S.QUEUED] = start
                sample.move(S.GENERATING, start)
                per_worker[worker].append(GenerateRequest(sample.request_id, ids, group.params))
        for worker, requests in per_worker.items():
            self.backend.submit(worker, requests)
        waiting = {s.request_id: s for group in groups for s in group.samples}
        while waiting:
            events = self.backend.poll(self.poll_s)
            for result in events.generated:
                if result.finish_reason == "abort":
                    raise RuntimeError(f"request {result.request_id} was aborted by the engine")
                waiting.pop(result.request_id).result = result
        generated = time.monotonic()
        jobs = []
        for group in groups:
            for sample in group.samples:
                sample.response_text = self.tokenizer.decode(
                    sample.result.token_ids, skip_special_tokens=True
                )
                sample.move(S.REWARDING, generated)
                jobs.append(
                    ScoreJob(
                        sample.request_id,
                        self.prompts.texts[group.prompt_index],
                        sample.response_text,
                        self.prompts.rows[group.prompt_index],
                        list(sample.result.token_ids),
                    )
                )
        self.backend.score(jobs)
        waiting = {s.request_id: s for group in groups for s in group.samples}
        while waiting:
            events = self.backend.poll(self.poll_s)
            now = time.monotonic()
            for scored in events.scored:
                sample = waiting.pop(scored.request_id)
                sample.score, sample.token_rewards = scored.score, scored.token_rewards
                sample.move(S.DONE, now)
        return self._assemble(groups), self._metrics(groups)

    def set_weights_version(self, version: int) -> None:
        self.weights_version = version

    def close(self) -> None:
        pass  # nothing runs between two next_batch calls

    def _assemble(self, groups: list[_Group]):
        """The fields and layout of the scheduler's batches (``roll.rollout.group_batch.assemble_batch``)."""
        from roll.rollout.group_batch import assemble_batch

        return assemble_batch(groups, self.prompts, self.pad_id, self.params.max_new_tokens)

    def _metrics(self, groups: list[_Group]) -> dict[str, float]:
        now = time.monotonic()
        samples = [s for g in groups for s in g.samples]
        stages: dict[str, list[float]] = defaultdict(list)
        for sample in samples:
            for stage, seconds in stage_seconds(sample).items():
                stages[stage].append(seconds)
            stages["ready_wait"].append(now - sample.times[SampleState.DONE])
        staleness = [
            self.weights_version - min(s.result.weight_versions, default=self.weights_version)
            for s in samples
        ]
        return {
            "rollout/prompts_per_step": float(len(groups)),
            "rollout/filtered_frac": 0.0,
            "rollout/aborted_frac": 0.0,
            "rollout/stale_groups": 0.0,
            "rollout/fallback_groups": 0.0,
            "rollout/staleness_mean": sum(staleness) / len(staleness),
            "rollout/staleness_max": float(max(staleness)),
            **{f"rollout/{stage}_s": sum(v) / len(v) for stage, v in stages.items()},
        }


# ------------------------------------------------------------------------------------- the fake engine


class FakeEngineBackend(RolloutBackend):
    """A ``RolloutBackend`` whose generation is simulated in real time; rewards go to the pipeline's real
    scorers (``rewards``: its reward workers, or the controller for rewards scored there).

    A request sent at time t ends at t + budget x ``token_s`` (its ``max_new_tokens``: every response
    runs to its budget, finish reason "length"), however many run at once, without using a core. An
    abort ends it at once with the tokens made so far. Token k carries the weights version in force
    when it was sampled (``set_version`` records each change)."""

    def __init__(self, rewards: RewardDispatch, num_workers: int, token_s: float, token_ids: Sequence[int]):
        self.rewards, self.num_workers = rewards, num_workers
        self.token_s, self.token_ids = token_s, list(token_ids)
        self.logprob = -math.log(len(self.token_ids))
        self.rng = random.Random(0)
        self._lock = threading.Lock()
        self._versions: list[tuple[float, int]] = [(-math.inf, 0)]
        self._running: dict[str, tuple[float, Any]] = {}  # request id -> (start, request)
        self._ends: list[tuple[float, int, str]] = []  # heap of (end time, order, request id)
        self._order = itertools.count()
        self._done: list = []  # results ready for the next poll (aborts)

    def set_version(self, version: int) -> None:
        with self._lock:
            self._versions.append((time.monotonic(), version))

    def submit(self, worker: int, requests) -> None:
        now = time.monotonic()
        with self._lock:
            for request in requests:
                self._running[request.request_id] = (now, request)
                end = now + request.params.max_new_tokens * self.token_s
                heapq.heappush(self._ends, (end, next(self._order), request.request_id))

    def abort(self, worker: int, request_ids) -> None:
        now = time.monotonic()
        with self._lock:
            for request_id in request_ids:
                if request_id in self._running:
                    start, request = self._running.pop(request_id)
                    made = min(int((now - start) / self.token_s), request.params.max_new_tokens)
                    self._done.append(self._result(request, start, made, "abort"))

    def score(self, jobs) -> None:
        self.rewards.send(jobs)

    def poll(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            events = Events(scored=self.rewards.take_ready())
            now = time.monotonic()
            with self._lock:
                events.generated, self._done = self._done, []
                while self._ends and self._ends[0][0] <= now:
                    _, _, request_id = heapq.heappop(self._ends)
                    if request_id in self._running:  # not aborted
                        start, request = self._running.pop(request_id)
                        budget = request.params.max_new_tokens
                        events.generated.append(self._result(request, start, budget, "length"))
                next_end = self._ends[0][0] if self._ends else math.inf
            for future in wait_any(list(self.rewards.calls), 0):
                events.scored += self.rewards.take(future)
            if events.generated or events.scored or now >= deadline:
                return events
            wait = max(min(deadline, next_end) - now, 0.0)
            if self.rewards.calls:
                wait_any(list(self.rewards.calls), wait)
            else:
                time.sleep(wait)

    def _result(self, request, start: float, tokens: int, reason: str):
        times = [start + (k + 1) * self.token_s for k in range(tokens)]
        moments = [t for t, _ in self._versions]
        versions = [self._versions[bisect.bisect_right(moments, t) - 1][1] for t in times]
        ids = [self.rng.choice(self.token_ids) for _ in range(tokens)]
        return GenerateResult(request.request_id, ids, [self.logprob] * tokens, reason, versions)


class VersionTap:
    """Passes the pipeline's calls to a scheduler and tells the fake engine each new weights version."""

    def __init__(self, inner, engine: FakeEngineBackend):
        self.inner, self.engine = inner, engine

    def next_batch(self, step: int):
        return self.inner.next_batch(step)

    def set_weights_version(self, version: int) -> None:
        self.engine.set_version(version)
        self.inner.set_weights_version(version)

    def close(self) -> None:
        self.inner.close()


# ------------------------------------------------------------------------------------------------ runs


@dataclass
class ModeResult:
    mode: str
    samples_per_step: int
    metrics: list[dict[str, float]] = field(default_factory=list)
    timed_steps: list[bool] = field(default_factory=list)  # False: a warm-up step of its block
    max_budget: list[int] = field(default_factory=list)  # longest budget in each step's batch

    def timed(self, key: str) -> list[float]:
        return [m[key] for m, timed in zip(self.metrics, self.timed_steps) if timed and key in m]

    def median(self, key: str) -> float:
        values = self.timed(key)
        return statistics.median(values) if values else float("nan")

    def samples_per_s(self) -> float:
        return self.samples_per_step / self.median("time/step_s")

    def samples_per_s_total(self) -> float:
        steps = self.timed("time/step_s")
        return self.samples_per_step * len(steps) / sum(steps) if steps else float("nan")


def run_modes(pipeline, args: argparse.Namespace) -> list[ModeResult]:
    """``args.rounds`` rounds of one block of ``args.steps`` steps per mode; block ``r`` of every mode
    trains on the same prompts (batches ``r * steps`` onwards of the seeded order)."""
    from roll.data.dataset import PromptIterator
    from roll.rollout.backend import RayBackend
    from roll.rollout.router import RolloutRouter
    from roll.rollout.scheduler import RolloutScheduler

    config, plan = pipeline.config, pipeline.plan
    sampling = plan.sampling
    rows = pipeline.train_prompts.rows
    by_budget: dict[int, Any] = {}

    def params_for(row: dict):
        budget = int(row["budget"])
        if budget not in by_budget:
            by_budget[budget] = dataclasses.replace(sampling, max_new_tokens=budget)
        return by_budget[budget]

    def prompt_order(skip_batches: int, seed: int = config.seed) -> PromptIterator:
        order = PromptIterator(rows, plan.prompts_per_step, seed=seed)
        for _ in range(skip_batches):
            order.next_indices()
        return order

    pipeline.scheduler.close()  # the pipeline's own; each block brings its own
    # One router for every block (one collect_finished call open per rollout worker), a backend per
    # block: reward calls a closed scheduler left in flight end in its own backend, unread.
    router = RolloutRouter(pipeline.rollout)
    alphabet_ids = pipeline.tokenizer.convert_tokens_to_ids(list(ALPHABET))
    samples = plan.prompts_per_step * plan.samples_per_prompt
    step = 0
    if args.warmup_steps:
        # Every response at the cap: the actor meets the longest sequences before any mode is timed (the
        # first long batch costs it several times what later ones do).
        order = prompt_order(0, seed=config.seed + 1)
        pipeline.scheduler = BatchRollout(
            RayBackend(router, pipeline.reward_dispatch()),
            pipeline.train_prompts,
            order,
            plan.scheduler,
            sampling,
            pipeline.tokenizer,
        )
        print(f"[warm-up, every budget {sampling.max_new_tokens}]", end="", flush=True)
        for _ in range(args.warmup_steps):
            step += 1
            print(f" {pipeline.step(step)['time/step_s']:.2f}s", end="", flush=True)
        print(flush=True)
        pipeline.scheduler = None
    results = {mode: ModeResult(mode, samples) for mode in args.modes}
    for round_ in range(args.rounds):
        for mode in args.modes:
            if args.fake:
                backend = FakeEngineBackend(
                    pipeline.reward_dispatch(),
                    config.rollout.world_size,
                    args.fake_token_ms / 1000,
                    alphabet_ids,
                )
                backend.set_version(step)
            else:
                backend = RayBackend(router, pipeline.reward_dispatch())
            order = prompt_order(round_ * args.steps)
            common = (backend, pipeline.train_prompts, order)
            if mode == "batch":
                scheduler = BatchRollout(*common, plan.scheduler, sampling, pipeline.tokenizer, params_for)
            else:
                spec = dataclasses.replace(plan.scheduler, async_generation_ratio=int(mode == "async"))
                scheduler = RolloutScheduler(
                    *common, spec, sampling, pipeline.tokenizer, params_for=params_for
                )
            scheduler.set_weights_version(step)  # what the rollout workers hold now
            pipeline.scheduler = VersionTap(scheduler, backend) if args.fake else scheduler
            result = results[mode]
            label = f"{mode} (fake engine)" if args.fake else mode
            print(f"[round {round_ + 1}: {label}]", end="", flush=True)
            try:
                for i in range(args.steps):
                    step += 1
                    metrics = pipeline.step(step)
                    stages = ("rollout", "logprobs", "train", "sync")
                    metrics["time/rest_s"] = metrics["time/step_s"] - sum(
                        metrics.get(f"time/{stage}_s", 0.0) for stage in stages
                    )
                    result.metrics.append(metrics)
                    result.timed_steps.append(i >= args.warmup)
                    print(f" {metrics['time/step_s']:.2f}s", end="", flush=True)
                print(flush=True)
            finally:
                pipeline.scheduler.close()
                pipeline.scheduler = None
            if isinstance(scheduler, RolloutScheduler) and not args.fake:
                drain(scheduler, backend)
            again = prompt_order(round_ * args.steps)
            result.max_budget += [
                max(int(rows[i]["budget"]) for i in again.next_indices()) for _ in range(args.steps)
            ]
    return list(results.values())


def drain(scheduler, backend, timeout_s: float = 60.0) -> None:
    """Wait until every request a closed scheduler sent has come back from the rollout workers (an
    async scheduler aborts those in flight when it closes), so that none reaches the next block's
    scheduler through the shared router. Its reward calls still in flight are left to finish alone."""
    deadline = time.monotonic() + timeout_s
    while any(scheduler.balancer.in_flight()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"requests still in flight {timeout_s} s after the scheduler closed")
        for result in backend.poll(0.1).generated:
            scheduler.balancer.finish(result.request_id)


# --------------------------------------------------------------------------------------------- report


def machine_note() -> str:
    import ray
    import transformers

    return (
        f"machine: {os.cpu_count()} CPU cores, {platform.machine()}, python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, ray {ray.__version__}"
    )


def count_parameters(model_dir: str) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return sum(p.numel() for p in model.parameters())


def fmt(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds:.3f}"


STAGES = ["time/step_s", "time/rollout_s", "time/train_s", "time/sync_s", "time/rest_s"]
ROLLOUT = ["rollout/queue_s", "rollout/generate_s", "rollout/reward_s", "rollout/ready_wait_s"]


def report(results: list[ModeResult], args: argparse.Namespace, budgets: list[int]) -> str:
    first = results[0]
    engine = (
        f"fake engine ({args.fake_token_ms:g} ms per token, no CPU)" if args.fake else "real engine (HF, CPU)"
    )
    timed = (
        f"{len(first.timed('time/step_s'))} steps per mode ({args.rounds} rounds x {args.steps} steps, "
        f"the first {args.warmup} of each block left out)"
    )
    tail = sorted(budgets)
    lines = [
        f"### rollout loops, {engine}: {args.prompts} prompts x {args.group_size} samples per step, "
        f"token budgets Pareto(shape {args.pareto_shape:g}, min {args.min_tokens}, cap {args.max_tokens}) "
        f"(dataset median {statistics.median(tail):g}, p90 {tail[int(0.9 * len(tail))]}, "
        f"mean {statistics.mean(tail):.1f}), reward {REWARD_NAME} 20 ms per response, "
        f"{args.rollout_workers} rollout / {args.reward_workers} reward worker(s), model "
        f"{args.params / 1e6:.2f}M params (hidden {args.hidden}, {args.layers} layers); medians of {timed}",
        "",
        f"| mode | samples/s (median step) | x {first.mode} | samples/s (all timed steps) | x {first.mode} |",
        "| --- | --- | --- | --- | --- |",
    ]
    base, base_total = first.samples_per_s(), first.samples_per_s_total()

    def label(r: ModeResult) -> str:
        return f"{r.mode} (fake engine)" if args.fake else r.mode

    for r in results:
        lines.append(
            f"| {label(r)} | {r.samples_per_s():.1f} | {r.samples_per_s() / base:.2f} "
            f"| {r.samples_per_s_total():.1f} | {r.samples_per_s_total() / base_total:.2f} |"
        )
    lines += [
        "",
        "where the time goes (s, medians; rollout/* are per-sample means of each step; aborted: mean share "
        "of the requests sent, stale groups: total dropped for staleness):",
        "",
        "| mode | "
        + " | ".join(k.split("/")[1][:-2] for k in STAGES + ROLLOUT)
        + " | resp tokens | staleness | aborted | stale groups |",
        "| --- " * (len(STAGES) + len(ROLLOUT) + 5) + "|",
    ]
    for r in results:
        cells = [fmt(r.median(k)) for k in STAGES + ROLLOUT]
        lines.append(
            f"| {label(r)} | "
            + " | ".join(cells)
            + f" | {r.median('response/length_mean'):.1f} | {r.median('rollout/staleness_mean'):.2f}"
            + f" | {statistics.mean(r.timed('rollout/aborted_frac')):.1%}"
            + f" | {sum(r.timed('rollout/stale_groups')):g} |"
        )
    lines += [
        "",
        "every step in run order, (left out): the longest budget in its batch (the same in every mode) "
        "and its times (s)",
        "",
    ]

    def row(label: str, cells: list[str], timed_steps: list[bool]) -> str:
        shown = [cell if timed else f"({cell})" for cell, timed in zip(cells, timed_steps)]
        return f"  {label:18s}" + " ".join(f"{cell:>6s}" for cell in shown)

    lines.append(row("budget", [str(b) for b in first.max_budget], first.timed_steps))
    for r in results:
        for key in ("step", "rollout", "train"):
            cells = [f"{m[f'time/{key}_s']:.2f}" for m in r.metrics]
            lines.append(row(f"{r.mode} {key}", cells, r.timed_steps))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fake", action="store_true", help="a latency-simulating fake engine generates")
    parser.add_argument("--fake-token-ms", type=float, default=10.0, help="fake engine: ms per token")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated, in order: " + ", ".join(MODES)
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of one block per mode, in turn")
    parser.add_argument("--steps", type=int, default=5, help="steps per block (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="leading steps of each block left out")
    parser.add_argument(
        "--warmup-steps", type=int, default=2, help="steps before the first mode, every response at the cap"
    )
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (rollout_batch_size)")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--pareto-shape", type=float, default=1.2)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128, help="model width (MLP: 4x)")
    parser.add_argument("--layers", type=int, default=6, help="model depth")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024, help="actor.micro_batch_tokens")
    parser.add_argument("--rows", type=int, default=512, help="dataset rows (prompts) written")
    parser.add_argument("--rollout-workers", type=int, default=1)
    parser.add_argument("--reward-workers", type=int, default=2)
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
    os.chdir(REPO)  # the Ray workers import benchmarks.rollout_reward from the driver's directory
    # Ray's workers inherit it: transformers' deprecation notices from the engine would break up the output.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import ray

    from roll.pipelines.rlvr import RLVRPipeline

    root = Path(args.output_dir or tempfile.mkdtemp(prefix="roll-rollout-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        budgets = write_dataset(root / "train.jsonl", args)
        config = load_benchmark_config(
            args,
            root / "train.jsonl",
            root / "run",
            args.warmup_steps + args.rounds * len(args.modes) * args.steps,
        )
        start = time.perf_counter()
        pipeline = RLVRPipeline(config)
        args.params = count_parameters(pipeline.model_path)
        print(f"pipeline ready in {time.perf_counter() - start:.1f} s", flush=True)
        try:
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
    print(report(results, args, budgets))
    if args.json:
        dump = {
            r.mode: {"metrics": r.metrics, "timed": r.timed_steps, "max_budget": r.max_budget}
            for r in results
        }
        Path(args.json).write_text(json.dumps(dump, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
