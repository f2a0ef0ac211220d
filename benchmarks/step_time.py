"""Benchmark: one RLVR training step of ROLL against TRL's ``GRPOTrainer``, side by side in one run.

These machines are noisy (other jobs share them), so the two frameworks are only ever compared within
one run of this script, on the same model and data. Two modes (``--mode``):

* ``standalone`` (the default, what a user sees): each framework runs alone, as a user runs ``roll
  train`` or a TRL script. Blocks of steps alternate, ROLL, TRL, ROLL, TRL, ... (``--blocks``, 3 each
  by default), and no process of the other framework is alive during a block: a ROLL block starts Ray
  and its workers and shuts them all down at its end; a TRL block is a child process at the niceness a
  user's script has (0). The report gives each block's median step, the ratio of the medians of the
  block medians, and their spread, so a change in the machine's load shows as a spread, not as a ratio.
* ``interleaved`` (a secondary figure): the steps alternate within one run, ROLL step 1, TRL step 1,
  ROLL step 2, ..., with both frameworks' processes alive throughout and TRL at the niceness of Ray's
  workers, so that a change in load hits both alike. This is not how either is used: TRL then shares
  the machine with ROLL's idle Ray processes.

Workloads (``--workloads``):

* ``quickstart``: ``examples/quickstart.yaml`` as it is (tiny Qwen2, 0.4M parameters, character
  tokenizer, 8 prompts x 8 samples, ``max_new_tokens`` 4, lr 1e-4 decaying linearly), without the SFT
  warm start and without evaluation; 60 steps by default.
* ``25m``: the same data, tokenizer and recipe with a randomly initialised 25M-parameter model (hidden 512,
  8 layers, 8 heads, 2 KV heads, intermediate 2048), 4 prompts x 8 samples, ``max_new_tokens`` 128
  (a random model stops early on EOS often: responses average about 20 tokens); 6 steps by default.

ROLL: the config is ``examples/quickstart.yaml`` loaded with overrides (``load_config``), run through
the real ``RLVRPipeline`` (Ray workers for actor, rollout and reward). Step and stage times are the
``time/step_s`` and ``time/<stage>_s`` metrics that ``pipeline.step(i)`` returns.

TRL: ``GRPOTrainer`` on the model directory ROLL built (``<output_dir>/tiny_model``: same initial
weights, same tokenizer), prompts rendered as ROLL renders them (``roll.data.prompts.render_prompt``,
the chat template), ROLL's ``exact_match`` as the reward function, and the same shapes: per-device
batch = prompts x 8, ``num_generations`` 8, ``max_completion_length``, temperature 1, same learning
rate and schedule, AdamW (``adamw_torch``), grad-norm clip 1, ``beta`` 0 (no reference model), one
optimizer step per generation batch, token-mean loss (``loss_type="dapo"``), fp32 on CPU, no gradient
checkpointing, no logging, no saving. The step time is on_step_begin -> on_step_end of a
``TrainerCallback``; the stage times are TRL's own ``profiling_context`` timers
(``transformers.generate``, the reward function, ``_prepare_inputs``), which TRL only sends to
wandb/mlflow/trackio, so this script records them by wrapping ``ProfilingContext._log_metrics``.

The first steps of each run are warm-up and are left out (``--warmup``, default a sixth of the steps,
at least one); every number is the median over the remaining steps, each column on its own (medians
of stages do not add up to the median step).

Run from the repository root (TRL is the optional ``bench`` extra: ``pip install -e ".[bench]"``)::

    python benchmarks/step_time.py [--workloads quickstart,quickstart_hybrid,25m] [--steps 60,60,6]
        [--mode standalone|interleaved] [--blocks 3] [--warmup N] [--no-trl]

Without TRL installed (or with ``--no-trl``) only ROLL runs. Ray starts locally unless ``RAY_ADDRESS``
names a cluster to join. TRL runs in a child process whose trainer waits in a callback for the parent's
go before each step (outside its step timer). In interleaved mode that child runs at the niceness Ray
gives its workers (15, ``RAY_worker_niceness``; ``--trl-niceness``): on a shared machine other jobs
would otherwise take cores from ROLL's workers but not from TRL.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import platform
import queue
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from roll.models.tiny import TINY_MODEL_DIR

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "examples" / "quickstart.yaml"

# Ray starts its workers at this niceness (the raylet's worker_niceness); TRL runs at the same one.
RAY_WORKER_NICENESS = int(os.environ.get("RAY_worker_niceness", "15"))

# The benchmark run: no SFT warm start, no evaluation (and no held-out set to load), no metric files.
COMMON_OVERRIDES = ["sft_warm_start=null", "eval.every_steps=0", "data.eval_path=null"]


@dataclass
class Workload:
    name: str
    description: str
    overrides: list[str]
    default_steps: int


WORKLOADS: dict[str, Workload] = {
    "quickstart": Workload(
        "quickstart",
        "examples/quickstart.yaml: 8 prompts x 8 samples, max_new_tokens 4",
        [],
        60,
    ),
    # The same with rollout.hybrid_engine: the actor generates with its own model (no rollout worker,
    # no weight sync), as TRL does; worth it only while the model is small.
    "quickstart_hybrid": Workload(
        "quickstart_hybrid",
        "examples/quickstart.yaml with rollout.hybrid_engine=true: the actor generates",
        ["rollout.hybrid_engine=true"],
        60,
    ),
    "25m": Workload(
        "25m",
        "random init, hidden 512, 8 layers, 8/2 heads: 4 prompts x 8 samples, max_new_tokens 128",
        [
            "model.tiny.hidden_size=512",
            "model.tiny.num_hidden_layers=8",
            "model.tiny.num_attention_heads=8",
            "model.tiny.num_key_value_heads=2",
            "model.tiny.intermediate_size=2048",
            "model.tiny.max_position_embeddings=160",
            "rollout.rollout_batch_size=4",
            "rollout.max_new_tokens=128",
        ],
        6,
    ),
}


@dataclass
class RunResult:
    """Per-step timings (seconds) of one framework on one workload, plus context."""

    framework: str
    steps: int
    warmup: int
    setup_s: float
    step_s: list[float] = field(default_factory=list)
    stages: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    response_length: list[float] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    # Share of responses cut at max_new_tokens: with batched decoding the longest response sets the
    # generate time, and the two frameworks sample different responses.
    truncated: list[float] = field(default_factory=list)

    def median(self, values: list[float]) -> float:
        timed = values[self.warmup :]
        return statistics.median(timed) if timed else float("nan")

    def mean(self, values: list[float]) -> float:
        timed = values[self.warmup :]
        return statistics.mean(timed) if timed else float("nan")


# --------------------------------------------------------------------------------------------- ROLL


def load_workload_config(workload: Workload, steps: int, output_dir: Path):
    from roll.config.loader import load_config

    overrides = [*COMMON_OVERRIDES, *workload.overrides, f"steps={steps}", f"output_dir={output_dir}"]
    return load_config(QUICKSTART, overrides)


def run_standalone(
    workload: Workload, steps: int, warmup: int, out: Path, blocks: int, with_trl: bool, niceness: int
) -> tuple[list[RunResult], list[RunResult], Path]:
    """``blocks`` blocks of ``steps`` steps per framework, alternating ROLL, TRL, ROLL, ...; nothing of
    one framework runs during the other's block. Returns the ROLL blocks, the TRL blocks and the model
    directory (every ROLL block builds the same tiny model from the same seed; TRL loads the first)."""
    roll_blocks: list[RunResult] = []
    trl_blocks: list[RunResult] = []
    model_dir = out / "roll_1" / TINY_MODEL_DIR
    for block in range(1, blocks + 1):
        print(f"[{workload.name}] block {block} of {blocks}: {steps} steps of ROLL alone", flush=True)
        config = load_workload_config(workload, steps, out / f"roll_{block}")
        roll_blocks.append(run_workload(config, warmup)[0])
        if not with_trl:
            continue
        print(f"[{workload.name}] block {block} of {blocks}: {steps} steps of TRL alone", flush=True)
        trl = TrlProcess(niceness, config, model_dir, out / f"trl_{block}", warmup)
        try:
            trl.start()
            for _ in range(steps):
                trl.step()
            trl_blocks.append(trl.finish())
        finally:
            trl.close()
    return roll_blocks, trl_blocks, model_dir


def run_workload(config, warmup: int, trl: TrlProcess | None = None) -> list[RunResult]:
    """ROLL's RLVRPipeline for ``config.steps`` steps; with ``trl``, one TRL step after each ROLL step,
    so that both see the same load on a machine other jobs share."""
    import ray

    from roll.pipelines.rlvr import RLVRPipeline

    start = time.perf_counter()
    pipeline = RLVRPipeline(config)
    roll = RunResult("ROLL", config.steps, warmup, setup_s=time.perf_counter() - start)
    try:
        if trl is not None:
            trl.start()  # the model ROLL just built is what TRL loads
        for step in range(1, config.steps + 1):
            metrics = pipeline.step(step)
            roll.step_s.append(metrics["time/step_s"])
            for key, value in metrics.items():
                if key.startswith("time/") and key.endswith("_s") and key != "time/step_s":
                    roll.stages[key[len("time/") : -len("_s")]].append(value)
            roll.response_length.append(metrics["response/length_mean"])
            roll.reward.append(metrics["reward/mean"])
            roll.truncated.append(metrics["response/truncated_frac"])
            if trl is not None:
                trl.step()
        return [roll] if trl is None else [roll, trl.finish()]
    finally:
        if trl is not None:
            trl.close()
        pipeline.shutdown()
        ray.shutdown()  # the next workload starts its own


# ---------------------------------------------------------------------------------------------- TRL


def trl_available() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


class TrlProcess:
    """``run_trl`` in a child process that makes one step each time ``step()`` lets it.

    A separate process for two reasons: steps of the two frameworks can alternate (the trainer's loop
    waits in a callback), and the child runs at Ray's worker niceness (15): on a machine other jobs
    share, TRL must not get a larger share of the cores than ROLL's workers do."""

    def __init__(self, niceness: int, *args: Any) -> None:
        self.niceness, self.args = niceness, args
        context = multiprocessing.get_context("spawn")
        self.go = context.Semaphore(0)
        self.messages = context.Queue()
        self.child = context.Process(
            target=_trl_child, args=(self.messages, self.go, niceness, *args), daemon=True
        )

    def start(self) -> None:
        """Start the child and wait until its trainer is about to make the first step."""
        self.child.start()
        self._receive("ready")

    def step(self) -> None:
        self.go.release()
        self._receive("step")

    def finish(self) -> RunResult:
        return self._receive("done")

    def close(self) -> None:
        if self.child.is_alive():
            self.child.terminate()
        if self.child.pid is not None:
            self.child.join()

    def _receive(self, kind: str) -> Any:
        got, payload = receive(self.messages, self.child)
        assert got == kind, (got, kind)
        return payload


