"""Benchmark: how long ROLL and TRL take to raise the quickstart's held-out score by ``--gain``, from the
same warm start, each framework alone, with the same evaluation schedule.

What a new user sees first is not a step time but how long the score takes to rise. This script:

1. Makes the warm start once: the quickstart's SFT warm start (``sft_warm_start`` of
   ``examples/quickstart.yaml``), through ROLL's real pipeline. Both frameworks start RL from that model.
2. Runs ROLL alone: ``RLVRPipeline`` on the quickstart config with ``model.path`` the warm start, no
   warm start of its own, ``steps`` as the quickstart (the learning-rate schedule runs over them).
3. Runs TRL alone (a child process, nothing of ROLL alive): ``GRPOTrainer`` with the recipe of
   ``benchmarks/step_time.py`` (same shapes, learning rate and schedule, exact-match reward) on the same
   model.

Both evaluate before the first step and every ``--eval-every`` steps with the same code: greedy answers
to the held-out prompts (``examples/data/addition/eval.jsonl``), scored by exact match, through
``roll.pipelines.common.evaluate`` (ROLL generates on its rollout worker, TRL with Hugging Face
``generate`` on its own model). Evaluation time is left out of the clock; the clock is the sum of the
training steps' wall time (ROLL: ``pipeline.step``; TRL: on_step_begin -> on_step_end). A run stops at
the first evaluation at or above its own starting score + ``--gain``, or after ``--max-steps``.

    python benchmarks/time_to_score.py             # --gain 0.3 --eval-every 50 --max-steps 3000 [--no-trl]

TRL is the optional ``bench`` extra (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_time import QUICKSTART, machine_note, receive, trl_args, trl_available, trl_dataset  # noqa: E402


@dataclass
class Curve:
    """Held-out scores against training seconds (evaluation excluded) and steps."""

    framework: str
    points: list[tuple[int, float, float]] = field(default_factory=list)  # (step, train seconds, score)

    def reached(self, gain: float) -> tuple[int, float] | None:
        """(step, seconds) of the first evaluation at or above the starting score + ``gain``."""
        start = self.points[0][2]
        for step, seconds, score in self.points:
            if score >= start + gain - 1e-9:
                return step, seconds
        return None


def warm_start(out: Path) -> str:
    """The quickstart's SFT warm start, made once through ROLL's pipeline; returns the model's path."""
    import ray

    from roll.config.loader import load_config
    from roll.pipelines.rlvr import RLVRPipeline

    config = load_config(QUICKSTART, [f"output_dir={out}", "steps=1", "eval.every_steps=0"])
    pipeline = RLVRPipeline(config)
    try:
        return pipeline.model_path
    finally:
        pipeline.shutdown()
        ray.shutdown()


def rl_overrides(model_path: str, out: Path, steps: int) -> list[str]:
    return [
        f"output_dir={out}",
        f"model.path={model_path}",
        "model.tiny=null",
        "sft_warm_start=null",
        "eval.every_steps=0",  # evaluated here, outside the clock
        f"steps={steps}",
    ]


def run_roll(model_path: str, out: Path, steps: int, eval_every: int, gain: float, max_steps: int) -> Curve:
    import ray

    from roll.config.loader import load_config
    from roll.pipelines.rlvr import RLVRPipeline

    pipeline = RLVRPipeline(load_config(QUICKSTART, rl_overrides(model_path, out, steps)))
    curve, seconds = Curve("ROLL"), 0.0
    try:
        curve.points.append((0, 0.0, pipeline.evaluate()["eval/score"]))
        for step in range(1, max_steps + 1):
            start = time.perf_counter()
            pipeline.step(step)
            seconds += time.perf_counter() - start
            if step % eval_every == 0:
                curve.points.append((step, seconds, pipeline.evaluate()["eval/score"]))
                print(f"  ROLL step {step}: {seconds:.1f} s, held-out {curve.points[-1][2]:.3f}", flush=True)
                if curve.reached(gain):
                    break
        return curve
    finally:
        pipeline.shutdown()
        ray.shutdown()


