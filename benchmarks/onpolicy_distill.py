"""Benchmark: on-policy distillation against GRPO with the task reward, from the same start, side by side.

Both runs are the quickstart (``examples/quickstart.yaml``: 8 prompts x 8 samples per step, lr 1e-4) from
the same weak student, one after the other on this machine, each alone:

- ``grpo``: the task reward (exact match), GRPO advantages.
- ``distill``: ``distill.mode: pure``, the teacher's per-token log-probabilities of the student's own
  samples give the advantage, -(log pi_student - log pi_teacher); the task reward is only logged.
- ``mixed`` (``--mixed``): both advantages added.

Every ``--eval-every`` steps the held-out prompts are answered greedily and scored by exact match. The
clock is the sum of the training steps' wall time (``time/step_s``; evaluation excluded). The table says
when each run first reached its start + ``--gain``.

The student and the teacher are made by the examples (docs/distill.md):

    roll train examples/sft_start.yaml          # runs/sft-start/model (its held-out score: docs/distill.md)
    roll train examples/distill_teacher.yaml    # runs/distill-teacher/model (4x wider, 4x longer)
    python benchmarks/onpolicy_distill.py [--steps 300] [--eval-every 25] [--gain 0.2] [--mixed]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

QUICKSTART = "examples/quickstart.yaml"


def run(name: str, out_dir: Path, overrides: list[str]) -> list[dict]:
    from roll.config import load_config
    from roll.pipelines.rlvr import RLVRPipeline

    output = out_dir / name
    RLVRPipeline(load_config(QUICKSTART, [f"output_dir={output}", *overrides]), overwrite=True).run()
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def summary(name: str, rows: list[dict], gain: float) -> dict:
    clock, elapsed = 0.0, {}
    for row in rows:
        clock += row.get("time/step_s", 0.0)
        elapsed[row["step"]] = clock
    evals = [(row["step"], row["eval/score"]) for row in rows if "eval/score" in row]
    start = evals[0][1]
    reached = next(((step, score) for step, score in evals if score >= start + gain), None)
    steps = [row for row in rows if "time/step_s" in row]
    return {
        "run": name,
        "start": start,
        "final": evals[-1][1],
        "best": max(score for _, score in evals),
        "steps_to_gain": reached[0] if reached else None,
        "seconds_to_gain": elapsed[reached[0]] if reached else None,
        "s_per_step": sum(r["time/step_s"] for r in steps) / len(steps),
        "teacher_kl_first_last": (steps[0].get("distill/teacher_kl"), steps[-1].get("distill/teacher_kl")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--student", default="runs/sft-start/model")
    parser.add_argument("--teacher", default="runs/distill-teacher/model")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--gain", type=float, default=0.2)
    parser.add_argument("--mixed", action="store_true", help="also run distillation + GRPO (mode mixed)")
    parser.add_argument("--out", help="where the runs go (default: a temporary directory)")
    args = parser.parse_args()
    for role, path in (("student", args.student), ("teacher", args.teacher)):
        if not (Path(path) / "config.json").is_file():
            sys.exit(f"no {role} model at {path}: make it first (see this script's docstring)")
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="roll-distill-bench-"))
    common = [
        f"model.path={args.student}",
        "model.tiny=null",
        "sft_warm_start=null",
        f"steps={args.steps}",
        f"eval.every_steps={args.eval_every}",
        "checkpoint.every_steps=0",
        "tracking.backends=[jsonl]",
    ]
    teacher = [f"distill.teachers.main.model_path={args.teacher}"]
    plans = {"grpo": common, "distill": [*common, *teacher, "distill.mode=pure"]}
    if args.mixed:
        plans["mixed"] = [*common, *teacher, "distill.mode=mixed"]
    results = [summary(name, run(name, out_dir, overrides), args.gain) for name, overrides in plans.items()]
    print(
        f"\nheld-out exact match, {args.steps} steps, runs in {out_dir}; "
        f"+{args.gain}: the first eval at start + gain"
    )
    print(
        f"{'run':8} {'start':>6} {'final':>6} {'best':>6} {'steps to +gain':>15} "
        f"{'s to +gain':>11} {'s/step':>7}"
    )
    for r in results:
        steps = "never" if r["steps_to_gain"] is None else str(r["steps_to_gain"])
        seconds = "-" if r["seconds_to_gain"] is None else f"{r['seconds_to_gain']:.1f}"
        print(
            f"{r['run']:8} {r['start']:6.3f} {r['final']:6.3f} {r['best']:6.3f} {steps:>15} {seconds:>11} "
            f"{r['s_per_step']:7.3f}"
        )
    for r in results:
        first, last = r["teacher_kl_first_last"]
        if first is not None:
            print(f"{r['run']}: distill/teacher_kl {first:.3f} -> {last:.3f} per token")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