def receive(messages: Any, child: Any) -> tuple[str, Any]:
    """The next ``(kind, payload)`` a TRL child process sent; raises if it failed or exited."""
    while True:
        try:
            kind, payload = messages.get(timeout=5)
            break
        except queue.Empty:
            if not child.is_alive():
                raise RuntimeError(f"the TRL process exited with code {child.exitcode}") from None
    if kind == "error":
        raise RuntimeError(f"the TRL run failed:\n{payload}")
    return kind, payload


def _trl_child(messages: Any, go: Any, niceness: int, *args: Any) -> None:
    try:
        current = os.nice(0)
        if niceness > current:
            os.nice(niceness - current)
        result = run_trl(messages, go, *args)
        result.stages = dict(result.stages)
        messages.put(("done", result))
    except BaseException:
        messages.put(("error", traceback.format_exc()))


def trl_dataset(config, tokenizer):
    """The training rows as TRL reads them: prompts rendered as ROLL renders them, answers as text."""
    from datasets import Dataset

    from roll.data.columns import ANSWER, PROMPT, map_columns
    from roll.data.formats import read_rows
    from roll.data.prompts import render_prompt

    rows = map_columns(read_rows(config.data.train_path), config.data.columns, (PROMPT, ANSWER))
    template = config.data.apply_chat_template
    return Dataset.from_list(
        [
            {"prompt": render_prompt(tokenizer, row[PROMPT], template), "answer": str(row[ANSWER])}
            for row in rows
        ]
    )


