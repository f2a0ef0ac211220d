"""A vision-language model through the RLVR pipeline: examples/vlm_shapes.yaml shortened (SFT warm start,
then GRPO on image prompts through the hf engine), resumed from a checkpoint, and its saved model played
with plain transformers."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from test_resume import assert_same_rows, crash_after, metrics

from roll import checkpoint
from roll.data.formats import read_rows

RUN = (
    "steps=6",
    "sft_warm_start.steps=60",
    "eval.every_steps=3",
    "eval.max_prompts=48",
    "checkpoint.every_steps=2",
    "tracking.backends=[jsonl]",
)


def greedy_score(model_dir: Path, rows: list[dict]) -> float:
    """The held-out score of ``model_dir`` as a user gets it: transformers' own model class, image
    processor and tokenizer, the picture in a content part, greedy decoding, exact match."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    right = 0
    for row in rows:
        picture = Image.open(io.BytesIO(row["images"][0])).convert("RGB")
        content = [{"type": "image"}, {"type": "text", "text": row["prompt"]}]
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        pixels = processor(images=[picture], return_tensors="pt")
        tokens = int(pixels["image_grid_thw"].prod()) // processor.merge_size**2
        ids = []
        for token in tokenizer(text, add_special_tokens=False)["input_ids"]:  # Qwen2VLProcessor's expansion
            ids += [token] * tokens if token == image_token else [token]
        ids = torch.tensor([ids])
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(ids == image_token).int(),
            max_new_tokens=10,
            do_sample=False,
        )
        answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        right += answer.strip() == row["answer"]
    return right / len(rows)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_a_vision_language_model_learns_resumes_and_saves_what_transformers_plays(tmp_path: Path) -> None:
    """Only a whole run shows these: the images reach every role (the engine's logprobs are the trainer's
    within float32 rounding, so both read the same pictures and positions), GRPO raises the held-out score
    from the warm start's, a run stopped after step 4 and resumed logs what the uninterrupted one logs, and
    the saved model/ played with plain transformers scores what the run's last evaluation scored."""
    from roll.cli import resume_run, train

    finished, stopped = tmp_path / "finished", tmp_path / "stopped"
    train("examples/vlm_shapes.yaml", [*RUN, f"output_dir={finished}"], resume=None, overwrite=False)
    rows = metrics(finished)
    steps = [row for row in rows if "rollout/logprob_diff_max" in row]
    assert len(steps) == 6 and max(row["rollout/logprob_diff_max"] for row in steps) < 1e-4, steps
    evals = [row["eval/score"] for row in rows if "eval/score" in row]
    assert len(evals) == 3 and evals[-1] >= evals[0] + 0.1, evals  # measured: 0.775 -> 0.96

    crash_after(finished, stopped, 4)
    last = checkpoint.latest_valid(checkpoint.checkpoints_root(stopped))
    assert last is not None and last.name.endswith("4")
    resume_run(str(stopped), [])
    assert_same_rows(metrics(stopped), rows)

    held_out = [row for _, row in read_rows("examples/data/shapes/eval.parquet")][:48]
    assert greedy_score(finished / "model", held_out) == pytest.approx(evals[-1])


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session", "at_repo_root")
def test_agentic_episodes_of_pictures_run_through_every_role(tmp_path: Path) -> None:
    """examples/agentic_frozenlake_vlm.yaml cut to its wiring (the example's learning is measured in
    docs/vlm.md): the expert's pictures reach the warm start, each turn's pictures reach the rollout
    workers over Ray, and the trainer scores what the engine sampled with the same pictures."""
    from roll.cli import train

    run = tmp_path / "lake"
    overrides = [
        "steps=2",
        "sft_warm_start.episodes=48",
        "sft_warm_start.steps=4",
        "rollout.rollout_batch_size=4",
        "rollout.num_return_sequences=4",
        "eval.seeds=8",
        "eval.every_steps=2",
        "checkpoint.every_steps=0",
        "tracking.backends=[jsonl]",
        f"output_dir={run}",
    ]
    train("examples/agentic_frozenlake_vlm.yaml", overrides, resume=None, overwrite=False)
    steps = [row for row in metrics(run) if "rollout/logprob_diff_max" in row]
    assert len(steps) == 2 and max(row["rollout/logprob_diff_max"] for row in steps) < 1e-4, steps
    assert all(row["episode/turns"] >= 1 for row in steps)
    sft = [row for row in metrics(run / "sft") if "sft/loss" in row]
    assert len(sft) == 4 and sft[-1]["sft/loss"] < sft[0]["sft/loss"], sft
    assert (run / "model" / "preprocessor_config.json").is_file()