def run_trl(
    messages: Any, model_path: str, out: Path, steps: int, eval_every: int, gain: float, max_steps: int
):
    import contextlib
    import io
    import warnings

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from roll.config.loader import load_config
    from roll.data.prompts import load_prompts
    from roll.models.loading import end_of_sequence_ids
    from roll.pipelines.common import evaluate
    from roll.rewards.match import exact_match
    from roll.strategies import hf_generate
    from roll.strategies.requests import SamplingParams

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    config = load_config(QUICKSTART, rl_overrides(model_path, out / "unused", steps))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    held_out = load_prompts(config.data.eval_path, tokenizer, config.data, ("answer",))
    eos_ids, pad_id = end_of_sequence_ids(tokenizer, model), tokenizer.pad_token_id
    greedy = SamplingParams(max_new_tokens=config.eval.max_new_tokens, greedy=True)

    def held_out_score() -> float:
        was_training = model.training
        model.eval()
        try:
            result = evaluate(
                held_out,
                generate=lambda batch, params: hf_generate.generate(
                    model, batch, params, eos_ids, pad_id, tokenizer
                ),
                score=lambda batch: torch.tensor(
                    [
                        exact_match(p, r, s)
                        for p, r, s in zip(batch["prompt_text"], batch["response_text"], batch["sample"])
                    ]
                ),
                params=greedy,
                batch_size=config.eval.batch_size,
                pad_id=pad_id,
                max_prompts=config.eval.max_prompts,
            )
        finally:
            model.train(was_training)
        return result["eval/score"]

    def exact_match_reward(prompts, completions, answer, **_):
        return [exact_match(p, c, {"answer": a}) for p, c, a in zip(prompts, completions, answer)]

    curve = Curve("TRL")

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.begin, self.seconds = 0.0, 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds += time.perf_counter() - self.begin
            step = state.global_step
            if step % eval_every == 0:
                curve.points.append((step, self.seconds, held_out_score()))
                messages.put(("progress", curve.points[-1]))
                if curve.reached(gain) or step >= max_steps:
                    control.should_training_stop = True
            elif step >= max_steps:
                control.should_training_stop = True

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' renames, used inside TRL
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=exact_match_reward,
            args=trl_args(config, out),
            train_dataset=trl_dataset(config, tokenizer),
            processing_class=tokenizer,
            callbacks=[Clock()],
        )
    trainer.remove_callback(PrinterCallback)
    curve.points.append((0, 0.0, held_out_score()))
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainer.train()
    return curve


def _trl_child(messages: Any, *args: Any) -> None:
    try:
        messages.put(("done", run_trl(messages, *args)))
    except BaseException:
        messages.put(("error", traceback.format_exc()))


def run_trl_alone(*args: Any) -> Curve:
    """``run_trl`` in a child process: a user's TRL script, nothing of ROLL alive beside it."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    child = context.Process(target=_trl_child, args=(messages, *args), daemon=True)
    child.start()
    try:
        while True:
            kind, payload = receive(messages, child)
            if kind != "progress":
                return payload
            step, seconds, score = payload
            print(f"  TRL step {step}: {seconds:.1f} s, held-out {score:.3f}", flush=True)
    finally:
        if child.is_alive():
            child.terminate()
        child.join()


def report(curves: list[Curve], gain: float) -> None:
    print(
        f"\n| framework | start score | steps to +{gain:.2f} | train seconds to +{gain:.2f} | final score |"
    )
    print("| --- | --- | --- | --- | --- |")
    reached = {}
    for curve in curves:
        hit = curve.reached(gain)
        reached[curve.framework] = hit
        steps, seconds = (str(hit[0]), f"{hit[1]:.1f}") if hit else (f"not in {curve.points[-1][0]}", "-")
        first, last = curve.points[0][2], curve.points[-1][2]
        print(f"| {curve.framework} | {first:.3f} | {steps} | {seconds} | {last:.3f} |")
    if all(reached.get(name) for name in ("ROLL", "TRL")):
        ratio = reached["ROLL"][1] / reached["TRL"][1]
        print(f"\nROLL/TRL time to +{gain:.2f} (standalone): {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gain", type=float, default=0.3, help="held-out score gain to reach (default 0.3)")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between evaluations (default 50)")
    parser.add_argument(
        "--steps", type=int, default=None, help="the schedule's length (default: the quickstart's)"
    )
    parser.add_argument("--max-steps", type=int, default=3000, help="stop a run here if it never gets there")
    parser.add_argument("--no-trl", action="store_true", help="run ROLL only")
    parser.add_argument(
        "--output-dir", default=None, help="where the runs write (default: a temporary directory)"
    )
    args = parser.parse_args()
    from roll.config.loader import load_config

    steps = args.steps or load_config(QUICKSTART, []).steps
    with_trl = not args.no_trl and trl_available()
    out = Path(args.output_dir) if args.output_dir else Path(tempfile.mkdtemp(prefix="roll-time-to-score-"))
    try:
        print("warm start (the quickstart's SFT), once for both", flush=True)
        model_path = warm_start(out / "warm")
        common = (steps, args.eval_every, args.gain, min(args.max_steps, steps))
        print("ROLL alone", flush=True)
        curves = [run_roll(model_path, out / "roll", *common)]
        if with_trl:
            print("TRL alone", flush=True)
            curves.append(run_trl_alone(model_path, out / "trl", *common))
        else:
            print("TRL not run (--no-trl, or the bench extra is not installed)")
        print("\n" + machine_note())
        print(f"quickstart from its SFT warm start, {steps}-step schedule, evaluated every {args.eval_every}")
        report(curves, args.gain)
    finally:
        if not args.output_dir:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