def trl_args(config, output_dir: Path):
    """``GRPOConfig`` with ROLL's recipe from ``config`` (see the module docstring)."""
    from trl import GRPOConfig

    rollout, actor, algo = config.rollout, config.actor, config.algorithm
    samples = rollout.rollout_batch_size * rollout.num_return_sequences
    return GRPOConfig(
        output_dir=str(output_dir),
        seed=config.seed,
        max_steps=config.steps,
        per_device_train_batch_size=samples,
        gradient_accumulation_steps=1,
        num_generations=rollout.num_return_sequences,
        num_iterations=actor.ppo_epochs,
        max_completion_length=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        learning_rate=actor.lr,
        lr_scheduler_type=actor.lr_scheduler,
        warmup_steps=actor.warmup_steps,
        weight_decay=actor.weight_decay,
        max_grad_norm=actor.max_grad_norm,
        optim="adamw_torch",
        beta=0.0,
        epsilon=algo.clip_ratio_low,
        epsilon_high=algo.clip_ratio_high,
        loss_type="dapo",  # token-mean over the whole batch, as ROLL's loss_agg_mode token-mean
        scale_rewards="group" if algo.norm_adv_by_std else "none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        activation_checkpointing=False,  # TRL turns it on by default
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )


def run_trl(messages: Any, go: Any, config, model_dir: Path, output_dir: Path, warmup: int) -> RunResult:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOTrainer
    from trl.extras import profiling

    from roll.rewards.match import exact_match

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    # ROLL's workers give torch every core of the machine (one worker per role here); do the same.
    torch.set_num_threads(os.cpu_count() or 1)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = trl_dataset(config, tokenizer)
    args = trl_args(config, output_dir)

    lengths: list[float] = []
    rewards: list[float] = []
    truncated: list[float] = []
    eos = tokenizer.eos_token_id

    def exact_match_reward(prompts, completions, completion_ids, answer, **_):
        scores = [exact_match(p, c, {"answer": a}) for p, c, a in zip(prompts, completions, answer)]
        lengths.append(sum(map(len, completion_ids)) / len(completion_ids))
        rewards.append(sum(scores) / len(scores))
        truncated.append(sum(eos not in ids for ids in completion_ids) / len(completion_ids))
        return scores

    profiled: dict[str, float] = defaultdict(float)
    original_log_metrics = profiling.ProfilingContext._log_metrics

    def record(self, duration: float) -> None:
        profiled[self.name.split(".", 1)[-1]] += duration
        original_log_metrics(self, duration)

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.begin = 0.0
            self.times: list[float] = []
            self.stages: list[dict[str, float]] = []

        def on_train_begin(self, args, state, control, **kwargs):
            messages.put(("ready", None))

        def on_step_begin(self, args, state, control, **kwargs):
            go.acquire()  # the parent's turn is over
            profiled.clear()
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.begin)
            self.stages.append(dict(profiled))
            messages.put(("step", None))

    timer = StepTimes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' renames, used inside TRL
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=exact_match_reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
        )
    trainer.remove_callback(PrinterCallback)  # disable_tqdm puts it in; it prints the final summary
    assert not trainer.args.activation_checkpointing and not trainer.args.bf16
    result = RunResult("TRL", config.steps, warmup, setup_s=time.perf_counter() - start)
    profiling.ProfilingContext._log_metrics = record
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' renames, inside TRL
            trainer.train()
    finally:
        profiling.ProfilingContext._log_metrics = original_log_metrics
    result.step_s = timer.times
    for step, stages in zip(timer.times, timer.stages):
        generate = stages.get("transformers.generate", float("nan"))
        reward = stages.get("exact_match_reward", float("nan"))
        prepare = stages.get("_prepare_inputs", float("nan"))
        result.stages["generate"].append(generate)
        result.stages["reward"].append(reward)
        # Tokenising, decoding and advantages: the rest of TRL's generate-and-score stage.
        result.stages["prepare_other"].append(prepare - generate - reward)
        # Forward, backward and optimizer step.
        result.stages["train"].append(step - prepare)
    result.response_length, result.reward, result.truncated = lengths, rewards, truncated
    return result


# --------------------------------------------------------------------------------------------- report


def count_parameters(model_dir: Path) -> int:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return sum(p.numel() for p in model.parameters())


def machine_note() -> str:
    versions = [f"torch {torch.__version__} ({torch.get_num_threads()} threads in the driver)"]
    for module in ("transformers", "trl", "ray"):
        try:
            versions.append(f"{module} {__import__(module).__version__}")
        except ImportError:
            versions.append(f"{module} not importable")
    return (
        f"machine: {os.cpu_count()} CPU cores, {platform.machine()}, python {platform.python_version()}, "
        + ", ".join(versions)
    )


def ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1000:.1f}"  # NaN -> "-"


def pooled(blocks: list[RunResult]) -> RunResult:
    """The timed steps of several blocks of one framework as one result (no warm-up left in it)."""
    first = blocks[0]
    out = RunResult(first.framework, 0, 0, setup_s=statistics.median(b.setup_s for b in blocks))
    for block in blocks:
        timed = slice(block.warmup, None)
        out.step_s += block.step_s[timed]
        out.response_length += block.response_length[timed]
        out.reward += block.reward[timed]
        out.truncated += block.truncated[timed]
        for name, values in block.stages.items():
            out.stages[name] += values[timed]
    out.steps = len(out.step_s)
    return out


def spread(values: list[float]) -> str:
    """``min-max`` of block medians in ms, and the range as a share of their median."""
    middle = statistics.median(values)
    return (
        f"{ms(min(values))}-{ms(max(values))} ms ({(max(values) - min(values)) / middle:.0%} of the median)"
    )


def standalone_report(
    workload: Workload, params: int, roll_blocks: list[RunResult], trl_blocks: list[RunResult]
) -> str:
    first = roll_blocks[0]
    lines = [
        f"### {workload.name} (standalone: each framework alone): {params / 1e6:.2f}M params, "
        f"{workload.description}; {len(roll_blocks)} blocks of {first.steps} steps per framework, "
        f"medians of steps {first.warmup + 1}-{first.steps} in each block",
        "",
        "| block | ROLL step ms | TRL step ms | ROLL/TRL |",
        "| --- | --- | --- | --- |",
    ]
    roll_medians = [b.median(b.step_s) for b in roll_blocks]
    trl_medians = [b.median(b.step_s) for b in trl_blocks]
    for index, roll in enumerate(roll_medians):
        trl = trl_medians[index] if index < len(trl_medians) else float("nan")
        ratio = f"{roll / trl:.2f}" if trl == trl else "-"
        lines.append(f"| {index + 1} | {ms(roll)} | {ms(trl)} | {ratio} |")
    roll_mid = statistics.median(roll_medians)
    summary = f"ROLL median of block medians {ms(roll_mid)} ms, spread {spread(roll_medians)}"
    if trl_medians:
        trl_mid = statistics.median(trl_medians)
        lines.append(f"| median | {ms(roll_mid)} | {ms(trl_mid)} | {roll_mid / trl_mid:.2f} |")
        summary += f"; TRL {ms(trl_mid)} ms, spread {spread(trl_medians)}"
        summary += f"\n\nROLL/TRL ratio of medians (standalone): {roll_mid / trl_mid:.2f}"
    lines += ["", summary, ""]
    results = [pooled(roll_blocks)] + ([pooled(trl_blocks)] if trl_blocks else [])
    lines += _stage_and_sample_lines(results, "all timed steps of every block")
    return "\n".join(lines)


def report(workload: Workload, params: int, results: list[RunResult]) -> str:
    first = results[0]
    lines = [
        f"### {workload.name} (interleaved: both alive, a secondary figure): {params / 1e6:.2f}M params, "
        f"{workload.description}; median of steps {first.warmup + 1}-{first.steps}",
        "",
    ]
    lines += _stage_and_sample_lines(results, "")
    if len(results) == 2:
        roll, trl = (result.median(result.step_s) for result in results)
        lines += ["", f"ROLL/TRL median step ratio (interleaved): {roll / trl:.2f}"]
    return "\n".join(lines)


def _stage_and_sample_lines(results: list[RunResult], over: str) -> list[str]:
    """Stage medians, then step, response length, truncation, reward and setup per framework."""
    lines = []
    for result in results:
        stages = ", ".join(f"{name} {ms(result.median(v))}" for name, v in result.stages.items())
        lines.append(f"{result.framework} stages (ms, medians{', ' + over if over else ''}): {stages}")
    lines += [
        "",
        "| framework | step ms | response tokens | truncated | reward | setup s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.framework} | {ms(r.median(r.step_s))} | {r.mean(r.response_length):.1f} "
            f"| {r.mean(r.truncated):.1%} | {r.mean(r.reward):.3f} | {r.setup_s:.1f} |"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workloads",
        default="quickstart,quickstart_hybrid,25m",
        help="comma-separated: " + ", ".join(WORKLOADS),
    )
    parser.add_argument(
        "--steps",
        default=None,
        help="steps per workload: one number for all, or one per workload (default 60, 60 and 6)",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="leading steps left out (default: steps // 6, at least 1)"
    )
    parser.add_argument("--no-trl", action="store_true", help="run ROLL only")
    parser.add_argument(
        "--mode",
        choices=("standalone", "interleaved"),
        default="standalone",
        help="standalone: blocks of steps, each framework alone (what a user sees; default); "
        "interleaved: steps alternate with both alive (a secondary figure)",
    )
    parser.add_argument(
        "--blocks", type=int, default=3, help="standalone: blocks per framework (default %(default)s, >= 3)"
    )
    parser.add_argument(
        "--trl-niceness",
        type=int,
        default=None,
        help="niceness of the TRL process (default: 0 standalone, as a user's script; interleaved: that "
        f"of Ray's workers, {RAY_WORKER_NICENESS})",
    )
    parser.add_argument(
        "--output-dir", default=None, help="where the runs write (default: a temporary directory, removed)"
    )
    parser.add_argument("--json", default=None, help="also write every per-step timing to this file")
    args = parser.parse_args(argv)
    args.workloads = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = [name for name in args.workloads if name not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    if args.blocks < 3:
        parser.error("--blocks: at least 3, so that the spread between blocks shows")
    if args.trl_niceness is None:
        args.trl_niceness = 0 if args.mode == "standalone" else RAY_WORKER_NICENESS
    if args.steps is None:
        args.steps = [WORKLOADS[name].default_steps for name in args.workloads]
    else:
        steps = [int(s) for s in args.steps.split(",")]
        if len(steps) == 1:
            steps *= len(args.workloads)
        if len(steps) != len(args.workloads) or min(steps) < 2:
            parser.error("--steps: one number (>= 2) for all workloads or one per workload")
        args.steps = steps
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(REPO)  # the quickstart's data paths are relative to the repository root
    with_trl = not args.no_trl and trl_available()
    if not args.no_trl and not with_trl:
        print('trl is not importable (pip install -e ".[bench]"): running ROLL only', flush=True)
    root = Path(args.output_dir or tempfile.mkdtemp(prefix="roll-step-time-"))
    reports, dump = [], {}
    try:
        for name, steps in zip(args.workloads, args.steps):
            workload = WORKLOADS[name]
            warmup = args.warmup if args.warmup is not None else max(1, steps // 6)
            warmup = min(warmup, steps - 1)
            out = root / name
            if args.mode == "standalone":
                roll_blocks, trl_blocks, model_dir = run_standalone(
                    workload, steps, warmup, out, args.blocks, with_trl, args.trl_niceness
                )
                params = count_parameters(model_dir)
                reports.append(standalone_report(workload, params, roll_blocks, trl_blocks))
                results = roll_blocks + trl_blocks
            else:
                config = load_workload_config(workload, steps, out / "roll")
                model_dir = out / "roll" / TINY_MODEL_DIR
                trl = (
                    TrlProcess(args.trl_niceness, config, model_dir, out / "trl", warmup)
                    if with_trl
                    else None
                )
                print(
                    f"[{name}] {steps} steps of ROLL" + (" and TRL, alternating" if trl else ""), flush=True
                )
                results = run_workload(config, warmup, trl)
                reports.append(report(workload, count_parameters(model_dir), results))
            dump[name] = [
                {
                    "framework": r.framework,
                    "mode": args.mode,
                    "warmup": r.warmup,
                    "step_s": r.step_s,
                    "stages": dict(r.stages),
                    "response_length": r.response_length,
                    "reward": r.reward,
                    "truncated": r.truncated,
                    "setup_s": r.setup_s,
                }
                for r in results
            ]
    finally:
        if args.output_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(machine_note())
    for text in reports:
        print()
        print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(dump, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
